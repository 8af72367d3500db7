"""The low-latency prepare/finalize shared by DeepEP LL and NIXL EP.

DeepEP V1's ``Buffer.low_latency_dispatch/low_latency_combine`` and ``nixl_ep.Buffer``'s have one
API shape: dispatch sends every (token, expert) pair to the rank holding the expert and returns
a packed receive layout ``[num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks,
hidden]`` with a receive count per local expert; combine sends each expert output back and
reduces it **with the router weights** into ``out``. So the prepare/finalize lives here once:
prepare (dispatch) and finalize (combine with ``out=``, row-scatter variant), per-call handle
reset in ``finally``. The async calls use ``return_recv_hook`` (send now, receive in the hook:
two kernel launches); the synchronous ``prepare``/``finalize`` make the blocking call (one launch
of both phases). Where the library's release is known
(:class:`moe_plugins.lowlat.vendor.RuntimeCalls`), they call its C++ runtime themselves, without
its Python wrapper, and leave to the runtime's host asserts what those check.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from moe_plugins.config import DispatchConfig
from moe_plugins.counters import DispatchStats
from moe_plugins.faults import group_faults, layer_name
from moe_plugins.interface import (ActivationFormat, AsyncResult, ExpertTokensMeta, Hook,
                                   PrepareFinalize, PrepareResult, RowScatterTarget,
                                   check_finalize_routing,
                                   check_prepare_inputs, row_scatter_add)
from moe_plugins.lowlat.limits import (LL_QUANTS, MSG_HEADER_BYTES, assert_expert_ids,
                                       expert_id_error, pad_hidden, unpad_received)
from moe_plugins.lowlat.manager import LowLatencyManager
from moe_plugins.lowlat.vendor import RuntimeCalls, first_method
from moe_plugins.quant import FP8_BLOCK, QuantSpec
from moe_plugins.registry import BackendSpec, Capabilities, Transport

logger = logging.getLogger(__name__)

__all__ = ["LowLatencyPrepareFinalize", "low_latency_spec"]


# What finalize needs from prepare, a plain tuple (built on every call: a dataclass's __init__
# costs ~0.5 us more): (handle: the library's; num_tokens given to prepare; expert_shape: the shape
# the expert outputs must have, the receive's (num_local_experts, num_recv_slots, hidden) with
# the layer's hidden where it is padded; topk_ids and topk_weights as given to prepare (finalize
# must get the same); ids and weights: prepare's in the library's dtypes, int64 and float32 (a
# finalize given those very tensors, as every caller does, reuses them without checking or
# casting again)).
_CallState = tuple


_BF16, _F32 = torch.bfloat16, torch.float32


class LowLatencyPrepareFinalize(PrepareFinalize):
    """BATCHED layout: prepare returns x [num_local_experts, num_recv_slots, hidden] with a
    token count per local expert, topk ids/weights None (combine applies the weights).

    num_recv_slots = ``max_tokens_per_rank * num_ranks`` (NIXL EP: times the active rank bound);
    only the first ``expert_num_tokens[e]`` rows of expert ``e`` are valid. x is bfloat16
    (``x_sf is None``) or float8_e4m3fn with x_sf float32 [..., hidden // 128], block-128
    scales in the kernels' column-major layout; with packed UE8M0 scales (experts that ask
    for them, :meth:`post_init_setup`) x_sf is int32 [..., ceil(hidden / 512)].

    Host cost per call: the layer's sizes and limits were checked when the manager was built;
    a call checks only what can change (the inputs' shapes, dtypes, token count, the quant spec
    when it is another object than last time) and adds its pair count to the stats, which are
    computed when read.
    """

    activation_format = ActivationFormat.BATCHED

    def __init__(self, manager: LowLatencyManager, cfg: DispatchConfig):
        self.manager = manager
        self.cfg = cfg
        self.use_ue8m0 = False
        self._state: Optional[_CallState] = None  # (see _CallState)
        # No host exchange on these kernels: a call that fails on one rank (before its
        # dispatch, or between dispatch and combine) breaks the group (moe_plugins.faults).
        self.faults = group_faults(manager.ctx.ep_group)
        self.name = layer_name(manager.backend_name, cfg, manager.rank)
        # What every call reads, read once (each attribute chain is host time per call).
        self._hidden = manager.hidden
        self._topk = cfg.num_topk
        self._padded = manager.padded
        self._idx_dtype = manager.topk_idx_dtype
        self._max_tokens = manager.max_tokens_per_rank
        check = manager.options.check_expert_ids  # None: on CPU only (see LowLatencyOptions)
        self._check_ids = manager.ctx.device.type != "cuda" if check is None else check
        self._num_experts = manager.num_experts
        self._id_error = expert_id_error(manager.num_experts, manager.backend_name)
        #: The library runtime's calls this object makes (None: the buffer's Python methods);
        #: with them, the runtime's host asserts check what they check (RuntimeCalls).
        self.runtime_calls: Optional[RuntimeCalls] = manager.runtime_calls
        self.library_timeout_s, self.library_traps = manager.library_timeout()
        self._buffer = manager.buffer
        # The buffer's Python methods (the calls where runtime_calls is None), bound once: a
        # getattr by name per call is host time on every dispatch and combine.
        self._wrapper_dispatch = first_method(self._buffer, manager.dispatch_methods)
        self._wrapper_combine = first_method(self._buffer, manager.combine_methods)
        # The library refuses calls under some deterministic settings of torch (DeepEP's current
        # line): checked on every call, before anything is sent (a flag read in the common case).
        self._determinism = manager.checks_determinism
        self._checked_quant: Optional[QuantSpec] = None  # the last quant spec prepare accepted
        self._fp8 = False  # and whether it puts FP8 on the wire
        self._calls = 0
        self._tokens = [0, 0]  # tokens dispatched: [bf16, fp8] on the wire (pairs: x num_topk)
        # tokens dispatched whose combine never ran (abandoned or raised): what the combine
        # brought back is the rest, so a combine counts nothing itself
        self._uncombined = 0

    @property
    def stats(self) -> DispatchStats:  # type: ignore[override]
        """What this rank sent, summed over calls: one message per (token, expert) pair (-1
        entries included: counting them exactly would need a sync), each with a 16-byte header;
        combine bytes are the rows combine brings back to this rank's pairs (what this rank
        sends is only known on the device; summed over ranks the two are equal)."""
        kh, k = self.manager.kernel_hidden, self._topk
        bf16, fp8 = self._tokens[0] * k, self._tokens[1] * k
        pairs = bf16 + fp8
        in_flight = 0 if self._state is None else self._state[1]
        return DispatchStats(calls=self._calls, pairs=pairs, rows=pairs,
                             act_bytes=(2 * bf16 + fp8) * kh, sf_bytes=fp8 * (kh // FP8_BLOCK) * 4,
                             meta_bytes=pairs * MSG_HEADER_BYTES,
                             combine_bytes=(pairs - (self._uncombined + in_flight) * k) * kh * 2)

    def num_dispatchers(self) -> int:
        return self.manager.num_ranks

    def supports_async(self) -> bool:
        return True

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return self.manager.max_tokens_per_rank

    def topk_indices_dtype(self) -> torch.dtype:
        """The dtype the library wants topk ids in (int32 router ids are widened in prepare)."""
        return self.manager.topk_idx_dtype

    def post_init_setup(self, experts: object) -> None:
        """Dispatch packed UE8M0 scales when ``experts.supports_packed_ue8m0_act_scales()``."""
        asks = getattr(experts, "supports_packed_ue8m0_act_scales", None)
        if asks is None or not asks():
            return
        if self.cfg.quant.quantized_on_wire:
            self.use_ue8m0 = True
            logger.info("%s: experts read packed UE8M0 scales; dispatching power-of-two scales "
                        "packed four to an int32", self.manager.backend_name)
        else:
            logger.warning("%s: %s can take FP8 activations with packed UE8M0 scales, but this "
                           "layer dispatches unquantized activations (quant %s)",
                           self.manager.backend_name, type(experts).__name__,
                           self.cfg.quant.scheme.value)

    def expert_shape(self) -> Optional[torch.Size]:
        """The shape the call in flight wants its expert outputs in (the receive's
        [num_local_experts, num_recv_slots, hidden]); None without a call in flight."""
        return None if self._state is None else self._state[2]

    def reset_call_state(self) -> None:
        if self._state is not None:  # dispatched, never combined: peers wait in the combine
            self.faults.mark_broken("a call was abandoned between its dispatch and its combine")
            self._uncombined += self._state[1]
        self._state = None

    def _ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """topk_ids in the library's dtype, contiguous (a cast only when it is another dtype:
        even a no-op ``.to`` costs a microsecond of host time)."""
        if topk_ids.dtype is not self._idx_dtype:
            topk_ids = topk_ids.to(self._idx_dtype)
        return topk_ids.contiguous()

    def _check_quant(self, quant: QuantSpec) -> None:
        if quant.scheme not in LL_QUANTS:
            raise ValueError(f"{self.manager.backend_name}: quant scheme {quant.scheme.value} is "
                             f"not supported; supported: {sorted(q.value for q in LL_QUANTS)}")

    def prepare_async(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, quant: QuantSpec) -> AsyncResult:
        """hidden_states bf16 [num_tokens, hidden], topk_weights float32 [num_tokens, num_topk],
        topk_ids int32/int64 [num_tokens, num_topk] (PHYSICAL ids, -1 for none). The send is
        issued here (hook mode); the hook receives; the receiver returns the
        :class:`PrepareResult`."""
        recv_x, recv_sf, recv_count, hook = self.dispatch_send(hidden_states, topk_weights,
                                                               topk_ids, quant, True)
        return AsyncResult(hook, lambda: PrepareResult(recv_x, recv_sf,
                                                       ExpertTokensMeta(recv_count), None, None))

    def prepare(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, quant: QuantSpec) -> PrepareResult:
        """:meth:`prepare_async` with nothing to run between its send and its receive: one
        blocking library call (send and receive in one kernel launch instead of two: a
        launch's host time less per call, eager)."""
        recv_x, recv_sf, recv_count, _ = self.dispatch_send(hidden_states, topk_weights,
                                                            topk_ids, quant, False)
        return PrepareResult(recv_x, recv_sf, ExpertTokensMeta(recv_count), None, None)

    def dispatch_send(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, quant: QuantSpec, recv_hook: bool
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor,
                                 Optional[Hook]]:
        """:meth:`prepare_async`'s halves without the result objects (the vLLM adapter builds
        vLLM's own from them): checks the call and issues the dispatch. Returns the receive
        buffers (the class doc's x and x_sf, filled once ``hook`` has run; hook None when not
        ``recv_hook``: filled already), recv_count int32 [num_local_experts] and the hook.
        Inputs refused before anything is launched leave the group in step where it has one
        rank, else the call is owed (:mod:`moe_plugins.faults`, rule "refused inputs"); any other error breaks
        the group: peers are in or past this dispatch."""
        f = self.faults
        if f.broken is not None or f.owed_by is not None:  # the common case: two attribute reads
            f.begin(self, self.name, hidden_states)
        launched = False
        try:
            rt = self.runtime_calls
            common = self._is_common_call(hidden_states, topk_weights, topk_ids, quant, rt)
            if not common:
                self._check_call(hidden_states, topk_weights, topk_ids, quant)
                ids = self._ids(topk_ids)
                x = hidden_states.contiguous()
                weights = topk_weights if topk_weights.dtype is _F32 else topk_weights.float()
            elif rt is None:
                ids, x, weights = topk_ids.contiguous(), hidden_states.contiguous(), topk_weights
            else:  # the runtime's asserts check the rest
                ids, x, weights = topk_ids, hidden_states, topk_weights
            n = hidden_states.shape[0]
            use_fp8 = self._fp8
            use_ue8m0 = use_fp8 and self.use_ue8m0
            if self._check_ids:
                assert_expert_ids(ids, self._num_experts, self._id_error)
            if self._padded:  # (see the module doc)
                x = pad_hidden(x, self._hidden, self.manager.kernel_hidden)
            launched = True
            if rt is None:
                recv_x, recv_sf, recv_count, handle, hook = self._dispatch_through_wrapper(
                    x, ids, use_fp8, use_ue8m0, recv_hook)
            else:
                try:
                    recv_x, recv_sf, recv_count, src_info, layout_range, _, hook = rt.dispatch(
                        self._buffer.runtime, x, ids, None, None, self._max_tokens,
                        self._num_experts, use_fp8, use_ue8m0, use_ue8m0, False, recv_hook)
                except RuntimeError as refused:
                    launched = False  # the runtime's host asserts come before any launch
                    x, ids = self._refused_dispatch(hidden_states, topk_weights, topk_ids,
                                                    quant, x, ids, refused)
                    launched = True
                    recv_x, recv_sf, recv_count, src_info, layout_range, _, hook = rt.dispatch(
                        self._buffer.runtime, x, ids, None, None, self._max_tokens,
                        self._num_experts, use_fp8, use_ue8m0, use_ue8m0, False, recv_hook)
                handle = (src_info, layout_range)
            if self._padded:  # the experts get views of the layer's columns (and scales)
                recv_x, recv_sf = unpad_received(recv_x, recv_sf, self._hidden)
            self._state = (handle, n, recv_x.shape, topk_ids, topk_weights, ids, weights)
            self._calls += 1
            self._tokens[use_fp8] += n
        except BaseException as e:
            if not launched and isinstance(e, (ValueError, TypeError)):
                raise f.refuse(self, self.name, e)  # nothing sent (faults, rule "refused inputs")
            # peers are in (or past) this dispatch: out of step now
            f.mark_broken(f"{self.name}: prepare raised on this rank", e)
            raise
        return recv_x, recv_sf, recv_count, hook

    def _is_common_call(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, quant: QuantSpec, rt: Optional[RuntimeCalls]
                        ) -> bool:
        """A layer's common call passes in one test: [n, hidden] tokens, float32 weights and ids
        in the library's dtype of shape [n, num_topk], the quant spec of the last call, no call
        in flight; and bf16 contiguous tokens within the capacity, contiguous ids, which the
        runtime's asserts check where it is called directly (RuntimeCalls). Any other call takes
        the full checks, which raise every error they raised before, in the same order."""
        try:
            h_shape = hidden_states.shape
            return (len(h_shape) == 2 and h_shape[1] == self._hidden
                    and topk_weights.dtype is _F32 and topk_ids.dtype is self._idx_dtype
                    and quant is self._checked_quant and self._state is None
                    and topk_ids.shape == topk_weights.shape == (h_shape[0], self._topk)
                    and (rt is not None or hidden_states.dtype is _BF16
                         and h_shape[0] <= self._max_tokens)
                    and not (self._determinism and torch.are_deterministic_algorithms_enabled()))
        except AttributeError:  # not tensors: the full checks say which
            return False

    def _dispatch_through_wrapper(self, x: torch.Tensor, topk_idx: torch.Tensor, use_fp8: bool,
                                  use_ue8m0: bool, recv_hook: bool
                                  ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor,
                                             Any, Optional[Hook]]:
        """The dispatch through the buffer's Python method (a library release whose runtime is
        not called directly): send x bf16 [num_tokens, kernel_hidden] (contiguous) to the
        experts in topk_idx [num_tokens, num_topk]. Returns (recv_x, recv_x_sf or None,
        recv_count int32 [num_local_experts], handle, hook). ``recv_hook``: the receive happens
        in ``hook`` (hook mode: two kernel launches); False: one launch sends and receives
        (blocking on the stream, as the library's default) and hook is None."""
        recv, count, handle, _event, hook = self._wrapper_dispatch(
            x, topk_idx, self._max_tokens, self._num_experts,
            use_fp8=use_fp8, round_scale=use_ue8m0, use_ue8m0=use_ue8m0,
            async_finish=False, return_recv_hook=recv_hook)
        if use_fp8:
            return recv[0], recv[1], count, handle, hook
        return recv, None, count, handle, hook

    def _combine_through_wrapper(self, x: torch.Tensor, topk_idx: torch.Tensor,
                                 topk_weights: torch.Tensor, handle: Any, out: torch.Tensor,
                                 recv_hook: bool) -> Optional[Hook]:
        """The combine through the buffer's Python method: send expert outputs x bf16
        [num_local_experts, num_recv_slots, kernel_hidden]; the receive reduces them with
        topk_weights float32 [num_tokens, num_topk] into out bf16 [num_tokens, kernel_hidden],
        in the returned hook (``recv_hook``) or in the same launch (False: returns None)."""
        _combined, _event, hook = self._wrapper_combine(
            x, topk_idx, topk_weights, handle, async_finish=False, zero_copy=False,
            return_recv_hook=recv_hook, out=out)
        return hook

    def _refused_dispatch(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, quant: QuantSpec, x: torch.Tensor,
                          ids: torch.Tensor, error: RuntimeError
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """The runtime's dispatch raised ``error`` on (x, ids). Where its asserts refused the
        call (nothing launched, RuntimeCalls), a wrong input raises its error with the fix and
        non-contiguous inputs come back as contiguous copies, to be dispatched; otherwise the
        runtime's error propagates."""
        self._check_call(hidden_states, topk_weights, topk_ids, quant)
        if x.is_contiguous() and ids.is_contiguous():
            raise error
        return x.contiguous(), ids.contiguous()

    def _check_call(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, quant: QuantSpec) -> None:
        """Every check of a prepare, each raising with the fix; a new quant spec is kept."""
        check_prepare_inputs(hidden_states, topk_weights, topk_ids, self.cfg)
        if quant is not self._checked_quant:  # a layer passes the same spec on every call
            self._check_quant(quant)
            self._checked_quant, self._fp8 = quant, quant.quantized_on_wire
        m = self.manager
        n = hidden_states.shape[0]  # hidden and top-k: checked against the layer above
        if hidden_states.dtype is not torch.bfloat16:
            raise TypeError(f"{m.backend_name}: hidden_states must be bfloat16 (the kernels "
                            f"dispatch bf16 and quantize to FP8 themselves), got "
                            f"{hidden_states.dtype}")
        if n > self._max_tokens:
            raise ValueError(f"{m.backend_name}: prepare got {n} tokens but the buffers hold "
                             f"{m.max_tokens_per_rank} per rank; raise "
                             "DispatchConfig.max_tokens_per_rank")
        if self._state is not None:
            raise self.faults.call_in_flight(self.name)
        if self._determinism:
            refused = m.determinism_error()
            if refused is not None:
                raise refused

    def finalize_async(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget
                       ) -> AsyncResult:
        """fused_expert_output bf16 [num_local_experts, num_recv_slots, hidden]: UNWEIGHTED
        expert outputs in prepare's layout; topk_weights/topk_ids: those given to prepare.
        ``output``: [num_tokens, hidden] to fill, or a row-scatter target whose owned rows
        receive the combined rows (added after the shared-expert join). Hook mode."""
        hook, dest = self.combine_send(fused_expert_output, topk_weights, topk_ids, output, True)
        if dest is output:  # the library writes the output itself
            return AsyncResult(hook, lambda: output)
        return AsyncResult(hook, lambda: self.combine_received(dest, output))

    def finalize(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget) -> torch.Tensor:
        """:meth:`finalize_async` as one blocking library call (send and receive in one kernel
        launch). Returns ``output`` (a row-scatter target: its buffer)."""
        _, dest = self.combine_send(fused_expert_output, topk_weights, topk_ids, output, False)
        return output if dest is output else self.combine_received(dest, output)

    def combine_received(self, dest: torch.Tensor, output: torch.Tensor | RowScatterTarget
                         ) -> torch.Tensor:
        """After the combine's receive: ``dest`` (what :meth:`combine_send` returned) into
        ``output``; returns ``output`` (a row-scatter target: its buffer)."""
        if dest is output:
            return output
        combined = dest[:, : self._hidden] if self._padded else dest
        if isinstance(output, RowScatterTarget):
            return row_scatter_add(output, combined)
        output.copy_(combined)
        return output

    def combine_send(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget,
                     recv_hook: bool) -> tuple[Optional[Hook], torch.Tensor]:
        """:meth:`finalize_async`'s first half without the result object: checks the call and
        issues the combine. Returns (hook or None, dest: the tensor the library writes,
        ``output`` itself where it can); after the hook, :meth:`combine_received` writes
        ``output``. A call that raises here breaks the group."""
        st = self._state
        if st is None:
            raise RuntimeError("finalize called without a matching prepare on this backend")
        handle, n, expert_shape, prepared_ids, prepared_weights, ids, weights = st
        rt = self.runtime_calls
        try:
            if self._determinism and torch.are_deterministic_algorithms_enabled():
                refused = self.manager.determinism_error()
                if refused is not None:
                    raise refused
            if fused_expert_output.shape != expert_shape:
                raise ValueError(f"fused_expert_output has shape {tuple(fused_expert_output.shape)}"
                                 f", expected {list(expert_shape)} (prepare's layout)")
            # bf16 and contiguous expert outputs, contiguous float32 weights: the runtime's
            # asserts check them where it is called directly (RuntimeCalls)
            if rt is None and fused_expert_output.dtype is not _BF16:
                raise _expert_dtype_error(self.manager.backend_name, fused_expert_output)
            if topk_ids is not prepared_ids or topk_weights is not prepared_weights:
                # the same routing only (equal values: prepare's casts serve as they are)
                check_finalize_routing(prepared_ids, prepared_weights, topk_ids, topk_weights)
            if isinstance(output, RowScatterTarget):
                if output.rows.num_owned != n:
                    raise ValueError(f"row-scatter target owns {output.rows.num_owned} rows, "
                                     f"prepare was given {n} tokens")
                dest = fused_expert_output.new_empty(n, self.manager.kernel_hidden)
            else:
                if output.shape != (n, self._hidden):
                    raise ValueError(f"finalize output has shape {tuple(output.shape)}, expected "
                                     f"[{n}, {self._hidden}] (the tokens given to prepare)")
                direct = (not self._padded and output.dtype is _BF16
                          and output.is_contiguous())
                dest = (output if direct
                        else fused_expert_output.new_empty(n, self.manager.kernel_hidden))
            x = (pad_hidden(fused_expert_output, self._hidden, self.manager.kernel_hidden)
                 if self._padded else fused_expert_output)
            if rt is None:
                hook = self._combine_through_wrapper(x.contiguous(), ids, weights.contiguous(),
                                                     handle, dest, recv_hook)
            else:
                try:
                    _, _, hook = rt.combine(
                        self._buffer.runtime, x, ids, weights, handle[0], handle[1], None,
                        self._max_tokens, self._num_experts, False, False, False, recv_hook, dest)
                except RuntimeError as refused:
                    x, weights = self._refused_combine(x, weights, refused)
                    _, _, hook = rt.combine(
                        self._buffer.runtime, x, ids, weights, handle[0], handle[1], None,
                        self._max_tokens, self._num_experts, False, False, False, recv_hook, dest)
        except BaseException as e:  # peers are in this combine: out of step now
            self._uncombined += n
            self.faults.mark_broken(f"{self.name}: finalize raised on this rank", e)
            raise
        finally:
            self._state = None
        return hook, dest

    def _refused_combine(self, x: torch.Tensor, weights: torch.Tensor, error: RuntimeError
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The runtime's combine raised ``error`` on (x, weights): as
        :meth:`_refused_dispatch`, for the expert outputs' dtype and the inputs' layout."""
        if x.dtype is not _BF16:
            raise _expert_dtype_error(self.manager.backend_name, x) from error
        if x.is_contiguous() and weights.is_contiguous():
            raise error
        return x.contiguous(), weights.contiguous()


def _expert_dtype_error(backend_name: str, fused_expert_output: torch.Tensor) -> TypeError:
    return TypeError(f"{backend_name}: expert outputs must be bfloat16 for the combine kernel, "
                     f"got {fused_expert_output.dtype}")

def low_latency_spec(name: str, prepare_finalize: type[LowLatencyPrepareFinalize],
                     manager: type[LowLatencyManager], description: str,
                     priority: int, use_for: str = "") -> BackendSpec:
    """The registry entry of a low-latency backend (both share capabilities and quants).

    sp follows vLLM's ``use_sequence_parallel_moe`` tuple, which lists deepep_low_latency and
    nixl_ep; tp: TP slicing happens before prepare. micro_batch: both libraries double-buffer
    (two calls in flight, as vLLM's DBO runs its in-tree LL classes) and the per-call handle
    lives in the prepare/finalize object; rank_masking: both have a mask buffer (DeepEP with
    ``enable_shrink``)."""
    return BackendSpec(
        name=name,
        prepare_finalize=prepare_finalize,
        manager=manager,
        capabilities=Capabilities(ep_dp=True, dp=True, tp=True, sp=True, row_scatter=True,
                                  recv_hook=True, activation_format=ActivationFormat.BATCHED,
                                  placements=True, micro_batch=True, rank_masking=True),
        quants=LL_QUANTS,
        required=(manager.required,),
        needs_cuda=True,
        description=description,
        use_for=use_for,
        priority=priority,
        dtypes=frozenset({torch.bfloat16}),  # the kernels dispatch bf16 (and quantize to FP8)
        wire_layout=manager.wire_layout,
        token_limit=manager.token_limit,
        transport=Transport.LOW_LATENCY,
    )
