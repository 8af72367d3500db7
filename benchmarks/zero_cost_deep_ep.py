"""A zero-cost stand-in for DeepEP V1's low-latency Python API (``deep_ep.Buffer`` at commit
567632d, deep_ep/buffer.py), for ``host_overhead.py --device cpu``.

Same names and signatures as the real module for what low-latency mode uses (``Buffer`` with
its constructor, ``get_low_latency_rdma_size_hint``, ``low_latency_dispatch``,
``low_latency_combine``, ``clean_low_latency_buffer``, ``destroy``; ``topk_idx_t``,
``EventOverlap``), but no kernels and no transport: a call returns tensors allocated once per
shape (the real receive layout's shapes, dtypes and the column-major scales) and a no-op hook.
What is left of a round trip is the Python around it, which is what the benchmark measures.
Normal mode's methods (``get_dispatch_layout``, ``dispatch``, ``combine``) exist by name, as
they do on every DeepEP ``Buffer`` (moe-plugins' DeepEP probe looks for them), and raise.
Not a test double: the outputs carry no data (tests use ``tests/emulation/deep_ep.py``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["Buffer", "EventOverlap", "topk_idx_t"]

topk_idx_t = torch.int64


class EventOverlap:
    """deep_ep.utils.EventOverlap (waiting is a no-op: there are no streams here)."""

    def __init__(self, event: Optional[object] = None,
                 extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        pass

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        pass


def _hook() -> None:
    """The receive hook: nothing to receive."""


class _Runtime:
    """``deep_ep_cpp.Buffer``'s low-latency methods (csrc/deep_ep.cpp 567632d, positional as
    pybind11 binds them), returning preallocated outputs at once."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._dispatch_out: dict[tuple, tuple] = {}
        self._combine_out: dict[tuple, torch.Tensor] = {}

    def destroy(self) -> None:
        self._dispatch_out.clear()
        self._combine_out.clear()

    def _dispatch_outputs(self, x: torch.Tensor, max_tokens: int, num_experts: int,
                          use_fp8: bool, use_ue8m0: bool) -> tuple:
        key = (x.shape[1], x.device, max_tokens, num_experts, use_fp8, use_ue8m0)
        found = self._dispatch_out.get(key)
        if found is None:
            e_l, hidden = num_experts // self.group_size, x.shape[1]
            slots = self.group_size * max_tokens
            dev = x.device
            count = torch.zeros(e_l, dtype=torch.int32, device=dev)
            src_info = torch.zeros(e_l, slots, dtype=torch.int32, device=dev)
            layout_range = torch.zeros(e_l, self.group_size, dtype=torch.int64, device=dev)
            sf = None
            if use_fp8:
                recv = torch.zeros(e_l, slots, hidden, device=dev).to(torch.float8_e4m3fn)
                if use_ue8m0:
                    sf = torch.zeros(e_l, hidden // 512, slots, dtype=torch.int32, device=dev)
                else:
                    sf = torch.zeros(e_l, hidden // 128, slots, device=dev)
                sf = sf.transpose(1, 2)  # column-major, as the kernels give
            else:
                recv = torch.zeros(e_l, slots, hidden, dtype=torch.bfloat16, device=dev)
            found = self._dispatch_out[key] = (recv, sf, count, src_info, layout_range)
        return found

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor],
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor],
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             use_fp8: bool, round_scale: bool, use_ue8m0: bool, async_: bool,
                             return_recv_hook: bool) -> tuple:
        recv, sf, count, src_info, layout_range = self._dispatch_outputs(
            x, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, use_ue8m0)
        return recv, sf, count, src_info, layout_range, None, _hook if return_recv_hook else None

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, src_info: torch.Tensor,
                            layout_range: torch.Tensor,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor],
                            num_max_dispatch_tokens_per_rank: int, num_experts: int,
                            use_logfmt: bool, zero_copy: bool, async_: bool,
                            return_recv_hook: bool, out: Optional[torch.Tensor]) -> tuple:
        if out is None:
            key = (topk_idx.shape[0], x.shape[2], x.device)
            out = self._combine_out.get(key)
            if out is None:
                out = self._combine_out[key] = torch.zeros(key[0], key[1], dtype=torch.bfloat16,
                                                           device=x.device)
        return out, None, _hook if return_recv_hook else None


class Buffer:
    """deep_ep.Buffer (low-latency mode): the Python methods wrap one ``runtime`` call each, as
    upstream's deep_ep/buffer.py does (so ``raw`` pays what the real wrapper costs)."""

    num_sms: int = 20

    def __init__(self, group: Optional["dist.ProcessGroup"], num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Optional[object] = None) -> None:
        if group is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.nvshmem_qp_depth = 1024
        self.runtime: Optional[_Runtime] = _Runtime(self.group_size)

    def destroy(self) -> None:
        assert self.runtime is not None
        self.runtime.destroy()
        self.runtime = None

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        return 0

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        pass

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False
                             ) -> Tuple[Any, torch.Tensor, Tuple, EventOverlap, Optional[Callable]]:
        assert self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2
        packed_recv_x, packed_recv_x_scales, packed_recv_count, packed_recv_src_info, \
            packed_recv_layout_range, event, hook = self.runtime.low_latency_dispatch(  # type: ignore[union-attr]
                x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0,
                async_finish, return_recv_hook)
        handle = (packed_recv_src_info, packed_recv_layout_range,
                  num_max_dispatch_tokens_per_rank, x.size(1), num_experts)
        tensors_to_record = (x, topk_idx, packed_recv_x, packed_recv_x_scales, packed_recv_count,
                             packed_recv_src_info, packed_recv_layout_range,
                             cumulative_local_expert_recv_stats)
        return ((packed_recv_x, packed_recv_x_scales) if use_fp8 else packed_recv_x,
                packed_recv_count, handle,
                EventOverlap(event, tensors_to_record if async_finish else None), hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None
                            ) -> Tuple[torch.Tensor, EventOverlap, Optional[Callable]]:
        src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts = handle
        assert self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2
        combined_x, event, hook = self.runtime.low_latency_combine(  # type: ignore[union-attr]
            x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats,
            num_max_dispatch_tokens_per_rank, num_experts, use_logfmt, zero_copy, async_finish,
            return_recv_hook, out)
        tensors_to_record = (x, topk_idx, topk_weights, src_info, layout_range, combined_x)
        return combined_x, EventOverlap(event, tensors_to_record if async_finish else None), hook

    # Normal mode: present by name, as on the real Buffer, so the package reads as DeepEP's V1
    # line; the benchmark measures low-latency mode only.
    def get_dispatch_layout(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the zero-cost stand-in has low-latency mode only")

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the zero-cost stand-in has low-latency mode only")

    def combine(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the zero-cost stand-in has low-latency mode only")
