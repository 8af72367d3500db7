"""Expert placement as data: which logical expert each physical expert slot holds, and where.

Vocabulary (vLLM's, as its EPLB and DeepEP low-latency code use it):

- **logical** expert: one of the model's ``num_logical`` experts (what the router picks).
- **physical** expert: one of ``num_physical = num_ranks * num_local`` expert slots. Physical id
  ``p`` sits on EP rank ``p // num_local`` in local slot ``p % num_local`` (contiguous blocks:
  the id space every transport dispatches, DeepEP/NixlEP's kernels included). It holds the weights
  of logical expert ``physical_to_logical[p]``. With redundant experts (EPLB) a logical expert
  has several physical replicas.
- **global** id (vLLM's router output with round-robin placement and no EPLB): a logical id whose
  owner is not ``id // num_local``; :meth:`ExpertPlacement.global_to_physical` maps it to the
  physical slot holding it (vLLM's ``routing_tables[0]``).

Linear placement is the identity; round-robin puts logical ``e`` on rank ``e % num_ranks``;
EPLB's is any ``physical_to_logical`` that holds every logical expert at least once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["ExpertPlacement"]


@dataclass(frozen=True)
class ExpertPlacement:
    """physical_to_logical: the logical expert in each physical slot (length ``num_physical``,
    a multiple of ``num_ranks``); num_logical: the model's experts (each held at least once).
    ``kind`` is a label for logs and plans ("linear", "round_robin", "eplb")."""

    num_ranks: int
    num_logical: int
    physical_to_logical: tuple[int, ...]
    kind: str = "custom"

    def __post_init__(self) -> None:
        p, r, e = len(self.physical_to_logical), self.num_ranks, self.num_logical
        if r < 1 or e < 1:
            raise ValueError(f"an expert placement needs >= 1 rank and expert, got num_ranks={r}, "
                             f"num_logical={e}")
        if p % r:
            raise ValueError(f"{p} physical experts cannot be split evenly over {r} EP ranks; "
                             "give every rank the same number of expert slots (num_physical "
                             "a multiple of the EP size)")
        held = set(self.physical_to_logical)
        if not held <= set(range(e)) or len(held) != e:
            missing = sorted(set(range(e)) - held)
            raise ValueError(f"physical_to_logical must hold each of the {e} logical experts at "
                             f"least once and nothing else; missing {missing}, out of range "
                             f"{sorted(held - set(range(e)))}")

    # -- constructors ------------------------------------------------------------------------
    @classmethod
    def linear(cls, num_experts: int, num_ranks: int) -> "ExpertPlacement":
        """Expert ``e`` on rank ``e // (num_experts // num_ranks)`` (vLLM's 'linear')."""
        cls._check_divisible(num_experts, num_ranks)
        return cls(num_ranks, num_experts, tuple(range(num_experts)), "linear")

    @classmethod
    def round_robin(cls, num_experts: int, num_ranks: int) -> "ExpertPlacement":
        """Expert ``e`` on rank ``e % num_ranks``, local slot ``e // num_ranks`` (vLLM's
        'round_robin'): physical slot ``r * L + j`` holds logical ``r + j * num_ranks``."""
        cls._check_divisible(num_experts, num_ranks)
        per = num_experts // num_ranks
        return cls(num_ranks, num_experts,
                   tuple(r + j * num_ranks for r in range(num_ranks) for j in range(per)),
                   "round_robin")

    @classmethod
    def eplb(cls, physical_to_logical: Sequence[int] | torch.Tensor, num_ranks: int,
             num_logical: Optional[int] = None) -> "ExpertPlacement":
        """EPLB's placement: vLLM's ``physical_to_logical_map`` of one layer (int [num_physical])."""
        ids = [int(v) for v in (physical_to_logical.tolist()
                                if isinstance(physical_to_logical, torch.Tensor)
                                else physical_to_logical)]
        return cls(num_ranks, num_logical if num_logical is not None else max(ids) + 1,
                   tuple(ids), "eplb")

    @staticmethod
    def _check_divisible(num_experts: int, num_ranks: int) -> None:
        if num_ranks < 1 or num_experts % num_ranks:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP size "
                             f"{num_ranks}; pick an EP size that divides the experts")

    # -- sizes -------------------------------------------------------------------------------
    @property
    def num_physical(self) -> int:
        return len(self.physical_to_logical)

    @property
    def num_local(self) -> int:
        """Expert slots per EP rank (``num_local_experts``)."""
        return self.num_physical // self.num_ranks

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    @property
    def is_linear(self) -> bool:
        return self.physical_to_logical == tuple(range(self.num_logical))

    def describe(self) -> str:
        return (f"{self.kind} ({self.num_logical} logical, {self.num_physical} physical experts, "
                f"{self.num_local} per rank)")

    # -- the tables ----------------------------------------------------------------------------
    def local_logical(self, rank: int) -> list[int]:
        """The logical expert in each local slot of EP ``rank`` (whose weights it loads)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"EP rank must be in [0, {self.num_ranks}), got {rank}")
        n = self.num_local
        return list(self.physical_to_logical[rank * n:(rank + 1) * n])

    def replicas(self) -> list[list[int]]:
        """Physical ids of each logical expert, ascending."""
        out: list[list[int]] = [[] for _ in range(self.num_logical)]
        for p, e in enumerate(self.physical_to_logical):
            out[e].append(p)
        return out

    def logical_to_physical_map(self) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's EPLB router tables: (logical_to_physical int64 [num_logical, max_replicas],
        -1 padded; logical_replica_count int64 [num_logical])."""
        reps = self.replicas()
        width = max(len(r) for r in reps)
        table = torch.full((self.num_logical, width), -1, dtype=torch.int64)
        for e, r in enumerate(reps):
            table[e, :len(r)] = torch.tensor(r)
        return table, torch.tensor([len(r) for r in reps], dtype=torch.int64)

    def global_to_physical(self) -> torch.Tensor:
        """int64 [num_logical]: the physical slot of each logical expert; only for placements
        without redundant copies (round-robin's routing table, the identity for linear)."""
        if self.num_redundant:
            raise ValueError(f"{self.describe()} has redundant copies; a logical id has no single "
                             "physical slot, map ids with to_physical (EPLB's replica choice)")
        g2p = torch.empty(self.num_logical, dtype=torch.int64)
        g2p[torch.tensor(self.physical_to_logical)] = torch.arange(self.num_physical)
        return g2p

    def to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """LOGICAL ids int [num_tokens, num_topk] -> PHYSICAL ids int64 of the same shape. A
        logical expert with several replicas goes to replica ``token_index % replica_count``
        (vLLM's EPLB router hashes the token index instead; any choice gives the same output,
        since replicas hold the same weights)."""
        table, count = self.logical_to_physical_map()
        table, count = table.to(topk_ids.device), count.to(topk_ids.device)
        ids = topk_ids.long()
        token = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
        return table[ids, token % count[ids]]

    def rank_of(self, physical_ids: torch.Tensor) -> torch.Tensor:
        """int64 EP rank holding each PHYSICAL id (same shape)."""
        ids = physical_ids if physical_ids.dtype is torch.int64 else physical_ids.long()
        return ids // self.num_local
