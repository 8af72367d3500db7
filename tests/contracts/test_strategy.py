"""Reduction strategy applicability and choice (docs/design.md, "Reduction strategies")."""
from __future__ import annotations

import pytest

from moe_plugins.layout import ParallelLayout
from moe_plugins.strategy import ReductionStrategy as S
from moe_plugins.strategy import SharedPlacement, applicable_strategies, choose_strategy

FULL = dict(supports_sp=True, supports_row_scatter=True, has_shared_expert=True)


@pytest.mark.parametrize("layout,expected", [
    (ParallelLayout(4, 1, True), [S.LOCAL]),
    (ParallelLayout(1, 2, False), [S.TP_UNIFIED]),
    (ParallelLayout(1, 2, True), [S.TP_UNIFIED, S.ROW_SCATTER_ALLREDUCE, S.GATHER_PLUS_ALLREDUCE]),
    (ParallelLayout(2, 2, True), [S.ROW_SCATTER_ALLREDUCE, S.SP_ALLGATHER, S.GATHER_PLUS_ALLREDUCE]),
])
def test_applicable(layout, expected):
    assert applicable_strategies(layout, **FULL) == expected


@pytest.mark.parametrize("kwargs,expected", [
    (dict(), S.ROW_SCATTER_ALLREDUCE),
    (dict(single_collective=False), S.GATHER_PLUS_ALLREDUCE),
    (dict(shared_placement=SharedPlacement.REPLICATED), S.SP_ALLGATHER),
    (dict(has_shared_expert=False), S.SP_ALLGATHER),
    (dict(supports_row_scatter=False, supports_sp=False), S.GATHER_PLUS_ALLREDUCE),
])
def test_choice_for_ep_times_tp(kwargs, expected):
    args = {**FULL, **kwargs}
    assert choose_strategy(ParallelLayout(2, 2, True), **args).strategy is expected


def test_fallback_says_why():
    choice = choose_strategy(ParallelLayout(2, 2, True), **{**FULL, "supports_sp": False},
                             single_collective=False)
    assert choice.strategy is S.GATHER_PLUS_ALLREDUCE
    assert "single-collective reduction switched off" in choice.reason


@pytest.mark.parametrize("layout,expected", [
    (ParallelLayout(1, 2, True), S.TP_UNIFIED), (ParallelLayout(4, 1, True), S.LOCAL)])
def test_choice_without_dispatch_choices(layout, expected):
    assert choose_strategy(layout, **FULL).strategy is expected
