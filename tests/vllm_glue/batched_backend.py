"""A batched-format backend for tests: the torch reference transport, with the received rows
packed per local expert as DeepEP low-latency hands them over.

prepare returns x [num_local_experts, max_recv_tokens, hidden] (max_recv_tokens =
max_tokens_per_rank x num_ranks, rows past each expert's count are NaN: stale data) and
expert_tokens_meta;
finalize takes the unweighted per-expert outputs in that layout, applies the router weights and
sums per received row, then combines through the reference transport.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moe_plugins.interface import (ActivationFormat, AsyncResult, ExpertTokensMeta,
                                   PrepareFinalize, PrepareResult, RowScatterTarget)
from moe_plugins.quant import QuantSpec
from moe_plugins.prepare_finalize.torch import TorchPrepareFinalize


@dataclass
class _Packing:
    """expert, slot: int64 [num_pairs] the (local expert, row in its batch) of each received
    (row, topk) pair that hit this rank; row: int64 [num_pairs]; weight: float32 [num_pairs]."""

    expert: torch.Tensor
    slot: torch.Tensor
    row: torch.Tensor
    weight: torch.Tensor
    num_recv: int


class BatchedTorchPrepareFinalize(TorchPrepareFinalize):
    activation_format = ActivationFormat.BATCHED

    def __init__(self, manager, cfg):
        super().__init__(manager, cfg)
        self._packing: Optional[_Packing] = None

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return self.cfg.max_tokens_per_rank

    def reset_call_state(self) -> None:
        super().reset_call_state()
        self._packing = None

    # the synchronous calls go through the (overridden) async ones, hook at once
    def prepare(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, quant: QuantSpec) -> PrepareResult:
        return PrepareFinalize.prepare(self, hidden_states, topk_weights, topk_ids, quant)

    def finalize(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget) -> torch.Tensor:
        return PrepareFinalize.finalize(self, fused_expert_output, topk_weights, topk_ids, output)

    def prepare_async(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, quant: QuantSpec) -> AsyncResult:
        sent = super().prepare_async(hidden_states, topk_weights, topk_ids, quant)
        capacity = self.cfg.max_tokens_per_rank * self.num_dispatchers()
        e_local = self.manager.placement.num_local

        def receiver() -> PrepareResult:
            std = sent.receiver()
            assert isinstance(std, PrepareResult) and std.topk_ids is not None
            assert std.topk_weights is not None and std.x_sf is None
            rows, ks = (std.topk_ids >= 0).nonzero(as_tuple=True)
            expert = std.topk_ids[rows, ks]
            order = torch.argsort(expert * (std.x.shape[0] + 1) + rows, stable=True)
            rows, ks, expert = rows[order], ks[order], expert[order]
            counts = torch.bincount(expert, minlength=e_local)
            starts = torch.cumsum(counts, 0) - counts
            slot = torch.arange(expert.numel()) - starts[expert]
            # slots past each expert's count hold whatever an earlier call left there on the
            # real kernels: NaN here, so a consumer that reads them shows it
            x = std.x.new_full((e_local, capacity, std.x.shape[1]), float("nan"))
            x[expert, slot] = std.x[rows]
            self._packing = _Packing(expert, slot, rows, std.topk_weights[rows, ks].float(),
                                     std.x.shape[0])
            return PrepareResult(x, None, ExpertTokensMeta(counts.to(torch.int32)), None, None)

        return AsyncResult(sent.hook, receiver)

    def finalize_async(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget
                       ) -> AsyncResult:
        p = self._packing
        if p is None:
            raise RuntimeError("finalize called without a matching prepare on this backend")
        per_row = torch.zeros(p.num_recv, fused_expert_output.shape[-1], dtype=torch.float32)
        per_row.index_add_(0, p.row,
                           fused_expert_output[p.expert, p.slot].float() * p.weight[:, None])
        self._packing = None
        return super().finalize_async(per_row.to(fused_expert_output.dtype), topk_weights,
                                      topk_ids, output)
