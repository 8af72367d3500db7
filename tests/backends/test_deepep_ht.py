"""deepep_ht and deepep_auto on CPU against the emulation of DeepEP's normal and low-latency
modes (tests/emulation: 567632d's V1 Buffer unless a test says otherwise; the ``legacy`` tests
run on the current line's legacy Buffer, d4f41e4 and later), multi-rank over gloo, compared with
the single-process reference; and the registry rows and refusals of both."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest
import torch

from tests.backends import deepep_ht_ranks as ht_rank_fns
from tests.backend_lists import NORMAL_MODE
from tests.checks import assert_matches_reference, faster_mode
from tests.emulation import in_deep_ep_shape
from moe_plugins.interface import ActivationFormat, BatchHint
from moe_plugins.planner.link_model import LinkModel
from moe_plugins.runner.launch import RankError
from moe_plugins.layout import ParallelLayout
from moe_plugins.config import MoEConfig
from moe_plugins.quant import QuantScheme, QuantSpec
from moe_plugins.runner.reference import tolerance_for
from moe_plugins.registry import get_backend, refusal_reason, select_backend
from moe_plugins.strategy import ReductionStrategy as S

BF16, FP8 = QuantSpec(), QuantSpec(QuantScheme.FP8_BLOCK128)
QUANTS, QUANT_IDS = [BF16, FP8], ["bf16", "fp8"]
BACKENDS = NORMAL_MODE  # the registry's backends with DeepEP's normal mode (tests/backend_lists.py)


def _cfg(**kw: object) -> MoEConfig:
    # hidden 2048: a low-latency kernel size, so deepep_auto's low-latency side runs unpadded
    return MoEConfig(**{"hidden": 2048, "num_experts": 8, "num_topk": 3, "intermediate": 32,
                        "shared_intermediate": 64, "dtype": torch.bfloat16, **kw})


LAYER_CASES = [
    (ParallelLayout(2, 1, True), S.LOCAL),
    (ParallelLayout(2, 2, True), S.ROW_SCATTER_ALLREDUCE),
    (ParallelLayout(2, 2, True), S.GATHER_PLUS_ALLREDUCE),
]
LAYER_IDS = ["tp1", "tp2-row_scatter", "tp2-gather"]


# -- the layer, multi-rank, against the reference ------------------------------------------

@pytest.mark.multirank
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 9])
@pytest.mark.parametrize("layout,strategy", LAYER_CASES, ids=LAYER_IDS)
@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_matches_reference(rank_pool, backend, quant, layout, strategy, num_tokens):
    cfg = _cfg()
    results = rank_pool(layout.world_size).run(ht_rank_fns.run_ht_layer, backend, layout, cfg,
                                               strategy, num_tokens, quant)
    assert_matches_reference(results, layout, cfg, num_tokens, quant)
    for r in results:
        s = r["stats"]
        assert r["strategy"] is strategy
        assert s["calls"] == 1 and s["pairs"] == r["owned"] * cfg.num_topk  # the owned slice
        assert (s["sf_bytes"] > 0) == (quant.quantized_on_wire and r["owned"] > 0)
        if backend == "deepep_auto":
            assert s["modes"] == {"low_latency": 1}  # the default capacity: max_tokens_per_rank


@pytest.mark.multirank
@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_matches_reference_on_the_current_deepep_line(rank_pool, backend, quant):
    """Both backends on the current line's legacy Buffer (the tests above run on 567632d's)."""
    layout, strategy = LAYER_CASES[1]
    cfg = _cfg()
    results = rank_pool(4).run(in_deep_ep_shape, "legacy", ht_rank_fns.run_ht_layer, backend,
                               layout, cfg, strategy, 5, quant)
    assert_matches_reference(results, layout, cfg, 5, quant)


@pytest.mark.multirank
@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_parallel_matches_reference(rank_pool, backend, quant):
    layout, cfg = ParallelLayout(2, 2, True), _cfg()
    results = rank_pool(4).run(ht_rank_fns.run_ht_layer, backend, layout, cfg, S.SP_ALLGATHER, 5,
                               quant)
    assert_matches_reference(results, layout, cfg, 5, quant)


@pytest.mark.multirank
@pytest.mark.parametrize("layout,strategy", [LAYER_CASES[0], LAYER_CASES[1]],
                         ids=LAYER_IDS[:2])
@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
def test_large_batch_matches_reference(rank_pool, quant, layout, strategy):
    """4096 tokens per DP group (a prefill batch): deepep_ht; deepep_auto takes normal mode."""
    cfg = _cfg(hidden=256, intermediate=16, shared_intermediate=32)
    pool = rank_pool(layout.world_size)
    from moe_plugins.all2all.deepep_auto import DeepEPAutoOptions

    for backend in BACKENDS:
        options = DeepEPAutoOptions(ll_max_tokens_per_rank=128) if backend == "deepep_auto" else None
        results = pool.run(ht_rank_fns.run_ht_layer, backend, layout, cfg, strategy, 4096, quant,
                           0, 4096, options)
        assert_matches_reference(results, layout, cfg, 4096, quant)
        if backend == "deepep_auto":
            assert all(r["stats"]["modes"] == {"normal": 1} for r in results)


@pytest.mark.multirank
def test_deferred_fp8_quant_dispatches_bf16(rank_pool):
    layout, cfg, quant = ParallelLayout(2, 1, True), _cfg(), QuantSpec(QuantScheme.FP8_BLOCK128, True)
    results = rank_pool(2).run(ht_rank_fns.run_ht_layer, "deepep_ht", layout, cfg, S.LOCAL, 8,
                               quant)
    assert_matches_reference(results, layout, cfg, 8, quant)
    assert all(r["stats"]["sf_bytes"] == 0 for r in results)


# -- what prepare hands the experts: the same rows as the reference transport -----------------

def _rows_by_content(x: torch.Tensor, *others: torch.Tensor) -> list[torch.Tensor]:
    probe = torch.randn(x.shape[1], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    order = torch.argsort(x.double() @ probe)
    return [x[order]] + [t[order] for t in others]


@pytest.mark.multirank
@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
def test_prepare_gives_the_reference_rows(rank_pool, quant):
    """deepep_ht's receive (rows, x_sf, LOCAL ids, weights, counts) holds exactly the rows the
    reference ``torch`` backend receives, one per (token, destination rank)."""
    layout, cfg, n = ParallelLayout(4, 1, True), _cfg(), 7
    pool = rank_pool(4)
    ht = pool.run(ht_rank_fns.run_ht_prepare, "deepep_ht", layout, cfg, n, quant)
    ref = pool.run(ht_rank_fns.run_ht_prepare, "torch", layout, cfg, n, quant)
    for r, (got, want) in enumerate(zip(ht, ref)):
        assert (got["x_sf"] is None) == (quant is BF16)
        assert got["x"].dtype == want["x"].dtype and got["x"].shape == want["x"].shape
        assert got["ids"].dtype == torch.int64 and got["weights"].dtype == torch.float32
        assert torch.equal(got["counts"], want["counts"]) and got["counts"].dtype == torch.int32
        assert bool(((got["ids"] == -1) == (got["weights"] == 0)).all())
        gx, gids, gw = _rows_by_content(got["x"].float(), got["ids"], got["weights"])
        wx, wids, ww = _rows_by_content(want["x"].float(), want["ids"], want["weights"].float())
        torch.testing.assert_close(gx, wx, atol=0, rtol=0)
        assert torch.equal(gids, wids)
        torch.testing.assert_close(gw, torch.where(wids >= 0, ww, torch.zeros_like(ww)),
                                   atol=0, rtol=0)
        if quant is FP8:
            gs = _rows_by_content(got["x"].float(), got["x_sf"])[1]
            ws = _rows_by_content(want["x"].float(), want["x_sf"])[1]
            torch.testing.assert_close(gs, ws, atol=0, rtol=0)
        assert got["stats"]["rows"] == want["stats"]["rows"]  # one per (token, rank)
        assert got["stats"]["combine_bytes"] == got["x"].shape[0] * cfg.hidden * 2
        assert torch.equal(got["finalized"], torch.zeros_like(got["finalized"]))


# -- deepep_auto: the switch -------------------------------------------------------------------

_TP1, _TP2 = ParallelLayout(2, 1, True), ParallelLayout(2, 2, True)


@pytest.mark.multirank
@pytest.mark.parametrize("quant,layout,shape", [
    (BF16, _TP1, "v1"), (FP8, _TP1, "v1"), (BF16, _TP2, "v1"), (FP8, _TP2, "v1"),
    (FP8, _TP1, "legacy")], ids=["bf16-tp1", "fp8-tp1", "bf16-tp2", "fp8-tp2", "fp8-tp1-legacy"])
def test_auto_switches_at_its_threshold(rank_pool, quant, layout, shape):
    """One layer, calls of C and C + 1 tokens per rank (C the low-latency capacity; with tp 2 a
    rank owns half the tokens): low-latency, then normal mode, then low-latency again; the rows
    both calls share have the same outputs, and each call matches the reference. Also on the
    current DeepEP line's legacy Buffer (both modes on one buffer)."""
    cfg, cap = _cfg(), 8  # token_capacity(8, ranks) == 8
    per_dp = [cap * layout.tp, cap * layout.tp + 1, cap * layout.tp]
    calls = [[n] * layout.dp for n in per_dp]
    results = rank_pool(layout.world_size).run(in_deep_ep_shape, shape, ht_rank_fns.run_auto_calls,
                                               layout, cfg, calls, cap, quant)
    for rank, r in enumerate(results):
        assert r["capacity"] == cap
        assert r["modes"] == [{"low_latency": 1}, {"low_latency": 1, "normal": 1},
                              {"low_latency": 2, "normal": 1}]
        # the layer has a shared expert: a hooked dispatch (it runs between send and receive,
        # two launches), then the blocking combine (one); normal mode launches none of them
        assert r["ll_launches"] == [3, 0, 3]
        ll, normal, again = r["outs"]
        ref = ll.float()
        atol, rtol = tolerance_for(ref, cfg.dtype)
        torch.testing.assert_close(normal[: per_dp[0]].float(), ref, atol=atol, rtol=rtol,
                                   msg=lambda m: f"rank {rank}: {m}")
        assert torch.equal(again, ll)  # the low-latency buffer was cleaned after normal mode
    for i, n in enumerate(per_dp):
        assert_matches_reference([{"out": r["outs"][i]} for r in results], layout, cfg, n, quant)


@pytest.mark.multirank
def test_auto_takes_one_mode_on_every_rank(rank_pool):
    """DP groups of different sizes: one fits the low-latency buffers, the other does not; all
    ranks take normal mode (the two modes are different collectives)."""
    layout, cfg, cap = ParallelLayout(2, 1, True), _cfg(), 8
    results = rank_pool(2).run(ht_rank_fns.run_auto_calls, layout, cfg, [[3, cap + 4]], cap)
    assert [r["modes"] for r in results] == [[{"normal": 1}], [{"normal": 1}]]
    assert_matches_reference([{"out": r["outs"][0]} for r in results], layout, cfg, [3, cap + 4])


# -- deepep_auto built with a link: the mode the time model prices faster ----------------------

#: NVLink at 2 GB/s and DeepEP's test SMs: a link slow enough that the time model's crossover of
#: _link_cfg()'s layer at EP 2 and 4 falls inside a 16-token low-latency capacity.
SLOW_LINK = LinkModel(nvlink_gbps=2.0, sms=24)
LINK_CAPACITY = 16


def _link_cfg() -> MoEConfig:
    return _cfg(num_experts=16, num_topk=8)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", [ParallelLayout(2, 1, True), ParallelLayout(2, 2, True)],
                         ids=["ep2", "ep4-tp2"])
@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
def test_auto_with_a_link_takes_the_faster_mode(rank_pool, quant, layout):
    """A layer built with a link takes, at every batch (both sides of the crossover, ragged DP
    groups, the capacity and beyond), the mode the time model prices faster for the largest
    rank's rows, the same on every rank; each call equals the single-process reference; the
    INFO line names the threshold and why."""
    from moe_plugins.planner.crossover import mode_crossover

    cfg, ep = _link_cfg(), layout.world_size
    c = mode_crossover(cfg, ParallelLayout(ep, 1, True), quant, get_backend("deepep_ll"),
                       get_backend("deepep_ht"), SLOW_LINK).tokens
    assert c is not None and 2 < c < LINK_CAPACITY, c
    # rows per rank on each DP group's ranks, per call (a DP group's tokens: rows x tp)
    calls = [[1, 1], [c - 1, c - 1], [c, c], [c - 1, 0], [2, c], [c + 1, 3],
             [LINK_CAPACITY, 1], [LINK_CAPACITY + 1, 0], [c - 1, c - 2]]
    want = [faster_mode(cfg, ep, max(rows), quant, SLOW_LINK, LINK_CAPACITY) for rows in calls]
    assert {"low_latency", "normal"} == set(want[:-2]), want  # both sides, within the capacity
    per_dp = [[n * layout.tp for n in rows] for rows in calls]
    results = rank_pool(ep).run(ht_rank_fns.run_auto_calls, layout, cfg, per_dp, LINK_CAPACITY,
                                quant, None, 0, SLOW_LINK)
    for rank, r in enumerate(results):
        assert r["threshold"] == c - 1, (rank, r["threshold"], c)
        taken = [next(m for m in now if now[m] != before.get(m, 0))
                 for before, now in zip([{}] + r["modes"], r["modes"])]
        assert taken == want, (rank, taken, want)
    for i, n in enumerate(per_dp):
        assert_matches_reference([{"out": r["outs"][i]} for r in results], layout, cfg, n, quant)
    info = [m for r in results for m in r["logs"] if "time model" in m]
    assert info and all(f"low-latency up to {c - 1} tokens per rank" in m
                        and f"deepep_ht below deepep_ll from {c} rows per rank" in m
                        and "link (link flags)" in m for m in info), info


@pytest.mark.multirank
@pytest.mark.parametrize("per_rank, named", [
    ([{"link": SLOW_LINK}, {}], "DeepEPAutoOptions.link (1: given, 0: none) (EP rank 0: 1, "
                                "EP rank 1: 0"),
    ([{"ll_max_tokens_per_rank": 8}, {"ll_max_tokens_per_rank": 16}],
     "low-latency capacity in tokens per rank (DeepEPAutoOptions.ll_max_tokens_per_rank, else "
     "max_tokens_per_rank) (EP rank 0: 8, EP rank 1: 16"),
    ([{"link": SLOW_LINK, "ll_max_tokens_per_rank": LINK_CAPACITY},
      {"link": LinkModel(nvlink_gbps=400.0, sms=24), "ll_max_tokens_per_rank": LINK_CAPACITY}],
     "low-latency threshold in tokens per rank (from the layer config and the link) (EP rank "
     "0: "),
    ([{"allow_nvlink": False}, {"allow_nvlink": True}],
     "DeepEPAutoOptions.allow_nvlink (1: on, 0: off) (EP rank 0: 0, EP rank 1: 1")],
    ids=["link-on-one-rank", "capacity", "links-with-other-thresholds", "allow_nvlink"])
def test_auto_refuses_on_every_rank_what_the_ranks_do_not_agree_on(rank_pool, per_rank, named):
    """What every rank must hold alike (a link or none, the low-latency capacity, NVLink, the
    threshold) is checked once at construction, on every rank: each refuses with a ValueError
    naming the value and each rank's, at once (not at the process-group timeout of a first
    call whose ranks took different collectives). Then the same layer built alike works."""
    layout, cfg = ParallelLayout(2, 1, True), _link_cfg()
    results = rank_pool(2).run(ht_rank_fns.build_auto_per_rank, layout, cfg, per_rank)
    for rank, r in enumerate(results):
        assert "error" in r, (rank, r)
        assert f"deepep_auto: the EP ranks were built with different {named}" in r["error"], r
        assert f"this is EP rank {rank}" in r["error"] and "same layer config" in r["error"]
    same = rank_pool(2).run(ht_rank_fns.build_auto_per_rank, layout, cfg, [per_rank[0]] * 2)
    assert [r.get("threshold") for r in same] == [same[0]["threshold"]] * 2, same


@pytest.mark.multirank
def test_auto_hands_float32_scales_in_both_modes_to_packed_scale_experts(rank_pool):
    """post_init_setup with experts that could read packed UE8M0 scales is not forwarded to
    the low-latency half: both modes hand them float32 [.., hidden // 128] scales (normal mode
    has no other format), and the INFO line says so."""
    layout, cfg, cap = ParallelLayout(2, 1, True), _cfg(), 4
    results = rank_pool(2).run(ht_rank_fns.auto_scales_after_packed_experts, layout, cfg, cap)
    for r in results:
        assert r["modes"] == {"low_latency": 1, "normal": 1}
        assert r["scales"] == {cap: ("torch.float32", cfg.hidden // 128),
                               cap + 1: ("torch.float32", cfg.hidden // 128)}
    assert any("both modes hand it float32 scales" in m for r in results for m in r["logs"])


@pytest.mark.multirank
def test_auto_prefill_hint_takes_normal_mode(rank_pool):
    """The engine's hint (vLLM: its forward context) decides without a collective: a prefill pass
    takes normal mode even when it fits; a decode pass of the same size takes low-latency."""
    layout, cfg, cap = ParallelLayout(2, 1, True), _cfg(), 8
    hints = [BatchHint(4, prefill=True), BatchHint(4, prefill=False), None]
    results = rank_pool(2).run(ht_rank_fns.run_auto_calls, layout, cfg, [[4, 4]] * 3, cap, BF16,
                               hints)
    for r in results:
        assert r["modes"][-1] == {"normal": 1, "low_latency": 2}
        assert r["modes"][0] == {"normal": 1}
    assert_matches_reference([{"out": r["outs"][0]} for r in results], layout, cfg, 4)


@pytest.mark.multirank
def test_auto_rejects_a_hint_smaller_than_the_batch(rank_pool):
    layout, cfg = ParallelLayout(2, 1, True), _cfg()
    try:
        with pytest.raises(RankError) as e:
            rank_pool(2).run(ht_rank_fns.run_auto_calls, layout, cfg, [[6, 6]], 8, BF16,
                             [BatchHint(4)])
    finally:  # both ranks refused the same call: the (cached) EP group may be used again
        rank_pool(2).run(ht_rank_fns.forget_faults, layout)
    assert e.value.exc_type == "ValueError" and "hint says at most 4" in e.value.message


@pytest.mark.multirank
def test_a_refused_capture_leaves_the_layer_usable(rank_pool):
    """deepep_ht cannot be captured: every rank refuses alike before sending, and the next
    eager call on the same layer and group is right (not LayerBrokenError)."""
    layout, cfg = ParallelLayout(2, 1, True), _cfg()
    results = rank_pool(2).run(ht_rank_fns.refused_capture_then_eager, layout, cfg, 6)
    for r in results:
        assert "cannot be captured in a CUDA graph" in r["refusal"]
        assert "deepep_auto" in r["refusal"]
    assert_matches_reference([{"out": r["out"]} for r in results], layout, cfg, 6)


# -- buffers ------------------------------------------------------------------------------------

@pytest.mark.multirank
def test_buffers_are_sized_from_deepep_hints(rank_pool):
    """deepep_ht: NVLink bytes = the larger dispatch/combine config hint, no RDMA (intranode),
    normal mode only. deepep_auto: one low-latency buffer with those NVLink bytes too."""
    from tests.emulation.deep_ep import Buffer

    layout, cfg = ParallelLayout(4, 1, True), _cfg()
    pool = rank_pool(4)
    ht = pool.run(ht_rank_fns.build_ht, "deepep_ht", layout, cfg)
    auto = pool.run(ht_rank_fns.build_ht, "deepep_auto", layout, cfg)
    hint = max(c.get_nvl_buffer_size_hint(cfg.hidden * 2, 4)
               for c in (Buffer.get_dispatch_config(4), Buffer.get_combine_config(4)))
    # config.hpp by hand, 4 ranks, hidden 2048 bf16, dispatch Config(20, 6, 256, 6, 128):
    # 10 channels x 4 ranks x (5 ints + 256 x (4096 + 8 + 128 x (8 + 4 + 4)) bytes)
    assert hint == -(-(40 * 5 * 4 + 40 * 256 * (4096 + 8 + 128 * 16)) // 128) * 128
    for r in ht:
        assert r == dict(num_nvl_bytes=hint, num_rdma_bytes=0, low_latency_mode=False,
                         num_qps_per_rank=Buffer.num_sms, use_fabric=False)
    for r in auto:
        assert r["num_nvl_bytes"] == hint and r["low_latency_mode"] and r["num_rdma_bytes"] > 0


@pytest.mark.multirank
@pytest.mark.parametrize("shape,mnnvl,fabric", [("v1", False, True), ("legacy", True, True),
                                                ("legacy", False, False)],
                         ids=["v1", "legacy-with-mnnvl", "legacy-without"])
def test_use_fabric_follows_the_deepep_line(rank_pool, shape, mnnvl, fabric):
    """DeepEPHTOptions(use_fabric=True): 567632d's constructor takes it; the current line's has
    no such switch and allocates through the fabric API exactly with allow_mnnvl, so there it
    is dropped with allow_mnnvl and refused without (on every rank, before the buffer's
    collectives)."""
    from moe_plugins.all2all.deepep_ht import DeepEPHTOptions

    options = DeepEPHTOptions(allow_mnnvl=mnnvl, use_fabric=True)
    args = (in_deep_ep_shape, shape, ht_rank_fns.build_ht, "deepep_ht", ParallelLayout(2, 1, True),
            _cfg(), options)
    if not fabric:
        with pytest.raises(RankError) as e:
            rank_pool(2).run(*args)
        assert e.value.exc_type == "ValueError"
        assert "has no use_fabric" in e.value.message and "allow_mnnvl=True" in e.value.message
        return
    assert all(r["use_fabric"] for r in rank_pool(2).run(*args))


@pytest.mark.multirank
def test_deterministic_torch_is_refused_on_the_current_deepep_line(rank_pool):
    """The current line's dispatch asserts check_torch_deterministic(): deepep_ht refuses the
    call on every rank first, with the fix."""
    errors = rank_pool(2).run(in_deep_ep_shape, "legacy", ht_rank_fns.deterministic_layer_call,
                              "deepep_ht", ParallelLayout(2, 1, True), _cfg(), S.LOCAL, 3)
    for err_type, msg in errors:
        assert err_type == "ValueError" and "fill_uninitialized_memory = False" in msg


# -- registry rows and refusals -------------------------------------------------------------

def test_registry_rows():
    for name in BACKENDS:
        spec = get_backend(name)
        assert spec.ep_dp_tp_support == (True, True, True, True)
        assert spec.quants == frozenset({QuantScheme.NONE, QuantScheme.FP8_BLOCK128})
        assert spec.capabilities.activation_format is ActivationFormat.STANDARD
        assert spec.required[0].module == "deep_ep" and spec.needs_cuda
    # auto-selection keeps deepep_ll first where it applies
    assert get_backend("deepep_ll").priority > get_backend("deepep_auto").priority \
        > get_backend("deepep_ht").priority


@pytest.mark.parametrize("backend", BACKENDS)
def test_refusals(backend):
    spec = get_backend(backend)
    ok = ParallelLayout(2, 2, True)
    assert refusal_reason(spec, ok, QuantScheme.FP8_BLOCK128, False, torch.bfloat16) is None
    assert "EP size 3" in refusal_reason(spec, ParallelLayout(3, 1, True), QuantScheme.NONE, False)
    assert "EP size 1" in refusal_reason(spec, ParallelLayout(1, 1, True), QuantScheme.NONE, False)
    assert "nvfp4" in refusal_reason(spec, ok, QuantScheme.NVFP4, False)
    assert "float32" in refusal_reason(spec, ok, QuantScheme.NONE, False, torch.float32)
    with pytest.raises(ValueError, match="EP size 3"):
        select_backend(ParallelLayout(3, 1, True), QuantScheme.NONE, backend,
                       require_available=False)


@pytest.mark.multirank
@pytest.mark.parametrize("backend,kw,error,match", [
    ("deepep_ht", dict(num_topk=33, num_experts=64), "ValueError", "limit of 32"),
    ("deepep_ht", dict(hidden=2052), "ValueError", "multiple of 16"),
    ("deepep_auto", dict(num_topk=12, num_experts=16), "ValueError", "limit of 11"),
    ("deepep_ht", dict(num_experts=512), "ValueError", "128"),
])
def test_layer_limits_are_clear_errors(rank_pool, backend, kw, error, match):
    with pytest.raises(RankError) as e:
        rank_pool(2).run(ht_rank_fns.build_ht, backend, ParallelLayout(2, 1, True), _cfg(**kw))
    assert e.value.exc_type == error and match in e.value.message


@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_options_type_is_a_type_error(rank_pool, backend):
    with pytest.raises(RankError) as e:
        rank_pool(2).run(ht_rank_fns.build_ht, backend, ParallelLayout(2, 1, True), _cfg(),
                         object())
    assert e.value.exc_type == "TypeError" and "backend_options" in e.value.message


# -- the plan counts normal mode as measured ----------------------------------------------------

@pytest.mark.multirank
@pytest.mark.parametrize("layout,strategy", [LAYER_CASES[0], LAYER_CASES[1]], ids=LAYER_IDS[:2])
@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
def test_plan_equals_measured_normal_mode(rank_pool, quant, layout, strategy):
    """deepep_ht: one row per (token, destination rank); with the routing prepare received,
    the plan's rows and bytes are exactly what the backend counted."""
    from moe_plugins.planner.plan import plan_layer
    from moe_plugins.planner.traffic import Routing

    cfg = _cfg(hidden=256, intermediate=16, shared_intermediate=32)
    tokens = (5,) * layout.dp
    results = rank_pool(layout.world_size).run(ht_rank_fns.measure_deepep_layer, layout, cfg,
                                               strategy, tokens, quant, 0, "deepep_ht")
    assert_matches_reference(results, layout, cfg, list(tokens), quant)
    routing = Routing.from_topk_ids([r["prepared_topk_ids"] for r in results], cfg.num_experts)
    plan = plan_layer(cfg, layout, tokens, get_backend("deepep_ht"), quant, routing=routing)
    assert not plan.wire.per_pair
    for rp, res in zip(plan.strategy(strategy).ranks, results):
        st = res["stats"]
        assert rp.pairs == st["pairs"]
        for planned, key in ((rp.rows, "rows"), (rp.act_bytes, "act_bytes"),
                             (rp.sf_bytes, "sf_bytes"), (rp.meta_bytes, "meta_bytes"),
                             (rp.combine_bytes, "combine_bytes")):
            assert planned.is_exact and planned.min == st[key], (rp.rank, key, planned, st[key])


def test_plan_counts_deepep_auto_in_the_mode_it_takes():
    from moe_plugins.planner.plan import plan_layer
    from moe_plugins.prepare_finalize.deepep_auto import PLANNED_CAPACITY

    layout, cfg, spec = ParallelLayout(2, 2, True), _cfg(), get_backend("deepep_auto")
    small = plan_layer(cfg, layout, 2 * PLANNED_CAPACITY, spec)  # 256 owned rows per rank
    large = plan_layer(cfg, layout, 2 * PLANNED_CAPACITY + 1, spec)
    assert small.wire.per_pair and not large.wire.per_pair
    rp = small.recommended.ranks[0]
    assert rp.rows.is_exact and rp.rows.min == PLANNED_CAPACITY * cfg.num_topk


@pytest.mark.multirank
def test_demo_counts_the_calls_of_each_mode(rank_pool):
    """The demo's rank function reports deepep_auto's calls per mode (the counted call plus the
    timed ones); the CLI prints them under its table."""
    layout, cfg = ParallelLayout(2, 1, True), _cfg(hidden=256, intermediate=16,
                                                   shared_intermediate=32)
    results = rank_pool(2).run(ht_rank_fns.demo_rank, layout, cfg, "deepep_auto", S.LOCAL, 4,
                               BF16, 0, 2)
    # the demo sizes the buffers for its batch, so every call fits the low-latency side
    assert all(r["modes"] == {"low_latency": 3} for r in results)


# -- the call bound over normal mode's host wait --------------------------------------------------
_HOST_WAIT_CHILD = """
import ctypes, faulthandler, os, sys, time
import torch, torch.distributed as dist
from moe_plugins.all2all.deepep_auto import DeepEPAutoOptions
from moe_plugins.groups import cached_dist_context
from moe_plugins.layout import ParallelLayout
from moe_plugins.overlap import OverlapConfig
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import get_backend
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.runner.layer import MoELayer
from moe_plugins.runner.model import MoEWeights
from tests.backends.test_deepep_ht import _cfg
from tests.emulation import installed

backend, store, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
arms = []
real_arm = faulthandler.dump_traceback_later
faulthandler.dump_traceback_later = lambda *a, **k: (arms.append(a), real_arm(*a, **k))
cfg = _cfg()
with installed("deep_ep"):
    import deep_ep
    dispatch = deep_ep.Buffer.dispatch

    def holding(self, *a, **k):  # DeepEP's host wait: a C call that keeps the interpreter lock
        # when the wait began (CLOCK_MONOTONIC: one clock for every process) and the timer armed
        print("HOLDING", time.monotonic(), arms[-1][0] if arms else None, flush=True)
        ctypes.PyDLL(None).sleep(30)
        return dispatch(self, *a, **k)

    deep_ep.Buffer.dispatch = holding
    options = DeepEPAutoOptions(ll_max_tokens_per_rank=8) if backend == "deepep_auto" else None
    layer = MoELayer(MoEWeights.random(cfg, 0), cached_dist_context(ParallelLayout(2, 1, True)),
                     get_backend(backend), None, QuantSpec(), OverlapConfig(overlap=False),
                     max_tokens_per_rank=64, backend_options=options, call_timeout_s=1.0)
    if backend == "deepep_auto":
        layer(demo_inputs(cfg, 4, rank, 0))  # low-latency mode
        print("LOW-LATENCY CALL, TIMERS ARMED:", len(arms), flush=True)
    t0 = time.monotonic()
    layer(demo_inputs(cfg, 32, rank, 0))  # normal mode
    print("RETURNED", round(time.monotonic() - t0, 1), flush=True)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_normal_mode_host_wait_is_ended_by_the_lock_free_timer(backend, tmp_path):
    """EP 2, the call bound (1 s) over normal mode's dispatch, whose host wait keeps the
    interpreter lock (the emulated dispatch holds it 30 s in a C call, as DeepEP's does while
    its peers' counts do not come): the watchdog thread cannot run, and faulthandler's timer,
    armed by the backend around that library call alone (for what is left of the bound), ends
    each rank within the bound plus slack of the wait's start, with the traceback of the wait.
    deepep_auto's low-latency call arms nothing (its mode is chosen inside the call)."""
    import os
    import subprocess
    import sys
    import time

    from moe_plugins.callbound.settings import POLL_S

    bound_s, hold_s, slack_s = 1.0, 30.0, 10.0  # slack: a loaded host's exit; far below hold_s
    env = dict(os.environ, MOE_PLUGINS_FIRST_CALL_TIMEOUT_S="1")
    ranks = [subprocess.Popen([sys.executable, "-c", _HOST_WAIT_CHILD, backend,
                               str(tmp_path / "store"), str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env,
                              cwd=str(Path(__file__).resolve().parents[2])) for r in (0, 1)]
    ended: list[Optional[float]] = [None, None]
    try:
        give_up = time.monotonic() + 120
        while None in ended and time.monotonic() < give_up:
            for r, p in enumerate(ranks):
                if ended[r] is None and p.poll() is not None:
                    ended[r] = time.monotonic()
            time.sleep(0.02)
        outs = [p.communicate(timeout=10) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    for r, (p, (out, err)) in enumerate(zip(ranks, outs)):
        assert p.returncode == 1 and "RETURNED" not in out, (p.returncode, out, err[-3000:])
        held = [line.split() for line in out.splitlines() if line.startswith("HOLDING")]
        assert len(held) == 1, out
        began, armed = float(held[0][1]), held[0][2]
        # the timer was armed before the wait, for at most the bound (what is left of it)
        assert armed != "None" and 0 < float(armed) <= bound_s + POLL_S, out
        # it ended the wait: faulthandler's dump of the waiting frame, then exit status 1
        assert "Timeout (" in err and "in _dispatch" in err, err[-3000:]
        assert ended[r] is not None and ended[r] - began < bound_s + slack_s < hold_s, \
            (ended[r], began)
        if backend == "deepep_auto":
            assert "LOW-LATENCY CALL, TIMERS ARMED: 0" in out, out


@pytest.mark.multirank
def test_auto_choice_collective_without_a_peer_is_the_groups_collective_error(rank_pool):
    """deepep_auto's mode choice (an all-reduce of the token counts, without an engine's hint)
    with a peer that never calls: the waiting rank raises the group's CollectiveError naming the
    choice, the layer and the peer, within the group's timeout, not a bare transport error."""
    timeout_s = 4.0
    results = rank_pool(2).run(ht_rank_fns.auto_choice_without_a_peer, ParallelLayout(2, 1, True),
                               _cfg(), 1, timeout_s)
    err_type, err, seconds = results[0]["error"]
    assert err_type == "CollectiveError", err
    assert "mode choice all-reduce" in err and "deepep_auto layer" in err, err
    assert "ranks [0, 1]" in err and f"timeout of {timeout_s:g} s" in err, err
    assert seconds < 3 * timeout_s, seconds


def test_auto_link_and_kernels_agree_on_nvlink():
    """A link whose ``ll_nvlink`` differs from the kernels' ``allow_nvlink`` is refused when the
    options are made (the time model would price transfers the kernels do not make); the
    engine's options (vLLM's ``--additional-config moe_plugins.link``) keep the kernels as the
    link says, so ``{"ll_nvlink": false}`` turns NVLink off in the buffer too."""
    from moe_plugins.all2all.deepep_auto import DeepEPAutoManager, DeepEPAutoOptions

    off = LinkModel(nvlink_gbps=2.0, sms=24, ll_nvlink=False)
    with pytest.raises(ValueError, match=r"link.ll_nvlink=False but allow_nvlink=True.*"
                                         r"allow_nvlink=False\) keeps the kernels"):
        DeepEPAutoOptions(link=off)
    assert DeepEPAutoOptions(link=off, allow_nvlink=False).allow_nvlink is False
    for link in (off, SLOW_LINK):
        options = DeepEPAutoManager.engine_options(None, link=link)
        assert options.link is link and options.allow_nvlink is link.ll_nvlink
    assert DeepEPAutoManager.engine_options(None) is None
