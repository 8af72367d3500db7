"""Reduction strategies: how routed and shared outputs are combined across TP, chosen once per layer."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from moe_plugins.layout import ParallelLayout

__all__ = ["ReductionStrategy", "SharedPlacement", "applicable_strategies", "choose_strategy",
           "StrategyChoice"]


class ReductionStrategy(str, enum.Enum):
    """See docs/design.md, "Reduction strategies". TP collectives per layer are given for a
    layer with a shared expert."""

    ROW_SCATTER_ALLREDUCE = "ROW_SCATTER_ALLREDUCE"  # 1 all_reduce [num_tokens, hidden]
    SP_ALLGATHER = "SP_ALLGATHER"  # 1 all_gather
    GATHER_PLUS_ALLREDUCE = "GATHER_PLUS_ALLREDUCE"  # all_gather routed + all_reduce shared
    TP_UNIFIED = "TP_UNIFIED"  # dp == 1: no dispatch, 1 all_reduce of routed + shared partials
    LOCAL = "LOCAL"  # tp == 1: no TP collective

    @property
    def dispatches(self) -> bool:
        """Whether tokens cross the EP group (TP_UNIFIED runs every token on every rank)."""
        return self is not ReductionStrategy.TP_UNIFIED

    @property
    def shared_placement(self) -> "SharedPlacement":
        """How this strategy holds the shared expert: replicated under SP, else TP-sharded."""
        if self is ReductionStrategy.SP_ALLGATHER:
            return SharedPlacement.REPLICATED
        return SharedPlacement.TP_SHARDED


class SharedPlacement(str, enum.Enum):
    """How the shared expert's weights sit on the TP ranks of a DP group."""

    TP_SHARDED = "tp_sharded"  # each rank holds intermediate / tp: outputs are partial sums
    REPLICATED = "replicated"  # each rank holds all of it: outputs are complete


def applicable_strategies(layout: ParallelLayout, *, supports_sp: bool, supports_row_scatter: bool,
                          has_shared_expert: bool) -> list[ReductionStrategy]:
    """Every strategy that can run this layout with this backend, preferred first."""
    if layout.tp == 1:
        return [ReductionStrategy.LOCAL]
    out = [ReductionStrategy.TP_UNIFIED] if layout.dp == 1 else []
    if not layout.ep:
        return out
    # With EP and dp == 1 the dispatch strategies still run (each TP rank dispatches its owned
    # slice); TP_UNIFIED stays the default there because it needs no dispatch at all.
    if supports_row_scatter and has_shared_expert:
        out.append(ReductionStrategy.ROW_SCATTER_ALLREDUCE)
    if layout.sequence_parallel(supports_sp):
        out.append(ReductionStrategy.SP_ALLGATHER)
    out.append(ReductionStrategy.GATHER_PLUS_ALLREDUCE)
    return out


@dataclass(frozen=True)
class StrategyChoice:
    strategy: ReductionStrategy
    reason: str


def choose_strategy(layout: ParallelLayout, *, supports_sp: bool, supports_row_scatter: bool,
                    has_shared_expert: bool, single_collective: bool = True,
                    shared_placement: SharedPlacement = SharedPlacement.TP_SHARDED) -> StrategyChoice:
    """The strategy a layer uses, and why (logged once per layer config by the caller).
    ``supports_sp`` / ``supports_row_scatter``: the backend's capabilities;
    ``single_collective``: the switch that prefers ROW_SCATTER_ALLREDUCE; ``shared_placement``:
    REPLICATED prefers SP where it applies. Returns a :class:`StrategyChoice` (strategy,
    reason)."""
    options = applicable_strategies(layout, supports_sp=supports_sp,
                                    supports_row_scatter=supports_row_scatter,
                                    has_shared_expert=has_shared_expert)
    if options[0] is ReductionStrategy.LOCAL:
        return StrategyChoice(options[0], "tp == 1: no TP reduction")
    if options[0] is ReductionStrategy.TP_UNIFIED:
        return StrategyChoice(options[0], "dp == 1: all TP ranks hold the same tokens, no dispatch")
    sp = ReductionStrategy.SP_ALLGATHER in options
    if shared_placement is SharedPlacement.REPLICATED and sp:
        return StrategyChoice(ReductionStrategy.SP_ALLGATHER,
                              "shared expert replicated and SP on: shared runs on the owned slice")
    if ReductionStrategy.ROW_SCATTER_ALLREDUCE in options and single_collective:
        return StrategyChoice(ReductionStrategy.ROW_SCATTER_ALLREDUCE,
                              "TP-sharded shared expert and row-scatter finalize: one all_reduce")
    if not has_shared_expert and sp:
        return StrategyChoice(ReductionStrategy.SP_ALLGATHER,
                              "no shared expert and SP on: one all_gather")
    why = []
    if not single_collective:
        why.append("single-collective reduction switched off")
    if not supports_row_scatter:
        why.append("backend has no row-scatter finalize")
    if shared_placement is SharedPlacement.REPLICATED and not sp:
        why.append("shared expert replicated but SP off for this backend")
    return StrategyChoice(ReductionStrategy.GATHER_PLUS_ALLREDUCE,
                          "fallback: " + ("; ".join(why) or "no single-collective path applies"))
