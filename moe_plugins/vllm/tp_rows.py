"""Which rows of vLLM's MoE input a TP rank dispatches, and how the finalize's output is made
whole again, for :class:`moe_plugins.vllm.prepare_finalize.MoEPluginsPrepareAndFinalize`.

Every TP rank of a DP group holds the same tokens (no SP); each dispatches the rows it owns
(:func:`moe_plugins.layout.owned_rows`, with the routing sliced alike). After the combine the
owned rows are complete: ROW_SCATTER_ALLREDUCE zeros the others (vLLM's runner then all-reduces
shared + routed), GATHER_PLUS_ALLREDUCE all-gathers them over TP. Under vLLM's sequence-parallel
MoE the input is already this rank's chunk: it owns all of it, as a TP group of one.
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_plugins.config import DispatchConfig
from moe_plugins.groups import DistContext, all_gather_rows
from moe_plugins.layout import OwnedRows, owned_rows, slice_owned
from moe_plugins.strategy import ReductionStrategy

__all__ = ["TpRows"]


class TpRows:
    """The TP row ownership of one adapted layer. ``tp``, ``tp_rank``: the group the tokens
    handed to prepare are shared by (1, 0 under SP); ``whole``: one rank's rows are all the rows
    and nothing is gathered after the finalize (no rows to track)."""

    def __init__(self, ctx: DistContext, strategy: ReductionStrategy) -> None:
        self.ctx, self.strategy = ctx, strategy
        # Under vLLM's sequence-parallel MoE the model already gave this rank its owned chunk
        # (padded and split as owned_rows does it): nothing is sliced a second time.
        sp = strategy is ReductionStrategy.SP_ALLGATHER
        self.tp, self.tp_rank = (1, 0) if sp else (ctx.layout.tp, ctx.tp_rank)
        self.gathers = strategy is ReductionStrategy.GATHER_PLUS_ALLREDUCE
        self.whole = self.tp == 1 and not self.gathers
        #: the input is this rank's chunk of its DP group's tokens (vLLM pads chunks to one size)
        self.presliced = self.tp != ctx.layout.tp

    def own(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
            ) -> tuple[Optional[OwnedRows], torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """hidden [num_tokens, hidden]; topk_ids, topk_weights [num_tokens, num_topk]. Returns
        (rows, hidden, ids, weights, owns_all) of the rows this rank dispatches (rows None where
        ``whole``), the three tensors sliced together."""
        if self.whole:
            return None, hidden, topk_ids, topk_weights, True
        rows = owned_rows(hidden.shape[0], self.tp, self.tp_rank)
        if self.tp > 1:
            owned = slice_owned(rows, hidden, topk_ids, topk_weights)
            hidden, topk_ids, topk_weights = owned.hidden_states, owned.topk_ids, owned.topk_weights
        return rows, hidden, topk_ids, topk_weights, rows.num_owned == rows.num_tokens

    def no_tokens(self, cfg: DispatchConfig
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[OwnedRows], bool]:
        """(hidden [0, hidden], ids int64 [0, num_topk], weights float32 [0, num_topk], rows,
        owns_all) of a call with no tokens of this rank's own."""
        device = self.ctx.device
        rows = None if self.whole else owned_rows(0, self.tp, self.tp_rank)
        return (torch.empty(0, cfg.hidden, dtype=cfg.dtype, device=device),
                torch.empty(0, cfg.num_topk, dtype=torch.int64, device=device),
                torch.empty(0, cfg.num_topk, dtype=torch.float32, device=device), rows, True)

    def target(self, output: torch.Tensor, rows: Optional[OwnedRows], owns_all: bool,
               refused: bool) -> tuple[torch.Tensor, bool]:
        """(the rows of ``output`` [num_tokens, hidden] the combine writes, done: nothing is
        left to do after it). A refused call writes nothing."""
        if refused:
            return output[:0], False
        if owns_all:
            return output, not self.gathers
        assert rows is not None
        return output[rows.as_slice], False

    def complete(self, output: torch.Tensor, rows: Optional[OwnedRows], owns_all: bool) -> None:
        """After the combine wrote this rank's rows of ``output`` [num_tokens, hidden]: gather
        the other TP ranks' rows (GATHER_PLUS_ALLREDUCE), or zero the rows it does not own."""
        if self.gathers:
            assert rows is not None
            gathered = all_gather_rows(output[rows.start:rows.stop], rows.chunk,
                                       self.ctx.tp_group, self.ctx.layout.tp)
            output.copy_(gathered[: output.shape[0]])
        elif not owns_all:
            assert rows is not None
            output[:rows.start].zero_()
            output[rows.stop:].zero_()
