"""The planner's results: per rank, per strategy and per layer, as :func:`moe_plugins.planner.plan.
plan_layer` returns them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moe_plugins.layout import ParallelLayout
from moe_plugins.placement import ExpertPlacement
from moe_plugins.planner.link_model import LinkModel
from moe_plugins.planner.model_config import ModelSpec
from moe_plugins.planner.traffic import Estimate, WireFormat
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import Transport
from moe_plugins.strategy import ReductionStrategy

__all__ = ["CollectivePlan", "RankPlan", "TimeEstimate", "StrategyPlan", "LayerPlan"]


@dataclass(frozen=True)
class CollectivePlan:
    """One TP collective per layer: ``bytes`` is the tensor this rank contributes (what the layer's
    CollectiveLog records), ``wire_bytes`` what it sends under a ring algorithm."""

    kind: str
    bytes: int
    wire_bytes: int
    link: str
    time_us: float


@dataclass(frozen=True)
class RankPlan:
    """One EP rank, one MoE layer. Sent quantities are named as in
    :class:`moe_plugins.counters.DispatchStats`; ``recv_*`` are what this rank receives."""

    rank: int
    dp_rank: int
    tp_rank: int
    num_tokens: int  # tokens of this rank's DP group
    owned: int  # tokens handed to prepare (0 when the strategy does not dispatch)
    pairs: int
    rows: Estimate
    act_bytes: Estimate
    sf_bytes: Estimate
    meta_bytes: Estimate
    combine_bytes: Estimate
    recv_pairs: Estimate
    recv_rows: Estimate
    recv_act_bytes: Estimate
    recv_sf_bytes: Estimate
    recv_meta_bytes: Estimate
    recv_combine_bytes: Estimate
    tp_collectives: tuple[CollectivePlan, ...]  # the MoE block's
    shared_weight_bytes: int
    expert_weight_bytes: int
    attention_collectives: tuple[CollectivePlan, ...] = ()  # the attention's reduction

    @property
    def decoder_collectives(self) -> tuple[CollectivePlan, ...]:
        """Every TP collective of one decoder layer, in order: attention's, then the MoE's."""
        return self.attention_collectives + self.tp_collectives

    @property
    def decoder_tp_bytes(self) -> int:
        return sum(c.bytes for c in self.decoder_collectives)

    @property
    def decoder_tp_wire_bytes(self) -> int:
        return sum(c.wire_bytes for c in self.decoder_collectives)

    @property
    def dispatch_bytes(self) -> Estimate:
        return self.act_bytes + self.sf_bytes + self.meta_bytes

    @property
    def recv_dispatch_bytes(self) -> Estimate:
        return self.recv_act_bytes + self.recv_sf_bytes + self.recv_meta_bytes

    @property
    def tp_collective_bytes(self) -> int:
        return sum(c.bytes for c in self.tp_collectives)


@dataclass(frozen=True)
class TimeEstimate:
    """Communication time of one decoder layer (us): dispatch and combine all-to-alls (the
    busiest rank, timed by :mod:`moe_plugins.planner.transport_time` for the backend's
    transport), the MoE block's TP collectives (``tp_us``) and the attention's reduction
    (``attention_us``). Expected routing, or the measured one when the plan was given it."""

    dispatch_us: float
    combine_us: float
    tp_us: float
    attention_us: float = 0.0

    @property
    def total_us(self) -> float:
        return self.dispatch_us + self.combine_us + self.tp_us + self.attention_us


@dataclass(frozen=True)
class StrategyPlan:
    """One strategy: ``recommended`` by :func:`recommend_strategy`; ``default``: what
    :func:`moe_plugins.strategy.choose_strategy` (a layer left to itself) picks."""

    strategy: ReductionStrategy
    recommended: bool
    reason: str
    dispatches: bool
    ranks: tuple[RankPlan, ...]
    time: TimeEstimate
    default: bool = False

    @property
    def num_tp_collectives(self) -> int:
        """TP collectives of the MoE block (``moe-plugins demo``'s ``tp_collectives``)."""
        return len(self.ranks[0].tp_collectives)

    @property
    def num_decoder_tp_collectives(self) -> int:
        """TP collectives (launches) of one decoder layer: attention's and the MoE block's."""
        return len(self.ranks[0].decoder_collectives)


@dataclass(frozen=True)
class LayerPlan:
    model: ModelSpec
    layout: ParallelLayout
    num_tokens: tuple[int, ...]  # per DP group
    backend: str
    quant: QuantSpec
    link: LinkModel
    wire: WireFormat
    routing_given: bool
    strategies: tuple[StrategyPlan, ...]
    placement: Optional[ExpertPlacement] = None  # EP on: where the experts are (None: linear)
    transport: Transport = Transport.NCCL  # how the dispatch and combine were timed

    @property
    def recommended(self) -> StrategyPlan:
        return next(s for s in self.strategies if s.recommended)

    @property
    def default(self) -> StrategyPlan:
        return next(s for s in self.strategies if s.default)

    def strategy(self, strategy: ReductionStrategy) -> StrategyPlan:
        for s in self.strategies:
            if s.strategy is strategy:
                return s
        raise ValueError(f"strategy {strategy.value} does not apply to layout "
                         f"{self.layout.describe()} with backend {self.backend}; applicable: "
                         f"{[s.strategy.value for s in self.strategies]}")
