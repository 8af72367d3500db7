"""Emulation of DeepEP's V1 low-latency Python API: ``deep_ep.Buffer`` at commit 567632d (the
last before the V2 rewrite), deep_ep/buffer.py, restricted to what low-latency mode uses.

Same constructor signature; like the real one it all-gathers over ``group`` while constructing
(a collective), reads ``NVSHMEM_QP_DEPTH`` (default 1024) and asserts in
``low_latency_dispatch/low_latency_combine`` that the depth is >= 2 * (max tokens + 1).
``low_latency_dispatch/low_latency_combine`` return exactly what the real ones return (see
:mod:`emulation._ll_kernels` for the kernels' observable behaviour). Unlike the real one it
changes no environment variable. ``get_local_buffer_tensor`` returns a view of an emulated
RDMA byte buffer (see :meth:`EmulatedLowLatencyRuntime.local_buffer_tensor`). Not emulated: normal (high-throughput) mode, ``comm``
(mpi4py), LogFMT and zero-copy combine.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist

from emulation._ll_kernels import EventOverlap, EmulatedLowLatencyRuntime, host_assert, size_hint

__all__ = ["Buffer", "EventOverlap", "topk_idx_t"]

topk_idx_t = torch.int64


def _all_gather_rank(rank: int, size: int, group: "dist.ProcessGroup") -> None:
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(gathered, torch.tensor([rank]), group=group)
    host_assert([int(t) for t in gathered] == list(range(size)), "emulation: group ranks")


class Buffer:
    """deep_ep.Buffer (low-latency mode)."""

    num_sms: int = 20

    def __init__(self, group: Optional["dist.ProcessGroup"], num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Optional[object] = None) -> None:
        if group is None:
            if comm is not None:
                raise NotImplementedError("emulation: mpi4py communicators are not emulated")
            raise ValueError("Either 'group' or 'comm' must be provided.")
        self.rank = group.rank()
        self.group = group
        self.group_size = group.size()
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        # Kept for tests (the real Buffer turns them into NVSHMEM environment variables).
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl = allow_mnnvl

        # The real constructor all-gathers (all_gather_object) device ids, IPC handles and the
        # NVSHMEM unique id: the same collectives, on tensors (no numpy here).
        for _ in ("device_ids", "ipc_handles"):
            _all_gather_rank(self.rank, self.group_size, group)
        if low_latency_mode:
            assert num_qps_per_rank > 0
            self.nvshmem_qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
            _all_gather_rank(self.rank, self.group_size, group)  # NVSHMEM unique ids
        self.runtime: Optional[EmulatedLowLatencyRuntime] = EmulatedLowLatencyRuntime(
            group, self.rank, self.group_size, num_rdma_bytes, mask_enabled=enable_shrink)

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        assert self.runtime is not None
        self.runtime.destroy()
        self.runtime = None

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        return size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def _runtime(self) -> EmulatedLowLatencyRuntime:
        if self.runtime is None:
            raise AttributeError("'NoneType' object has no attribute 'low_latency_dispatch' "
                                 "(the buffer was destroyed)")
        host_assert(self.low_latency_mode, "low_latency_mode")
        return self.runtime

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        self._runtime()

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False
                             ) -> Tuple[Any, torch.Tensor, Tuple, EventOverlap, Optional[Callable]]:
        assert self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2
        runtime = self._runtime()
        host_assert(num_experts % self.group_size == 0, "num_experts % num_ranks == 0")
        num_local_experts = num_experts // self.group_size
        # The first SM checks the QPs: ibgda_get_state()->num_rc_per_pe >= num_local_experts.
        host_assert(self.num_qps_per_rank >= num_local_experts,
                    "ibgda_get_state()->num_rc_per_pe >= num_local_experts")
        recv_x, scales, count, src_info, layout_range, hook = runtime.dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_local_experts, use_fp8,
            round_scale, use_ue8m0, async_finish, return_recv_hook,
            cumulative_local_expert_recv_stats)
        handle = (src_info, layout_range, num_max_dispatch_tokens_per_rank, x.size(1), num_experts)
        event = EventOverlap(object() if async_finish else None)
        return (recv_x, scales) if use_fp8 else recv_x, count, handle, event, hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None
                            ) -> Tuple[torch.Tensor, EventOverlap, Optional[Callable]]:
        src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts = handle
        assert self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2
        combined, hook = self._runtime().combine(
            x, topk_idx, topk_weights, src_info, layout_range, num_max_dispatch_tokens_per_rank,
            num_experts // self.group_size, use_logfmt, zero_copy, async_finish,
            return_recv_hook, out)
        return combined, EventOverlap(object() if async_finish else None), hook

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None,
                                offset: int = 0, use_rdma_buffer: bool = False) -> torch.Tensor:
        return self._runtime().local_buffer_tensor(dtype, size, offset, use_rdma_buffer)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        self._runtime().update_mask(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        self._runtime().query_mask(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        runtime = self._runtime()
        host_assert(runtime.mask_enabled, "mask_buffer_ptr != nullptr and \"Shrink mode must be enabled\"")
        runtime.active = [True] * runtime.num_ranks
