"""Re-homing the logical experts of lost EP ranks to their replicas on the survivors.

EPLB's placement (:class:`moe_plugins.placement.ExpertPlacement`) holds a logical expert in one
or more physical slots, on different ranks where there is redundancy. When ranks are lost,
their slots stay in the physical id space (the library's buffers are sized for it, and masked
ranks are neither sent to nor waited for), but the router must not pick them: the placement
of the survivors (:class:`SurvivorPlacement`) maps each logical expert to its replicas on
surviving ranks only. Decided from the placement and the lost ranks alone, which every survivor
holds, so every survivor routes alike without exchanging anything. A logical expert whose every
replica was on a lost rank is *lost*: :func:`rehome` names it; in degraded mode the router maps
it to -1 (no expert: its term leaves the token's weighted sum, the weights are not
renormalized).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_plugins.placement import ExpertPlacement

__all__ = ["SurvivorPlacement", "Rehoming", "rehome"]


@dataclass(frozen=True)
class SurvivorPlacement(ExpertPlacement):
    """An :class:`ExpertPlacement` whose router leaves out the slots of ``lost_ranks`` (EP
    ranks, ascending); a logical expert without a surviving replica maps to -1."""

    lost_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = [r for r in self.lost_ranks if not 0 <= r < self.num_ranks]
        if bad or list(self.lost_ranks) != sorted(set(self.lost_ranks)):
            raise ValueError(f"lost_ranks must be distinct EP ranks in [0, {self.num_ranks}) in "
                             f"ascending order, got {list(self.lost_ranks)}")
        if len(self.lost_ranks) >= self.num_ranks:
            raise ValueError(f"every one of the {self.num_ranks} EP ranks is lost: no survivor "
                             "to place experts on")

    @property
    def is_linear(self) -> bool:
        return not self.lost_ranks and super().is_linear

    def describe(self) -> str:
        return f"{super().describe()} without lost EP ranks {list(self.lost_ranks)}"

    def replicas(self) -> list[list[int]]:
        """Physical ids of each logical expert on surviving ranks, ascending (empty: lost)."""
        lost, n = set(self.lost_ranks), self.num_local
        return [[p for p in reps if p // n not in lost] for reps in super().replicas()]

    def lost_experts(self) -> list[int]:
        """Logical experts without a replica on a surviving rank."""
        return [e for e, reps in enumerate(self.replicas()) if not reps]

    def to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """LOGICAL ids int [num_tokens, num_topk] -> PHYSICAL ids int64 on surviving ranks (a
        replica per token, as :meth:`ExpertPlacement.to_physical`), -1 for a lost expert."""
        table, count = self.logical_to_physical_map()
        table = table.to(topk_ids.device)
        count = count.clamp(min=1).to(topk_ids.device)  # a lost expert's row is all -1
        ids = topk_ids.long()
        token = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
        return table[ids, token % count[ids]]


@dataclass(frozen=True)
class Rehoming:
    """Where the experts go once ``lost_ranks`` are gone: ``placement`` for
    ``MoELayer.rebalance``; ``lost_experts``: logical experts left without a replica."""

    placement: SurvivorPlacement
    lost_ranks: tuple[int, ...]
    lost_experts: tuple[int, ...]


def rehome(placement: ExpertPlacement, lost_ranks: tuple[int, ...] | list[int]) -> Rehoming:
    """The placement of the survivors after ``lost_ranks`` (EP ranks; any earlier losses of
    ``placement`` stay lost), and the logical experts it loses."""
    before = placement.lost_ranks if isinstance(placement, SurvivorPlacement) else ()
    lost = tuple(sorted(set(before) | {int(r) for r in lost_ranks}))
    survivors = SurvivorPlacement(placement.num_ranks, placement.num_logical,
                                  placement.physical_to_logical, placement.kind, lost)
    return Rehoming(survivors, lost, tuple(survivors.lost_experts()))
