"""Emulation of DeepEP's current line as our backends see it: the legacy ``deep_ep.Buffer`` of
``deep_ep/buffers/legacy.py`` at d4f41e4 (PR #642; the file is the same at dd758ca), exported
beside V2's ``ElasticBuffer`` (``deep_ep/__init__.py``), with its C++ classes in ``deep_ep._C``.

Built on the V1 emulation (:mod:`tests.emulation.deep_ep`, 567632d's deep_ep/buffer.py), with
what differs between the two files (every method's parameters and defaults are checked against
both, :mod:`tests.emulation.deep_ep_upstream`):

- ``Buffer.__init__`` has no ``use_fabric``; the C++ runtime gets ``allow_mnnvl`` as its fabric
  flag (``_C.Buffer(..., enable_shrink, allow_mnnvl)``), kept as ``buffer.use_fabric``;
- ``dispatch``, ``combine``, ``low_latency_dispatch`` and ``low_latency_combine`` first run
  ``check_torch_deterministic()`` (deep_ep/utils/envs.py): an AssertionError when torch's
  deterministic algorithms and ``fill_uninitialized_memory`` are both on;
- ``__version__`` is set (``2.1.0`` at dd758ca; a build's distribution version appends
  ``+<rev>``), and ``ElasticBuffer`` exists (not emulated: constructing one raises).

``internode_dispatch`` (which lost ``num_worst_tokens``) is not emulated, as in the V1 emulation.
The kernels beneath are the same (the fence of #642 changes no result a caller can observe
below 256 tokens per rank on one node). Install it with ``tests.emulation.installed("deep_ep",
deep_ep_shape="legacy")``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from tests.emulation import _ht_kernels
from tests.emulation import deep_ep as _v1
from tests.emulation._ll_kernels import EventOverlap

__all__ = ["Buffer", "Config", "ElasticBuffer", "EventOverlap", "topk_idx_t",
           "check_torch_deterministic"]

__version__ = "2.1.0"
topk_idx_t = torch.int64


class Config(_ht_kernels.Config):
    """``deep_ep._C.Config`` (the current line's extension module)."""

    __module__ = "deep_ep._C"


def check_torch_deterministic() -> None:
    """deep_ep/utils/envs.py: deterministic algorithms and fill_uninitialized_memory are not
    both on (``torch.empty`` would launch a fill kernel racing the communication stream)."""
    assert not (torch.are_deterministic_algorithms_enabled()
                and torch.utils.deterministic.fill_uninitialized_memory)


class ElasticBuffer:
    """V2's buffer: present in the package, not emulated."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("emulation: DeepEP V2's ElasticBuffer is not emulated")


class Buffer(_v1.Buffer):
    """deep_ep.Buffer of deep_ep/buffers/legacy.py (d4f41e4)."""

    def __init__(self, group: Optional["dist.ProcessGroup"], num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm: Optional[object] = None) -> None:
        # the runtime's last argument is allow_mnnvl where 567632d passed use_fabric
        super().__init__(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode,
                         num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl,
                         allow_mnnvl, explicitly_destroy, enable_shrink, comm)

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
                 allocate_on_comm_stream: bool = False) -> tuple:
        check_torch_deterministic()
        return super().dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                expert_alignment, num_worst_tokens, config, previous_event,
                                async_finish, allocate_on_comm_stream)

    def combine(self, x: torch.Tensor, handle: Tuple,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple:
        check_torch_deterministic()
        return super().combine(x, handle, topk_weights, bias, config, previous_event,
                               async_finish, allocate_on_comm_stream)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False
                             ) -> Tuple[Any, torch.Tensor, Tuple, EventOverlap, Optional[Callable]]:
        check_torch_deterministic()
        return super().low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
            cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
            round_scale, use_ue8m0, async_finish, return_recv_hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None
                            ) -> Tuple[torch.Tensor, EventOverlap, Optional[Callable]]:
        check_torch_deterministic()
        return super().low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt,
                                           zero_copy, async_finish, return_recv_hook, out,
                                           combine_wait_recv_cost_stats)
