"""Emulation of DeepEP's V1 Python API: ``deep_ep.Buffer``, ``deep_ep.Config`` and
``deep_ep.EventOverlap`` at commit 567632d (the last before the V2 rewrite), deep_ep/buffer.py,
for low-latency mode and intranode normal (high-throughput) mode. Its C++ classes' module is
``deep_ep_cpp``, as 567632d's extension. The current line's legacy Buffer (d4f41e4 and later,
deep_ep/buffers/legacy.py) is :mod:`tests.emulation.deep_ep_legacy`, built on this one; every
public method's parameters and defaults of both are checked against those two upstream files
(:mod:`tests.emulation.deep_ep_upstream`, ``test_emulations_have_the_upstream_signatures``).

Same constructor signature; like the real one it all-gathers over ``group`` while constructing
(a collective), reads ``NVSHMEM_QP_DEPTH`` (default 1024) and asserts in
``low_latency_dispatch/low_latency_combine`` that the depth is >= 2 * (max tokens + 1).
``low_latency_dispatch/low_latency_combine`` return exactly what the real ones return (see
:mod:`emulation._ll_kernels` for the kernels' observable behaviour). Unlike the real one it
changes no environment variable. ``get_local_buffer_tensor`` returns a view of an emulated
RDMA byte buffer (see :meth:`EmulatedLowLatencyRuntime.local_buffer_tensor`).

Normal mode (checked against 567632d ``deep_ep/buffer.py`` and ``csrc/deep_ep.cpp``): the same
signatures and return tuples of ``get_dispatch_config/get_combine_config`` (the same per-rank
``Config`` table), ``Config.get_nvl_buffer_size_hint/get_rdma_buffer_size_hint``,
``get_dispatch_layout``, ``dispatch`` (non-cached, cached with ``handle``, ``num_worst_tokens``)
and ``combine``, ``capture``, ``set_num_sms``; the constructor's size checks; the kernels'
observable behaviour is in :mod:`emulation._ht_kernels`. Stricter than the real library in one
place: after a normal-mode call on a buffer that also has low-latency mode, the next
low-latency call needs ``clean_low_latency_buffer`` first (the real one needs it where normal
mode wrote the shared RDMA buffer, i.e. internode; SGLang cleans on every switch).
Not emulated: internode normal mode (more than 8 ranks), ``comm`` (mpi4py), LogFMT and
zero-copy combine.

The build and the platform (:func:`tests.emulation.installed` with ``deep_ep_build`` /
``platform``; the defaults are a 567632d build without a record on NVSHMEM 3.4.5):

- ``Buffer.build``: the build record ``scripts/deepep/build.sh`` writes
  (``deep_ep/moe_plugins_build.json``: ``patches``, ``timeouts``), which the emulated kernels
  follow as the compiled library follows its sources: ``NUM_TIMEOUT_CYCLES`` (default 200G)
  bounds the low-latency kernels' waits (:mod:`emulation._ll_kernels`, at 2 GHz, the clock of
  DeepEP's own comment "200G cycles ~= 100s"); ``pr695-rc-qp-assert`` changes the QP check;
- ``Buffer.platform`` (:class:`Platform`): the NVSHMEM version, whether its IBGDA transport
  starts, which peers are reachable through P2P. The low-latency dispatch's first SM checks
  ``ibgda_get_state()->num_rc_per_pe >= num_local_experts`` (csrc/kernels/internode_ll.cu at
  567632d), an ``EP_DEVICE_ASSERT`` (a trap); with DeepEP PR #695 only where some peer is not
  P2P-reachable (``nvshmemi_get_p2p_ptr`` gives 0 for it; every peer does with
  ``allow_nvlink_for_low_latency_mode=False``, which sets ``NVSHMEM_DISABLE_P2P=1``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from tests.emulation import _ht_kernels
from tests.emulation._ht_kernels import NUM_MAX_NVL_PEERS, EmulatedNormalRuntime, EventHandle
from tests.emulation._ll_kernels import EventOverlap, EmulatedLowLatencyRuntime, host_assert, size_hint

__all__ = ["Buffer", "Config", "DeepEPRuntime", "EventOverlap", "Platform", "topk_idx_t"]

_NUM_BUFFER_ALIGNMENT_BYTES = 128
#: csrc/kernels/configs.cuh at 567632d: the kernels' wait bound and the clock its comment assumes
_NUM_TIMEOUT_CYCLES = 200_000_000_000
_CYCLES_PER_S = 2e9
_RC_QP_PATCH = "pr695-rc-qp-assert"


@dataclass(frozen=True)
class Platform:
    """What NVSHMEM gives the emulated DeepEP.

    nvshmem: NVSHMEM's version; ibgda: whether its IBGDA transport starts (a host with an RDMA
    NIC); ranks_per_node: ranks on one host, reachable from each other through P2P (None: all).
    """

    nvshmem: tuple[int, ...] = (3, 4, 5)
    ibgda: bool = False
    ranks_per_node: Optional[int] = None

    def num_rc_per_pe(self, num_qps_per_rank: int) -> int:
        """``ibgda_get_state()->num_rc_per_pe``: DeepEP's Buffer sets
        ``NVSHMEM_IBGDA_NUM_RC_PER_PE`` to ``num_qps_per_rank``; NVSHMEM 3.6 and later leave it
        at zero where IBGDA does not start (earlier versions keep the requested count)."""
        return num_qps_per_rank if self.ibgda or self.nvshmem < (3, 6) else 0

    def p2p(self, rank: int, peer: int, allow_nvlink: bool) -> bool:
        """Whether ``nvshmemi_get_p2p_ptr`` gives ``rank`` a pointer into ``peer``'s buffer."""
        if not allow_nvlink:
            return False  # NVSHMEM_DISABLE_P2P=1
        per_node = self.ranks_per_node
        return per_node is None or rank // per_node == peer // per_node

topk_idx_t = torch.int64


class Config(_ht_kernels.Config):
    """``deep_ep_cpp.Config`` (567632d's extension module)."""

    __module__ = "deep_ep_cpp"


def _all_gather_rank(rank: int, size: int, group: "dist.ProcessGroup") -> None:
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(gathered, torch.tensor([rank]), group=group)
    host_assert([int(t) for t in gathered] == list(range(size)), "emulation: group ranks")



class DeepEPRuntime(EmulatedLowLatencyRuntime):
    """``deep_ep_cpp.Buffer``'s low-latency methods, as csrc/deep_ep.cpp (567632d) defines them
    and pybind11 binds them (positional, no defaults): ``low_latency_dispatch(x, topk_idx,
    cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
    num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0, async,
    return_recv_hook)`` -> (packed_recv_x, packed_recv_x_scales or None, packed_recv_count,
    packed_recv_src_info, packed_recv_layout_range, event or None, hook or None), and
    ``low_latency_combine(x, topk_idx, topk_weights, src_info, layout_range,
    combine_wait_recv_cost_stats, num_max_dispatch_tokens_per_rank, num_experts, use_logfmt,
    zero_copy, async, return_recv_hook, out)`` -> (combined_x, event or None, hook or None).
    The host asserts the C++ makes before the launch are here; the kernels' behaviour is
    :class:`EmulatedLowLatencyRuntime`'s."""

    def __init__(self, group: "dist.ProcessGroup", rank: int, num_ranks: int, num_rdma_bytes: int,
                 mask_enabled: bool, low_latency_mode: bool, num_qps_per_rank: int,
                 platform: Platform = Platform(), allow_nvlink: bool = True,
                 build: Optional[dict] = None):
        build = build or {}
        cycles = build.get("timeouts", {}).get("NUM_TIMEOUT_CYCLES", _NUM_TIMEOUT_CYCLES)
        # the store fabric's waits (made in the base's __init__) follow the kernels' timeout
        self.timeout_s = int(cycles) / _CYCLES_PER_S
        super().__init__(group, rank, num_ranks, num_rdma_bytes, mask_enabled)
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.low_latency_dirty = False  # set by normal-mode calls (see the module doc)
        self.num_rc_per_pe = platform.num_rc_per_pe(num_qps_per_rank)
        self.needs_ibgda = any(not platform.p2p(rank, peer, allow_nvlink)
                               for peer in range(num_ranks) if peer != rank)
        self.rc_qp_patched = _RC_QP_PATCH in build.get("patches", ())
        self.kernel_timeout_s = self.timeout_s

    def destroy(self) -> None:
        """567632d's ``Buffer::destroy``: before freeing the RDMA buffer every rank meets in an
        NVSHMEM barrier (``internode::barrier()``, nvshmem_barrier_all: no timeout, the mask
        not consulted), so with a rank lost it never returns. On the store fabric the barrier
        is one on the store (:meth:`StoreFabric.barrier`), which raises after a bound instead of
        waiting forever, so a test that meets it fails rather than hangs."""
        if self.fabric is not None:
            self.fabric.barrier("destroy")
        super().destroy()

    def _checked_experts(self, num_experts: int) -> int:
        host_assert(self.low_latency_mode, "low_latency_mode")
        host_assert(not self.low_latency_dirty, "emulation: a normal-mode call used this buffer "
                    "since the last low-latency one; call clean_low_latency_buffer first")
        host_assert(num_experts % self.num_ranks == 0, "num_experts % num_ranks == 0")
        return num_experts // self.num_ranks

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor],
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor],
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             use_fp8: bool, round_scale: bool, use_ue8m0: bool, async_: bool,
                             return_recv_hook: bool) -> tuple:
        num_local_experts = self._checked_experts(num_experts)
        self._check_alive()
        # The first SM checks the QPs (567632d); with PR #695 only where a peer needs them.
        if self.rc_qp_patched:
            self.device_assert(not self.needs_ibgda or self.num_rc_per_pe >= num_local_experts,
                               "not needs_ibgda or ibgda_get_state()->num_rc_per_pe >= "
                               "num_local_experts")
        else:
            self.device_assert(self.num_rc_per_pe >= num_local_experts,
                               "ibgda_get_state()->num_rc_per_pe >= num_local_experts")
        recv_x, scales, count, src_info, layout_range, hook = self.run_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_local_experts, use_fp8,
            round_scale, use_ue8m0, async_, return_recv_hook, cumulative_local_expert_recv_stats)
        return (recv_x, scales, count, src_info, layout_range,
                EventHandle() if async_ else None, hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, src_info: torch.Tensor,
                            layout_range: torch.Tensor,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor],
                            num_max_dispatch_tokens_per_rank: int, num_experts: int,
                            use_logfmt: bool, zero_copy: bool, async_: bool,
                            return_recv_hook: bool, out: Optional[torch.Tensor]) -> tuple:
        num_local_experts = self._checked_experts(num_experts)
        combined, hook = self.run_combine(
            x, topk_idx, topk_weights, src_info, layout_range, num_max_dispatch_tokens_per_rank,
            num_local_experts, use_logfmt, zero_copy, async_, return_recv_hook, out)
        return combined, EventHandle() if async_ else None, hook


class Buffer:
    """deep_ep.Buffer (low-latency mode). ``build`` and ``platform``: see the module doc."""

    num_sms: int = 20
    build: Optional[dict] = None
    platform: Platform = Platform()

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
        # Buffer::Buffer's common checks
        host_assert(num_nvl_bytes % _NUM_BUFFER_ALIGNMENT_BYTES == 0,
                    "num_nvl_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0")
        host_assert(num_rdma_bytes % _NUM_BUFFER_ALIGNMENT_BYTES == 0,
                    "num_rdma_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0")
        host_assert(self.group_size < NUM_MAX_NVL_PEERS or self.group_size % NUM_MAX_NVL_PEERS == 0,
                    "num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0")
        if num_rdma_bytes > 0:
            host_assert(self.group_size > NUM_MAX_NVL_PEERS or low_latency_mode,
                        "num_ranks > NUM_MAX_NVL_PEERS or low_latency_mode")
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        # Kept for tests (the real Buffer turns them into NVSHMEM environment variables).
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl = allow_mnnvl
        self.use_fabric = use_fabric  # the C++ runtime's fabric flag (567632d passes use_fabric)

        # The real constructor all-gathers (all_gather_object) device ids, IPC handles and the
        # NVSHMEM unique id: the same collectives, on tensors (no numpy here).
        for _ in ("device_ids", "ipc_handles"):
            _all_gather_rank(self.rank, self.group_size, group)
        if low_latency_mode:
            assert num_qps_per_rank > 0
            self.nvshmem_qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
            _all_gather_rank(self.rank, self.group_size, group)  # NVSHMEM unique ids
        self.runtime: Optional[DeepEPRuntime] = DeepEPRuntime(
            group, self.rank, self.group_size, num_rdma_bytes, enable_shrink, low_latency_mode,
            num_qps_per_rank, self.platform, allow_nvlink_for_low_latency_mode, self.build)
        self.normal_runtime = EmulatedNormalRuntime(self.runtime, self.rank, self.group_size,
                                                    num_nvl_bytes)

    @property
    def low_latency_dirty(self) -> bool:
        """Whether a normal-mode call used this buffer since the last low-latency one (see the
        module doc; kept on the runtime, whose low-latency calls refuse to run then)."""
        return self.runtime is not None and self.runtime.low_latency_dirty

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        assert self.runtime is not None
        self.runtime.destroy()
        self.runtime = None

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        return size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def _runtime(self) -> "DeepEPRuntime":
        if self.runtime is None:
            raise AttributeError("'NoneType' object has no attribute 'low_latency_dispatch' "
                                 "(the buffer was destroyed)")
        host_assert(self.low_latency_mode, "low_latency_mode")
        return self.runtime

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        self._runtime().low_latency_dirty = False

    # As upstream's deep_ep/buffer.py: each low-latency method is one call of the C++ runtime
    # (``self.runtime``, positional as pybind11 binds it) wrapped into the public return tuple.
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False
                             ) -> Tuple[Any, torch.Tensor, Tuple, EventOverlap, Optional[Callable]]:
        assert self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2
        recv_x, scales, count, src_info, layout_range, event, hook = \
            self._runtime().low_latency_dispatch(
                x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0,
                async_finish, return_recv_hook)
        handle = (src_info, layout_range, num_max_dispatch_tokens_per_rank, x.size(1), num_experts)
        return (recv_x, scales) if use_fp8 else recv_x, count, handle, EventOverlap(event), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None
                            ) -> Tuple[torch.Tensor, EventOverlap, Optional[Callable]]:
        src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts = handle
        assert self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2
        combined, event, hook = self._runtime().low_latency_combine(
            x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats,
            num_max_dispatch_tokens_per_rank, num_experts, use_logfmt, zero_copy, async_finish,
            return_recv_hook, out)
        return combined, EventOverlap(event), hook

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
        runtime.clean_transport()

    # -- normal (high-throughput) mode ---------------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, 'The SM count must be even'
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        config_map = {
            2: Config(Buffer.num_sms, 24, 256, 6, 128),
            4: Config(Buffer.num_sms, 6, 256, 6, 128),
            8: Config(Buffer.num_sms, 6, 256, 6, 128),
            16: Config(Buffer.num_sms, 36, 288, 20, 128),
            24: Config(Buffer.num_sms, 32, 288, 8, 128),
            32: Config(Buffer.num_sms, 32, 288, 8, 128),
            48: Config(Buffer.num_sms, 32, 288, 8, 128),
            64: Config(Buffer.num_sms, 32, 288, 8, 128),
            96: Config(Buffer.num_sms, 20, 480, 12, 128),
            128: Config(Buffer.num_sms, 20, 560, 12, 128),
            144: Config(Buffer.num_sms, 32, 720, 12, 128),
            160: Config(Buffer.num_sms, 28, 720, 12, 128),
        }
        assert num_ranks in config_map, f'Unsupported number of EP ranks: {num_ranks}'
        return config_map[num_ranks]

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        config_map = {
            2: Config(Buffer.num_sms, 10, 256, 6, 128),
            4: Config(Buffer.num_sms, 9, 256, 6, 128),
            8: Config(Buffer.num_sms, 4, 256, 6, 128),
            16: Config(Buffer.num_sms, 4, 288, 12, 128),
            24: Config(Buffer.num_sms, 1, 288, 8, 128),
            32: Config(Buffer.num_sms, 1, 288, 8, 128),
            48: Config(Buffer.num_sms, 1, 288, 8, 128),
            64: Config(Buffer.num_sms, 1, 288, 8, 128),
            96: Config(Buffer.num_sms, 1, 480, 8, 128),
            128: Config(Buffer.num_sms, 1, 560, 8, 128),
            144: Config(Buffer.num_sms, 2, 720, 8, 128),
            160: Config(Buffer.num_sms, 2, 720, 8, 128),
        }
        assert num_ranks in config_map, f'Unsupported number of EP ranks: {num_ranks}'
        return config_map[num_ranks]

    def _normal(self) -> EmulatedNormalRuntime:
        self._runtime_alive()
        if self.low_latency_mode:
            assert self.runtime is not None
            self.runtime.low_latency_dirty = True
        return self.normal_runtime

    def _runtime_alive(self) -> None:
        if self.runtime is None:
            raise AttributeError("'NoneType' object has no attribute 'intranode_dispatch' "
                                 "(the buffer was destroyed)")

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        self._runtime_alive()
        per_rank, per_rdma_rank, per_expert, in_rank, event = \
            self.normal_runtime.get_dispatch_layout(topk_idx, num_experts,
                                                    getattr(previous_event, 'event', None),
                                                    async_finish, allocate_on_comm_stream)
        return per_rank, per_rdma_rank, per_expert, in_rank, EventOverlap(event)

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], Optional[torch.Tensor],
                  Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        config = self.get_dispatch_config(self.group_size) if config is None else config
        runtime = self._normal()
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        prev = getattr(previous_event, 'event', None)
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            rank_prefix_matrix, channel_prefix_matrix, _, recv_src_idx, is_token_in_rank, _ = handle
            recv_x, recv_x_scales, *_, event = runtime.intranode_dispatch(
                x, x_scales, None, None, None, is_token_in_rank, None, recv_src_idx.size(0),
                rank_prefix_matrix, expert_alignment, num_worst_tokens, config, async_finish,
                allocate_on_comm_stream, prev)
            return ((recv_x, recv_x_scales) if x_scales is not None else recv_x, None, None, None,
                    None, EventOverlap(event))
        assert num_tokens_per_rank is not None and is_token_in_rank is not None \
            and num_tokens_per_expert is not None
        (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list,
         rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
         send_head, event) = runtime.intranode_dispatch(
            x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
            num_tokens_per_expert, 0, None, expert_alignment, num_worst_tokens, config,
            async_finish, allocate_on_comm_stream, prev)
        handle = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
                  recv_src_idx, is_token_in_rank, send_head)
        return ((recv_x, recv_x_scales) if x_scales is not None else recv_x, recv_topk_idx,
                recv_topk_weights, per_expert_list, handle, EventOverlap(event))

    def combine(self, x: torch.Tensor, handle: Tuple,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        config = self.get_combine_config(self.group_size) if config is None else config
        runtime = self._normal()
        # NOTES (as the real one): the second entry is the sending side's
        rank_prefix_matrix, _, channel_prefix_matrix, src_idx, _is_recv_token_in_rank, send_head = handle
        bias_0, bias_1 = None, None
        if isinstance(bias, torch.Tensor):
            bias_0 = bias
        elif isinstance(bias, tuple):
            assert len(bias) == 2
            bias_0, bias_1 = bias
        recv_x, recv_topk_weights, event = runtime.intranode_combine(
            x, topk_weights, bias_0, bias_1, src_idx, rank_prefix_matrix, channel_prefix_matrix,
            send_head, config, getattr(previous_event, 'event', None), async_finish,
            allocate_on_comm_stream)
        return recv_x, recv_topk_weights, EventOverlap(event)
