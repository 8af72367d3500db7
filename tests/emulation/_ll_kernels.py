"""Emulated low-latency EP kernels over torch.distributed, shared by the deep_ep and nixl_ep
emulations (the two libraries run the same kernels).

Follows what a caller can observe of DeepEP V1 (commit 567632d: csrc/deep_ep.cpp
``Buffer::low_latency_dispatch/low_latency_combine``, csrc/kernels/internode_ll.cu,
csrc/config.hpp ``LowLatencyLayout``) and nixl_ep v1.4.0 (examples/device/ep/csrc/nixl_ep.cpp,
kernels/nixl_ep_ll.cu):

- host checks (``EP_HOST_ASSERT`` -> RuntimeError "Failed: Assertion error"): bf16 contiguous x,
  kernel hidden sizes, top-k <= 11, topk_idx dtype, tokens <= max tokens, packed token dimension a
  multiple of 4, FP8 needs hidden % 512 == 0, UE8M0 needs round_scale, buffer size >= layout;
- dispatch sends one message per (token, expert) pair (16-byte header with the source token index,
  then the row; FP8: e4m3 row + float block-128 scales); experts of masked ranks get nothing;
- FP8 cast per 128 columns: amax = max(1e-4, max|x|), scale = 448 / amax, scale_inv = amax / 448,
  or with round_scale scale_inv = 2 ** ceil(log2(amax / 448)); x * scale saturated to e4m3;
- receive layout: packed_recv_x [num_local_experts, rank_bound * max_tokens, hidden] (bf16 or
  e4m3), scales [.., hidden // 128] float32 or UE8M0-packed int32 [.., hidden // 512], both
  column-major (a transposed view); packed per expert, source ranks one after another;
  recv_count int32 [num_local_experts]; src_info int32 [num_local_experts, slots] (source
  token index); layout_range int64 [num_local_experts, rank_bound] = begin << 32 | count;
- combine sends each valid row back to its source rank into a slot per (expert, token) and
  reduces there, in float32, ``sum_k topk_weights[t, k] * slot(topk_idx[t, k], t)`` over
  non-negative ids of unmasked ranks, cast to bf16 into ``out`` (a token routed twice to one
  expert gets (w1 + w2) x row; a slot no row reached this call reads as NaN, standing for the
  stale data the real buffer holds, e.g. when finalize gets other topk ids than dispatch);
  host checks are against the rank bound at combine time (nixl_ep: ``active_rank_bound``);
- expert ids >= num_experts are not checked by the kernels (they write outside their
  buffers); the emulation drops such pairs;
- buffer size: DeepEP's layout with 4-byte signal words, nixl_ep's with 8-byte ones;
- ``return_recv_hook``: the call issues the send (counts exchanged, data all-to-all started) and
  returns a hook that receives; until the hook runs, the returned tensors hold poison (NaN, -1)
  so reading them early fails loudly. A hook runs once.

Transport: one synchronous ``all_to_all_single`` of per-rank message counts, then one async
``all_to_all_single`` of the packed messages (uint8 rows: fp8 travels as bytes); or, with
``MOE_EMU_LL_FABRIC=store``, one-sided puts and spin-waits that read the mask as each begins
(as the kernels do: a mask set later does not end a wait already spinning) and mask a peer at
the library's timeout (:mod:`tests.emulation._ll_fabric`). Not modelled: CUDA
streams/events (``async_finish`` returns an event whose wait is a no-op), LogFMT and zero-copy
combine, the normal (high-throughput) kernels.

Traps. A kernel that traps (``EP_DEVICE_ASSERT``, or a wait past the kernel timeout without a
mask buffer) loses the process's CUDA context: the call raises what torch raises at the next
CUDA call ("CUDA error: unspecified launch failure"), and so does every later call on the
runtime. ``kernel_timeout_s`` (None: unbounded, the transport group's own timeout) bounds the
group all-to-all's waits for a peer's messages when the buffer has no mask; with a mask the
real kernels mask the late peer and go on, which the store fabric emulates and the group
all-to-all does not (its wait goes on).

"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist

from tests.emulation._ll_fabric import store_fabric_for

class EventOverlap:
    """deep_ep.utils.EventOverlap / nixl_ep.utils.EventOverlap (same class in both libraries);
    there are no CUDA streams here: waiting completes what the event's emulated handle still
    holds (normal-mode receives), else it is a no-op."""

    def __init__(self, event: Optional[object] = None,
                 extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        assert self.event is not None
        self._wait()

    def _wait(self) -> None:
        # Emulated events of the normal-mode kernels (emulation._ht_kernels.EventHandle) carry
        # the receive that the real CUDA event orders; the low-latency ones carry nothing.
        wait = getattr(self.event, "current_stream_wait", None)
        if wait is not None:
            wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self._wait()

KERNEL_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
MAX_TOPK = 11
FP8_MARGIN = 1e-4
FP8_MAX = 448.0
NUM_BUFFER_ALIGNMENT_BYTES = 128
_HEADER_INTS = 4  # int4 header: source token index, (emulation) global expert id, 2 reserved


def host_assert(cond: bool, what: str) -> None:
    """What ``EP_HOST_ASSERT`` raises through pybind11."""
    if not cond:
        raise RuntimeError(f"Failed: Assertion error {what}")


#: What torch raises at the first CUDA call after a kernel trapped (asm("trap;") in
#: EP_DEVICE_ASSERT and at DeepEP's kernel timeouts).
TRAP_ERROR = "CUDA error: unspecified launch failure"


#: Bytes of one per-expert signal word: DeepEP's receive counts are ``int``
#: (``LowLatencyLayout``: ``num_experts * sizeof(int)``), nixl_ep's ``uint64_t``
#: (``EPLayout``: ``num_experts * sizeof(uint64_t)``).
DEEP_EP_SIGNAL_BYTES, NIXL_EP_SIGNAL_BYTES = 4, 8


def layout_total_bytes(max_tokens: int, hidden: int, num_ranks: int, num_experts: int,
                       signal_bytes: int = DEEP_EP_SIGNAL_BYTES) -> int:
    """``LowLatencyLayout::total_bytes`` (DeepEP csrc/config.hpp) / ``EPLayout::total_bytes``
    (nixl_ep csrc/config.hpp): the same layout but for the signal word size."""
    num_scales = hidden // 128
    host_assert(num_scales * 4 <= hidden, "num_scales * sizeof(float) <= hidden")
    dispatch_msg = 16 + max(hidden * 2, hidden + num_scales * 4)
    combine_msg = num_scales * 4 + hidden * 2
    send = max(max_tokens * dispatch_msg, num_experts * max_tokens * combine_msg)
    recv = max(num_experts * max_tokens * dispatch_msg, num_experts * max_tokens * combine_msg)
    signaling = -(-(num_experts * signal_bytes) // 128) * 128
    return 2 * send + 2 * recv + 2 * signaling


def size_hint(max_tokens: int, hidden: int, num_ranks: int, num_experts: int,
              signal_bytes: int = DEEP_EP_SIGNAL_BYTES) -> int:
    """``get_low_latency_rdma_size_hint``: the layout rounded up to the buffer alignment."""
    total = layout_total_bytes(max_tokens, hidden, num_ranks, num_experts, signal_bytes)
    return ((total + NUM_BUFFER_ALIGNMENT_BYTES) // NUM_BUFFER_ALIGNMENT_BYTES
            * NUM_BUFFER_ALIGNMENT_BYTES)


def fp8_cast(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatch kernel's per-128-column cast: x bf16 [n, hidden] -> (e4m3 [n, hidden],
    scale_inv float32 [n, hidden // 128])."""
    n, hidden = x.shape
    blocks = x.float().view(n, hidden // 128, 128)
    amax = blocks.abs().amax(dim=-1).clamp(min=FP8_MARGIN)
    if round_scale:
        mant, exp = torch.frexp(amax * (1.0 / FP8_MAX))
        exp = exp - (mant == 0.5).to(exp.dtype)  # fast_log2_ceil
        scale, scale_inv = torch.exp2(-exp.float()), torch.exp2(exp.float())
    else:
        scale_inv, scale = amax * (1.0 / FP8_MAX), FP8_MAX / amax
    q = (blocks * scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(n, hidden), scale_inv


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor's rows as uint8 rows."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], t.shape[1] * t.element_size())


class EmulatedLowLatencyRuntime:
    """The part of the C++ runtime the low-latency Python API calls.

    group: the torch.distributed group standing for the RDMA/NVLink fabric; num_ranks: ranks of
    the buffer layout (== the group's size here); mask_enabled: whether a mask buffer exists
    (DeepEP ``enable_shrink``; always for nixl_ep). ``active[r]`` False means rank r is masked:
    nothing is sent to it or received from it.
    """

    signal_bytes = DEEP_EP_SIGNAL_BYTES
    bound_name = "num_ranks"  # what the library's host checks call the rank bound

    #: the library's ``topk_idx_t`` (DeepEP: int64; nixl_ep as nixl's meson builds it: int32)
    topk_idx_dtype: torch.dtype = torch.int64
    #: the kernels' wait for a peer (DeepEP: about 100 s; nixl_ep: its timeout_ms); only the
    #: store fabric models it
    timeout_s: float = 100.0

    def __init__(self, group: "dist.ProcessGroup", rank: int, num_ranks: int, num_rdma_bytes: int,
                 mask_enabled: bool):
        host_assert(dist.get_world_size(group) == num_ranks,
                    "emulation: the buffer's ranks must be the transport group's ranks")
        host_assert(dist.get_rank(group) == rank, "emulation: rank must be the group rank")
        self.group, self.rank, self.num_ranks = group, rank, num_ranks
        self.num_rdma_bytes = num_rdma_bytes
        self.mask_enabled = mask_enabled
        self.active = [True] * num_ranks
        self.pending_receives = 0  # issued sends whose receive hook has not run (tests read it)
        # Kernel launches the library would make (tests read it). Upstream (DeepEP 567632d
        # csrc/deep_ep.cpp, nixl_ep the same): one launch of both phases
        # (LOW_LATENCY_SEND_PHASE | LOW_LATENCY_RECV_PHASE) without a hook; with
        # return_recv_hook the call launches the send phase and the hook the receive phase.
        self.launches = 0
        self.rdma_bytes: Optional[torch.Tensor] = None  # uint8 [num_rdma_bytes], on first use
        self.destroyed = False
        # puts and spin-waits that read the mask as each begins (tests.emulation._ll_fabric),
        # or None: the group all-to-all below
        self.fabric = store_fabric_for(group, rank, num_ranks, lambda: self.active,
                                       lambda r: self.update_mask(r, True), self.timeout_s,
                                       mask_enabled)
        self.kernel_timeout_s: Optional[float] = None  # see the module doc
        self.trapped: Optional[str] = None  # the error every call raises once a kernel trapped

    # -- masks ------------------------------------------------------------------------------
    def update_mask(self, rank_to_mask: int, mask: bool) -> None:
        host_assert(self.mask_enabled, "mask_buffer_ptr != nullptr and \"Shrink mode must be enabled\"")
        host_assert(0 <= rank_to_mask < self.num_ranks, "rank_to_mask >= 0 and rank_to_mask < num_ranks")
        self.active[rank_to_mask] = not mask

    def query_mask(self, mask_status: torch.Tensor) -> None:
        host_assert(self.mask_enabled, "mask_buffer_ptr != nullptr and \"Shrink mode must be enabled\"")
        host_assert(mask_status.numel() == self.num_ranks and mask_status.dtype == torch.int32,
                    "mask_status.numel() == num_ranks && mask_status.scalar_type() == torch::kInt32")
        mask_status.copy_(torch.tensor([0 if a else 1 for a in self.active], dtype=torch.int32))

    def rank_bound(self) -> int:
        """Source ranks in the packed receive layout (DeepEP: all ranks)."""
        return self.num_ranks

    def local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size], offset: int,
                            use_rdma_buffer: bool) -> torch.Tensor:
        """``Buffer.get_local_buffer_tensor``: the local RDMA buffer from byte ``offset`` as a
        flat ``dtype`` tensor, or its first ``size`` elements in that shape (a view: writing it
        writes the buffer). The emulated kernels keep
        their messages elsewhere; the bytes start as a nonzero pattern, standing for what a
        dispatch/combine leaves in a real buffer, so a caller's zeroing is observable."""
        self._check_alive()
        host_assert(use_rdma_buffer, "emulation: low-latency mode allocates no NVL buffer")
        if self.rdma_bytes is None:
            self.rdma_bytes = torch.full((self.num_rdma_bytes,), 0x5A, dtype=torch.uint8)
        host_assert(0 <= offset <= self.num_rdma_bytes, "offset within the buffer")
        usable = (self.num_rdma_bytes - offset) // dtype.itemsize * dtype.itemsize
        tensor = self.rdma_bytes[offset:offset + usable].view(dtype)
        if size is None:
            return tensor
        assert tensor.numel() >= size.numel()
        return tensor[: size.numel()].view(size)

    # -- transport ----------------------------------------------------------------------------
    def _send(self, msgs: torch.Tensor, dest: torch.Tensor
              ) -> tuple[Callable[[], tuple[torch.Tensor, torch.Tensor]], int]:
        """msgs uint8 [num_msgs, msg_bytes] for ranks ``dest`` int64 [num_msgs]. Exchanges the
        counts now and starts the data all-to-all; returns a wait() giving (received uint8
        [num_recv, msg_bytes], source rank int64 [num_recv])."""
        order = torch.argsort(dest, stable=True)
        msgs, dest = msgs[order].contiguous(), dest[order]
        if self.fabric is not None:
            return self.fabric.send(msgs, dest), msgs.shape[1]
        send_counts = torch.bincount(dest, minlength=self.num_ranks).to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        self._bounded(dist.all_to_all_single(recv_counts, send_counts, group=self.group,
                                             async_op=True), "the peers' counts")
        recv_splits = recv_counts.tolist()
        recv = torch.empty(sum(recv_splits), msgs.shape[1], dtype=torch.uint8)
        work = dist.all_to_all_single(recv, msgs, recv_splits, send_counts.tolist(),
                                      group=self.group, async_op=True)
        src = torch.repeat_interleave(torch.arange(self.num_ranks), recv_counts)

        def wait() -> tuple[torch.Tensor, torch.Tensor]:
            self._bounded(work, "the peers' messages")
            return recv, src

        return wait, msgs.shape[1]

    def _bounded(self, work: Any, what: str) -> None:
        """Wait for ``work``: at most ``kernel_timeout_s`` where a late peer traps the kernel (no
        mask buffer), else as long as the transport group lets it."""
        if self.kernel_timeout_s is None or self.mask_enabled:
            work.wait()
            return
        try:
            work.wait(timeout=timedelta(seconds=self.kernel_timeout_s))
        except RuntimeError as e:
            if "timed out" not in str(e).lower():
                raise
            self.trap(f"DeepEP timeout: no answer from a peer ({what}) within the kernel "
                      f"timeout of {self.kernel_timeout_s:g} s")

    def device_assert(self, cond: bool, what: str) -> None:
        """What ``EP_DEVICE_ASSERT`` does: on failure the kernel traps (:meth:`trap`)."""
        if not cond:
            self.trap(f"Assertion failed: csrc/kernels/internode_ll.cu, condition: {what}")

    def trap(self, why: str) -> None:
        """A kernel trapped: this call and every later one raise (the CUDA context is lost)."""
        self.trapped = f"{TRAP_ERROR} (emulation: the kernel trapped: {why})"
        raise RuntimeError(self.trapped)

    def _deferred(self, recv: Callable[[], None], return_recv_hook: bool) -> Optional[Callable[[], None]]:
        self.launches += 1
        if not return_recv_hook:
            recv()
            return None
        self.pending_receives += 1
        ran = [False]

        def hook() -> None:
            host_assert(not ran[0], "emulation: a receive hook runs once")
            ran[0] = True
            self.pending_receives -= 1
            self.launches += 1
            recv()

        return hook

    def _check_alive(self) -> None:
        if self.trapped is not None:
            raise RuntimeError(self.trapped)
        host_assert(not self.destroyed, "emulation: the buffer was destroyed")

    # -- dispatch -------------------------------------------------------------------------------
    def run_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, max_tokens: int,
                     num_local_experts: int, use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                     async_finish: bool, return_recv_hook: bool,
                     cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None):
        """Returns (packed_recv_x, packed_recv_x_scales or None, packed_recv_count,
        packed_recv_src_info, packed_recv_layout_range, hook or None)."""
        self._check_alive()
        host_assert(x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16,
                    "x.dim() == 2 and x.is_contiguous() and x.scalar_type() == torch::kBFloat16")
        host_assert(x.size(1) % 8 == 0 and x.size(1) % 128 == 0,
                    "x.size(1) % sizeof(int4) == 0 and x.size(1) % 128 == 0")
        host_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(),
                    "topk_idx.dim() == 2 and topk_idx.is_contiguous()")
        host_assert(x.size(0) == topk_idx.size(0) and x.size(0) <= max_tokens,
                    "x.size(0) == topk_idx.size(0) and x.size(0) <= num_max_dispatch_tokens_per_rank")
        host_assert(topk_idx.dtype == self.topk_idx_dtype,
                    "topk_idx.scalar_type() == c10::CppTypeToScalarType<topk_idx_t>::value")
        host_assert(not (async_finish and return_recv_hook), "not(async and return_recv_hook)")
        n, hidden = x.shape
        num_topk = topk_idx.size(1)
        num_experts = num_local_experts * self.num_ranks
        host_assert(layout_total_bytes(max_tokens, hidden, self.num_ranks, num_experts,
                                       self.signal_bytes)
                    <= self.num_rdma_bytes, "layout.total_bytes <= num_rdma_bytes")
        bound = self.rank_bound()
        slots = bound * max_tokens
        host_assert(slots % 4 == 0, "(num_ranks * num_max_dispatch_tokens_per_rank) % 4 == 0 and "
                                    "\"TMA requires the number of tokens to be multiple of 4\"")
        if use_fp8:
            host_assert(hidden % 512 == 0, "hidden % 512 == 0")
        if use_ue8m0:
            host_assert(round_scale, "round_scale and \"UE8M0 SF requires `round_scale=True`\"")
        host_assert(num_topk <= MAX_TOPK, "num_topk <= kNumMaxTopK")
        host_assert(hidden in KERNEL_HIDDEN_SIZES, "false and \"Unsupported hidden\"")

        # Send: one message per (token, expert) pair, to unmasked ranks only. The kernels do not
        # check expert ids: an id >= num_experts makes them write outside their buffers. That is
        # undefined, not an error; the emulation drops such a pair (a silently wrong result, as
        # a user would see), so only the caller's own check can catch it.
        tok, k = ((topk_idx >= 0) & (topk_idx < num_experts)).nonzero(as_tuple=True)
        experts = topk_idx[tok, k]
        dest = experts // num_local_experts
        keep = torch.tensor([self.active[d] for d in dest.tolist()], dtype=torch.bool)
        tok, experts, dest = tok[keep], experts[keep], dest[keep]
        header = torch.zeros(tok.numel(), _HEADER_INTS, dtype=torch.int32)
        header[:, 0], header[:, 1] = tok.to(torch.int32), experts.to(torch.int32)
        if use_fp8:
            q, scale_inv = fp8_cast(x, round_scale)
            rows = torch.cat([_bytes(q), _bytes(scale_inv)], dim=1)
        else:
            rows = _bytes(x)
        wait, _ = self._send(torch.cat([_bytes(header), rows[tok]], dim=1), dest)

        # Outputs are allocated now and hold poison until the receive.
        recv_x = torch.full((num_local_experts, slots, hidden), float("nan"), dtype=torch.bfloat16)
        scales = None
        if use_fp8:
            recv_x = recv_x.to(torch.float8_e4m3fn)
            if use_ue8m0:
                scales = torch.full((num_local_experts, hidden // 512, slots), -1, dtype=torch.int32)
            else:
                scales = torch.full((num_local_experts, hidden // 128, slots), float("nan"))
            scales = scales.transpose(1, 2)
        count = torch.full((num_local_experts,), -1, dtype=torch.int32)
        src_info = torch.full((num_local_experts, slots), -1, dtype=torch.int32)
        layout_range = torch.full((num_local_experts, bound), -1, dtype=torch.int64)
        data_bytes = hidden * (1 if use_fp8 else 2)

        def recv() -> None:
            msgs, src = wait()
            alive = torch.tensor([self.active[s] for s in src.tolist()], dtype=torch.bool)
            msgs, src = msgs[alive], src[alive]
            hdr = msgs[:, : 4 * _HEADER_INTS].contiguous().view(torch.int32)
            local = hdr[:, 1].long() - self.rank * num_local_experts
            host_assert(bool(((local >= 0) & (local < num_local_experts)).all()),
                        "emulation: message for an expert this rank does not hold")
            body = msgs[:, 4 * _HEADER_INTS:]
            for e in range(num_local_experts):
                begin = 0
                for r in range(bound):
                    sel = ((local == e) & (src == r)).nonzero(as_tuple=True)[0]
                    c = sel.numel()
                    if c:
                        data = body[sel, :data_bytes].contiguous()
                        recv_x[e, begin:begin + c] = data.view(recv_x.dtype).view(c, hidden)
                        src_info[e, begin:begin + c] = hdr[sel, 0]
                        if scales is not None:
                            s = body[sel, data_bytes:].contiguous().view(torch.float32)
                            if use_ue8m0:
                                exps = ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
                                s = exps.contiguous().view(torch.int32)
                            scales[e, begin:begin + c] = s
                    layout_range[e, r] = (begin << 32) | c
                    begin += c
                host_assert(begin <= slots, "emulation: more tokens than receive slots")
                count[e] = begin
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(count)

        hook = self._deferred(recv, return_recv_hook)
        return recv_x, scales, count, src_info, layout_range, hook

    # -- combine --------------------------------------------------------------------------------
    def run_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    src_info: torch.Tensor, layout_range: torch.Tensor, max_tokens: int,
                    num_local_experts: int, use_logfmt: bool, zero_copy: bool,
                    async_finish: bool, return_recv_hook: bool, out: Optional[torch.Tensor]):
        """Returns (combined_x, hook or None)."""
        self._check_alive()
        # Checked against the rank bound NOW (DeepEP: num_ranks; nixl_ep: active_rank_bound,
        # which a mask change between dispatch and combine moves), not the dispatch's layout.
        bound = self.rank_bound()
        host_assert(x.dim() == 3 and x.is_contiguous() and x.dtype == torch.bfloat16,
                    "x.dim() == 3 and x.is_contiguous() and x.scalar_type() == torch::kBFloat16")
        host_assert(x.size(0) == num_local_experts, "x.size(0) == num_experts / num_ranks")
        host_assert(x.size(1) == bound * max_tokens,
                    f"x.size(1) == {self.bound_name} * num_max_dispatch_tokens_per_rank")
        host_assert(x.size(2) % 8 == 0 and x.size(2) % 128 == 0,
                    "x.size(2) % sizeof(int4) == 0 and x.size(2) % 128 == 0")
        host_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(),
                    "topk_idx.dim() == 2 and topk_idx.is_contiguous()")
        host_assert(topk_idx.shape == topk_weights.shape,
                    "topk_idx.size(0) == topk_weights.size(0) and topk_idx.size(1) == topk_weights.size(1)")
        host_assert(topk_idx.dtype == self.topk_idx_dtype,
                    "topk_idx.scalar_type() == c10::CppTypeToScalarType<topk_idx_t>::value")
        host_assert(topk_weights.dim() == 2 and topk_weights.is_contiguous(),
                    "topk_weights.dim() == 2 and topk_weights.is_contiguous()")
        host_assert(topk_weights.size(0) <= max_tokens,
                    "topk_weights.size(0) <= num_max_dispatch_tokens_per_rank")
        host_assert(topk_weights.dtype == torch.float32, "topk_weights.scalar_type() == torch::kFloat32")
        host_assert(src_info.dtype == torch.int32 and src_info.size(0) == x.size(0),
                    "src_info.scalar_type() == torch::kInt32 and x.size(0) == src_info.size(0)")
        host_assert(src_info.dim() == 2 and src_info.size(1) == bound * max_tokens,
                    f"src_info.size(1) == {self.bound_name} * num_max_dispatch_tokens_per_rank")
        host_assert(layout_range.dtype == torch.int64 and layout_range.dim() == 2
                    and layout_range.size(0) == num_local_experts
                    and layout_range.size(1) == bound,
                    "layout_range.size(0) == num_experts_per_rank and layout_range.size(1) == "
                    f"{self.bound_name}")
        host_assert(not (async_finish and return_recv_hook), "not(async and return_recv_hook)")
        host_assert(not use_logfmt and not zero_copy,
                    "emulation: LogFMT and zero-copy combine are not emulated")
        n, hidden = topk_weights.size(0), x.size(2)
        host_assert(hidden in KERNEL_HIDDEN_SIZES, "false and \"Unsupported hidden\"")
        host_assert(layout_total_bytes(max_tokens, hidden, self.num_ranks,
                                       num_local_experts * self.num_ranks, self.signal_bytes)
                    <= self.num_rdma_bytes, "layout.total_bytes <= num_rdma_bytes")
        if out is not None:
            host_assert(out.dim() == 2 and out.is_contiguous(), "out->dim() == 2 and out->is_contiguous()")
            host_assert(out.size(0) == n and out.size(1) == hidden,
                        "out->size(0) == num_combined_tokens and out->size(1) == hidden")
            host_assert(out.dtype == x.dtype, "out->scalar_type() == x.scalar_type()")
            combined = out
        else:
            combined = torch.empty(n, hidden, dtype=x.dtype)

        # Send every received row back to the rank it came from.
        tokens, experts, dests, rows = [], [], [], []
        for e in range(num_local_experts):
            for r in range(bound):
                packed = int(layout_range[e, r])
                begin, c = packed >> 32, packed & 0xFFFFFFFF
                if c == 0 or not self.active[r]:
                    continue
                tokens.append(src_info[e, begin:begin + c].long())
                experts.append(torch.full((c,), self.rank * num_local_experts + e))
                dests.append(torch.full((c,), r))
                rows.append(x[e, begin:begin + c])
        cat = (lambda ts, **kw: torch.cat(ts) if ts else torch.zeros(0, **kw))
        tok_t, exp_t = cat(tokens, dtype=torch.int64), cat(experts, dtype=torch.int64)
        header = torch.zeros(tok_t.numel(), _HEADER_INTS, dtype=torch.int32)
        header[:, 0], header[:, 1] = tok_t.to(torch.int32), exp_t.to(torch.int32)
        row_t = torch.cat(rows) if rows else torch.zeros(0, hidden, dtype=torch.bfloat16)
        wait, _ = self._send(torch.cat([_bytes(header), _bytes(row_t)], dim=1),
                             cat(dests, dtype=torch.int64))
        combined.fill_(float("nan"))  # written only by the receive

        def recv() -> None:
            # The receive buffer has one slot per (global expert, token): a row sent back for
            # (e, t) lands in slot (e, t), so a token routed twice to one expert gets the same
            # row twice into one slot. The reduction then reads, for each of the token's top-k
            # entries, the slot of that entry's expert: (w1 + w2) x row for the doubled expert
            # (DeepEP internode_ll.cu combine: ``rdma_recv_x + (topk_idx * max_tokens + token)``).
            msgs, src = wait()
            alive = torch.tensor([self.active[s] for s in src.tolist()], dtype=torch.bool)
            msgs = msgs[alive]
            hdr = msgs[:, : 4 * _HEADER_INTS].contiguous().view(torch.int32)
            tok, exp = hdr[:, 0].long(), hdr[:, 1].long()
            vals = msgs[:, 4 * _HEADER_INTS:].contiguous().view(torch.bfloat16).float()
            num_experts = num_local_experts * self.num_ranks
            slot_keys = exp * n + tok  # duplicates carry the same row: either write wins
            order = torch.argsort(slot_keys)
            keys = slot_keys[order]
            ids = topk_idx.long()
            wanted = ids.clamp(0, num_experts - 1) * n + torch.arange(n).unsqueeze(1)
            pos = torch.searchsorted(keys, wanted).clamp(max=max(keys.numel() - 1, 0))
            owner_active = torch.tensor(
                [[0 <= i < num_experts and self.active[i // num_local_experts] for i in row]
                 for row in ids.tolist()], dtype=torch.bool).reshape(ids.shape)
            read = owner_active & (ids >= 0)
            if keys.numel():
                found = keys[pos] == wanted
                # A slot nobody wrote this round holds stale data on the real kernel: poison.
                rows = torch.where(found.unsqueeze(-1), vals[order[pos]],
                                   torch.tensor(float("nan")))
            else:
                rows = torch.full((*ids.shape, hidden), float("nan"))
            weighted = torch.where(read.unsqueeze(-1), rows * topk_weights.unsqueeze(-1), 0.0)
            combined.copy_(weighted.sum(dim=1).to(combined.dtype))

        hook = self._deferred(recv, return_recv_hook)
        return combined, hook

    def clean_transport(self) -> None:
        """The mask buffer was cleaned (with the RDMA buffer, after a fault): no signal of an
        earlier call is read again."""
        if self.fabric is not None:
            self.fabric.reset()

    def destroy(self) -> None:
        self.destroyed = True
