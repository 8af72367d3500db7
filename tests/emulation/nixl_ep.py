"""Emulation of NIXL EP's Python API: ``nixl_ep.Buffer`` of ai-dynamo/nixl v1.4.0
(examples/device/ep/nixl_ep/buffer.py), low-latency mode.

Same signatures; checked against the released wheel nixl-cu13 1.5.1
(``nixl_ep_cu13/buffer.py``, which the ``nixl`` 1.5.1 wheel re-exports as ``nixl_ep``): the
parameter lists of ``Buffer.__init__``, ``low_latency_dispatch``, ``low_latency_combine``,
``update_memory_buffers``, ``connect_ranks``, ``set_tcp_store_group``, the mask methods and both
size hints are identical (``get_local_buffer_tensor(dtype, size, offset, use_rdma_buffer)``,
which vLLM's ``clean_buffers`` calls, checked against the same wheel). The ``nixl`` 1.5.2 wheel
ships the same ``nixl_ep`` re-export (its Python files are byte-identical to 1.5.1's); the
nixl-cu12/cu13 1.5.2 wheels it requires, which would carry 1.5.2's ``buffer.py``, are not on the
package index, so 1.5.1's is the newest checked. Lifecycle as upstream: ``Buffer(rank=..., tcp_store_group=...)`` allocates
nothing; ``update_memory_buffers(num_ranks, num_experts_per_rank, num_rdma_bytes)`` sizes the
layout (every other rank starts masked: not connected); ``connect_ranks(remote_ranks)`` exchanges
agent metadata through the store exactly as upstream (``NIXL_EP/<rank>`` set, peers' keys waited
for and read, own key deleted afterwards) and unmasks the connected ranks. The emulated agents
check that each peer's metadata names that peer, then hold a barrier over the transport group
(standing for the agents' connection handshake, which keeps a key alive until every peer has
read it). Masking follows nixl: the local rank cannot be masked, only connected ranks can be
unmasked, and the packed receive layout spans ``active_rank_bound`` = highest active rank + 1.

The data path is :mod:`emulation._ll_kernels`. The transport group is ``group`` if given, else
the default process group (the fabric NIXL reaches peers through); its ranks must be the
buffer's ranks. Not emulated: connecting without a store (etcd), high-throughput mode,
``comm`` (mpi4py), LogFMT and zero-copy combine.
"""
from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from tests.emulation._ll_kernels import (NIXL_EP_SIGNAL_BYTES, EventOverlap, EmulatedLowLatencyRuntime,
                                   host_assert, size_hint)

__all__ = ["Buffer", "EventOverlap", "topk_idx_t"]

# nixl's meson builds nixl_ep with TOPK_IDX_BITS=32: the real library (built on the H200 from
# nixl's sources, tests/gpu/README.md) asserts int32 ids, as this emulation does.
topk_idx_t = torch.int32
DEFAULT_TIMEOUT_MS = 30_000


def _agent_metadata(rank: int) -> bytes:
    return f"nixl-ep-emulated-agent:{rank}".encode()


class _NixlRuntime(EmulatedLowLatencyRuntime):
    """Adds connections and the active-rank bound to the shared emulated kernels."""

    topk_idx_dtype = topk_idx_t

    signal_bytes = NIXL_EP_SIGNAL_BYTES  # EPLayout: num_experts * sizeof(uint64_t)
    bound_name = "active_rank_bound"

    def __init__(self, group: "dist.ProcessGroup", rank: int, num_ranks: int, num_rdma_bytes: int,
                 num_experts_per_rank: int, timeout_s: float = DEFAULT_TIMEOUT_MS / 1000.0):
        self.timeout_s = timeout_s  # the kernels mask a peer that does not answer within it
        super().__init__(group, rank, num_ranks, num_rdma_bytes, mask_enabled=True)
        self.num_experts_per_rank = num_experts_per_rank
        self.connected = {rank}
        self.active = [r == rank for r in range(num_ranks)]

    def rank_bound(self) -> int:
        return max(r for r in range(self.num_ranks) if self.active[r]) + 1

    # nixl_ep_cpp.Buffer's dispatch / combine as csrc/nixl_ep.cpp (nixl 1.5.1) defines them and
    # pybind11 binds them (positional, no defaults). Upstream's combine takes no num_experts;
    # its dispatch's num_experts (optional) sizes the rank bound, which the emulation takes from
    # the active ranks (rank_bound).
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor],
                 dispatch_wait_recv_cost_stats: Optional[torch.Tensor],
                 num_max_dispatch_tokens_per_rank: int, num_experts: Optional[int],
                 use_fp8: bool, round_scale: bool, use_ue8m0: bool, async_: bool,
                 return_recv_hook: bool) -> tuple:
        """-> (packed_recv_x, packed_recv_x_scales or None, packed_recv_count,
        packed_recv_src_info, packed_recv_layout_range, event or None, hook or None)."""
        recv_x, scales, count, src_info, layout_range, hook = self.run_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, self.num_experts_per_rank, use_fp8,
            round_scale, use_ue8m0, async_, return_recv_hook, cumulative_local_expert_recv_stats)
        return (recv_x, scales, count, src_info, layout_range, object() if async_ else None,
                hook)

    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                src_info: torch.Tensor, layout_range: torch.Tensor,
                combine_wait_recv_cost_stats: Optional[torch.Tensor],
                num_max_dispatch_tokens_per_rank: int, use_logfmt: bool, zero_copy: bool,
                async_: bool, return_recv_hook: bool, out: Optional[torch.Tensor]) -> tuple:
        """-> (combined_x, event or None, hook or None)."""
        combined, hook = self.run_combine(
            x, topk_idx, topk_weights, src_info, layout_range, num_max_dispatch_tokens_per_rank,
            self.num_experts_per_rank, use_logfmt, zero_copy, async_, return_recv_hook, out)
        return combined, object() if async_ else None, hook

    def get_local_metadata(self) -> bytes:
        return _agent_metadata(self.rank)

    def connect_ranks(self, remote_ranks: List[int], remote_mds: Optional[List[bytes]] = None,
                      activate: bool = True) -> None:
        if remote_mds is None:
            raise NotImplementedError("emulation: connecting without a TCPStore (etcd metadata "
                                      "exchange) is not emulated")
        for r, md in zip(remote_ranks, remote_mds):
            host_assert(0 <= r < self.num_ranks, "remote_rank >= 0 and remote_rank < max_num_ranks")
            host_assert(bytes(md) == _agent_metadata(r),
                        f"emulation: metadata read for rank {r} is {bytes(md)!r}")
        dist.barrier(group=self.group)  # the agents' connection handshake
        for r in remote_ranks:
            self.connected.add(r)
            if activate:
                self.active[r] = True

    def disconnect_ranks(self, remote_ranks: List[int]) -> None:
        host_assert(len(remote_ranks) > 0, "!remote_ranks_list.empty()")
        for r in remote_ranks:
            host_assert(r != self.rank, "removed_rank != rank")
            host_assert(r in self.connected, "_is_rank_connected(removed_rank)")
            self.active[r] = False
            self.connected.discard(r)

    def update_mask(self, rank_to_mask: int, mask: bool) -> None:
        host_assert(0 <= rank_to_mask < self.num_ranks,
                    "rank_to_mask >= 0 and rank_to_mask < max_num_ranks")
        host_assert(rank_to_mask != self.rank or not mask,
                    "(rank_to_mask != rank or !mask) && \"cannot mask the local rank\"")
        if not mask:
            host_assert(rank_to_mask in self.connected,
                        "_is_rank_connected(rank_to_mask) && \"cannot unmask an unconnected rank\"")
        self.active[rank_to_mask] = not mask


class Buffer:
    """nixl_ep.Buffer (low-latency mode)."""

    num_sms: int = 20

    def __init__(self, disable_ll_nvlink: bool = False, explicitly_destroy: bool = False,
                 rank: int = 0, low_latency_mode: bool = True,
                 group: Optional["dist.ProcessGroup"] = None, comm: Optional[object] = None,
                 tcp_store_group: Optional["dist.Store"] = None,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        self.rank = rank
        self.group_size = 0  # Will be updated by `update_memory_buffers`
        self.low_latency_mode = low_latency_mode
        self.timeout_ms = timeout_ms
        self.explicitly_destroy = explicitly_destroy
        self.group = group
        self.comm = comm
        self.tcp_store_group = tcp_store_group
        assert not (group and comm)
        if comm is not None:
            raise NotImplementedError("emulation: mpi4py communicators are not emulated")
        if not low_latency_mode:
            raise NotImplementedError("emulation: high-throughput mode is not emulated")
        self.disable_ll_nvlink = disable_ll_nvlink  # the real one sets UCX_TLS=^cuda_ipc
        self.runtime: Optional[_NixlRuntime] = None
        self._destroyed = False

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        if self.runtime is not None:
            self.runtime.destroy()
        self.runtime = None
        self._destroyed = True

    @staticmethod
    def get_low_latency_buffer_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                         num_ranks: int, num_experts: int) -> int:
        return size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts,
                         NIXL_EP_SIGNAL_BYTES)

    @staticmethod
    def get_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                           num_experts: int) -> int:
        return Buffer.get_low_latency_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden,
                                                       num_ranks, num_experts)

    def _runtime(self) -> _NixlRuntime:
        host_assert(not self._destroyed, "emulation: the buffer was destroyed")
        host_assert(self.runtime is not None, "emulation: update_memory_buffers was not called")
        assert self.runtime is not None
        return self.runtime

    def update_memory_buffers(self, num_ranks: int, num_experts_per_rank: int,
                              num_rdma_bytes: int, num_nvl_bytes: int = 0) -> None:
        host_assert(not self._destroyed, "emulation: the buffer was destroyed")
        self.group_size = num_ranks
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        transport = self.group if self.group is not None else dist.group.WORLD
        self.runtime = _NixlRuntime(transport, self.rank, num_ranks, num_rdma_bytes,
                                    num_experts_per_rank, self.timeout_ms / 1000.0)

    def set_tcp_store_group(self, tcp_store_group: Optional["dist.Store"]) -> None:
        self.tcp_store_group = tcp_store_group

    @contextmanager
    def _fetch_remote_metadata_from_tcp_store(self, remote_ranks: List[int]) -> Iterator[List[bytes]]:
        assert self.tcp_store_group is not None, "TCPStore group is not set"
        md_key = f"NIXL_EP/{self.rank}"
        self.tcp_store_group.set(md_key, self._runtime().get_local_metadata())
        remote_md_keys = [f"NIXL_EP/{rank}" for rank in remote_ranks]
        if remote_md_keys:
            self.tcp_store_group.wait(remote_md_keys, timedelta(seconds=300))
            remote_mds = self.tcp_store_group.multi_get(remote_md_keys)
        else:
            remote_mds = []
        try:
            yield remote_mds
        finally:
            self.tcp_store_group.delete_key(md_key)

    def connect_ranks(self, remote_ranks: List[int], activate: bool = True) -> None:
        remote_ranks = [r for r in remote_ranks if r != self.rank]  # self is filtered out
        runtime = self._runtime()
        if self.tcp_store_group is not None:
            with self._fetch_remote_metadata_from_tcp_store(remote_ranks) as remote_mds:
                runtime.connect_ranks(remote_ranks, remote_mds, activate=activate)
        else:
            runtime.connect_ranks(remote_ranks, activate=activate)

    def disconnect_ranks(self, remote_ranks: List[int]) -> None:
        self._runtime().disconnect_ranks(remote_ranks)

    def barrier(self) -> None:
        dist.barrier(group=self._runtime().group)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int,
                             num_experts: Optional[int] = None,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False
                             ) -> Tuple[Any, torch.Tensor, Tuple, EventOverlap, Optional[Callable]]:
        # as upstream's wrapper: one runtime call, the handle, an EventOverlap
        recv_x, scales, count, src_info, layout_range, event, hook = self._runtime().dispatch(
            x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
            num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0,
            async_finish, return_recv_hook)
        handle = (src_info, layout_range, num_max_dispatch_tokens_per_rank, x.size(1))
        return (recv_x, scales) if use_fp8 else recv_x, count, handle, EventOverlap(event), hook

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        return self.low_latency_dispatch(*args, **kwargs)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None
                            ) -> Tuple[torch.Tensor, EventOverlap, Optional[Callable]]:
        src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden = handle
        combined, event, hook = self._runtime().combine(
            x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats,
            num_max_dispatch_tokens_per_rank, use_logfmt, zero_copy, async_finish,
            return_recv_hook, out)
        return combined, EventOverlap(event), hook

    def combine(self, *args: Any, **kwargs: Any) -> Any:
        return self.low_latency_combine(*args, **kwargs)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None,
                                offset: int = 0, use_rdma_buffer: bool = False) -> torch.Tensor:
        return self._runtime().local_buffer_tensor(dtype, size, offset, use_rdma_buffer)

    def update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        self._runtime().update_mask(rank_to_mask, mask)

    def query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        self._runtime().query_mask(mask_status)

    def clean_mask_buffer(self) -> None:
        runtime = self._runtime()
        runtime.active = [r in runtime.connected for r in range(runtime.num_ranks)]
        runtime.clean_transport()
