"""Shared-expert overlap: switches, CPU fallback, failure path (GPU behaviour: tests/gpu/)."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.runner import multirank_ranks as rank_fns
from moe_plugins import overlap
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.groups import DistContext
from moe_plugins.runner.layer import MoELayer
from moe_plugins.layout import ParallelLayout
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights
from moe_plugins.overlap import OverlapConfig
from moe_plugins.runner.reference import reference_moe, tolerance_for
from moe_plugins.registry import get_backend
from moe_plugins.strategy import ReductionStrategy as S

CFG = MoEConfig(hidden=128, num_experts=4, num_topk=2, intermediate=32, shared_intermediate=64)


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the once-only warnings afresh; the process-wide set comes back after."""
    monkeypatch.setattr(overlap, "_WARNED", set())


def _single_rank_layer(overlap_on: bool) -> MoELayer:
    ctx = DistContext(ParallelLayout(1, 1, False), 0, None, None, torch.device("cpu"))
    return MoELayer(MoEWeights.random(CFG), ctx, get_backend("torch"),
                    overlap=OverlapConfig(overlap=overlap_on))


def test_overlap_without_cuda_runs_inline_identically_and_warns_once(fresh_warnings, caplog):
    x = demo_inputs(CFG, 6, 0, 0)
    with caplog.at_level(logging.WARNING, logger="moe_plugins.overlap"):
        requested = _single_rank_layer(True)
        outs = [requested(x), requested(x), _single_rank_layer(True)(x)]
    # Requested-but-off runs inline; both paths must still be the MoE (shared expert included):
    # compared with the independent per-token reference, not with each other (on CPU both
    # run the same inline code, so equality alone could not fail).
    ref = reference_moe(x, MoEWeights.random(CFG))
    atol, rtol = tolerance_for(ref, CFG.dtype)
    for out in outs + [_single_rank_layer(False)(x)]:
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "overlap was requested but is off: no CUDA device" in warnings[0].getMessage()


def test_overlap_switched_off_does_not_warn(fresh_warnings, caplog):
    with caplog.at_level(logging.WARNING, logger="moe_plugins.overlap"):
        _single_rank_layer(False)(demo_inputs(CFG, 4, 0, 0))
    assert not caplog.records


@pytest.mark.parametrize("env,expected", [
    ({}, OverlapConfig(True, True, 1024)),
    ({"MOE_PLUGINS_OVERLAP": "0"}, OverlapConfig(True, False, 1024)),
    ({"MOE_PLUGINS_SINGLE_COLLECTIVE": "off", "MOE_PLUGINS_OVERLAP_MAX_TOKENS": "64"},
     OverlapConfig(False, True, 64)),
])
def test_switches_from_env(monkeypatch, env, expected):
    for k in ("MOE_PLUGINS_OVERLAP", "MOE_PLUGINS_SINGLE_COLLECTIVE", "MOE_PLUGINS_OVERLAP_MAX_TOKENS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert OverlapConfig.from_env() == expected


def test_engine_config_overrides_env(monkeypatch):
    monkeypatch.setenv("MOE_PLUGINS_OVERLAP", "1")
    assert OverlapConfig.from_env(overlap=False).overlap is False


@pytest.mark.parametrize("kwargs,match", [
    (dict(env={"MOE_PLUGINS_OVERLAP": "maybe"}), "MOE_PLUGINS_OVERLAP='maybe': expected one of"),
    (dict(overrides={"overlapp": True}), r"unknown overlap settings \['overlapp'\]"),
])
def test_bad_switch_values_are_clear_errors(monkeypatch, kwargs, match):
    for k, v in kwargs.get("env", {}).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        OverlapConfig.from_env(**kwargs.get("overrides", {}))


@pytest.mark.multirank
@pytest.mark.parametrize("single_collective,expected,collectives", [
    (True, S.ROW_SCATTER_ALLREDUCE, 1), (False, S.GATHER_PLUS_ALLREDUCE, 2)])
def test_single_collective_switch_picks_the_layer_strategy(rank_pool, single_collective, expected,
                                                           collectives):
    results = rank_pool(4).run(rank_fns.run_layer, ParallelLayout(2, 2, True), CFG, None, 5,
                               single_collective=single_collective)
    for r in results:
        assert r["strategy"] is expected
        assert len([n for n, _ in r["calls"] if n != "all_to_all_single"]) == collectives


@pytest.mark.multirank
@pytest.mark.parametrize("layout,strategy", [(ParallelLayout(2, 2, True), S.ROW_SCATTER_ALLREDUCE),
                                             (ParallelLayout(2, 1, True), S.LOCAL)])
def test_failure_in_routed_path_breaks_the_group_until_rebuilt(rank_pool, layout, strategy):
    results = rank_pool(layout.world_size).run(rank_fns.run_layer_after_failure, layout, CFG,
                                               strategy, 5)
    weights = MoEWeights.random(CFG, 0)
    for rank, r in enumerate(results):
        assert r["first_error"] == "injected expert failure"  # the real first error, not a stale handle
        assert r["handle_after"] is None
        # the next call on those groups names the first failure instead of pairing collectives
        assert "out of step" in r["second_error"] and "injected expert failure" in r["second_error"]
        ref = reference_moe(demo_inputs(CFG, 5, layout.dp_rank(rank), 0), weights)
        torch.testing.assert_close(r["out"], ref, **dict(zip(("atol", "rtol"), tolerance_for(ref, CFG.dtype))))


def test_layer_config_logged_once_at_info_with_strategy_and_overlap_reason(caplog, monkeypatch):
    from moe_plugins.runner import layer as layer_mod

    monkeypatch.setattr(layer_mod, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="moe_plugins.runner.layer"):
        _single_rank_layer(True)
        _single_rank_layer(True)
    lines = [r.getMessage() for r in caplog.records if r.name == "moe_plugins.runner.layer"]
    assert len(lines) == 1
    assert "strategy=LOCAL" in lines[0] and "overlap=off (no CUDA device" in lines[0]
