"""vLLM's prepare/finalize over one of our backends (:class:`MoEPluginsPrepareAndFinalize`).

How a layer maps onto vLLM's modular kernel (vLLM's EP group = DP x TP ranks; without SP every
TP rank of a DP group holds the same tokens; under vLLM's sequence-parallel MoE the model hands
each TP rank its owned chunk):

| strategy | prepare | finalize | ``output_is_reduced()`` | vLLM runner afterwards |
|---|---|---|---|---|
| LOCAL (tp == 1) | dispatch all tokens | combine into ``output`` | True | nothing |
| SP_ALLGATHER (vLLM's SP on) | dispatch all of the chunk (no second slicing) | combine into ``output`` | True | nothing (the model all_gathers the chunks) |
| ROW_SCATTER_ALLREDUCE | dispatch the owned rows | combine into the owned rows, zero the rest | False | ``all_reduce(shared partial + routed)`` once |
| GATHER_PLUS_ALLREDUCE | dispatch the owned rows | combine, then all_gather the rows over TP | True | all_reduce of the shared output |
| TP_UNIFIED (dp == 1) | none (local experts on all tokens) | weight and reduce into ``output`` | False | ``all_reduce(shared partial + routed)`` once |

Expert ids: vLLM's ids, the physical ids our transports dispatch and the local slots they hand
back are mapped by :class:`moe_plugins.vllm.expert_ids.ExpertIds`; what the experts get (a
quantized wire format, or the model dtype quantized after the receive) is decided by
:func:`moe_plugins.vllm.receive_quant.experts_quantization`.

Batched format (backends whose capabilities say BATCHED, e.g. DeepEP low-latency): prepare hands
vLLM ``[num_local_experts, max_recv_tokens, hidden]`` with per-expert counts, the experts return
unweighted rows in the same layout, and the backend's combine applies the router weights. vLLM
picks batched experts only when ``use_batched_activation_format`` is true; the hook in
:mod:`moe_plugins.vllm.patches` answers it from :func:`layer_plan`, as this module does.

Dual-batch overlap (``--enable-dbo``): vLLM runs two micro-batches of one layer on two threads
that hand over at its yields, so two calls of one layer are in flight. The adapter keeps one call
state per micro-batch id (``dbo_current_ubatch_id()``) and, for backends whose capabilities say
``micro_batch``, one backend prepare/finalize object per micro-batch over the same manager and
library buffer (the per-call handle lives in that object; the layer's counters sum them). It takes
part in vLLM's protocol where vLLM's in-tree DeepEP LL class does: before its combine send it
runs the receive hook the other micro-batch registered (``dbo_maybe_run_recv_hook``), so at most
two transfers are in flight (the libraries double-buffer).
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Optional, Sequence

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceContiguous, TopKWeightAndReduceDelegate)
from vllm.v1.worker.ubatching import dbo_current_ubatch_id, dbo_enabled, dbo_maybe_run_recv_hook

from moe_plugins.counters import DispatchStats
from moe_plugins.faults import group_faults, is_owed_call
from moe_plugins.groups import DistContext
from moe_plugins.interface import (ActivationFormat, AsyncResult, PrepareFinalize,
                                   PrepareResult, SplitPhases, check_finalize_result)
from moe_plugins.layout import OwnedRows
from moe_plugins.overlap import OverlapConfig
from moe_plugins.quant import QuantScheme, QuantSpec, quantize_for_dispatch, swizzle_nvfp4_sf
from moe_plugins.strategy import ReductionStrategy, StrategyChoice
from moe_plugins.vllm.batch_hint import batch_hint
from moe_plugins.vllm.call_guard import CallGuard
from moe_plugins.vllm.expert_ids import ExpertIds
from moe_plugins.vllm.fault_tolerance import fit_expert_output
from moe_plugins.vllm.receive_quant import (ReceiveQuant, experts_quantization, quantize_received,
                                            valid_rows)
from moe_plugins.vllm.tokens_meta import vllm_tokens_meta
from moe_plugins.vllm.tp_rows import TpRows

logger = logging.getLogger(__name__)

__all__ = ["MoEPluginsPrepareAndFinalize"]


_DEFERRED = QuantSpec()  # what travels under defer_input_quant: the activations as they are


_FIRST_CALL_LOGGED: set[str] = set()


def _nothing() -> None:
    """The receiver of a finalize that has nothing left to do."""


class MoEPluginsPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """vLLM's prepare/finalize over one of our :class:`PrepareFinalize` backends.

    backend: None for TP_UNIFIED (no dispatch); its activation format (standard or batched) is
    the one vLLM's experts get. ``stats`` counts what this layer sent (the backend's counters) and
    ``calls`` the prepares that ran. ``quants``: what the backend can put on the wire.
    ``global_to_physical``: vLLM's routing table (int [num_experts], the first of the
    ``routing_tables`` it hands its LL backends with round-robin placement), None where vLLM's
    ids are already physical (linear, EPLB); a round-robin ``expert_map`` without one is
    recognised and mapped with the same table.
    ``micro_batch_backends``: prepare/finalize objects of the same backend over the same manager
    for micro-batch ids 1, 2, ... (vLLM's dual-batch overlap; ``backend`` serves id 0);
    ``stats`` sums them all.
    """

    def __init__(self, backend: Optional[PrepareFinalize], backend_name: str, ctx: DistContext,
                 choice: StrategyChoice, overlap: OverlapConfig, num_experts: int,
                 wire_scheme: Optional[QuantScheme],
                 quants: frozenset[QuantScheme] = frozenset(QuantScheme),
                 global_to_physical: Optional[torch.Tensor] = None,
                 micro_batch_backends: Sequence[PrepareFinalize] = ()):
        super().__init__()
        if backend is None and micro_batch_backends:
            raise ValueError("micro_batch_backends need a backend for micro-batch 0")
        layout = ctx.layout
        if num_experts % layout.ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP size "
                             f"{layout.ep_size}; pick an EP size that divides the experts")
        self.backend, self.backend_name, self.ctx = backend, backend_name, ctx
        self.batched = backend is not None and backend.activation_format is ActivationFormat.BATCHED
        if self.batched and backend is not None and backend.max_num_tokens_per_rank() is None:
            raise ValueError(f"batched backend {backend_name!r} reports no max_num_tokens_per_rank"
                             "; vLLM sizes its batched experts from it")
        self.strategy = choice.strategy
        self.overlap = overlap
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // layout.ep_size
        self._ids = ExpertIds(num_experts, self.experts_per_rank, ctx.rank, layout.ep_size,
                              ctx.device, global_to_physical)
        self._no_stats = DispatchStats()
        self.calls = 0
        self._wire_scheme = wire_scheme
        self._quants = quants
        self._quant = QuantSpec()  # what travels: set by post_init_setup from the experts
        self._recv_quant: Optional[ReceiveQuant] = None
        self._nvfp4_swizzle = False
        self._first_call_logged = False
        # the rows this TP rank dispatches, and how its output is made whole after the combine
        self._rows = TpRows(ctx, choice.strategy)
        # micro-batch id -> its backend object and its call in flight
        self._backends: tuple[PrepareFinalize, ...] = (
            () if backend is None else (backend, *micro_batch_backends))
        # read once: only a per-call backend pays for reading vLLM's forward context per call
        self._wants_hint = backend is not None and backend.uses_batch_hint
        self.faults = group_faults(ctx.ep_group)  # the backends' (moe_plugins.faults)
        # each micro-batch's call in flight, the bound on it and the rules of a failed call
        self._guard = CallGuard(f"{backend_name} layer (EP rank {ctx.rank})", backend_name, ctx,
                                self._backends, self.faults)
        self._calls = self._guard.calls
        # backends with split phases (moe_plugins.interface.SplitPhases; every micro-batch's
        # object): the adapter calls their send and receive halves directly
        self._low_latency = bool(self._backends) and all(
            isinstance(b, SplitPhases) for b in self._backends)
        # read once: vLLM asks on every prepare and finalize
        self._async = overlap.overlap and backend is not None and backend.supports_async()
        # micro-batch ids below this have a backend object (no backend: any id, nothing to call)
        self._num_slots = len(self._backends) if backend is not None else sys.maxsize

    @property
    def stats(self) -> DispatchStats:
        """What this layer sent: the backend's counters, summed over its micro-batch objects
        (read when asked, not per call)."""
        if self.backend is None:
            return self._no_stats
        if len(self._backends) == 1:
            return self.backend.stats
        return DispatchStats.total([b.stats for b in self._backends])

    # -- capabilities ------------------------------------------------------------------------
    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return (mk.FusedMoEActivationFormat.BatchedExperts if self.batched
                else mk.FusedMoEActivationFormat.Standard)

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        """Batched backends: the backend's id dtype (DeepEP/NIXL EP: the library's
        ``topk_idx_t``), so vLLM's router emits it and no cast runs per call, as vLLM's in-tree
        DeepEP LL class asks. Standard backends: None (the router's default, int32), because
        the ids also reach vLLM's experts, and some take int32 only (its CPU experts do)."""
        return self.backend.topk_indices_dtype() if self.batched and self.backend else None

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return None if self.backend is None else self.backend.max_num_tokens_per_rank()

    def num_dispatchers(self) -> int:
        return 1 if self.backend is None else self.backend.num_dispatchers()

    def output_is_reduced(self) -> bool:
        # SP_ALLGATHER: the rows of this rank's chunk are complete (vLLM's runner reduces
        # nothing under SP; the model all_gathers), as vLLM's in-tree SP backends report.
        return self.strategy in (ReductionStrategy.LOCAL, ReductionStrategy.GATHER_PLUS_ALLREDUCE,
                                 ReductionStrategy.SP_ALLGATHER)

    def supports_async(self) -> bool:
        # vLLM runs the shared expert between finalize_async and its receive hook.
        return self._async

    def supports_dbo(self) -> bool:
        """Micro-batch safe: no dispatch (TP_UNIFIED), or one backend object per micro-batch."""
        return self.backend is None or len(self._backends) > 1

    def post_init_setup(self, fused_experts: mk.FusedMoEExperts) -> None:
        """Check the experts against what the backend delivers; fix the wire quantization; then
        let the backend adapt its wire format to the experts (packed UE8M0 scales for experts
        that ask for them, as vLLM's in-tree DeepEP LL class does)."""
        if self.batched:
            impl = fused_experts.finalize_weight_and_reduce_impl()
            if not isinstance(impl, TopKWeightAndReduceDelegate):
                raise ValueError(
                    f"batched backend {self.backend_name!r} applies the router weights in its "
                    f"combine, but {type(fused_experts).__name__} reduces with "
                    f"{type(impl).__name__}; use experts that leave the reduction to the "
                    "prepare/finalize (TopKWeightAndReduceDelegate)")
        wants = experts_quantization(fused_experts, self.backend_name, self.batched,
                                     self._quants, self._wire_scheme)
        self._quant, self._recv_quant = wants.wire, wants.after_receive
        self._nvfp4_swizzle = wants.nvfp4_swizzle
        # Only a quantized wire has a scale format to adapt (experts that take unquantized
        # inputs get bf16 whatever the layer's quant config says).
        if self._quant.quantized_on_wire:
            for backend in self._backends:
                backend.post_init_setup(fused_experts)

    # -- helpers -------------------------------------------------------------------------------
    def _to_vllm(self, prep: PrepareResult, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 quant: QuantSpec, quant_config: Any, defer_input_quant: bool
                 ) -> mk.PrepareResultType:
        """Our PrepareResult -> vLLM's (x, x_sf, expert_tokens_meta, topk_ids, topk_weights),
        quantized after the receive where the experts want a format the wire does not carry."""
        meta = vllm_tokens_meta(prep.expert_tokens_meta)
        x, x_sf = prep.x, prep.x_sf
        if self.batched:
            # x [num_local_experts, max_recv_tokens, hidden]; the experts keep the caller's ids
            ids = weights = None
        else:
            ids, weights = self._ids.to_vllm(prep, topk_ids.dtype, topk_weights.dtype)
        if self._recv_quant is not None and not defer_input_quant:
            assert x_sf is None
            x, x_sf = quantize_received(self._recv_quant, x, valid_rows(prep), quant_config,
                                        self.batched)
        elif (x_sf is not None and quant.scheme is QuantScheme.NVFP4 and self._nvfp4_swizzle
              and not prep.x_sf_swizzled):
            # A backend that returns NVFP4 scales row-aligned: interleave them here, as
            # vLLM's two-sided backend does after its all-to-all (only when present).
            x_sf = swizzle_nvfp4_sf(x_sf)
        return x, x_sf, meta, ids, weights

    def _log_first_call(self, num_tokens: int) -> None:
        self._first_call_logged = True
        key = self.backend_name
        if key not in _FIRST_CALL_LOGGED:
            _FIRST_CALL_LOGGED.add(key)
            logger.info("moe-plugins: prepare/finalize of backend %s ran on EP rank %d of %d "
                        "(strategy %s, first call %d tokens, call bound %s)", self.backend_name,
                        self.ctx.rank, self.ctx.layout.ep_size, self.strategy.value, num_tokens,
                        self._guard.describe())

    # -- prepare -------------------------------------------------------------------------------
    def prepare_async(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      num_experts: int, expert_map: Optional[torch.Tensor],
                      apply_router_weight_on_input: bool, quant_config: Any,
                      defer_input_quant: bool = False) -> Any:
        """a1 [num_tokens, hidden]; topk_* [num_tokens, num_topk] with GLOBAL ids. Returns
        (hook, receiver) or a receiver; the receiver gives vLLM's 5-tuple (x, x_sf,
        expert_tokens_meta, topk_ids, topk_weights) of the received rows (standard: GLOBAL ids;
        batched: x [num_local_experts, max_recv_tokens, hidden] and no ids/weights).

        vLLM's modular kernel runs nothing between a dispatch's send and its receive hook unless
        dual-batch overlap is on (then the other micro-batch computes there); without it the
        dispatch is the backend's blocking ``prepare`` (on the low-latency kernels one launch
        instead of two, which vLLM's in-tree class always makes) and only a receiver returns."""
        return self._prepare(a1, topk_weights, topk_ids, expert_map, apply_router_weight_on_input,
                             quant_config, defer_input_quant, not dbo_enabled())

    def _prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 expert_map: Optional[torch.Tensor], apply_router_weight_on_input: bool,
                 quant_config: Any, defer_input_quant: bool, blocking: bool) -> Any:
        slot = dbo_current_ubatch_id()  # 0 without dual-batch overlap
        if slot >= self._num_slots:
            self._guard.no_slot(slot)
        if slot in self._calls:
            self._guard.left_in_flight(slot)
        self.calls += 1
        if not self._first_call_logged:
            self._log_first_call(a1.shape[0])
        quant = _DEFERRED if defer_input_quant else self._quant
        refusal: Optional[BaseException] = None
        try:
            if apply_router_weight_on_input:
                if topk_ids.shape[1] != 1:
                    raise ValueError("apply_router_weight_on_input needs num_topk == 1, got "
                                     f"{topk_ids.shape[1]}")
                a1 = a1 * topk_weights.to(a1.dtype)
                if self.batched:
                    # A batched backend's combine applies the weights it is given (prepare's,
                    # which finalize passes on): the input already carries the router weight,
                    # so it combines with unit weights, as vLLM's in-tree batched backends do.
                    topk_weights = torch.ones_like(topk_weights)
            if self.backend is None:  # no dispatch: quantize the local rows as a receive would
                if self._recv_quant is not None and not defer_input_quant:
                    every_row = torch.ones(a1.shape[0], dtype=torch.bool, device=a1.device)
                    x, x_sf = quantize_received(self._recv_quant, a1, every_row, quant_config,
                                                self.batched)
                else:
                    x, x_sf = quantize_for_dispatch(a1, quant)
                    if (x_sf is not None and quant.scheme is QuantScheme.NVFP4
                            and self._nvfp4_swizzle):
                        x_sf = swizzle_nvfp4_sf(x_sf)
                return lambda: (x, x_sf, None, None, None)

            # TP_UNIFIED (no backend) takes any expert_map; checked once per expert_map tensor
            id_map = self._ids
            if expert_map is not id_map.placement_map or id_map.slot_ids is None:
                id_map.check(expert_map)
            ids = topk_ids if id_map.g2p is None else id_map.physical(topk_ids)
            # tp == 1 owns every row: nothing to slice, and the backend's input check covers
            # what slice_owned would check (the three tensors cover the same tokens).
            rows, x, ids, weights, owns_all = self._rows.own(a1, ids, topk_weights)
        except (ValueError, TypeError) as e:  # refused before anything was sent
            if self.backend is None:
                raise
            refusal = self._guard.refuse(e)
            x, ids, weights, rows, owns_all = self._rows.no_tokens(self._backends[0].cfg)
        backend = self._backends[slot]
        if self._wants_hint:
            # per-call backends pick their transport (deepep_auto) or size their receive rows
            # (flashinfer two-sided, by vLLM's DP metadata as vLLM's in-tree two-sided backend)
            # from what every rank agrees on; under SP a1 is already this rank's chunk (vLLM
            # pads the chunks to one size)
            backend.set_batch_hint(batch_hint(a1.shape[0], self.ctx.layout,
                                              presliced=self._rows.presliced))
        try:
            sent = self._send(slot, backend, x, weights, ids, quant, rows, owns_all, refusal,
                              topk_ids, topk_weights, quant_config, defer_input_quant, blocking)
        except BaseException as e:
            if refusal is not None or not is_owed_call(e):
                raise
            # the backend refused this rank's tokens and its peers are in the call
            refusal = self._guard.refuse(e)
            x, ids, weights, rows, owns_all = self._rows.no_tokens(self._backends[0].cfg)
            if self._wants_hint:
                backend.set_batch_hint(batch_hint(a1.shape[0], self.ctx.layout,
                                                  presliced=self._rows.presliced))
            sent = self._send(slot, backend, x, weights, ids, quant, rows, owns_all, refusal,
                              topk_ids, topk_weights, quant_config, defer_input_quant, blocking)
        return sent

    def _send(self, slot: int, backend: PrepareFinalize, x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, quant: QuantSpec, rows: Optional[OwnedRows], owns_all: bool,
              refusal: Optional[BaseException], topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, quant_config: Any, defer_input_quant: bool,
              blocking: bool) -> Any:
        """Register the call and issue the backend's dispatch; returns vLLM's (hook, receiver)
        or receiver."""
        watched = self._guard.open(slot, backend, self.calls, rows, ids, weights, owns_all,
                                   refusal)
        try:
            if self._low_latency and (defer_input_quant or self._recv_quant is None):
                # our low-latency backends' send, vLLM's result built from the receive buffers
                # (no PrepareResult in between: host time on every eager call)
                recv_x, recv_sf, count, hook = backend.dispatch_send(x, weights, ids, quant,
                                                                     not blocking)
                result = (recv_x, recv_sf, mk.ExpertTokensMetadata(count, None), None, None)
                return (hook, lambda: result) if hook is not None else lambda: result
            if blocking:
                result = self._to_vllm(backend.prepare(x, weights, ids, quant), topk_ids,
                                       topk_weights, quant, quant_config, defer_input_quant)
                return lambda: result
            sent = backend.prepare_async(x, weights, ids, quant)
        except BaseException as e:
            self._guard.send_failed(slot, backend, watched, self.calls, e)
            raise

        def receiver() -> mk.PrepareResultType:
            prep = sent.receiver()
            assert isinstance(prep, PrepareResult)
            return self._to_vllm(prep, topk_ids, topk_weights, quant, quant_config,
                                 defer_input_quant)

        return (sent.hook, receiver) if sent.hook is not None else receiver

    def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                num_experts: int, expert_map: Optional[torch.Tensor],
                apply_router_weight_on_input: bool, quant_config: Any,
                defer_input_quant: bool = False) -> mk.PrepareResultType:
        """:meth:`prepare_async` with the receive at once (the backend's blocking dispatch)."""
        return self._prepare(a1, topk_weights, topk_ids, expert_map, apply_router_weight_on_input,
                             quant_config, defer_input_quant, True)()

    # -- finalize ------------------------------------------------------------------------------
    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       apply_router_weight_on_input: bool,
                       weight_and_reduce_impl: mk.TopKWeightAndReduce) -> Any:
        """output [num_tokens, hidden] (written in place); fused_expert_output: the experts'
        output for the received rows (standard: reduced here by ``weight_and_reduce_impl``;
        batched: [num_local_experts, max_recv_tokens, hidden], weighted by the combine).
        Hook mode: vLLM runs the shared expert between this and the hook."""
        return self._finalize(output, fused_expert_output, topk_weights, topk_ids,
                              apply_router_weight_on_input, weight_and_reduce_impl, False)

    def _finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  apply_router_weight_on_input: bool,
                  weight_and_reduce_impl: mk.TopKWeightAndReduce, blocking: bool) -> Any:
        if not self.batched and isinstance(weight_and_reduce_impl, TopKWeightAndReduceDelegate):
            weight_and_reduce_impl = TopKWeightAndReduceContiguous()
        if self.backend is None:
            weight_and_reduce_impl.apply(output=output, fused_expert_output=fused_expert_output,
                                         topk_weights=topk_weights, topk_ids=topk_ids,
                                         apply_router_weight_on_input=apply_router_weight_on_input)
            return lambda: None
        slot = dbo_current_ubatch_id()
        if slot >= self._num_slots:
            self._guard.no_slot(slot)
        rows, ids, weights, owns_all, refusal, watched = self._guard.take(slot)
        backend = self._backends[slot]
        # As vLLM's in-tree LL class: receive what the other micro-batch left in flight before
        # this combine's send (no-op without dual-batch overlap).
        dbo_maybe_run_recv_hook()
        try:
            if self.batched:
                # [num_local_experts, max_recv_tokens, hidden]: never vLLM's output's shape, so
                # never aliased to it (vLLM aliases its fused output to `output` where the
                # shapes match)
                expert_out = fused_expert_output
            else:
                expert_out = weight_and_reduce_impl.apply(
                    output=None, fused_expert_output=fused_expert_output,
                    topk_weights=topk_weights, topk_ids=topk_ids,
                    apply_router_weight_on_input=apply_router_weight_on_input)
                if expert_out.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
                    expert_out = expert_out.clone()
            # the call without this rank's tokens (refused) writes nothing
            target, done = self._rows.target(output, rows, owns_all, refusal is not None)
            if self._low_latency:  # their halves, without the result objects in between
                expert_out = fit_expert_output(expert_out, backend.expert_shape())
                hook, dest = backend.combine_send(expert_out, weights, ids, target, not blocking)
                if hook is None:
                    backend.combine_received(dest, target)
                    if done:
                        return _nothing
                    received = None
                elif dest is target and done:  # the library writes the output itself
                    return hook, _nothing
                else:
                    def received() -> torch.Tensor:
                        return backend.combine_received(dest, target)
            elif blocking:  # the backend's finalize checks that it wrote ``target``
                backend.finalize(expert_out, weights, ids, target)
                backend.reset_call_state()
                if done:
                    return _nothing
                hook, received = None, None
            else:
                sent: AsyncResult = backend.finalize_async(expert_out, weights, ids, target)
                hook, received = sent.hook, sent.receiver
        except BaseException as e:
            backend.reset_call_state()
            self._guard.raise_library_timeout(backend, self.calls, e)
            raise
        finally:  # the combine is enqueued (a hang in a later receive stalls the next call)
            self._guard.end_watch(watched, backend)

        def receiver() -> None:
            if received is not None:
                try:
                    check_finalize_result(backend, target, received())
                finally:
                    backend.reset_call_state()
            if refusal is not None:  # served the peers; now this rank's own error
                raise refusal
            self._rows.complete(output, rows, owns_all)

        return (hook, receiver) if hook is not None else receiver

    def finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 apply_router_weight_on_input: bool,
                 weight_and_reduce_impl: mk.TopKWeightAndReduce) -> None:
        """:meth:`finalize_async` as the backend's blocking combine."""
        self._finalize(output, fused_expert_output, topk_weights, topk_ids,
                       apply_router_weight_on_input, weight_and_reduce_impl, True)()
