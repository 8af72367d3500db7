"""Backend flashinfer_nvlink_two_sided against the emulated flashinfer API (both the 0.7.2.post1
MnnvlMoe API and the 0.7.4 moe_ep API), on real gloo ranks, compared with the single-process
reference; plus its capability row, and what happens without flashinfer."""
from __future__ import annotations

import pytest
import torch

from tests.backends import flashinfer_two_sided_ranks as fi
from tests.checks import assert_matches_reference
from moe_plugins.all2all.flashinfer_nvlink_two_sided import FlashInferTwoSidedOptions, TwoSidedApi
from tests.emulation import flashinfer_two_sided as emu
from moe_plugins.cli import main as cli_main
from moe_plugins.config import DispatchConfig
from moe_plugins.groups import DistContext
from moe_plugins.runner.launch import RankError
from moe_plugins.layout import ParallelLayout
from moe_plugins.config import MoEConfig
from moe_plugins.quant import NVFP4_BLOCK, QuantScheme, QuantSpec
from moe_plugins.registry import (BACKEND_EP_DP_TP_SUPPORT, BACKEND_SUPPORTED_QUANTS,
                                  get_backend, select_backend)
from moe_plugins.strategy import ReductionStrategy
from moe_plugins.prepare_finalize.flashinfer_nvlink_two_sided import SPEC

NAME = "flashinfer_nvlink_two_sided"
EP2 = ParallelLayout(2, 1, True)
EP4 = ParallelLayout(4, 1, True)
# (emulated flashinfer version, the API `auto` must pick there)
FLAVORS = [("0.7.2.post1", "mnnvl_moe"), ("0.7.4", "moe_ep")]
FP8, NVFP4 = QuantScheme.FP8_BLOCK128, QuantScheme.NVFP4


def _cfg(dtype: torch.dtype = torch.float32, **kw: object) -> MoEConfig:
    return MoEConfig(**{"hidden": 256, "num_experts": 8, "num_topk": 2, "intermediate": 64,
                        "shared_intermediate": 128, "dtype": dtype, **kw})


def _scale_sends(comm: list[dict], x_dtype: torch.dtype) -> list[dict]:
    """moe_comm calls of the dispatch that moved something other than the activations."""
    return [c for c in comm if c["dtype"] != x_dtype]


# ---- the layer, every quant, both APIs ---------------------------------------------------------
QUANTS = fi.QUANTS


@pytest.mark.multirank
@pytest.mark.parametrize("name,quant,dtype", QUANTS, ids=[q[0] for q in QUANTS])
@pytest.mark.parametrize("flavor,api", FLAVORS, ids=[f[0] for f in FLAVORS])
def test_layer_matches_reference(rank_pool, flavor, api, name, quant, dtype):
    cfg = _cfg(dtype)
    results = rank_pool(2).run(fi.run_layer, EP2, cfg, 9, quant, flavor)
    assert_matches_reference(results, EP2, cfg, 9, quant)
    for r in results:
        assert r["api"] == api and r["strategy"] is ReductionStrategy.LOCAL
        assert r["pairs"] == 9 * cfg.num_topk and 9 <= r["rows_sent"] <= 9 * 2
        # scales cross the all-to-all exactly when the activations are quantized on the wire
        assert (r["sf_bytes"] > 0) == quant.quantized_on_wire
        combine = 1
        assert len(r["comm"]) == (2 if quant.quantized_on_wire else 1) + combine
        assert len(r["prepare"]) == 1 and r["prepare"][0]["with_scales"]  # the router weights


@pytest.mark.multirank
@pytest.mark.parametrize("num_tokens", [0, 1, 5])
def test_four_ranks_ragged(rank_pool, num_tokens):
    """Four ranks, nvfp4; one token (most ranks receive nothing) and none at all."""
    cfg, quant = _cfg(), QuantSpec(NVFP4)
    results = rank_pool(4).run(fi.run_layer, EP4, cfg, num_tokens, quant, "0.7.2.post1")
    assert_matches_reference(results, EP4, cfg, num_tokens, quant)


# ---- prepare: x, x_sf, swizzle, and what travels -----------------------------------------------
R = 2 * 8  # receive rows: num_ranks * max_tokens_per_rank
SWIZZLED_NVFP4_SF = (-(-R // 128) * 128) * (-(-(256 // NVFP4_BLOCK) // 4) * 4)
X_SF_CASES = [
    # quant, swizzle option, x dtype and columns, x_sf (dtype, shape) or None, swizzled
    ("none", QuantSpec(), True, (torch.float32, 256), None, False),
    ("fp8", QuantSpec(FP8), True, (torch.float8_e4m3fn, 256), (torch.float32, (R, 2)), False),
    ("nvfp4-swizzled", QuantSpec(NVFP4), True, (torch.uint8, 128),
     (torch.float8_e4m3fn, (SWIZZLED_NVFP4_SF,)), True),
    ("nvfp4-rowaligned", QuantSpec(NVFP4), False, (torch.uint8, 128),
     (torch.float8_e4m3fn, (R, 16)), False),
    ("fp8-deferred", QuantSpec(FP8, True), True, (torch.float32, 256), None, False),
    ("nvfp4-deferred", QuantSpec(NVFP4, True), True, (torch.float32, 256), None, False),
]


@pytest.mark.multirank
@pytest.mark.parametrize("flavor,api", FLAVORS, ids=[f[0] for f in FLAVORS])
@pytest.mark.parametrize("case,quant,swizzle,x,sf,swizzled", X_SF_CASES,
                         ids=[c[0] for c in X_SF_CASES])
def test_prepare_x_sf(rank_pool, flavor, api, case, quant, swizzle, x, sf, swizzled):
    cfg = _cfg(shared_intermediate=0)  # routed only: the finalize output is the reference
    options = FlashInferTwoSidedOptions(nvfp4_swizzled_sf=swizzle)
    results = rank_pool(2).run(fi.run_routed, EP2, cfg, 8, quant, flavor, options)
    assert_matches_reference(results, EP2, cfg, 8, quant)
    for r in results:
        assert r["api"] == api
        assert (r["x_dtype"], r["x_shape"]) == (x[0], (R, x[1]))
        assert r["x_sf"] == sf and r["x_sf_swizzled"] is swizzled
        assert r["topk_ids"].dtype == torch.int64 and r["topk_ids"].shape == (R, cfg.num_topk)
        assert int(r["topk_ids"].min()) >= -1 and int(r["topk_ids"].max()) < 4
        scale_sends = _scale_sends(r["dispatch_comm"], x[0])
        if sf is None:
            assert scale_sends == [] and len(r["dispatch_comm"]) == 1 and r["sf_bytes"] == 0
        else:
            assert len(scale_sends) == 1 and len(r["dispatch_comm"]) == 2 and r["sf_bytes"] > 0
            # fp8 scales are 8 bytes a row at hidden 256: padded to the kernels' 16-byte rows
            assert scale_sends[0]["cols"] * sf[0].itemsize % 16 == 0


@pytest.mark.multirank
@pytest.mark.parametrize("flavor,api", FLAVORS, ids=[f[0] for f in FLAVORS])
def test_deferred_nvfp4_with_swizzle_runs_the_whole_prepare(rank_pool, flavor, api):
    """Regression: nvfp4 with swizzled scales and defer_input_quant has no scales (x_sf is None);
    an unguarded scale all-to-all or swizzle crashed on it. Deferred quant must send the raw
    activations only and return x_sf None, and the experts then match the reference."""
    cfg, quant = _cfg(shared_intermediate=0), QuantSpec(NVFP4, defer_input_quant=True)
    options = FlashInferTwoSidedOptions(nvfp4_swizzled_sf=True)
    results = rank_pool(2).run(fi.run_routed, EP2, cfg, 8, quant, flavor, options)
    assert_matches_reference(results, EP2, cfg, 8, quant)
    for r in results:
        assert r["x_sf"] is None and not r["x_sf_swizzled"] and r["x_dtype"] == torch.float32
        assert [c["dtype"] for c in r["dispatch_comm"]] == [torch.float32] and r["sf_bytes"] == 0


# ---- finalize, lifecycle, errors ---------------------------------------------------------------
@pytest.mark.multirank
@pytest.mark.parametrize("flavor", [f[0] for f in FLAVORS])
def test_row_scatter_adds_into_the_buffer_it_was_given(rank_pool, flavor):
    results = rank_pool(2).run(fi.row_scatter, EP2, _cfg(), 7, flavor)
    for r in results:
        assert r["same_buffer"]
        torch.testing.assert_close(r["row_scatter"], r["partial"] + r["plain"], atol=1e-6, rtol=1e-6)


@pytest.mark.multirank
@pytest.mark.parametrize("flavor,api", FLAVORS, ids=[f[0] for f in FLAVORS])
def test_workspaces_are_lazy_shared_and_freed(rank_pool, flavor, api):
    results = rank_pool(2).run(fi.lifecycle, EP2, _cfg(), flavor)
    for r in results:
        assert r["after_construction"] == 0
        assert r["after_first_dispatch"] == r["after_second_dispatch"] == 2  # FIFO + prepare
        assert r["after_first_destroy"] == 2 and r["outputs_equal"]
        assert "destroyed" in r["use_after_destroy"] and r["broken_after_use"]
        if api == "mnnvl_moe":  # ours to free: MnnvlMoe's process-wide cache is released
            assert r["after_last_destroy"] == 0 and r["mnnvl_moe_cache_cleared"]
        else:  # moe_ep keeps its workspaces for the process's later instances
            assert r["after_last_destroy"] == 2


@pytest.mark.multirank
@pytest.mark.parametrize("flavor,api", [("0.7.2.post1", "mnnvl_moe"), ("0.7.2.post1", "moe_ep")])
def test_mnnvl_moe_cache_serves_one_ep_group_per_process(rank_pool, flavor, api):
    # 0.7.2.post1's moe_ep takes MnnvlMoe's one-mapping cache too: ours refuses the second group
    # (flashinfer's own check is a bare assert) and serves it once the first group went
    for r in rank_pool(2).run(fi.second_mapping, EP2, _cfg(), flavor, api):
        assert "one EP mapping per process" in r["refused"] and r["broken"]
        assert "flashinfer-python 0.7.4" in r["refused"]
        assert r["after_first_group_went"]


@pytest.mark.multirank
def test_moe_ep_of_0_7_4_serves_two_ep_groups_at_once(rank_pool):
    for r in rank_pool(2).run(fi.second_mapping, EP2, _cfg(), "0.7.4", "moe_ep"):
        assert r["refused"] is None and r["both_at_once"]


@pytest.mark.multirank
def test_mnnvl_moe_and_moe_ep_of_0_7_2_do_not_share_the_cache(rank_pool):
    for r in rank_pool(2).run(fi.mixed_apis, EP2, _cfg()):
        assert "on the mnnvl_moe API, whose mapping differs" in r["refused"]
        assert r["live_with_mnnvl"] == 2  # the refusal allocated nothing
        # the MnnvlMoe layer went with the cache; the moe_ep layer then made it anew
        assert r["after_mnnvl_went"] == 0 and r["moe_ep_right"]
        assert r["after_both_went"] == 0 and r["cache_cleared"]


@pytest.mark.multirank
@pytest.mark.parametrize("flavor", [f[0] for f in FLAVORS])
def test_reset_after_a_failed_call(rank_pool, flavor):
    cfg = _cfg(shared_intermediate=0)
    results = rank_pool(2).run(fi.reset_after_error, EP2, cfg, flavor)
    assert all("abandoned between its dispatch and its combine" in r["broken"] for r in results)
    assert_matches_reference(results, EP2, cfg, 4, QuantSpec())


@pytest.mark.multirank
@pytest.mark.parametrize("flavor", [f[0] for f in FLAVORS])
def test_receivers_issue_the_communication(rank_pool, flavor):
    """No receive hook: prepare_async/finalize_async send nothing, their receivers do it all, so
    a shared expert the layer forks after prepare_async overlaps with dispatch, experts, combine."""
    for r in rank_pool(2).run(fi.issue_order, EP2, _cfg(), flavor):
        assert r["prepare_async"] == (0, 0, None) and r["finalize_async"] == (0, 0, None)
        assert r["prepare_receiver"][0] > 0 and r["prepare_receiver"][1] == 3  # prepare, x, x_sf
        assert r["finalize_receiver"][0] > 0 and r["finalize_receiver"][1] == 1  # combine
        assert r["supports_async"] is False


CALL_ERRORS = [
    ("too_many_tokens", "ValueError", "max_tokens_per_rank=4"),
    ("mismatched_tokens", "ValueError", "(2, 256)"),
    ("prepare_twice", "RuntimeError", "the previous call is in flight"),
    ("finalize_output_shape", "ValueError", "(3, 256)"),
]


@pytest.mark.multirank
@pytest.mark.parametrize("case,exc,text", CALL_ERRORS, ids=[c[0] for c in CALL_ERRORS])
def test_call_errors(rank_pool, case, exc, text):
    with pytest.raises(RankError) as e:
        rank_pool(2).run(fi.call_error, EP2, _cfg(), case)
    assert e.value.exc_type == exc and text in e.value.message


@pytest.mark.multirank
def test_refused_workspace_says_where_and_why(rank_pool):
    with pytest.raises(RankError) as e:
        rank_pool(2).run(fi.workspace_refused, EP2, _cfg())
    msg = e.value.message
    assert e.value.exc_type == "RuntimeError"
    for text in ("MNNVL workspaces on EP rank", "of 2", "gpus_per_node=", "FABRIC",
                 "CUDA_ERROR_NOT_SUPPORTED (cuMemCreate)", "POSIX file descriptors"):
        assert text in msg, text


@pytest.mark.multirank
def test_handle_exchange_comm(rank_pool):
    for r in rank_pool(2).run(fi.handle_exchange_comm):
        assert r["gathered"] == ({"rank": 0, "handle": b"hhh"}, {"rank": 1, "handle": b"hhhh"})
        assert r["bcast"] == ("from root", 1) and r["split_is_self"]
        assert r["refused"] is not None and "not supported" in r["refused"]


def _ctx(layout: ParallelLayout) -> DistContext:
    """No process group: every check below fails before the manager touches one."""
    return DistContext(layout, 0, None, None, torch.device("cpu"))


def _dcfg(**kw: object) -> DispatchConfig:
    return DispatchConfig(**{"num_experts": 8, "hidden": 256, "num_topk": 2, **kw})


CONSTRUCTION_ERRORS = [
    ("one_rank", ParallelLayout(1, 1, True), _dcfg(), "EP group of >= 2 ranks"),
    ("ep_off", ParallelLayout(1, 4, False), _dcfg(), "EP size 1"),
    ("experts_not_multiple_of_4", EP2, _dcfg(num_experts=6), "divisible by 4, got 6"),
    ("experts_not_divisible_by_ep", ParallelLayout(8, 1, True), _dcfg(num_experts=12),
     "not divisible by the EP size 8"),
    ("topk_over_32", EP2, _dcfg(num_experts=40, num_topk=33), "num_topk <= 32, got 33"),
]


@pytest.mark.parametrize("case,layout,dcfg,text", CONSTRUCTION_ERRORS,
                         ids=[c[0] for c in CONSTRUCTION_ERRORS])
def test_construction_refuses(case, layout, dcfg, text):
    with emu.installed("0.7.2.post1"), pytest.raises(ValueError, match=None) as e:
        SPEC.build(_ctx(layout), dcfg)
    assert text in str(e.value)


def test_backend_options_of_another_type():
    with emu.installed("0.7.2.post1"), pytest.raises(TypeError, match="FlashInferTwoSidedOptions"):
        SPEC.build(_ctx(EP2), _dcfg(backend_options={"api": "moe_ep"}))


def test_options_reject_an_unknown_api():
    with pytest.raises(ValueError, match="mnnvl_moe"):
        FlashInferTwoSidedOptions(api="nccl")
    assert FlashInferTwoSidedOptions(api="moe_ep").api is TwoSidedApi.MOE_EP


def test_requested_api_missing_names_the_extra():
    with emu.installed("0.7.4"), pytest.raises(ImportError) as e:
        SPEC.build(_ctx(EP2), _dcfg(backend_options=FlashInferTwoSidedOptions(api="mnnvl_moe")))
    assert "only has ['moe_ep']" in str(e.value) and "[flashinfer] extra" in str(e.value)


def test_flashinfer_without_a_two_sided_api():
    with emu.installed("no_two_sided"), pytest.raises(ImportError) as e:
        SPEC.build(_ctx(EP2), _dcfg())
    assert "MnnvlMoe" in str(e.value) and "NVLinkTwoSidedAlltoAll" in str(e.value)
    assert "[flashinfer] extra" in str(e.value)


# ---- without flashinfer; the capability row ----------------------------------------------------
def test_without_flashinfer_construction_names_the_extra():
    with emu.not_installed(), pytest.raises(ImportError) as e:
        SPEC.build(_ctx(EP2), _dcfg())
    assert "pip install 'flashinfer-python>=0.7.2'" in str(e.value)


@pytest.mark.parametrize("how", ["not_installed", "emulation_installed"])
def test_list_says_why_unusable(capsys, how):
    """`list` reports the missing package (and GPU), also while the emulation is in sys.modules:
    the emulation never passes for the real package."""
    ctx = emu.not_installed() if how == "not_installed" else emu.installed("0.7.2.post1")
    with ctx:
        assert cli_main(["list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(NAME))
    assert "package 'flashinfer' not installed (pip install 'flashinfer-python>=0.7.2'" in row
    assert row.split()[1] == "no"
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU, none visible" in row


def test_capability_row():
    assert BACKEND_EP_DP_TP_SUPPORT[NAME] == (True, True, True, False)
    assert BACKEND_SUPPORTED_QUANTS[NAME] == frozenset({QuantScheme.NONE, FP8, NVFP4})
    spec = get_backend(NAME)
    assert spec.needs_cuda and not spec.capabilities.recv_hook and spec.capabilities.row_scatter
    assert select_backend(EP4, NVFP4, NAME, require_available=False) is spec
    assert select_backend(ParallelLayout(2, 2, True), QuantScheme.NONE, NAME,
                          require_available=False) is spec


# ---- TP inside the EP group: owned rows only, row-scatter on and off ---------------------------
TP_CASES = [
    (ParallelLayout(2, 2, True), ReductionStrategy.ROW_SCATTER_ALLREDUCE, ["all_reduce"]),
    (ParallelLayout(2, 2, True), ReductionStrategy.GATHER_PLUS_ALLREDUCE,
     ["all_gather", "all_reduce"]),
    (ParallelLayout(1, 2, True), ReductionStrategy.ROW_SCATTER_ALLREDUCE, ["all_reduce"]),
]


@pytest.mark.multirank
@pytest.mark.parametrize("num_tokens", [7, 1])
@pytest.mark.parametrize("layout,strategy,colls", TP_CASES,
                         ids=[f"dp{l.dp}-tp{l.tp}-{s.value}" for l, s, _ in TP_CASES])
def test_tp2_dispatches_owned_rows(rank_pool, layout, strategy, colls, num_tokens):
    """tp 2: each TP rank dispatches only the rows it owns (vLLM's in-tree two-sided backend
    sends every token from every TP rank: tp times the pairs), and ROW_SCATTER_ALLREDUCE (one
    all_reduce) as well as GATHER_PLUS_ALLREDUCE match the reference, nvfp4 on the wire."""
    from moe_plugins.layout import owned_rows

    cfg, quant = _cfg(), QuantSpec(NVFP4)
    results = rank_pool(layout.world_size).run(fi.run_layer, layout, cfg, num_tokens, quant,
                                               "0.7.2.post1", 0, strategy)
    assert_matches_reference(results, layout, cfg, num_tokens, quant)
    for rank, r in enumerate(results):
        owned = owned_rows(num_tokens, layout.tp, layout.tp_rank(rank)).num_owned
        assert r["strategy"] is strategy and r["tp_collectives"] == colls
        assert r["pairs"] == owned * cfg.num_topk
    for d in range(layout.dp):  # a DP group dispatches each of its tokens once, not tp times
        assert sum(r["pairs"] for i, r in enumerate(results)
                   if layout.dp_rank(i) == d) == num_tokens * cfg.num_topk



@pytest.mark.multirank
def test_plan_equals_the_backends_counters(rank_pool):
    """`moe-plugins plan` for this backend, given the routing of the owned rows (computed here
    from the same inputs), states exactly what its DispatchStats counted: rows once per
    destination rank, nvfp4 rows and scales, int32 ids + float32 weights per row."""
    from moe_plugins.runner.demo import demo_inputs
    from moe_plugins.layout import owned_rows
    from moe_plugins.runner.model import MoEWeights, route
    from moe_plugins.planner.plan import plan_layer
    from moe_plugins.planner.traffic import Routing

    layout, cfg, n, quant = ParallelLayout(2, 2, True), _cfg(), 7, QuantSpec(NVFP4)
    strategy = ReductionStrategy.ROW_SCATTER_ALLREDUCE
    results = rank_pool(4).run(fi.run_layer, layout, cfg, n, quant, "0.7.2.post1", 0, strategy)
    router = MoEWeights.random(cfg, 0).router
    ids = []
    for rank in range(4):
        _, topk_ids = route(demo_inputs(cfg, n, layout.dp_rank(rank), 0), router, cfg.num_topk,
                            cfg.renormalize)
        ids.append(topk_ids[owned_rows(n, layout.tp, layout.tp_rank(rank)).as_slice])
    plan = plan_layer(cfg, layout, n, get_backend(NAME), quant,
                      routing=Routing.from_topk_ids(ids, cfg.num_experts))
    assert plan.wire.meta_bytes == cfg.num_topk * (4 + 4)
    for rp, r in zip(plan.strategy(strategy).ranks, results):
        assert rp.pairs == r["pairs"] and rp.rows.min == r["rows_sent"]
        assert (rp.act_bytes.min, rp.sf_bytes.min, rp.meta_bytes.min) == (
            r["act_bytes"], r["sf_bytes"], r["meta_bytes"])
        assert rp.combine_bytes.min == r["combine_bytes"]


# ---- receive rows sized per call (issue 11: not ep_size x the layer's max at batch 1) -----------
BOUND_CASES = [("bf16", QuantSpec()), ("fp8", QuantSpec(FP8)), ("nvfp4", QuantSpec(NVFP4))]


@pytest.mark.multirank
@pytest.mark.parametrize("flavor,api", FLAVORS, ids=[f[0] for f in FLAVORS])
@pytest.mark.parametrize("name,quant", BOUND_CASES, ids=[c[0] for c in BOUND_CASES])
@pytest.mark.parametrize("tokens", [[3, 1], [1, 1], [0, 2]], ids=["3-1", "1-1", "0-2"])
def test_receive_rows_follow_the_call_bound(rank_pool, flavor, api, name, quant, tokens):
    """A layer built for 64 tokens per rank; a call whose largest rank sends max(tokens):
    every receive buffer (activations, scales, routing) has ep_size * max(tokens) rows (at least
    one per rank), not ep_size * 64; the result is the reference's; the workspaces are the
    same; a bound below a rank's tokens or above the layer's is refused before any collective."""
    from moe_plugins.runner.demo import demo_inputs
    from moe_plugins.runner.model import MoEWeights
    from moe_plugins.runner.reference import reference_moe, tolerance_for

    cfg = _cfg(shared_intermediate=0)
    bound = max(tokens)
    results = rank_pool(2).run(fi.run_bounded, EP2, cfg, tokens, 64, quant, flavor, bound)
    rows = 2 * max(bound, 1)
    weights = MoEWeights.random(cfg, 0)
    for rank, r in enumerate(results):
        assert r["recv_rows"] == r["ids_rows"] == rows
        assert r["sf_rows"] == (None if not quant.quantized_on_wire else
                                -(-rows // 128) * 128 * 16 if quant.scheme is NVFP4 else rows)
        x = demo_inputs(cfg, tokens[rank], rank, 0)
        assert torch.equal(r["x"], x)
        ref = reference_moe(x, weights, quant)
        torch.testing.assert_close(r["out"], ref, atol=tolerance_for(ref, cfg.dtype)[0],
                                   rtol=1e-5)
        assert r["workspaces"] == results[0]["workspaces"] > 0
        if tokens[rank] >= 1:
            assert any("must cover this rank's tokens" in e for e in r["errors"])
        assert any("max_tokens_per_rank=64" in e for e in r["errors"])


@pytest.mark.multirank
def test_without_a_bound_the_layer_max_sizes_the_receive(rank_pool):
    results = rank_pool(2).run(fi.run_bounded, EP2, _cfg(shared_intermediate=0), [3, 1], 64,
                               QuantSpec(), "0.7.4", None)
    assert all(r["recv_rows"] == 2 * 64 for r in results)
