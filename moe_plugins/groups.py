"""Process groups of one rank: the EP group (DP x TP ranks) and its TP group."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from moe_plugins.layout import ParallelLayout

__all__ = ["DistContext", "make_dist_context", "cached_dist_context", "all_gather_rows",
           "all_gather_tensor",
           "reduce_scatter_tensor", "TIMEOUT_ENV", "DEFAULT_TIMEOUT_S", "timeout_seconds",
           "default_timeout", "bound_timeout"]

#: Seconds a collective of a process group we create may wait for its peers (torch's own
#: default is 30 minutes for gloo and NCCL: a stuck peer would block that long).
TIMEOUT_ENV = "MOE_PLUGINS_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0


def timeout_seconds(timeout_s: Optional[float] = None) -> float:
    """``timeout_s``, else ``$MOE_PLUGINS_TIMEOUT_S``, else :data:`DEFAULT_TIMEOUT_S`; positive."""
    if timeout_s is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT_S
        try:
            timeout_s = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number; give the collective "
                             "timeout in seconds, e.g. 300") from None
    if not timeout_s > 0:
        raise ValueError(f"collective timeout must be > 0 seconds, got {timeout_s} "
                         f"(argument or {TIMEOUT_ENV})")
    return float(timeout_s)


def default_timeout(timeout_s: Optional[float] = None) -> datetime.timedelta:
    """:func:`timeout_seconds` as the timedelta torch.distributed takes."""
    return datetime.timedelta(seconds=timeout_seconds(timeout_s))


@dataclass(frozen=True)
class DistContext:
    """rank: EP rank (== world rank); ep_group spans all DP x TP ranks; tp_group the TP ranks of
    this rank's DP group (None when tp == 1); timeout_s: the groups' collective timeout, when
    known (errors name it)."""

    layout: ParallelLayout
    rank: int
    ep_group: "dist.ProcessGroup | None"
    tp_group: "dist.ProcessGroup | None"
    device: torch.device
    timeout_s: Optional[float] = None

    def __post_init__(self) -> None:
        # "cuda" without an index is the current device; tensors always name theirs ("cuda:0"),
        # so the layer's device checks compare against the indexed one
        device = torch.device(self.device)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        object.__setattr__(self, "device", device)

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.rank)


def make_dist_context(layout: ParallelLayout, device: torch.device | str = "cpu",
                      timeout_s: Optional[float] = None, fresh_ep_group: bool = False) -> DistContext:
    """Build the groups for ``layout`` over the default process group. Collective: every rank of
    the world calls it with the same layout. The TP groups (and with ``fresh_ep_group`` a new EP
    group instead of the default one: what rebuilding a layer after a fault needs, see
    :mod:`moe_plugins.faults`) wait at most ``timeout_s`` (:func:`timeout_seconds`)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world_size:
        raise ValueError(f"layout {layout.describe()} needs {layout.world_size} ranks, "
                         f"the process group has {world}")
    timeout_s = timeout_seconds(timeout_s)
    timeout = default_timeout(timeout_s)
    tp_group = None
    if layout.tp > 1:
        for d in range(layout.dp):  # new_group is collective: every rank creates every group
            g = dist.new_group(layout.tp_group_ranks(d), timeout=timeout)
            if d == layout.dp_rank(rank):
                tp_group = g
    ep_group = dist.new_group(list(range(world)), timeout=timeout) if fresh_ep_group \
        else dist.group.WORLD
    # The default group's own timeout is whatever its creator gave (not known here).
    return DistContext(layout, rank, ep_group, tp_group, torch.device(device),
                       timeout_s if fresh_ep_group else None)


def bound_timeout(group: "dist.ProcessGroup | None", timeout_s: Optional[float] = None) -> float:
    """Give a process group someone else created (vLLM's) our bounded collective timeout
    (:func:`timeout_seconds`) for its future collectives; returns the seconds set."""
    seconds = timeout_seconds(timeout_s)
    if group is not None and hasattr(group, "set_timeout"):
        group.set_timeout(datetime.timedelta(seconds=seconds))
    return seconds


_CONTEXTS: dict[tuple[ParallelLayout, str], DistContext] = {}


def cached_dist_context(layout: ParallelLayout, device: torch.device | str = "cpu") -> DistContext:
    """:func:`make_dist_context`, made once per layout in this process group (collective on first
    use for a layout: all ranks must ask for the same layouts in the same order)."""
    key = (layout, str(device))
    if key not in _CONTEXTS:
        _CONTEXTS[key] = make_dist_context(layout, device)
    return _CONTEXTS[key]


# torch 2.13 renamed the tensor collectives (*_into_tensor / *_tensor now warn as deprecated);
# older torch (2.11, for one) has only the old names. Resolved at call time so a test
# that wraps torch.distributed sees the call.
def all_gather_tensor(out: torch.Tensor, inp: torch.Tensor, group: "dist.ProcessGroup | None") -> None:
    """out [world * n, ...] <- every rank's inp [n, ...], in rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def all_gather_rows(owned: torch.Tensor, chunk: int, group: "dist.ProcessGroup | None",
                    world: int) -> torch.Tensor:
    """Every TP rank's owned rows, in token order: owned [num_owned <= chunk, hidden] on each of
    the ``world`` ranks of ``group`` (rank r owns rows [r * chunk, r * chunk + num_owned)) ->
    [world * chunk, hidden], the padding rows zero; slice it to the token count. Each rank
    sends ``chunk`` rows (its owned ones, zero-padded): the collective needs equal blocks."""
    padded = owned.new_zeros(chunk, owned.shape[1])
    padded[: owned.shape[0]] = owned
    gathered = owned.new_empty(chunk * world, owned.shape[1])
    all_gather_tensor(gathered, padded, group)
    return gathered


def reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, group: "dist.ProcessGroup | None") -> None:
    """out [n, ...] <- sum over ranks of block ``rank`` of inp [world * n, ...]."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)
