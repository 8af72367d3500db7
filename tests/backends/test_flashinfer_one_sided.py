"""Backend flashinfer_nvlink_one_sided against the emulated flashinfer (the one-sided class of
0.7.2.post1 and of 0.7.4, tests/emulation/flashinfer_one_sided.py), on real gloo ranks, element-wise
against the single-process reference; plus its capability row, its options and errors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_plugins.all2all.flashinfer_nvlink_one_sided import FlashInferOneSidedOptions
from moe_plugins.config import DispatchConfig, MoEConfig
from moe_plugins.groups import DistContext
from moe_plugins.layout import ParallelLayout
from moe_plugins.masking import MaskWord, masked_from_library
from moe_plugins.quant import NVFP4_BLOCK, QuantScheme, QuantSpec
from moe_plugins.registry import BACKEND_EP_DP_TP_SUPPORT, BACKEND_SUPPORTED_QUANTS, get_backend
from moe_plugins.runner.model import MoEWeights
from moe_plugins.strategy import ReductionStrategy as S
from tests.backends import flashinfer_one_sided_ranks as fo
from tests.checks import assert_matches_reference
from tests.emulation import flashinfer_two_sided as emu

NAME = "flashinfer_nvlink_one_sided"
FLAVORS = ["0.7.2.post1", "0.7.4"]
FP8, NVFP4 = QuantScheme.FP8_BLOCK128, QuantScheme.NVFP4
QUANTS = [("bf16", QuantSpec()), ("fp8_block128", QuantSpec(FP8)), ("nvfp4", QuantSpec(NVFP4)),
          ("fp8_block128-deferred", QuantSpec(FP8, defer_input_quant=True))]


def _ctx(layout: ParallelLayout) -> DistContext:
    """A context without process groups: construction must refuse before touching one."""
    return DistContext(layout, 0, None, None, torch.device("cpu"))


def _cfg(**kw: object) -> MoEConfig:
    return MoEConfig(**{"hidden": 256, "num_experts": 8, "num_topk": 2, "intermediate": 64,
                        "shared_intermediate": 128, "dtype": torch.bfloat16, **kw})


@pytest.mark.multirank
@pytest.mark.parametrize("name,quant", QUANTS, ids=[q[0] for q in QUANTS])
@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("ep", [2, 4])
def test_layer_matches_reference(rank_pool, ep, flavor, name, quant):
    """EP 2 and 4, every format, both releases: ragged token counts with a rank that has none."""
    layout, cfg = ParallelLayout(ep, 1, True), _cfg()
    counts = [5, 0] if ep == 2 else [3, 0, 7, 1]
    results = rank_pool(ep).run(fo.run_layer, layout, cfg, counts, quant, flavor)
    assert_matches_reference(results, layout, cfg, counts, quant)
    for r in results:
        # 0.7.2.post1's MoeAlltoAll keeps its workspace for the process; 0.7.4 frees it
        assert r["strategy"] is S.LOCAL
        assert r["live_after_destroy"] == (1 if flavor == "0.7.2.post1" else 0)
        (d,), (c,) = r["dispatch"], r["combine"]
        assert d["transport"] == "fence" and c["dtype"] == torch.bfloat16
        # activations, scales only when quantized on the wire, int32 ids, float32 weights
        dtypes = [p[0] for p in d["payloads"]]
        assert dtypes[-2:] == [torch.int32, torch.float32]
        assert len(dtypes) == (4 if quant.quantized_on_wire else 3)
        assert (r["sf_bytes"] > 0) == (quant.quantized_on_wire and r["rows"] > 0)
        assert r["meta_bytes"] == r["rows"] * cfg.num_topk * 8


@pytest.mark.multirank
@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("strategy", [S.SP_ALLGATHER, S.ROW_SCATTER_ALLREDUCE])
def test_dp2_tp2_sp_and_row_scatter(rank_pool, flavor, strategy):
    """dp 2 x tp 2: each TP rank dispatches the rows it owns; SP (replicated shared expert on the
    owned slice, one all_gather) and row-scatter (one all_reduce) both equal the reference."""
    layout, cfg = ParallelLayout(2, 2, True), _cfg()
    results = rank_pool(4).run(fo.run_layer, layout, cfg, [7, 2], QuantSpec(), flavor, strategy)
    assert_matches_reference(results, layout, cfg, [7, 2])
    for r in results:
        assert r["strategy"] is strategy
        kinds = set(r["tp_collectives"])
        assert kinds == ({"all_gather"} if strategy is S.SP_ALLGATHER else {"all_reduce"}), kinds


R = 2 * 8  # receive rows: num_ranks * max_tokens_per_rank
X_SF_CASES = [
    ("none", QuantSpec(), True, (torch.bfloat16, 256), None, False),
    ("fp8", QuantSpec(FP8), True, (torch.float8_e4m3fn, 256), (torch.float32, (R, 2)), False),
    ("nvfp4-swizzled", QuantSpec(NVFP4), True, (torch.uint8, 128),
     (torch.float8_e4m3fn, ((-(-R // 128) * 128) * (-(-(256 // NVFP4_BLOCK) // 4) * 4),)), True),
    ("nvfp4-rowaligned", QuantSpec(NVFP4), False, (torch.uint8, 128),
     (torch.float8_e4m3fn, (R, 16)), False),
    ("nvfp4-deferred", QuantSpec(NVFP4, True), True, (torch.bfloat16, 256), None, False),
]


@pytest.mark.multirank
@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("case,quant,swizzle,x,sf,swizzled", X_SF_CASES,
                         ids=[c[0] for c in X_SF_CASES])
def test_prepare_x_sf(rank_pool, flavor, case, quant, swizzle, x, sf, swizzled):
    """x_sf is None exactly when nothing quantized crossed; scales travel row-aligned and are
    swizzled after the all-to-all only when present; received ids are LOCAL, -1 elsewhere."""
    layout, cfg = ParallelLayout(2, 1, True), _cfg(shared_intermediate=0)
    options = FlashInferOneSidedOptions(nvfp4_swizzled_sf=swizzle)
    results = rank_pool(2).run(fo.run_routed, layout, cfg, 8, quant, flavor, options)
    assert_matches_reference(results, layout, cfg, 8, quant)
    for r in results:
        assert (r["x_dtype"], r["x_shape"]) == (x[0], (R, x[1]))
        assert r["x_sf"] == sf and r["x_sf_swizzled"] is swizzled
        ids = r["topk_ids"]
        assert ids.dtype == torch.int64 and int(ids.min()) >= -1 and int(ids.max()) < 4
        (d,) = r["dispatch"]
        assert len(d["payloads"]) == (3 if sf is None else 4)


@pytest.mark.multirank
@pytest.mark.parametrize("flavor", FLAVORS)
def test_eplb_redundant_experts_and_rebalance(rank_pool, flavor):
    """EPLB's redundant copies, shuffled, then a rebalance to another map: the reference both
    times (the placement contract's rank functions, on this backend)."""
    from tests.contracts import placement_ranks as prf

    layout, cfg = ParallelLayout(4, 1, True), _cfg(hidden=128)
    placements = [prf.random_placement(8, 4, 8, seed=s) for s in (1, 2)]
    results = rank_pool(4).run(prf.run_placed_layer, NAME, layout, cfg, None, 9, placements)
    for i in range(2):
        for res in results:
            res[f"out{i}"] = res["outs"][i]
        assert_matches_reference(results, layout, cfg, 9, key=f"out{i}")


@pytest.mark.multirank
@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_masked_rank_is_left_out(rank_pool, flavor):
    """Ranks 0-2 mask rank 3 (masked=True, our contract; flashinfer's mask then has rank 3's
    bit clear): nothing goes to it and their outputs are the reference without its experts.
    The mask the library's kernels read (its word, 1 = active) gives back our flags on every
    rank (moe_plugins.masking: one contract)."""
    world, dead = 4, 3
    layout, cfg = ParallelLayout(world, 1, True), _cfg(shared_intermediate=0)
    options = FlashInferOneSidedOptions(enable_rank_mask=True)
    results = rank_pool(world).run(fo.run_routed, layout, cfg, 6, QuantSpec(), flavor, options,
                                   dead)
    w = MoEWeights.random(cfg, 0)
    w2 = w.w2.clone()
    w2[dead * 2:(dead + 1) * 2] = 0
    assert_matches_reference(results, layout, cfg, 6, weights=dataclasses.replace(w, w2=w2),
                             ranks=list(range(dead)))
    for rank, r in enumerate(results):
        assert r["masked"] == ([dead] if rank != dead else [])
        assert r["dispatch"][0]["masked"]
        words = [int(p in r["dispatch"][0]["active"]) for p in range(world)]  # as read
        assert masked_from_library(words, MaskWord.ONE_ACTIVE) == r["masked"], words


BAD_MASKS = [
    ("without enable_rank_mask", FlashInferOneSidedOptions(), 1, True,
     "ValueError: flashinfer_nvlink_one_sided was built without rank masking"),
    ("itself", FlashInferOneSidedOptions(enable_rank_mask=True), 0, True,
     "cannot mask itself"),
    ("masked='False'", FlashInferOneSidedOptions(enable_rank_mask=True), 1, "False",
     "TypeError"),
    ("masked=2", FlashInferOneSidedOptions(enable_rank_mask=True), 1, 2, "ValueError"),
]


@pytest.mark.multirank
@pytest.mark.parametrize("label,options,offset,masked,expected", BAD_MASKS,
                         ids=[b[0] for b in BAD_MASKS])
def test_bad_mask_requests_are_refused(rank_pool, label, options, offset, masked, expected):
    results = rank_pool(2).run(fo.bad_mask, ParallelLayout(2, 1, True), _cfg(), "0.7.4",
                               options, offset, masked)
    assert all(expected in r for r in results), results


@pytest.mark.multirank
@pytest.mark.parametrize("flavor", FLAVORS)
def test_checkpoint_prepare_and_restore(rank_pool, flavor):
    """Through either release's place for them (the object in 0.7.4, its MoeAlltoAll in
    0.7.2.post1): the call after a restore equals the call before."""
    results = rank_pool(2).run(fo.checkpoint, ParallelLayout(2, 1, True), _cfg(), flavor)
    for r in results:
        torch.testing.assert_close(r["second"], r["first"], rtol=0, atol=0)


@pytest.mark.multirank
def test_lamport_transport_where_the_library_picks_it(rank_pool):
    """0.7.4 on a GPU with Lamport kernels: the library takes small steps on it (tokens land at
    ``src * tokens_per_rank + t``) and the output is the same reference."""
    layout, cfg = ParallelLayout(2, 1, True), _cfg()
    results = rank_pool(2).run(fo.run_layer, layout, cfg, [4, 3], QuantSpec(), "0.7.4",
                               platform={"lamport": True})
    assert_matches_reference(results, layout, cfg, [4, 3])
    assert all(r["dispatch"][0]["transport"] == "lamport" for r in results)


def test_capability_row_and_options():
    spec = get_backend(NAME)
    assert BACKEND_EP_DP_TP_SUPPORT[NAME] == (True, True, True, True)
    assert BACKEND_SUPPORTED_QUANTS[NAME] == frozenset({QuantScheme.NONE, FP8, NVFP4})
    assert spec.dtypes == frozenset({torch.bfloat16, torch.float16})
    assert not spec.capabilities.micro_batch and spec.capabilities.placements
    with pytest.raises(ValueError, match="both ask for every eligible step"):
        FlashInferOneSidedOptions(cft=True, lamport=True)
    with pytest.raises(ValueError, match="timeout_sec must be a positive int"):
        FlashInferOneSidedOptions(timeout_sec=0)


CONSTRUCTION = [
    ("one_rank", ParallelLayout(1, 1, True), {}, "EP group of >= 2 ranks"),
    ("float32", ParallelLayout(2, 1, True), {"dtype": torch.float32}, "bfloat16 or float16"),
    ("topk_5", ParallelLayout(2, 1, True), {"num_topk": 5}, "num_topk in"),
    ("experts_not_divisible", ParallelLayout(4, 1, True), {"num_experts": 6}, "divisible by the"),
]


@pytest.mark.parametrize("label,layout,kw,text", CONSTRUCTION, ids=[c[0] for c in CONSTRUCTION])
def test_construction_refuses(label, layout, kw, text):
    """Refused with the fix before any process group is touched (no ranks needed)."""
    base = dict(num_experts=8, hidden=256, num_topk=2, max_tokens_per_rank=4,
                dtype=torch.bfloat16)
    cfg = DispatchConfig(**{**base, **kw})
    ctx = _ctx(layout)
    with emu.installed("0.7.4"), pytest.raises(ValueError) as e:
        get_backend(NAME).manager(ctx, cfg)
    assert text in str(e.value)


def test_without_flashinfer_an_import_error_names_the_extra():
    layout = ParallelLayout(2, 1, True)
    cfg = DispatchConfig(num_experts=8, hidden=256, num_topk=2, max_tokens_per_rank=4)
    with emu.not_installed(), pytest.raises(ImportError, match=r"\[flashinfer\] extra"):
        get_backend(NAME).manager(_ctx(layout), cfg)


def test_a_release_without_the_one_sided_class_is_named():
    layout = ParallelLayout(2, 1, True)
    cfg = DispatchConfig(num_experts=8, hidden=256, num_topk=2, max_tokens_per_rank=4)
    with emu.installed("no_two_sided"), pytest.raises(ImportError, match="NVLinkOneSidedAlltoAll"):
        get_backend(NAME).manager(_ctx(layout), cfg)
