"""Backend ``deepep_ht``: DeepEP's normal (high-throughput) mode, STANDARD format.

Built for prefill: one message per (token, destination rank) with the layout computed on the
GPU, NVLink inside a node and RDMA + NVLink forwarding across nodes, no token capacity (the
receive sizes come from the counts, which the host waits for, so normal mode cannot be captured
in a CUDA graph: ``deepep_auto`` uses the low-latency kernels there).

prepare: fp8 block-128 quantization happens before the dispatch (DeepEP moves the e4m3 rows and
their float32 scales; ``x_sf is None`` exactly when the activations travel in bf16), then
``get_dispatch_layout`` and ``dispatch`` are issued; the receive hook makes the current stream
wait for the dispatch event, so the shared expert launched between them overlaps the transfer.
The experts get the received rows with LOCAL topk ids (-1 for experts elsewhere, weight 0.0), as
DeepEP returns them. finalize: the experts' router-weighted rows are combined (DeepEP sums
without weights); the hook waits for the combine event; the result goes through
:func:`moe_plugins.interface.write_output` (a plain output, or the row-scatter add).

The calls run asynchronously on DeepEP's communication stream, ordered by its ``EventOverlap``
events: the layout event feeds the dispatch (``previous_event``, tensors allocated on the
communication stream), and the caller's stream waits for the dispatch and the combine events in
the receive hooks. The manager (:mod:`moe_plugins.all2all.deepep_ht`) owns the buffer; this class makes the
calls.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from moe_plugins.all2all.deepep_ll import DEEPEP_PACKAGE
from moe_plugins.all2all.deepep_ht import EP_SIZES, HT_QUANTS, DeepEPHTManager, check_normal_mode_layer
from moe_plugins.config import DispatchConfig
from moe_plugins.counters import DispatchStats, host_count
from moe_plugins.faults import group_faults, in_step, layer_name
from moe_plugins.callbound import host_wait
from moe_plugins.interface import (ActivationFormat, AsyncResult, ExpertTokensMeta,
                                   PrepareFinalize, PrepareResult, RowScatterTarget,
                                   capturing, check_finalize_routing, check_output,
                                   check_prepare_inputs, write_output)
from moe_plugins.quant import QuantSpec, quantize_for_dispatch
from moe_plugins.registry import BackendSpec, Capabilities, Transport, WireLayout

__all__ = ["DeepEPHTPrepareFinalize", "SPEC", "deepep_spec"]


@dataclass
class _CallState:
    """What finalize needs from prepare: DeepEP's handle, the tokens given to prepare, the rows
    received and the routing given to prepare."""

    handle: Any
    num_tokens: int
    num_recv: int
    topk_ids: torch.Tensor  # as given to prepare (finalize must get the same)
    topk_weights: torch.Tensor


class DeepEPHTPrepareFinalize(PrepareFinalize):
    """STANDARD layout: prepare returns x [num_recv_tokens, hidden] (bf16, or e4m3 with x_sf
    float32 [num_recv_tokens, hidden // 128]), topk_ids int64 [num_recv_tokens, num_topk] LOCAL
    ids (-1 elsewhere), topk_weights float32 (0.0 where the id is -1), and the received tokens
    per local expert. Rows are ordered by source rank, then source token order."""

    activation_format = ActivationFormat.STANDARD
    waits_on_host = True  # the dispatch waits for the peers' counts on the host (host_wait)

    def __init__(self, manager: DeepEPHTManager, cfg: DispatchConfig):
        if not isinstance(manager, DeepEPHTManager):
            raise TypeError(f"DeepEPHTPrepareFinalize needs a DeepEPHTManager, got "
                            f"{type(manager).__name__}")
        self.manager = manager
        self.cfg = cfg
        # DeepEP's host wait raises at its timeout as built (NUM_CPU_TIMEOUT_SECS; its kernels'
        # waits trap): the backstop after it
        self.library_timeout_s = manager.deepep.timeouts.cpu_s
        self.stats = DispatchStats()
        self._state: Optional[_CallState] = None
        # No host exchange: a refused input owes the call, any other failure breaks the group
        # (moe_plugins.faults).
        self.faults = group_faults(manager.group)
        self.name = layer_name(manager.backend_name, cfg, manager.rank)

    def num_dispatchers(self) -> int:
        return self.manager.num_ranks

    def supports_async(self) -> bool:
        return True

    def topk_indices_dtype(self) -> torch.dtype:
        return self.manager.topk_idx_dtype

    def reset_call_state(self) -> None:
        if self._state is not None:  # dispatched, never combined: peers wait in the combine
            self.faults.mark_broken("a call was abandoned between its dispatch and its combine")
        self._state = None

    def _check(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, quant: QuantSpec) -> None:
        """Every check of a prepare, each raising with the fix, before anything is sent."""
        check_prepare_inputs(hidden_states, topk_weights, topk_ids, self.cfg)
        m = self.manager
        if quant.scheme not in HT_QUANTS:
            raise ValueError(f"{m.backend_name}: quant scheme {quant.scheme.value} is not "
                             f"supported; supported: {sorted(q.value for q in HT_QUANTS)}")
        if hidden_states.shape[1] != m.hidden:
            raise ValueError(f"hidden_states has hidden={hidden_states.shape[1]}, the layer was "
                             f"built for {m.hidden}")
        if hidden_states.dtype != torch.bfloat16:
            raise TypeError(f"{m.backend_name}: hidden_states must be bfloat16 (DeepEP's combine "
                            f"reduces bf16), got {hidden_states.dtype}")
        refused = m.deepep.determinism_error(m.backend_name)  # the library would assert
        if refused is not None:
            raise refused
        if capturing():
            # In step, not a refusal that owes the call: an EP layer is captured on every rank
            # at once (its captured kernels communicate), and while capturing no rank sends
            # anything, so every rank refuses here alike and the group stays usable.
            raise in_step(RuntimeError(
                f"{m.backend_name}: DeepEP's normal mode waits on the host for the receive counts "
                "and cannot be captured in a CUDA graph; use 'deepep_auto' (low-latency kernels "
                "under capture) or run eagerly (vLLM: --enforce-eager)"))

    def prepare_async(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, quant: QuantSpec) -> AsyncResult:
        """hidden_states bf16 [num_tokens, hidden], topk_weights float [num_tokens, num_topk],
        topk_ids int32/int64 [num_tokens, num_topk] GLOBAL ids (-1: none). The layout and the
        dispatch are issued here; the hook orders the current stream after the dispatch."""
        f = self.faults
        f.start(self, self.name, hidden_states, self._state is not None, self._check,
                hidden_states, topk_weights, topk_ids, quant)
        m = self.manager
        try:
            ids = topk_ids.to(m.topk_idx_dtype).contiguous()
            weights = topk_weights.float().contiguous()
            x, x_sf = quantize_for_dispatch(hidden_states.contiguous(), quant)
            layout = self._layout(ids)
            recv_x, recv_sf, recv_ids, recv_weights, counts, handle, event = self._dispatch(
                x, x_sf, ids, weights, layout)
        except BaseException as e:  # peers are in (or past) this dispatch
            f.mark_broken(f"{self.name}: prepare raised on this rank", e)
            raise
        num_recv = recv_x.shape[0]
        self._state = _CallState(handle, hidden_states.shape[0], num_recv, topk_ids,
                                 topk_weights)
        self._count(topk_ids, layout[3], x, x_sf, num_recv)

        def receiver() -> PrepareResult:
            meta = ExpertTokensMeta(torch.tensor(counts, dtype=torch.int32, device=recv_x.device))
            return PrepareResult(x=recv_x, x_sf=recv_sf, expert_tokens_meta=meta,
                                 topk_ids=recv_ids, topk_weights=recv_weights)

        return AsyncResult(event.current_stream_wait, receiver)

    # -- the library calls (the manager owns the buffer) -------------------------------------
    def _layout(self, topk_idx: torch.Tensor) -> tuple[Any, Any, Any, Any, Any]:
        """topk_idx topk_idx_dtype [num_tokens, num_topk] (GLOBAL ids, -1: none) ->
        (num_tokens_per_rank int32 [num_ranks], num_tokens_per_rdma_rank or None,
        num_tokens_per_expert int32 [num_experts], is_token_in_rank bool [num_tokens, num_ranks],
        event), computed on the communication stream."""
        return self.manager.buffer.get_dispatch_layout(topk_idx, self.manager.num_experts, async_finish=True)

    def _dispatch(self, x: torch.Tensor, x_sf: Optional[torch.Tensor], topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor, layout: tuple[Any, Any, Any, Any, Any]):
        """Send x [num_tokens, hidden] (bf16, or e4m3 with x_sf float32 [num_tokens, hidden // 128])
        once to every rank holding one of its experts. Blocks the host until the receive counts
        are known (DeepEP's normal mode). Returns (recv_x, recv_x_sf or None, recv_topk_idx
        [num_recv_tokens, num_topk] LOCAL ids (-1 elsewhere), recv_topk_weights float32 (0.0
        elsewhere), per-local-expert counts (list of int), handle, event); the tensors are
        valid once ``event.current_stream_wait()`` has run."""
        per_rank, per_rdma_rank, per_expert, in_rank, layout_event = layout
        with host_wait():  # it waits holding the interpreter lock: the lock-free timer
            recv, recv_ids, recv_weights, counts, handle, event = self.manager.buffer.dispatch(
                (x, x_sf) if x_sf is not None else x, num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                previous_event=layout_event, async_finish=True, allocate_on_comm_stream=True)
        recv_x, recv_sf = recv if x_sf is not None else (recv, None)
        return recv_x, recv_sf, recv_ids, recv_weights, counts, handle, event

    def _combine(self, x: torch.Tensor, handle: Any) -> tuple[torch.Tensor, Any]:
        """Send expert outputs x bf16 [num_recv_tokens, hidden] (already router-weighted: the
        combine sums without weights) back; returns (combined bf16 [num_tokens, hidden], event)."""
        combined, _, event = self.manager.buffer.combine(x, handle, async_finish=True)
        return combined, event

    def _count(self, topk_ids: torch.Tensor, is_token_in_rank: torch.Tensor, x: torch.Tensor,
               x_sf: Optional[torch.Tensor], num_recv: int) -> None:
        s, h = self.stats, self.manager.hidden
        s.calls += 1
        s.pairs += topk_ids.numel()
        # What this rank sends is known only on the device (a read would stall the stream);
        # what it receives, and so sends back in combine, the host knows from the dispatch.
        rows = host_count(is_token_in_rank.sum())
        if rows is not None:
            s.rows += rows
            s.act_bytes += rows * h * x.element_size()
            s.sf_bytes += rows * x_sf.shape[1] * x_sf.element_size() if x_sf is not None else 0
            s.meta_bytes += rows * topk_ids.shape[1] * (8 + 4)  # int64 ids + float32 weights
        s.combine_bytes += num_recv * h * 2

    def finalize_async(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget) -> AsyncResult:
        """fused_expert_output bf16 [num_recv_tokens, hidden]: the router-weighted sum of this
        rank's experts per received row. ``output``: [num_tokens, hidden] to fill, or a
        row-scatter target whose owned rows get the combined rows added."""
        st = self._state
        if st is None:
            raise RuntimeError("finalize called without a matching prepare on this backend")
        m = self.manager
        try:
            if tuple(fused_expert_output.shape) != (st.num_recv, m.hidden):
                raise ValueError(f"fused_expert_output has shape {tuple(fused_expert_output.shape)},"
                                 f" expected [{st.num_recv}, {m.hidden}] (the rows prepare received)")
            if fused_expert_output.dtype != torch.bfloat16:
                raise TypeError(f"{m.backend_name}: expert outputs must be bfloat16 for DeepEP's "
                                f"combine, got {fused_expert_output.dtype}")
            if topk_ids is not st.topk_ids or topk_weights is not st.topk_weights:
                check_finalize_routing(st.topk_ids, st.topk_weights, topk_ids, topk_weights)
            check_output(output, st.num_tokens, m.hidden)
            combined, event = self._combine(fused_expert_output.contiguous(), st.handle)
        except BaseException as e:  # peers are in this combine: out of step now
            self.faults.mark_broken(f"{self.name}: finalize raised on this rank", e)
            raise
        finally:
            self._state = None

        return AsyncResult(event.current_stream_wait, lambda: write_output(output, combined))


def deepep_spec(name: str, prepare_finalize: type[PrepareFinalize], manager: type,
                description: str, priority: int, **extra: Any) -> BackendSpec:
    """The registry entry of a STANDARD-format DeepEP backend (deepep_ht, deepep_auto): the
    capabilities, quants, EP sizes and dtype both share. sp: vLLM's use_sequence_parallel_moe
    lists deepep_high_throughput; tp: TP slicing happens before prepare."""
    return BackendSpec(
        name=name, prepare_finalize=prepare_finalize, manager=manager,
        capabilities=Capabilities(ep_dp=True, dp=True, tp=True, sp=True, row_scatter=True,
                                  recv_hook=True, activation_format=ActivationFormat.STANDARD,
                                  placements=True),
        quants=HT_QUANTS, required=(DEEPEP_PACKAGE,), needs_cuda=True, description=description,
        priority=priority, ep_sizes=EP_SIZES,
        dtypes=frozenset({torch.bfloat16}),  # the normal-mode combine reduces bf16 only
        wire_layout=functools.partial(normal_mode_wire_layout, backend=name),
        **{"transport": Transport.NORMAL, **extra})


def normal_mode_wire_layout(cfg: DispatchConfig, backend: str) -> WireLayout:
    """``BackendSpec.wire_layout``: the normal-mode layer checks (ValueError naming ``backend``),
    then the row DeepEP's normal mode sends per (token, rank): the layer's hidden, no header,
    int64 expert ids."""
    check_normal_mode_layer(cfg, backend)
    return WireLayout(cfg.hidden)


SPEC = deepep_spec(
    "deepep_ht", DeepEPHTPrepareFinalize, DeepEPHTManager,
    "DeepEP V1 normal (high-throughput) dispatch/combine: NVLink + RDMA forwarding, layout on "
    "the GPU, one row per (token, rank); prefill (no CUDA graphs)",
    # below deepep_ll: auto-selection cannot know the batch sizes; deepep_auto picks per call
    priority=20, use_for="prefill: large batches, eager mode (no CUDA graphs)")
