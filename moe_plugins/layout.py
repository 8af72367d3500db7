"""Parallel layout (EP/DP/TP/SP) and the one token-ownership function.

Vocabulary used in docstrings across the package:
``num_tokens`` tokens of a DP group, ``hidden`` model width, ``num_topk`` experts per token,
``num_experts`` experts of the layer, ``num_local_experts`` experts held by one EP rank,
``num_ranks`` EP ranks, ``num_owned`` rows a TP rank owns.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moe_plugins.placement import ExpertPlacement

__all__ = ["ParallelLayout", "OwnedRows", "owned_rows", "OwnedTokens", "slice_owned",
           "local_expert_ids", "LocalIdMap", "destination_ranks", "DestinationMap"]


@dataclass(frozen=True)
class ParallelLayout:
    """Where a rank sits: EP group = DP x TP ranks (vLLM's meaning).

    ``tp`` is the attention TP size inside the EP group. Ranks are numbered
    ``rank = dp_rank * tp + tp_rank``, as vLLM numbers its EP group.
    """

    dp: int = 1
    tp: int = 1
    ep: bool = False

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1:
            raise ValueError(f"dp and tp must be >= 1, got dp={self.dp}, tp={self.tp}")
        if self.dp > 1 and not self.ep:
            raise ValueError(
                f"dp={self.dp} without expert parallelism is not a layout moe-plugins serves: "
                "every backend here dispatches tokens across an EP group; "
                "enable expert parallelism (--enable-expert-parallel / --ep)"
            )

    @property
    def world_size(self) -> int:
        """Ranks of the EP group: dp * tp."""
        return self.dp * self.tp

    @property
    def ep_size(self) -> int:
        """Ranks that split the experts (1 when EP is off: experts are TP-sharded)."""
        return self.world_size if self.ep else 1

    def dp_rank(self, rank: int) -> int:
        """The DP group of EP rank ``rank``."""
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        """The rank's place inside its DP group's TP ranks."""
        return rank % self.tp

    def tp_group_ranks(self, dp_rank: int) -> list[int]:
        """The EP ranks of DP group ``dp_rank``'s TP group, in TP order."""
        return [dp_rank * self.tp + t for t in range(self.tp)]

    def sequence_parallel(self, backend_supports_sp: bool) -> bool:
        """SP is on when EP is on, tp > 1, dp > 1 and the backend supports SP."""
        return self.ep and self.tp > 1 and self.dp > 1 and backend_supports_sp

    def describe(self) -> str:
        """``dp=2 tp=2 ep=on``: how logs and errors name the layout."""
        return f"dp={self.dp} tp={self.tp} ep={'on' if self.ep else 'off'}"


@dataclass(frozen=True)
class OwnedRows:
    """Rows ``[start, stop)`` of ``num_tokens`` that one TP rank owns.

    ``chunk`` is the padded per-rank chunk (``ceil(num_tokens / tp)``); trailing ranks may own
    fewer than ``chunk`` real rows, or none.
    """

    num_tokens: int
    start: int
    stop: int
    chunk: int

    @property
    def num_owned(self) -> int:
        """Real rows this rank owns (0 for a trailing rank of a short batch)."""
        return self.stop - self.start

    @property
    def as_slice(self) -> slice:
        """``slice(start, stop)``: index a [num_tokens, ...] tensor with it for the owned rows."""
        return slice(self.start, self.stop)


@functools.lru_cache(maxsize=4096)
def owned_rows(num_tokens: int, tp: int, tp_rank: int) -> OwnedRows:
    """The one function that decides which rows a TP rank owns.

    Pad ``num_tokens`` up to a multiple of ``tp``, split it in ``tp`` equal chunks; rank ``r``
    owns chunk ``r`` clipped to the real rows. Used for dispatch, row-scatter write-back and SP.
    Called on every layer call with few distinct arguments: the (immutable) answers are cached.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank must be in [0, {tp}), got {tp_rank}")
    chunk = -(-num_tokens // tp)
    start = min(tp_rank * chunk, num_tokens)
    stop = min(start + chunk, num_tokens)
    return OwnedRows(num_tokens=num_tokens, start=start, stop=stop, chunk=chunk)


@dataclass  # made per layer call: a plain dataclass (see moe_plugins.interface on frozen ones)
class OwnedTokens:
    """hidden_states and routing of the owned rows, sliced together (never one without the other)."""

    rows: OwnedRows
    hidden_states: torch.Tensor  # [num_owned, hidden]
    topk_ids: torch.Tensor  # [num_owned, num_topk]
    topk_weights: torch.Tensor  # [num_owned, num_topk]


def slice_owned(
    rows: OwnedRows,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> OwnedTokens:
    """Slice ``hidden_states`` [num_tokens, hidden] and its routing to the rows ``rows`` owns.
    A rank that owns every row (tp == 1) gets the tensors themselves, not views of them."""
    n = rows.num_tokens
    if hidden_states.shape[0] != n or topk_ids.shape[0] != n or topk_weights.shape[0] != n:
        for name, t in (("hidden_states", hidden_states), ("topk_ids", topk_ids),
                        ("topk_weights", topk_weights)):
            if t.shape[0] != n:
                raise ValueError(
                    f"{name} has {t.shape[0]} tokens (shape {tuple(t.shape)}) but the ownership "
                    f"was computed for {n}; slice hidden_states, topk_ids and topk_weights "
                    "from the same batch"
                )
    if rows.start == 0 and rows.stop == n:
        return OwnedTokens(rows, hidden_states, topk_ids, topk_weights)
    s = rows.as_slice
    return OwnedTokens(rows, hidden_states[s], topk_ids[s], topk_weights[s])


# Expert placement (moe_plugins.placement): transports dispatch PHYSICAL ids, physical expert p
# on EP rank p // num_local. These two helpers are the only code that maps ids to ranks/slots.
def local_expert_ids(physical_ids: torch.Tensor, placement: "ExpertPlacement", rank: int
                     ) -> torch.Tensor:
    """PHYSICAL ids [num_tokens, num_topk] -> int64 LOCAL slot ids on EP ``rank``, -1 for experts
    held elsewhere (or id -1)."""
    ids = physical_ids.long()
    first, n = rank * placement.num_local, placement.num_local
    mine = (ids >= first) & (ids < first + n)
    return torch.where(mine, ids - first, torch.full_like(ids, -1))


class LocalIdMap:
    """:func:`local_expert_ids` of one rank's slots as one lookup, for backends that map the
    received ids on every call: ``map(ids)`` == ``local_expert_ids(ids, placement, rank)`` for
    any integer ids, in two kernels (clamp, gather) instead of six. The table int64
    [num_physical + 2] (entry ``num_physical`` and the last, where -1 indexes, hold -1) is made
    per device on first use."""

    def __init__(self, placement: "ExpertPlacement", rank: int):
        self.num_experts = placement.num_physical
        ids = torch.cat([torch.arange(self.num_experts + 1), torch.tensor([-1])])
        self._cpu_table = local_expert_ids(ids, placement, rank)
        self._tables: dict[torch.device, torch.Tensor] = {}

    def __call__(self, topk_ids: torch.Tensor) -> torch.Tensor:
        ids = topk_ids if topk_ids.dtype is torch.int64 else topk_ids.long()  # take: int64
        table = _on_device(self._tables, self._cpu_table, ids.device)
        return torch.take(table, ids.clamp(-1, self.num_experts))

    def checked(self, checked_ids: torch.Tensor) -> torch.Tensor:
        """``map(ids)`` in one gather (no clamp), for int64 ids already known to lie in
        [-1, num_physical) (the sender checked them)."""
        return torch.take(_on_device(self._tables, self._cpu_table, checked_ids.device),
                          checked_ids)


def _on_device(tables: dict[torch.device, torch.Tensor], cpu_table: torch.Tensor,
               device: torch.device) -> torch.Tensor:
    """``cpu_table`` on ``device``, copied there on first use and kept in ``tables``."""
    table = tables.get(device)
    if table is None:
        table = tables[device] = cpu_table.to(device)
    return table


def destination_ranks(physical_ids: torch.Tensor, placement: "ExpertPlacement") -> torch.Tensor:
    """bool [num_tokens, num_ranks]: which EP ranks hold at least one of each token's experts.
    Ids outside [0, num_physical) (-1: no expert) reach no rank; callers that must reject
    out-of-range ids check them separately (without a host sync)."""
    ids = physical_ids if physical_ids.dtype is torch.int64 else physical_ids.long()
    valid = (ids >= 0) & (ids < placement.num_physical)
    # invalid ids land in a spare last column, dropped (a scatter of False could clear a hit)
    dest = torch.where(valid, ids // placement.num_local, placement.num_ranks)
    hit = torch.zeros(ids.shape[0], placement.num_ranks + 1, dtype=torch.bool, device=ids.device)
    hit.scatter_(1, dest, True)
    return hit[:, : placement.num_ranks]


class DestinationMap:
    """:func:`destination_ranks` with the out-of-range check folded in, as one lookup, for
    backends that route on every call: ``map(ids)`` -> int64 0/1 [num_ranks + 2, num_tokens],
    rank major (the rows a dispatch sends, grouped by destination, are then the nonzeros of a
    contiguous prefix); rows [0, num_ranks) are ``destination_ranks(ids, placement).t()``, row
    num_ranks marks tokens with a -1 entry (no expert: dropped), row num_ranks + 1 tokens with
    an id outside [-1, num_physical). Four kernels (clamp, gather, zeros, scatter) instead of
    seven plus a separate range check. int64, not bool: its row sums (the header's counts)
    then need no dtype conversion (a kernel more on CUDA, for bool). The table int64
    [num_physical + 3] is made per device on first use: entry p < num_physical holds p's rank,
    entries num_physical and num_physical + 1 (where an id clamped to -2 indexes from the end)
    the bad row, the last (-1) the no-expert row."""

    def __init__(self, placement: "ExpertPlacement"):
        self.num_physical, self.num_ranks = placement.num_physical, placement.num_ranks
        ranks = torch.arange(self.num_physical) // placement.num_local
        bad, none = self.num_ranks + 1, self.num_ranks
        self._cpu_table = torch.cat([ranks, torch.tensor([bad, bad, none])])
        self._tables: dict[torch.device, torch.Tensor] = {}

    def __call__(self, physical_ids: torch.Tensor) -> torch.Tensor:
        """physical_ids int [num_tokens, num_topk] -> int64 0/1 [num_ranks + 2, num_tokens]."""
        table = _on_device(self._tables, self._cpu_table, physical_ids.device)
        ids = physical_ids if physical_ids.dtype is torch.int64 else physical_ids.long()
        # a gather by take (int64 ids; negative ones index from the end): a fraction of
        # advanced indexing's host time
        dest = torch.take(table, ids.clamp(-2, self.num_physical))  # [num_tokens, num_topk]
        hit = torch.zeros(self.num_ranks + 2, physical_ids.shape[0], dtype=torch.int64,
                          device=physical_ids.device)
        return hit.scatter_(0, dest.t(), 1)
