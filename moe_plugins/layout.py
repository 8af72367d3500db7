"""Parallel layout (EP/DP/TP/SP) and the one token-ownership function.

Vocabulary used in docstrings across the package:
``num_tokens`` tokens of a DP group, ``hidden`` model width, ``num_topk`` experts per token,
``num_experts`` experts of the layer, ``num_local_experts`` experts held by one EP rank,
``num_ranks`` EP ranks, ``num_owned`` rows a TP rank owns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ParallelLayout", "OwnedRows", "owned_rows", "OwnedTokens", "slice_owned",
           "local_expert_ids", "destination_ranks"]


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
        return self.dp * self.tp

    @property
    def ep_size(self) -> int:
        """Ranks that split the experts (1 when EP is off: experts are TP-sharded)."""
        return self.world_size if self.ep else 1

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def tp_group_ranks(self, dp_rank: int) -> list[int]:
        return [dp_rank * self.tp + t for t in range(self.tp)]

    def sequence_parallel(self, backend_supports_sp: bool) -> bool:
        """SP is on when EP is on, tp > 1, dp > 1 and the backend supports SP."""
        return self.ep and self.tp > 1 and self.dp > 1 and backend_supports_sp

    def describe(self) -> str:
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
        return self.stop - self.start

    @property
    def as_slice(self) -> slice:
        return slice(self.start, self.stop)


def owned_rows(num_tokens: int, tp: int, tp_rank: int) -> OwnedRows:
    """The one function that decides which rows a TP rank owns.

    Pad ``num_tokens`` up to a multiple of ``tp``, split it in ``tp`` equal chunks; rank ``r``
    owns chunk ``r`` clipped to the real rows. Used for dispatch, row-scatter write-back and SP.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank must be in [0, {tp}), got {tp_rank}")
    chunk = -(-num_tokens // tp)
    start = min(tp_rank * chunk, num_tokens)
    stop = min(start + chunk, num_tokens)
    return OwnedRows(num_tokens=num_tokens, start=start, stop=stop, chunk=chunk)


@dataclass(frozen=True)
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
    """Slice ``hidden_states`` [num_tokens, hidden] and its routing to the rows ``rows`` owns."""
    for name, t in (("hidden_states", hidden_states), ("topk_ids", topk_ids),
                    ("topk_weights", topk_weights)):
        if t.shape[0] != rows.num_tokens:
            raise ValueError(
                f"{name} has {t.shape[0]} tokens (shape {tuple(t.shape)}) but the ownership was "
                f"computed for {rows.num_tokens}; slice hidden_states, topk_ids and topk_weights "
                "from the same batch"
            )
    s = rows.as_slice
    return OwnedTokens(rows, hidden_states[s], topk_ids[s], topk_weights[s])


# Expert placement: contiguous blocks, expert e on EP rank e // experts_per_rank.
def local_expert_ids(topk_ids: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    """GLOBAL ids [num_tokens, num_topk] -> int64 LOCAL ids of the block
    [first_expert, first_expert + num_local), -1 for experts held elsewhere (or id -1)."""
    ids = topk_ids.long()
    mine = (ids >= first_expert) & (ids < first_expert + num_local)
    return torch.where(mine, ids - first_expert, torch.full_like(ids, -1))


def destination_ranks(topk_ids: torch.Tensor, experts_per_rank: int, num_ranks: int) -> torch.Tensor:
    """bool [num_tokens, num_ranks]: which EP ranks hold at least one of each token's experts.
    Ids outside [0, experts_per_rank * num_ranks) (-1: no expert) reach no rank; callers that
    must reject out-of-range ids check them separately (without a host sync)."""
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < experts_per_rank * num_ranks)
    hit = torch.zeros(topk_ids.shape[0], num_ranks, dtype=torch.int32, device=topk_ids.device)
    hit.scatter_add_(1, (ids.clamp(min=0) // experts_per_rank).clamp(max=num_ranks - 1),
                     valid.to(torch.int32))
    return hit > 0
