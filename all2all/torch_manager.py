"""Transport of the reference backend: ``all_to_all_single`` over the EP group (gloo or NCCL)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from moe_plugins.config import DispatchConfig
from moe_plugins.groups import DistContext
from moe_plugins.quant import wire_view

__all__ = ["TorchAll2AllManager"]


class TorchAll2AllManager:
    """One per layer config and EP group. ``placement`` (from the config, linear by default)
    says where the physical experts are; the ids dispatched are physical."""

    def __init__(self, ctx: DistContext, cfg: DispatchConfig):
        self.ctx = ctx
        self.group = ctx.ep_group
        self.num_ranks = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.placement = cfg.placement_for(self.num_ranks)

    def exchange_header(self, send: torch.Tensor, recv: Optional[torch.Tensor] = None
                        ) -> torch.Tensor:
        """The call's host exchange: send int64 [num_ranks, HEADER_WORDS] (row r: rows we send
        rank r, then this call's sequence number, layer digest and input status; see
        :mod:`moe_plugins.faults`) -> what each peer sent us, same shape (into ``recv`` when
        given: a caller that keeps one buffer for both saves an allocation per call)."""
        if recv is None:
            recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
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
        work = dist.all_to_all_single(recv, wire, recv_splits, send_splits, group=self.group,
                                      async_op=not blocking)
        return recv.view(send.dtype) if recv.dtype != send.dtype else recv, work

    def destroy(self) -> None:
        """Nothing to free: the transport owns no buffers."""
