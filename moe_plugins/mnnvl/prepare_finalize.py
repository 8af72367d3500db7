"""The prepare/finalize of the flashinfer MNNVL backends (``flashinfer_nvlink_two_sided``,
``flashinfer_nvlink_one_sided``): STANDARD layout, one dispatch and one combine per call on the
manager's transport (:class:`moe_plugins.mnnvl.manager.MnnvlManager`), which adapts the
flashinfer API of each backend and release.

prepare: quantization happens before the all-to-all with scales left unswizzled (the nvfp4
swizzle pads rows to 128, so swizzled scales would no longer be row-aligned with the tokens);
the activations, their scales only when they are quantized (``x_sf is not None``) and the routing
(int32 ids, float32 weights) cross together; with ``nvfp4_swizzled_sf`` the received nvfp4
scales are interleaved afterwards, again only when present. ``defer_input_quant`` sends the raw
activations and returns ``x_sf = None``.

finalize: the combine sends each row back to its token's rank and sums the per-rank partials;
the result is copied into the output, or added into the owned rows of a row-scatter target
after the join.

These backends have no receive hook: the whole dispatch is issued by the receiver, i.e. after
the layer has forked the shared expert onto the side stream, so the shared expert overlaps with
the dispatch, the experts and the combine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from moe_plugins.config import DispatchConfig
from moe_plugins.counters import DispatchStats, host_count
from moe_plugins.faults import group_faults, layer_name
from moe_plugins.mnnvl.manager import Dispatched, MnnvlManager, pad_row_bytes
from moe_plugins.interface import (ActivationFormat, AsyncResult, BatchHint, PrepareFinalize,
                                   PrepareResult, RowScatterTarget, check_finalize_routing,
                                   check_output, check_prepare_inputs, write_output)
from moe_plugins.layout import LocalIdMap, destination_ranks
from moe_plugins.quant import QuantScheme, QuantSpec, quantize_for_dispatch, swizzle_nvfp4_sf

__all__ = ["MnnvlPrepareFinalize"]


@dataclass
class _CallState:
    """Between prepare and finalize. recv_tokens: rows that carry a token (None: not counted,
    e.g. during CUDA-graph capture)."""

    num_tokens: int
    recv_rows: int
    topk_ids: torch.Tensor  # as given to prepare (finalize must get the same)
    topk_weights: torch.Tensor
    recv_tokens: Optional[int] = None
    dispatched: bool = False  # the receiver issued the dispatch


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


class MnnvlPrepareFinalize(PrepareFinalize):
    """STANDARD layout: prepare returns ``num_recv_tokens = num_ranks * tokens_per_rank`` rows
    (source-rank major), ``tokens_per_rank`` being the call's bound
    (:meth:`set_batch_hint` before the call: the most tokens any rank sends in it, the same on
    every rank) or, without one, the layer's ``max_tokens_per_rank``; rows that carry no token
    have topk_ids -1 in every column and unspecified x. topk_ids are LOCAL expert ids, -1 where
    the expert lives on another rank. expert_tokens_meta is None."""

    activation_format = ActivationFormat.STANDARD

    #: the manager class a subclass is built on (its backend's)
    manager_type: ClassVar[type[MnnvlManager]] = MnnvlManager

    def __init__(self, manager: MnnvlManager, cfg: DispatchConfig):
        if not isinstance(manager, self.manager_type):
            raise TypeError(f"{type(self).__name__} needs a {self.manager_type.__name__}, got "
                            f"{type(manager).__name__}")
        self.manager = manager
        self.cfg = cfg
        self.stats = DispatchStats()
        self._state: Optional[_CallState] = None
        self._hint: Optional[BatchHint] = None
        self._local_id_map = LocalIdMap(manager.placement, manager.rank)
        # No host exchange: a refused input owes the call, any other failure breaks the group
        # (moe_plugins.faults).
        self.faults = group_faults(manager.group)
        self.name = layer_name(manager.backend_name, cfg, manager.rank)

    def num_dispatchers(self) -> int:
        return self.manager.num_ranks

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return self.manager.max_tokens_per_rank

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        """flashinfer's all-to-all moves int32 ids."""
        return torch.int32

    def reset_call_state(self) -> None:
        if self._state is not None and self._state.dispatched:
            # dispatched, never combined: peers wait in the combine
            self.faults.mark_broken("a call was abandoned between its dispatch and its combine")
        self._state = None
        self.manager.reset_call_state()

    def _local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """PHYSICAL int32 ids -> LOCAL int64 ids, -1 outside this rank's experts (other ranks'
        experts, the kernels' invalid id on rows that carry no token)."""
        return self._local_id_map(topk_ids)

    def _count_dispatch(self, topk_ids: torch.Tensor, x: torch.Tensor, x_sf: Optional[torch.Tensor],
                        local_ids: torch.Tensor) -> Optional[int]:
        """Add this call's payload (without the kernels' 16-byte row padding) to the stats;
        returns the received rows that carry a token. On a GPU only calls and pairs are
        counted, and no kernel runs for the stats (see :func:`moe_plugins.counters.host_count`)."""
        m, s = self.manager, self.stats
        s.calls += 1
        s.pairs += topk_ids.numel()
        if topk_ids.is_cuda:
            return None
        hit = destination_ranks(topk_ids, m.placement)
        rows = host_count(hit.sum())
        if rows is not None:
            s.rows += rows
            s.act_bytes += rows * _row_bytes(x)
            s.sf_bytes += rows * _row_bytes(x_sf) if x_sf is not None else 0
            s.meta_bytes += rows * m.num_topk * (4 + 4)  # int32 ids + float32 weights
        return host_count((local_ids >= 0).any(dim=1).sum())

    #: the engine's hint bounds the next call's receive rows
    uses_batch_hint = True

    def set_batch_hint(self, hint: Optional[BatchHint]) -> None:
        """The next prepare's receive rows follow ``hint.max_tokens_per_rank`` (the same on
        every EP rank; see the class doc); None: the layer's ``max_tokens_per_rank``. A hint
        covers one call."""
        self._hint = hint

    def _check(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, hint: Optional[BatchHint]) -> int:
        """Every check of a prepare (ValueError/TypeError with the fix, before anything is
        sent); returns the call's tokens per rank (its receive rows' bound)."""
        check_prepare_inputs(hidden_states, topk_weights, topk_ids)
        m, cfg = self.manager, self.cfg
        n = hidden_states.shape[0]
        if n > m.max_tokens_per_rank:
            raise ValueError(
                f"prepare got {n} tokens but the layer was built for max_tokens_per_rank="
                f"{m.max_tokens_per_rank} (it sizes flashinfer's receive buffers); build the layer "
                "with a larger max_tokens_per_rank"
            )
        if hidden_states.shape[1] != cfg.hidden or topk_ids.shape[1] != cfg.num_topk:
            raise ValueError(
                f"hidden_states {tuple(hidden_states.shape)} / topk_ids {tuple(topk_ids.shape)} do "
                f"not match the layer (hidden={cfg.hidden}, num_topk={cfg.num_topk})"
            )
        return m.tokens_per_rank(n, None if hint is None else hint.max_tokens_per_rank)

    def prepare_async(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, quant: QuantSpec) -> AsyncResult:
        """The receive rows follow the call's hint (see the class doc); the workspaces do not
        depend on it."""
        hint, self._hint = self._hint, None  # a hint covers one call
        f = self.faults
        tokens_per_rank = f.start(self, self.name, hidden_states, self._state is not None,
                                  self._check, hidden_states, topk_weights, topk_ids, hint)
        m, n = self.manager, hidden_states.shape[0]
        state = self._state = _CallState(n, m.recv_rows(tokens_per_rank), topk_ids, topk_weights)

        def receiver() -> PrepareResult:
            # Unswizzled scales, or (hidden_states, None) when unquantized or deferred.
            try:
                x, x_sf = quantize_for_dispatch(hidden_states, quant)
                d = self._dispatch(x, x_sf, topk_ids, topk_weights, tokens_per_rank)
                state.dispatched = True
            except BaseException as e:  # peers are in (or past) this dispatch
                f.mark_broken(f"{self.name}: prepare raised on this rank", e)
                raise
            recv_sf, swizzled = d.x_sf, False
            swizzle = m.options.nvfp4_swizzled_sf if quant.nvfp4_swizzled_sf is None \
                else quant.nvfp4_swizzled_sf
            if recv_sf is not None and quant.scheme is QuantScheme.NVFP4 and swizzle:
                recv_sf, swizzled = swizzle_nvfp4_sf(recv_sf), True
            local = self._local_ids(d.topk_ids)
            state.recv_tokens = self._count_dispatch(topk_ids, x, x_sf, local)
            return PrepareResult(x=d.x, x_sf=recv_sf, expert_tokens_meta=None, topk_ids=local,
                                 topk_weights=d.topk_weights, x_sf_swizzled=swizzled)

        return AsyncResult(None, receiver)

    def finalize_async(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget) -> AsyncResult:
        state = self._state
        if state is None:
            raise RuntimeError("finalize called without a matching prepare on this backend")
        # Checked before the combine is sent, so an error names what is wrong; the peers are in
        # the call, so it breaks the group all the same.
        try:
            if fused_expert_output.shape != (state.recv_rows, self.cfg.hidden):
                raise ValueError(f"fused_expert_output has shape "
                                 f"{tuple(fused_expert_output.shape)}, expected "
                                 f"[{state.recv_rows}, {self.cfg.hidden}] (the rows prepare "
                                 "returned, the layer's hidden)")
            if topk_ids is not state.topk_ids or topk_weights is not state.topk_weights:
                check_finalize_routing(state.topk_ids, state.topk_weights, topk_ids, topk_weights)
            check_output(output, state.num_tokens, self.cfg.hidden)
        except BaseException as e:
            self.faults.mark_broken(f"{self.name}: finalize raised on this rank", e)
            self._state = None
            raise

        def receiver() -> torch.Tensor:
            try:
                combined = self._combine(fused_expert_output, state.num_tokens)
            except BaseException as e:
                self.faults.mark_broken(f"{self.name}: finalize raised on this rank", e)
                raise
            finally:
                self._state = None
            if state.recv_tokens is not None:
                self.stats.combine_bytes += state.recv_tokens * _row_bytes(fused_expert_output)
            return write_output(output, combined)

        return AsyncResult(None, receiver)

    # -- the library calls (the manager owns the workspaces) ---------------------------------
    def _dispatch(self, x: torch.Tensor, x_sf: Optional[torch.Tensor], topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, tokens_per_rank: Optional[int] = None) -> Dispatched:
        """x [num_tokens, *] (model dtype or quantized), x_sf [num_tokens, *] unswizzled or None,
        topk_ids int [num_tokens, num_topk] GLOBAL ids, topk_weights float [num_tokens, num_topk].
        Scales travel only when ``x_sf is not None``. ``tokens_per_rank``: this call's bound from
        :meth:`MnnvlManager.tokens_per_rank` (None: the layer's); the result has
        ``num_ranks * tokens_per_rank`` rows. Collective over the EP group."""
        t = self.manager.transport()
        bound = self.manager.max_tokens_per_rank if tokens_per_rank is None else tokens_per_rank
        if topk_ids.dtype is not torch.int32:
            topk_ids = topk_ids.to(torch.int32)
        if topk_weights.dtype is not torch.float32:
            topk_weights = topk_weights.to(torch.float32)
        align = self.manager.row_align_bytes
        d = t.dispatch(pad_row_bytes(x, align),
                       None if x_sf is None else pad_row_bytes(x_sf, align),
                       topk_ids.contiguous(), topk_weights.contiguous(), bound)
        # Slice the 16-byte row padding off only where there was some (a slice costs host time).
        recv_x = d.x if d.x.shape[1] == x.shape[1] else d.x[:, : x.shape[1]]
        recv_sf = None
        if d.x_sf is not None and x_sf is not None:
            recv_sf = d.x_sf if d.x_sf.shape[1] == x_sf.shape[1] else d.x_sf[:, : x_sf.shape[1]]
        if recv_x is d.x and recv_sf is d.x_sf:
            return d
        return Dispatched(recv_x, recv_sf, d.topk_ids, d.topk_weights)

    def _combine(self, expert_output: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """expert_output [num_ranks * tokens_per_rank, hidden] (each row: the weighted sum of
        this rank's experts for that row) -> [num_tokens, hidden] summed over ranks, same dtype.
        Collective over the EP group."""
        out = self.manager.transport().combine(
            pad_row_bytes(expert_output, self.manager.row_align_bytes), num_tokens)
        return out if out.shape[1] == expert_output.shape[1] else out[:, : expert_output.shape[1]]
