"""vLLM's expert ids and the ids our transports dispatch, for one layer on one EP rank.

vLLM's router hands the layer ids in its expert id space (``num_experts`` ids: with EPLB the
physical ids its router mapped logical ones to, contiguous per rank; with round-robin placement
the logical ids, and the routing table ``global_to_physical`` vLLM gives its LL backends). Our
transports dispatch PHYSICAL ids (physical expert p on EP rank p // num_local,
:mod:`moe_plugins.placement`): :meth:`ExpertIds.physical` maps through the routing table first,
and :meth:`ExpertIds.check` makes sure once per ``expert_map`` that this rank holds exactly the
slots the transport delivers. Standard format: our backends hand LOCAL slots (-1 for experts
elsewhere) to the experts, which take vLLM ids: :meth:`ExpertIds.to_vllm` converts through the
inverse of ``expert_map`` (a slot held elsewhere gets an id this rank does not hold, weight 0).
vLLM's CPU experts, which ignore ``expert_map``, get local ids from
:func:`ids_through_expert_map` (the CPU experts' hook in :mod:`moe_plugins.vllm.patches`).
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_plugins.interface import PrepareResult
from moe_plugins.placement import ExpertPlacement

__all__ = ["ExpertIds", "ids_through_expert_map"]


class ExpertIds:
    """The id maps of one layer on EP rank ``rank`` of ``ep_size`` (``num_experts`` experts,
    ``experts_per_rank`` local slots). ``global_to_physical``: vLLM's routing table (int
    [num_experts]) or None where vLLM's ids are already physical (linear, EPLB; a round-robin
    ``expert_map`` without a table is recognised in :meth:`check`)."""

    def __init__(self, num_experts: int, experts_per_rank: int, rank: int, ep_size: int,
                 device: torch.device, global_to_physical: Optional[torch.Tensor] = None):
        self.num_experts, self.experts_per_rank = num_experts, experts_per_rank
        self.rank, self.ep_size, self.device = rank, ep_size, device
        self.g2p = None if global_to_physical is None else global_to_physical.to(torch.int64)
        # vLLM id of each local slot, then (index num_local) one held elsewhere; from expert_map
        self.slot_ids: Optional[torch.Tensor] = None
        self.placement_map: Optional[torch.Tensor] = None

    def checked(self, expert_map: Optional[torch.Tensor]) -> bool:
        """Whether :meth:`check` already accepted this very ``expert_map`` tensor."""
        return self.slot_ids is not None and expert_map is self.placement_map

    def check(self, expert_map: Optional[torch.Tensor]) -> None:
        """Once per ``expert_map`` tensor (one host sync): it must hold on this rank exactly the
        slots the transport delivers here (physical id p on rank p // num_local, after the
        routing table); builds the slot -> vLLM id table the standard format returns."""
        if self.checked(expert_map):
            return
        e, per, rank, ep = self.num_experts, self.experts_per_rank, self.rank, self.ep_size
        got = (torch.arange(e) if expert_map is None and ep == 1
               else None if expert_map is None else expert_map.detach().to("cpu", torch.int64))
        if got is None or got.shape != (e,):
            raise ValueError(f"EP rank {rank} got expert_map "
                             f"{None if got is None else tuple(got.shape)}, expected int "
                             f"[{e}] (vLLM's id -> local slot, -1 elsewhere) under EP size {ep}")
        if self.g2p is None and ep > 1 and torch.equal(
                got, _slots_of(ExpertPlacement.round_robin(e, ep).global_to_physical(), per, rank)):
            # vLLM's round-robin placement without its routing table: the same table, made here
            self.g2p = ExpertPlacement.round_robin(e, ep).global_to_physical()
        g2p = torch.arange(e) if self.g2p is None else self.g2p.to("cpu")
        expected = _slots_of(g2p, per, rank)
        if not torch.equal(got, expected):
            raise ValueError(
                f"EP rank {rank} holds slots {got.tolist()} (expert_map) but the transport "
                f"delivers {expected.tolist()} here (physical id p on EP rank p // {per}, "
                f"{'after the routing table' if self.g2p is not None else 'ids as given'}); "
                "moe-plugins serves vLLM's linear and round-robin placements and EPLB's physical "
                "experts. Use --expert-placement-strategy linear or round_robin")
        slot_ids = torch.zeros(per + 1, dtype=torch.int64)
        mine = got >= 0
        slot_ids[got[mine]] = torch.arange(e)[mine]
        elsewhere = (~mine).nonzero().flatten()
        slot_ids[per] = int(elsewhere[0]) if elsewhere.numel() else 0  # weight 0 there anyway
        device = expert_map.device if expert_map is not None else self.device
        self.slot_ids = slot_ids.to(device)
        if self.g2p is not None:
            self.g2p = self.g2p.to(device)
        self.placement_map = expert_map

    def physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """vLLM's ids -> the PHYSICAL ids the transports dispatch (same shape and dtype)."""
        if self.g2p is None:
            return topk_ids
        return torch.take(self.g2p, topk_ids.long()).to(topk_ids.dtype)

    def to_vllm(self, prep: PrepareResult, ids_dtype: torch.dtype, weights_dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """LOCAL slots (-1: elsewhere) of ``prep`` -> vLLM's ids through the inverse of
        ``expert_map``; elsewhere -> an id this rank does not hold, with weight 0."""
        assert prep.topk_ids is not None and prep.topk_weights is not None
        assert self.slot_ids is not None
        local = prep.topk_ids
        # (-1 takes the last entry: an id held elsewhere)
        ids = torch.take(self.slot_ids, local if local.dtype is torch.int64 else local.long())
        # where, not masked_fill: the same mask without masked_fill's copy of the weights first
        weights = torch.where(local < 0, 0.0, prep.topk_weights)
        if ids.dtype is not ids_dtype:
            ids = ids.to(ids_dtype)
        if weights.dtype is not weights_dtype:
            weights = weights.to(weights_dtype)
        return ids, weights


def _slots_of(global_to_physical: torch.Tensor, per_rank: int, rank: int) -> torch.Tensor:
    """int64 [num_experts]: the local slot on ``rank`` of each id whose physical expert it holds
    (physical p on rank p // per_rank), -1 elsewhere: the expert_map the transport implies."""
    g2p = global_to_physical.long()
    return torch.where(g2p // per_rank == rank, g2p % per_rank, torch.full_like(g2p, -1))


def ids_through_expert_map(expert_map: torch.Tensor, topk_ids: torch.Tensor,
                           topk_weights: torch.Tensor, weights_on_input: bool
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ids -> local ids for experts that cannot read ``expert_map``.

    expert_map: int32 [num_experts], local index or -1; topk_ids: int [num_tokens, num_topk]
    global ids; topk_weights: float [num_tokens, num_topk]. Slots of experts held elsewhere get
    local expert 0 with weight 0, so they add nothing. Returns (ids in topk_ids.dtype, weights).
    """
    local = expert_map[topk_ids.long()]
    remote = local < 0
    if weights_on_input and bool(remote.any()):
        raise NotImplementedError(
            "router weights applied on the input (top-1 models) with experts held on other ranks "
            "cannot be masked for vLLM's CPU experts; use a layout where each rank routes only "
            "to its own experts, or another all2all backend"
        )
    ids = torch.where(remote, torch.zeros_like(local), local).to(topk_ids.dtype)
    weights = torch.where(remote, torch.zeros_like(topk_weights), topk_weights)
    return ids, weights
