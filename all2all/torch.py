"""Transport of the reference backend: ``all_to_all_single`` over the EP group (gloo or NCCL)."""
from __future__ import annotations

import torch.distributed as dist

from moe_plugins.config import DispatchConfig
from moe_plugins.groups import DistContext
from moe_plugins.backend_manager import BackendManager

__all__ = ["TorchAll2AllManager"]


def _options(async_op: bool) -> "dist.AllToAllOptions":
    opts = dist.AllToAllOptions()
    if hasattr(opts, "asyncOp"):  # torch >= 2.7; what dist.all_to_all_single sets
        opts.asyncOp = async_op
    return opts


class TorchAll2AllManager(BackendManager):
    """One per layer config and EP group: the process group, the all-to-all options made once
    (``blocking_opts``, ``async_opts``) and the placement. ``placement`` (from the config,
    linear by default) says where the physical experts are; the ids dispatched are physical.
    The prepare/finalize (:mod:`moe_plugins.prepare_finalize.torch`) makes the calls."""

    def __init__(self, ctx: DistContext, cfg: DispatchConfig):
        self.ctx = ctx
        self.group = ctx.ep_group
        self.num_ranks = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.placement = cfg.placement_for(self.num_ranks)
        self.pg = self.group if self.group is not None else dist.group.WORLD
        self.blocking_opts, self.async_opts = _options(False), _options(True)

    def destroy(self) -> None:
        """Nothing to free: the transport owns no buffers."""
