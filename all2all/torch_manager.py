"""Transport of the reference backend: ``all_to_all_single`` over the EP group (gloo or NCCL)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from moe_plugins.config import DispatchConfig
from moe_plugins.groups import DistContext
from moe_plugins.quant import wire_view

__all__ = ["TorchAll2AllManager"]


def _options(async_op: bool) -> "dist.AllToAllOptions":
    opts = dist.AllToAllOptions()
    if hasattr(opts, "asyncOp"):  # torch >= 2.7; what dist.all_to_all_single sets
        opts.asyncOp = async_op
    return opts


class TorchAll2AllManager:
    """One per layer config and EP group. ``placement`` (from the config, linear by default)
    says where the physical experts are; the ids dispatched are physical.

    The all-to-alls call the process group's own ``alltoall_base``, as
    ``dist.all_to_all_single`` does after its argument checks. Those checks cannot fail here
    (this rank is in the group, the tensors are plain, same-dtype, never complex), and on a busy
    host they cost about as much as a kernel launch, three times a round trip. Under
    ``torch.compile`` tracing the public function is called instead (Dynamo maps it to a
    functional collective)."""

    def __init__(self, ctx: DistContext, cfg: DispatchConfig):
        self.ctx = ctx
        self.group = ctx.ep_group
        self.num_ranks = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.placement = cfg.placement_for(self.num_ranks)
        self._pg = self.group if self.group is not None else dist.group.WORLD
        self._blocking_opts, self._async_opts = _options(False), _options(True)

    def _all_to_all_single(self, recv: torch.Tensor, send: torch.Tensor,
                           recv_splits: Optional[list[int]], send_splits: Optional[list[int]],
                           blocking: bool) -> Optional["dist.Work"]:
        """``dist.all_to_all_single(recv, send, recv_splits, send_splits, group, not blocking)``
        (None splits: equal ones)."""
        if torch.compiler.is_compiling():
            return dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group,
                                          async_op=not blocking)
        work = self._pg.alltoall_base(recv, send, recv_splits or [], send_splits or [],
                                      self._blocking_opts if blocking else self._async_opts)
        if blocking:
            # NCCL returns no work for a blocking call (it ran on the current stream), as
            # dist.all_to_all_single expects of backends that sync in C++
            if work is not None:
                work.wait()
            return None
        return work

    def exchange_header(self, send: torch.Tensor, recv: Optional[torch.Tensor] = None
                        ) -> torch.Tensor:
        """The call's host exchange: send int64 [num_ranks, HEADER_WORDS] (row r: rows we send
        rank r, then this call's sequence number, layer digest and input status; see
        :mod:`moe_plugins.faults`) -> what each peer sent us, same shape (into ``recv`` when
        given: a caller that keeps one buffer for both saves an allocation per call)."""
        if recv is None:
            recv = torch.empty_like(send)
        self._all_to_all_single(recv, send, None, None, True)
        return recv

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                   num_recv: Optional[int] = None, blocking: bool = False
                   ) -> tuple[torch.Tensor, Optional["dist.Work"]]:
        """Rows of ``send`` [sum(send_splits), ...] go to each rank in order; returns the receive
        tensor [sum(recv_splits), ...] (same dtype) and the pending work to wait on (None when
        ``blocking``: the call returns once the transfer is done, on NCCL once it is queued on
        the stream, with no work object or event to keep). ``num_recv``: sum(recv_splits)
        when the caller has it already."""
        wire = wire_view(send.contiguous())
        rows = sum(recv_splits) if num_recv is None else num_recv
        recv = torch.empty((rows, *wire.shape[1:]), dtype=wire.dtype, device=wire.device)
        work = self._all_to_all_single(recv, wire, recv_splits, send_splits, blocking)
        return recv.view(send.dtype) if recv.dtype != send.dtype else recv, work

    def destroy(self) -> None:
        """Nothing to free: the transport owns no buffers."""
