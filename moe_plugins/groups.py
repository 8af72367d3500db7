"""Process groups of one rank: the EP group (DP x TP ranks) and its TP group."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_plugins.layout import ParallelLayout

__all__ = ["DistContext", "make_dist_context", "cached_dist_context", "all_gather_tensor",
           "reduce_scatter_tensor"]


@dataclass(frozen=True)
class DistContext:
    """rank: EP rank (== world rank); ep_group spans all DP x TP ranks; tp_group the TP ranks of
    this rank's DP group (None when tp == 1)."""

    layout: ParallelLayout
    rank: int
    ep_group: "dist.ProcessGroup | None"
    tp_group: "dist.ProcessGroup | None"
    device: torch.device

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.rank)


def make_dist_context(layout: ParallelLayout, device: torch.device | str = "cpu") -> DistContext:
    """Build the groups for ``layout`` over the default process group. Collective: every rank of
    the world calls it with the same layout."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world_size:
        raise ValueError(f"layout {layout.describe()} needs {layout.world_size} ranks, "
                         f"the process group has {world}")
    tp_group = None
    if layout.tp > 1:
        for d in range(layout.dp):  # new_group is collective: every rank creates every group
            g = dist.new_group(layout.tp_group_ranks(d))
            if d == layout.dp_rank(rank):
                tp_group = g
    return DistContext(layout, rank, dist.group.WORLD, tp_group, torch.device(device))


_CONTEXTS: dict[tuple[ParallelLayout, str], DistContext] = {}


def cached_dist_context(layout: ParallelLayout, device: torch.device | str = "cpu") -> DistContext:
    """:func:`make_dist_context`, made once per layout in this process group (collective on first
    use for a layout: all ranks must ask for the same layouts in the same order)."""
    key = (layout, str(device))
    if key not in _CONTEXTS:
        _CONTEXTS[key] = make_dist_context(layout, device)
    return _CONTEXTS[key]


# torch 2.13 renamed the tensor collectives (*_into_tensor / *_tensor now warn as deprecated);
# older torch (the GPU image has 2.11) has only the old names. Resolved at call time so a test
# that wraps torch.distributed sees the call.
def all_gather_tensor(out: torch.Tensor, inp: torch.Tensor, group: "dist.ProcessGroup | None") -> None:
    """out [world * n, ...] <- every rank's inp [n, ...], in rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, group: "dist.ProcessGroup | None") -> None:
    """out [n, ...] <- sum over ranks of block ``rank`` of inp [world * n, ...]."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)
