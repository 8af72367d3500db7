"""The plan (analytic cost model) against what the reference backend and torch.distributed counted
on real multi-rank gloo runs; its routing statistics; the link model; model-config reading."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import subprocess
import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from tests.planner import plan_ranks as plan_rank_fns
from tests.backend_lists import LOW_LATENCY
from tests.checks import assert_matches_reference, run_cli
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.faults import HEADER_WORDS
from moe_plugins.interface import ActivationFormat
from moe_plugins.layout import ParallelLayout, owned_rows
from moe_plugins.planner.link_model import LinkModel
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights, route
from moe_plugins.planner.model_config import load_model_config, model_spec_from_dict
from moe_plugins.planner.model_config import ModelSpec
from moe_plugins.planner.decoder import decoder_tp_collectives
from moe_plugins.planner.plan import plan_layer
from moe_plugins.planner.recommend import recommend_strategy
from moe_plugins.planner.traffic import Routing, expected_ranks_hit, ranks_hit_bounds
from moe_plugins.planner.transport_time import FITTED, all_to_all_us
from moe_plugins.quant import QuantScheme, QuantSpec
from moe_plugins.registry import BackendSpec, Capabilities, Transport, get_backend
from moe_plugins.strategy import ReductionStrategy as S
from moe_plugins.strategy import SharedPlacement, applicable_strategies, choose_strategy

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "model_configs"


def _cfg(dtype: torch.dtype = torch.float32, **kw: object) -> MoEConfig:
    return MoEConfig(**{"hidden": 256, "num_experts": 8, "num_topk": 2, "intermediate": 64,
                        "shared_intermediate": 128, "dtype": dtype, **kw})


def _kind(name: str) -> str:
    """torch.distributed function name -> the collective kind the layer records."""
    return "all_gather" if name.startswith("all_gather") else name


def _run(rank_pool, layout, cfg, strategy, tokens, quant=QuantSpec()):
    results = rank_pool(layout.world_size).run(plan_rank_fns.measure_layer, layout, cfg, strategy,
                                               tokens, quant)
    # the counts the tests compare are of a run that computed right
    assert_matches_reference(results, layout, cfg, list(tokens), quant)
    assert all(res["strategy"] is strategy for res in results)
    return results


# --------------------------------------------------------------------------------------------
# The plan against measured runs
# --------------------------------------------------------------------------------------------
LAYOUTS = [
    (ParallelLayout(1, 1, True), S.LOCAL),
    (ParallelLayout(2, 1, True), S.LOCAL),
    (ParallelLayout(4, 1, True), S.LOCAL),
    (ParallelLayout(1, 2, False), S.TP_UNIFIED),
    (ParallelLayout(1, 2, True), S.TP_UNIFIED),
    (ParallelLayout(1, 2, True), S.ROW_SCATTER_ALLREDUCE),
    (ParallelLayout(1, 4, True), S.GATHER_PLUS_ALLREDUCE),
    (ParallelLayout(2, 2, True), S.ROW_SCATTER_ALLREDUCE),
    (ParallelLayout(2, 2, True), S.SP_ALLGATHER),
    (ParallelLayout(2, 2, True), S.GATHER_PLUS_ALLREDUCE),
]
# tokens of each DP group: even, ragged over TP (trailing TP ranks own fewer or zero rows), and
# DP groups of different sizes with an empty one.
TOKENS = ["even", "ragged", "one", "uneven-dp"]


def _tokens(kind: str, dp: int) -> tuple[int, ...]:
    return {"even": (8,) * dp, "ragged": (5,) * dp, "one": (1,) * dp,
            "uneven-dp": tuple([7, 0, 3, 2][:dp]) if dp > 1 else (3,)}[kind]


QUANTS = [
    QuantSpec(),
    QuantSpec(QuantScheme.FP8_BLOCK128),
    QuantSpec(QuantScheme.FP8_BLOCK128, defer_input_quant=True),
    QuantSpec(QuantScheme.NVFP4),
]


def _quant_id(q: QuantSpec) -> str:
    return q.scheme.value + ("-deferred" if q.defer_input_quant else "")


MATRIX = ([(lay, s, t, QuantSpec()) for (lay, s), t in itertools.product(LAYOUTS, TOKENS)]
          + [(lay, s, "ragged", q) for (lay, s), q in itertools.product(
              [LAYOUTS[2], LAYOUTS[5], LAYOUTS[8]], QUANTS[1:])])


def _check_deterministic(plan, strategy, results, layout, cfg):
    """Everything the plan states exactly, without knowing the routing."""
    sp = plan.strategy(strategy)
    for rp, res in zip(sp.ranks, results):
        ids = res["prepared_topk_ids"]
        assert rp.owned == (0 if ids is None else ids.shape[0])
        assert rp.pairs == res["stats"]["pairs"]
        # the TP collectives: as the layer logged them and as torch.distributed saw them
        planned = [(c.kind, c.bytes) for c in rp.tp_collectives]
        assert planned == res["recorded"]
        assert planned == [(_kind(n), b) for n, b in res["calls"] if n != "all_to_all_single"]
        assert rp.shared_weight_bytes == res["shared_weight_bytes"]
        assert rp.expert_weight_bytes == res["expert_weight_bytes"]
        if not sp.dispatches:
            assert not any(n == "all_to_all_single" for n, _ in res["calls"])
            assert all(v == 0 for v in res["stats"].values())


def _check_bounds(plan, strategy, results):
    """Routing-dependent counts lie within the plan's exact bounds."""
    sp = plan.strategy(strategy)
    for rp, res in zip(sp.ranks, results):
        st = res["stats"]
        for planned, measured in ((rp.rows, st["rows"]), (rp.act_bytes, st["act_bytes"]),
                                  (rp.sf_bytes, st["sf_bytes"]), (rp.meta_bytes, st["meta_bytes"]),
                                  (rp.combine_bytes, st["combine_bytes"])):
            assert planned.contains(measured), (rp.rank, planned, measured)


def _check_given_routing(plan, strategy, results, layout):
    """With the routing the backend really received, every count is exact."""
    sp = plan.strategy(strategy)
    assert plan.routing_given
    for rp, res in zip(sp.ranks, results):
        st = res["stats"]
        for planned, key in ((rp.rows, "rows"), (rp.act_bytes, "act_bytes"),
                             (rp.sf_bytes, "sf_bytes"), (rp.meta_bytes, "meta_bytes"),
                             (rp.combine_bytes, "combine_bytes")):
            assert planned.is_exact and planned.min == st[key], (rp.rank, key, planned, st[key])
        # Received bytes as torch.distributed saw them (each all_to_all_single call's output):
        # first the row-count exchange, last the combine, the dispatch payloads between.
        a2a = [b for n, b in res["calls"] if n == "all_to_all_single"]
        # int64 header per rank: row count, call sequence number, layer digest, input status
        assert a2a[0] == layout.world_size * 8 * HEADER_WORDS
        assert rp.recv_combine_bytes.min == a2a[-1]
        assert rp.recv_dispatch_bytes.is_exact and rp.recv_dispatch_bytes.min == sum(a2a[1:-1])
    # what is sent is received, per category
    for sent, recv in (("act_bytes", "recv_act_bytes"), ("sf_bytes", "recv_sf_bytes"),
                       ("meta_bytes", "recv_meta_bytes"), ("rows", "recv_rows"),
                       ("combine_bytes", "recv_combine_bytes")):
        assert sum(getattr(r, recv).min for r in sp.ranks) == sum(getattr(r, sent).min
                                                                  for r in sp.ranks)
    assert sum(r.recv_pairs.min for r in sp.ranks) == sum(r.pairs for r in sp.ranks)


@pytest.mark.multirank
@pytest.mark.parametrize("layout,strategy,tokens,quant", MATRIX, ids=[
    f"dp{l.dp}-tp{l.tp}-{'ep' if l.ep else 'noep'}-{s.value}-{t}-{_quant_id(q)}"
    for l, s, t, q in MATRIX])
def test_plan_equals_measured(rank_pool, layout, strategy, tokens, quant):
    cfg = _cfg()
    n = _tokens(tokens, layout.dp)
    results = _run(rank_pool, layout, cfg, strategy, n, quant)
    torch_backend = get_backend("torch")
    plan = plan_layer(cfg, layout, n, torch_backend, quant)
    _check_deterministic(plan, strategy, results, layout, cfg)
    _check_bounds(plan, strategy, results)
    if plan.strategy(strategy).dispatches:
        routing = Routing.from_topk_ids([r["prepared_topk_ids"] for r in results], cfg.num_experts)
        exact = plan_layer(cfg, layout, n, torch_backend, quant, routing=routing)
        _check_deterministic(exact, strategy, results, layout, cfg)
        _check_given_routing(exact, strategy, results, layout)


@pytest.mark.multirank
def test_plan_equals_measured_bf16_topk4(rank_pool):
    """bf16 activations (2-byte rows and collectives) and 4 of 8 experts per token."""
    layout, cfg, n = ParallelLayout(2, 2, True), _cfg(torch.bfloat16, num_topk=4), (9, 4)
    results = _run(rank_pool, layout, cfg, S.GATHER_PLUS_ALLREDUCE, n)
    plan = plan_layer(cfg, layout, n, get_backend("torch"))
    _check_deterministic(plan, S.GATHER_PLUS_ALLREDUCE, results, layout, cfg)
    _check_bounds(plan, S.GATHER_PLUS_ALLREDUCE, results)
    routing = Routing.from_topk_ids([r["prepared_topk_ids"] for r in results], cfg.num_experts)
    exact = plan_layer(cfg, layout, n, get_backend("torch"), routing=routing)
    _check_given_routing(exact, S.GATHER_PLUS_ALLREDUCE, results, layout)


TP_SLICED = [(ParallelLayout(1, 4, True), S.ROW_SCATTER_ALLREDUCE, (9,)),
             (ParallelLayout(2, 2, True), S.SP_ALLGATHER, (5, 1)),
             (ParallelLayout(2, 2, True), S.GATHER_PLUS_ALLREDUCE, (8, 3))]


@pytest.mark.multirank
@pytest.mark.parametrize("layout,strategy,tokens", TP_SLICED,
                         ids=[f"dp{l.dp}-tp{l.tp}-{s.value}" for l, s, _ in TP_SLICED])
def test_tp_sliced_dispatch_never_exceeds_owned_rows_times_topk(rank_pool, layout, strategy, tokens):
    """The peer simulator's bug: it dispatched the whole DP group's [N, k] routing from every TP
    rank, tp times too much. Planned and measured pairs and rows stay within owned x topk, and a
    DP group dispatches N x topk pairs in total, not tp x N x topk."""
    cfg = _cfg(num_topk=4)
    results = _run(rank_pool, layout, cfg, strategy, tokens)
    sp = plan_layer(cfg, layout, tokens, get_backend("torch")).strategy(strategy)
    k = cfg.num_topk
    for rp, res in zip(sp.ranks, results):
        owned = owned_rows(tokens[rp.dp_rank], layout.tp, rp.tp_rank).num_owned
        assert owned <= -(-tokens[rp.dp_rank] // layout.tp)
        assert rp.pairs == owned * k and rp.rows.max <= owned * k
        assert res["stats"]["pairs"] == owned * k and res["stats"]["rows"] <= owned * k
        assert res["prepared_topk_ids"].shape == (owned, k)
    for d in range(layout.dp):
        group = [rp for rp in sp.ranks if rp.dp_rank == d]
        assert sum(rp.pairs for rp in group) == tokens[d] * k
        assert sum(res["stats"]["pairs"] for rp, res in zip(sp.ranks, results)
                   if rp.dp_rank == d) == tokens[d] * k


def test_plan_rejects_routing_of_the_whole_dp_group():
    """Routing given with every token of the DP group on each TP rank (the simulator's mistake) is
    refused, naming the owned rows."""
    layout, cfg, n = ParallelLayout(1, 2, True), _cfg(), 8
    x = demo_inputs(cfg, n, 0, 0)
    _, ids = route(x, MoEWeights.random(cfg, 0).router, cfg.num_topk, cfg.renormalize)
    with pytest.raises(ValueError, match=r"routing of rank 0 has 8 tokens but the rank owns 4 rows"):
        plan_layer(cfg, layout, n, get_backend("torch"),
                   routing=Routing.from_topk_ids([ids, ids], cfg.num_experts))


# --------------------------------------------------------------------------------------------
# Routing statistics, per-expert backends, strategy choice
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("experts,ranks", [(8, 1), (8, 2), (8, 4), (8, 8), (12, 3), (12, 4)])
def test_expected_ranks_hit_equals_enumeration(experts, ranks):
    per = experts // ranks
    for k in range(1, experts + 1):
        hits = [len({e // per for e in c}) for c in itertools.combinations(range(experts), k)]
        assert expected_ranks_hit(experts, k, ranks) == Fraction(sum(hits), len(hits))
        assert ranks_hit_bounds(experts, k, ranks) == (min(hits), max(hits))


def test_uniform_routing_average_is_the_expected_value():
    """Rows measured on a large uniformly routed batch average to the plan's expected value."""
    layout, cfg, n = ParallelLayout(4, 1, True), _cfg(num_experts=16, num_topk=4), 4000
    g = torch.Generator().manual_seed(0)
    ids = [torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(n)]) for _ in range(4)]
    exact = plan_layer(cfg, layout, n, get_backend("torch"), routing=Routing.from_topk_ids(ids, 16))
    uniform = plan_layer(cfg, layout, n, get_backend("torch"))
    for e, u in zip(exact.recommended.ranks, uniform.recommended.ranks):
        assert u.rows.contains(e.rows.min)
        assert abs(e.rows.min - u.rows.expected) < 0.02 * u.rows.expected
        assert abs(e.recv_rows.min - u.recv_rows.expected) < 0.02 * u.recv_rows.expected


def _per_expert_backend() -> BackendSpec:
    """A BATCHED-format (DeepEP-LL-style) backend spec: the plan reads only its capabilities."""
    def unbuildable(*_: object) -> None:
        raise AssertionError("the plan must not build a backend")

    return BackendSpec(name="per-expert", prepare_finalize=unbuildable, manager=unbuildable,
                       capabilities=Capabilities(ep_dp=True, dp=True, tp=True, sp=False,
                                                 row_scatter=True,
                                                 activation_format=ActivationFormat.BATCHED),
                       quants=frozenset({QuantScheme.NONE, QuantScheme.FP8_BLOCK128}))


def test_per_expert_backend_rows_are_pairs_exactly():
    layout, cfg = ParallelLayout(2, 2, True), _cfg(num_topk=4)
    plan = plan_layer(cfg, layout, 7, _per_expert_backend(), QuantSpec(QuantScheme.FP8_BLOCK128))
    assert plan.wire.per_pair and plan.wire.meta_bytes == 0
    assert [s.strategy for s in plan.strategies] == [S.ROW_SCATTER_ALLREDUCE,
                                                     S.GATHER_PLUS_ALLREDUCE]  # no SP
    for rp in plan.recommended.ranks:
        assert rp.rows.is_exact and rp.rows.min == rp.pairs == rp.owned * 4
        assert rp.act_bytes.min == rp.pairs * cfg.hidden  # fp8: one byte per value
        assert rp.sf_bytes.min == rp.pairs * cfg.hidden // 128 * 4
        assert rp.recv_combine_bytes.min == rp.pairs * cfg.hidden * 4


PLAN_LAYOUTS = [ParallelLayout(1, 1, False), ParallelLayout(1, 4, False), ParallelLayout(1, 2, True),
                ParallelLayout(4, 1, True), ParallelLayout(2, 2, True), ParallelLayout(2, 4, True)]


@pytest.mark.parametrize("placement", list(SharedPlacement))
@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("shared", [0, 128])
@pytest.mark.parametrize("layout", PLAN_LAYOUTS, ids=lambda l: l.describe().replace(" ", "-"))
def test_strategies_and_recommendation_come_from_strategy_module(layout, shared, single, placement):
    cfg, caps = _cfg(shared_intermediate=shared), get_backend("torch").capabilities
    plan = plan_layer(cfg, layout, 8, get_backend("torch"), single_collective=single,
                      shared_placement=placement)
    kw = dict(supports_sp=caps.sp, supports_row_scatter=caps.row_scatter,
              has_shared_expert=cfg.has_shared_expert)
    assert [s.strategy for s in plan.strategies] == applicable_strategies(layout, **kw)
    choice = choose_strategy(layout, **kw, single_collective=single, shared_placement=placement)
    assert [s.strategy for s in plan.strategies if s.default] == [choice.strategy]
    rec = recommend_strategy(layout, cfg, supports_sp=caps.sp,
                             supports_row_scatter=caps.row_scatter, num_tokens=8,
                             single_collective=single)
    assert [s.strategy for s in plan.strategies if s.recommended] == [rec.strategy]
    assert plan.recommended.reason.startswith(rec.reason)


def test_routing_rejects_local_or_out_of_range_ids():
    with pytest.raises(ValueError, match=r"rank 1 hold ids in \[-1, 3\], expected PHYSICAL expert ids"):
        Routing.from_topk_ids([torch.tensor([[0, 5]]), torch.tensor([[-1, 3]])], 8)


def test_plan_errors_name_what_is_wrong():
    torch_backend = get_backend("torch")
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by the EP size 4"):
        plan_layer(_cfg(num_experts=6), ParallelLayout(4, 1, True), 8, torch_backend)
    with pytest.raises(ValueError, match=r"one per DP group \(2\)"):
        plan_layer(_cfg(), ParallelLayout(2, 1, True), (8, 8, 8), torch_backend)
    with pytest.raises(ValueError, match="quant nvfp4 not in"):
        plan_layer(_cfg(), ParallelLayout(2, 1, True), 8, _per_expert_backend(),
                   QuantSpec(QuantScheme.NVFP4))
    with pytest.raises(ValueError, match="shared expert intermediate size 90 is not divisible by tp=4"):
        plan_layer(_cfg(shared_intermediate=90), ParallelLayout(1, 4, True), 8, torch_backend)


# --------------------------------------------------------------------------------------------
# Link model
# --------------------------------------------------------------------------------------------
def test_link_model_times():
    link = LinkModel(nvlink_gbps=100.0, nvlink_latency_us=2.0, rdma_gbps=10.0, rdma_latency_us=5.0,
                     gpus_per_node=2)
    # 4 ranks on 2 nodes; rank 0 sends 1e6 rows of 1 B to rank 1 (NVLink) and to rank 2 (RDMA);
    # NCCL's combine is one exchange: a fixed cost + the slowest link's latency + the busiest
    # link's bytes
    c = FITTED
    m = [[0.0] * 4 for _ in range(4)]
    m[0][0], m[0][1], m[0][2] = 5e9, 1e6, 1e6  # the self-send is free
    nccl = functools.partial(all_to_all_us, Transport.NCCL, "combine", row_bytes=1, link=link)
    assert nccl(m) == pytest.approx(c.ll_fixed_us + 5.0 + 1e6 / (10e3 * c.normal_rdma_efficiency))
    m[0][2] = 0.0
    assert nccl(m) == pytest.approx(c.ll_fixed_us + 2.0
                                  + 1e6 / (100e3 * c.normal_nvlink_efficiency))
    # its dispatch adds the count exchange
    assert all_to_all_us(Transport.NCCL, "dispatch", m, 1, link) == pytest.approx(
        nccl(m) + c.ll_fixed_us + 2.0)
    # ring all_reduce of 4e6 B over 2 ranks of one node: 2 steps of 2e6 B
    assert link.all_reduce_us(4e6, [0, 1]) == pytest.approx(2 * (2.0 + 2e6 / 100e3))
    # all_gather of 1e6 B each over 4 ranks spanning nodes: 3 RDMA steps
    assert link.all_gather_us(1e6, [0, 1, 2, 3]) == pytest.approx(3 * (5.0 + 1e6 / 10e3))
    with pytest.raises(ValueError, match="rdma_gbps must be > 0"):
        LinkModel(rdma_gbps=0)


@pytest.mark.parametrize("field,value,error,message", [
    # issue 28: an infinite link speed made every transfer free
    ("nvlink_gbps", float("inf"), ValueError, "nvlink_gbps must be > 0 GB/s and finite, got inf"),
    ("rdma_gbps", float("nan"), ValueError, "rdma_gbps must be > 0 GB/s and finite, got nan"),
    ("nvlink_gbps", -450.0, ValueError, "nvlink_gbps must be > 0 GB/s"),
    ("nvlink_gbps", True, TypeError, "nvlink_gbps must be a number (GB/s), got True (bool)"),
    ("rdma_gbps", "50", TypeError, "rdma_gbps must be a number (GB/s), got '50' (str)"),
    ("nvlink_latency_us", float("inf"), ValueError, "nvlink_latency_us must be >= 0 us and finite"),
    ("rdma_latency_us", -1, ValueError, "rdma_latency_us must be >= 0 us and finite, got -1"),
    ("gpus_per_node", 0, ValueError, "gpus_per_node must be >= 1, got 0"),
    ("gpus_per_node", 8.0, TypeError, "gpus_per_node must be an int, got 8.0 (float)"),
    ("gpus_per_node", True, TypeError, "gpus_per_node must be an int, got True (bool)"),
    ("ll_nvlink", "on", TypeError, "ll_nvlink must be a bool, got 'on' (str)"),
    ("sms", 0, ValueError, "sms must be >= 1, got 0"),
    ("sms", 20.0, TypeError, "sms must be an int, got 20.0 (float)"),
    ("nodes", 0, ValueError, "nodes must be >= 1, got 0"),
])
def test_link_model_refuses_what_is_not_a_link(field, value, error, message):
    with pytest.raises(error) as e:
        LinkModel(**{field: value})
    assert message in str(e.value)


def test_link_model_accepts_ints_and_zero_latency():
    link = LinkModel(nvlink_gbps=100, nvlink_latency_us=0, rdma_gbps=10, rdma_latency_us=0)
    assert link.transfer_us(1e5, "nvlink") == pytest.approx(1.0)


def test_plan_time_grows_when_ranks_leave_the_node():
    cfg = _cfg(hidden=1024, num_experts=16)
    one_node = plan_layer(cfg, ParallelLayout(16, 1, True), 64, get_backend("torch"),
                          link=LinkModel(gpus_per_node=16)).recommended.time
    two_nodes = plan_layer(cfg, ParallelLayout(16, 1, True), 64, get_backend("torch"),
                           link=LinkModel(gpus_per_node=8)).recommended.time
    assert two_nodes.dispatch_us > one_node.dispatch_us > 0
    assert two_nodes.combine_us > one_node.combine_us > 0


# --------------------------------------------------------------------------------------------
# Model configs
# --------------------------------------------------------------------------------------------
EXPECTED_CONFIGS = {
    "deepseek-v3.json": (7168, 256, 8, 2048, 2048, False, 58, torch.bfloat16),
    "qwen1.5-moe-a2.7b.json": (2048, 60, 4, 1408, 5632, True, 24, torch.bfloat16),
    "qwen3-30b-a3b.json": (2048, 128, 8, 768, 0, False, 48, torch.bfloat16),
    "tiny-qwen2-moe.json": (256, 8, 2, 64, 128, True, 2, torch.float32),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_CONFIGS))
def test_example_model_configs(name):
    spec = load_model_config(EXAMPLES / name)
    m = spec.moe
    assert (m.hidden, m.num_experts, m.num_topk, m.intermediate, m.shared_intermediate,
            m.shared_gate, spec.num_moe_layers, m.dtype) == EXPECTED_CONFIGS[name]


def test_tiny_config_plans_like_the_demo_shape():
    spec = load_model_config(EXAMPLES / "tiny-qwen2-moe.json")
    assert spec.moe == _cfg()


def _mutated(name: str, field: str, value: object) -> dict:
    data = json.loads((EXAMPLES / name).read_text())
    if value is _DROP:
        del data[field]
    else:
        data[field] = value
    return data


_DROP = object()
BAD_FIELDS = [
    ("deepseek-v3.json", "hidden_size", _DROP, "'hidden_size' is missing"),
    ("deepseek-v3.json", "n_shared_experts", _DROP, "'n_shared_experts' is missing"),
    ("deepseek-v3.json", "first_k_dense_replace", _DROP, "'first_k_dense_replace' is missing"),
    ("deepseek-v3.json", "moe_intermediate_size", "2048", "'moe_intermediate_size' is '2048'"),
    ("deepseek-v3.json", "num_experts_per_tok", 0, "'num_experts_per_tok' is 0"),
    ("deepseek-v3.json", "num_experts_per_tok", 300, "'num_experts_per_tok' is 300, expected at most n_routed_experts=256"),
    ("deepseek-v3.json", "torch_dtype", _DROP, "'torch_dtype' is missing"),
    ("deepseek-v3.json", "num_hidden_layers", 3, "'num_hidden_layers' leaves no MoE layer"),
    ("qwen1.5-moe-a2.7b.json", "shared_expert_intermediate_size", _DROP,
     "'shared_expert_intermediate_size' is missing"),
    ("qwen1.5-moe-a2.7b.json", "num_experts", True, "'num_experts' is True"),
    ("qwen1.5-moe-a2.7b.json", "torch_dtype", "fp8", "'torch_dtype' is 'fp8'"),
    ("qwen1.5-moe-a2.7b.json", "mlp_only_layers", "0,1", "'mlp_only_layers' is '0,1'"),
    ("qwen3-30b-a3b.json", "num_experts", _DROP, "neither field 'n_routed_experts'"),
]


@pytest.mark.parametrize("name,field,value,message", BAD_FIELDS,
                         ids=[f"{n.split('.')[0]}-{f}-{'missing' if v is _DROP else 'wrong'}"
                              for n, f, v, _ in BAD_FIELDS])
def test_model_config_errors_name_the_field(name, field, value, message):
    with pytest.raises(ValueError) as e:
        model_spec_from_dict(_mutated(name, field, value), name)
    assert message in str(e.value) and name in str(e.value)


def test_qwen3_without_shared_field_has_no_shared_expert_but_qwen2_needs_it():
    data = _mutated("qwen3-30b-a3b.json", "model_type", "qwen2_moe")
    with pytest.raises(ValueError, match="'shared_expert_intermediate_size' is missing"):
        model_spec_from_dict(data)


def test_dtype_key_and_text_config_are_read():
    data = _mutated("qwen3-30b-a3b.json", "torch_dtype", _DROP)
    data["dtype"] = "float16"
    spec = model_spec_from_dict({"model_type": "wrapper", "text_config": data})
    assert spec.moe.dtype == torch.float16 and spec.moe.num_experts == 128


def test_model_config_file_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot read model config"):
        load_model_config(tmp_path / "nope.json")
    bad = tmp_path / "config.json"
    bad.write_text("{hidden_size: 1")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_model_config(bad)


# What is in the file -> what the error says after naming the file (issue 28: a binary file
# raised UnicodeDecodeError, which named neither the file nor what to pass).
BAD_FILES = {
    "binary": (b"\x00\x01\xff\xfe binary", "is not a UTF-8 text file (byte 0xff at offset 2)"),
    "latin-1": ('{"model_type": "caf\xe9"}'.encode("latin-1"), "is not a UTF-8 text file"),
    "empty": (b"", "is not valid JSON: Expecting value"),
    "deep": (b"[" * 100_000 + b"]" * 100_000, "nests too deeply to parse"),
    "array": (b"[1, 2]", "expected a JSON object, got list"),
    "dtype-list": (json.dumps(_mutated("qwen3-30b-a3b.json", "torch_dtype", ["bf16"])).encode(),
                   "field 'torch_dtype' is ['bf16'], expected one of"),
    "hidden-nan": (json.dumps(_mutated("qwen3-30b-a3b.json", "hidden_size",
                                       float("nan"))).encode(),
                   "field 'hidden_size' is nan, expected an integer >= 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_model_config_file_errors_name_the_file(tmp_path, case):
    content, message = BAD_FILES[case]
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        load_model_config(path)
    assert str(path) in str(e.value) and message in str(e.value)


def test_model_config_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match=f"cannot read model config {tmp_path}: Is a directory"):
        load_model_config(tmp_path)


def test_cli_plan_binary_model_config_names_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(BAD_FILES["binary"][0])
    proc = _cli("plan", "--model-config", str(path), "--ep")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"moe-plugins: error: model config {path} is not a UTF-8 text "
                                   "file (byte 0xff at offset 2); pass the path of a Hugging Face "
                                   "config.json")


# --------------------------------------------------------------------------------------------
# CLI (subprocess of the installed console script)
# --------------------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=240)


def _json_lines(proc: subprocess.CompletedProcess) -> list[dict]:
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def test_cli_plan_json_with_demo_flags():
    rows = _json_lines(_cli("plan", "--ranks", "4", "--tp", "2", "--ep", "--tokens", "5", "--json"))
    assert [r["strategy"] for r in rows] == ["ROW_SCATTER_ALLREDUCE", "SP_ALLGATHER",
                                             "GATHER_PLUS_ALLREDUCE"]
    # a layer left to itself runs ROW_SCATTER; no memory budget: SP is recommended
    assert [r["default"] for r in rows] == [True, False, False]
    assert [r["recommended"] for r in rows] == [False, True, False]
    assert "SP moves fewer TP bytes per decoder layer" in rows[1]["reason"]
    for r in rows:  # 5 tokens over tp=2: TP ranks own 3 and 2 rows, topk 2
        assert r["dispatched_pairs"] == [6, 4, 6, 4]
    assert [r["tp_collectives"] for r in rows] == [1, 1, 2]  # an integer, as in demo --json
    assert [[c["kind"] for c in r["tp_collective_detail"]] for r in rows] == [
        ["all_reduce"], ["all_gather"], ["all_gather", "all_reduce"]]
    assert rows[0]["tp_collective_detail"][0]["bytes"] == [5 * 256 * 4] * 4
    # per decoder layer the attention's reduction comes first
    assert [r["decoder_tp_collectives"] for r in rows] == [2, 2, 3]
    assert [[c["kind"] for c in r["decoder_tp_collective_detail"]] for r in rows] == [
        ["all_reduce", "all_reduce"], ["reduce_scatter", "all_gather"],
        ["all_reduce", "all_gather", "all_reduce"]]
    row = 256 * 4  # float32 rows of hidden 256; 5 tokens pad to 6 for tp 2, chunk 3
    assert rows[0]["decoder_tp_bytes"] == [2 * 5 * row] * 4
    assert rows[1]["decoder_tp_bytes"] == [6 * row + 3 * row] * 4
    # ring bytes sent: all_reduce 2 (n-1)/n, reduce_scatter (n-1)/n of its input, all_gather n-1
    assert rows[0]["decoder_tp_wire_bytes"] == [2 * 5 * row] * 4
    assert rows[1]["decoder_tp_wire_bytes"] == [3 * row + 3 * row] * 4


def test_cli_plan_tokens_per_dp_group():
    rows = _json_lines(_cli("plan", "--ranks", "4", "--ep", "--tokens-per-dp", "7,0,3,2", "--json"))
    assert [r["strategy"] for r in rows] == ["LOCAL"]
    assert rows[0]["tokens_per_dp_group"] == [7, 0, 3, 2]
    # --tokens alone: that count for every DP group; neither: the default, 8
    rows3 = _json_lines(_cli("plan", "--ranks", "4", "--ep", "--tokens", "3", "--json"))
    assert rows3[0]["tokens_per_dp_group"] == [3, 3, 3, 3]
    rows8 = _json_lines(_cli("plan", "--ranks", "4", "--ep", "--json"))
    assert rows8[0]["tokens_per_dp_group"] == [8, 8, 8, 8]
    assert rows[0]["dispatched_pairs"] == [14, 0, 6, 4]
    assert rows[0]["dispatched_rows"][1] == {"min": 0, "max": 0, "expected": 0.0}


@pytest.mark.multirank
@pytest.mark.parametrize("flags", [["--ranks", "4", "--tp", "2", "--ep", "--tokens", "5"],
                                   ["--ranks", "2", "--ep", "--tokens", "7", "--quant", "nvfp4"]],
                         ids=["dp2-tp2", "dp2-nvfp4"])
def test_cli_plan_agrees_with_demo(flags):
    """The same flags to `demo` (measured on CPU ranks) and `plan` (analytic)."""
    demo = {r["strategy"]: r for r in _json_lines(_cli("demo", *flags, "--iters", "1", "--json"))}
    plan = {r["strategy"]: r for r in _json_lines(_cli("plan", *flags, "--json"))}
    assert sorted(demo) == sorted(plan)
    for name, d in demo.items():
        p = plan[name]
        assert d["default"] == p["default"]
        assert d["dispatched_pairs"] == p["dispatched_pairs"]
        assert d["tp_collectives"] == p["tp_collectives"]
        assert d["tp_collective_bytes"] == sum(c["bytes"][0] for c in p["tp_collective_detail"])
        for measured, planned in zip(d["dispatched_bytes"], p["dispatched_bytes"]):
            assert planned["min"] <= measured <= planned["max"]


def test_cli_plan_model_config_table():
    proc = _cli("plan", "--model-config", str(EXAMPLES / "deepseek-v3.json"), "--dp", "16", "--ep",
                "--tokens", "128", "--quant", "fp8_block128")
    assert proc.returncode == 0, proc.stderr
    assert "hidden=7168 experts=256 topk=8" in proc.stdout and "moe_layers=58" in proc.stdout
    assert "wire per row: act 7168 B, x_sf 224 B, meta 96 B; combine 14336 B" in proc.stdout
    assert "LOCAL*" in proc.stdout and "* LOCAL: tp == 1" in proc.stdout


def test_cli_plan_flags_override_model_config():
    rows = _json_lines(_cli("plan", "--model-config", str(EXAMPLES / "qwen1.5-moe-a2.7b.json"),
                            "--dp", "1", "--tp", "2", "--ranks", "2", "--tokens", "6", "--topk", "2",
                            "--json"))
    assert [r["strategy"] for r in rows] == ["TP_UNIFIED"]
    assert rows[0]["num_moe_layers"] == 24 and rows[0]["dispatched_pairs"] == [0, 0]
    # routed experts TP-sharded (EP off): 60 x 3 x 1408/2 x 2048 bf16 values per rank
    assert rows[0]["expert_weight_bytes"] == [60 * 3 * 704 * 2048 * 2] * 2
    # gated shared expert, TP-sharded: 3 x 5632/2 x 2048 + gate 2048, bf16
    assert rows[0]["shared_weight_bytes"] == [(3 * 2816 * 2048 + 2048) * 2] * 2


@pytest.mark.parametrize("field,value,message", [
    ("num_experts_per_tok", _DROP, "field 'num_experts_per_tok' is missing"),
    ("hidden_size", "big", "field 'hidden_size' is 'big'"),
])
def test_cli_plan_bad_model_config(tmp_path, field, value, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_mutated("deepseek-v3.json", field, value)))
    proc = _cli("plan", "--model-config", str(path), "--ranks", "8", "--ep")
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--dp", "2", "--tp", "2", "--ranks", "8"], "--ranks 8 contradicts --dp 2 x --tp 2"),
    (["--ranks", "4", "--ep", "--backend", "nope"], "unknown moe-plugins backend 'nope'"),
    (["--ranks", "3", "--ep"], "num_experts=8 is not divisible by the EP size 3"),
    (["--ranks", "4", "--ep", "--tokens-per-dp", "7,1"],
     "--tokens-per-dp 7,1 gives 2 counts, the layout has 4 DP groups"),
    # issue 28: --tokens was silently ignored next to --tokens-per-dp
    (["--ranks", "4", "--ep", "--tokens", "5", "--tokens-per-dp", "1,2,3,4"],
     "--tokens 5 and --tokens-per-dp 1,2,3,4 both set the tokens of each DP group"),
    (["--ranks", "4", "--ep", "--tokens", "8", "--tokens-per-dp", "8,8,8,8"],
     "--tokens 8 and --tokens-per-dp 8,8,8,8 both set"),  # the default value given explicitly
    (["--ranks", "4", "--ep", "--shared-expert-budget-gb", "1e308"],
     "--shared-expert-budget-gb 1e+308 is too large to count in bytes"),
])
def test_cli_plan_usage_errors(args, message):
    proc = _cli("plan", *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------------------
# The decoder layer and the SP / ROW_SCATTER recommendation
# --------------------------------------------------------------------------------------------
def test_decoder_layer_counts_attention_and_moe():
    """Per decoder layer and TP rank (docs/design.md, "Reduction strategies"): SP moves one
    all_reduce's worth of bytes (reduce_scatter + all_gather), ROW_SCATTER two all_reduces, at
    2 launches each; with the attention's all_reduce kept under SP (vLLM's Qwen3-MoE / Llama-4)
    SP is all_reduce + all_gather."""
    cfg, tp, n, row = _cfg(torch.bfloat16), 4, 64, 256 * 2
    wire = {}
    for strategy, attn in ((S.SP_ALLGATHER, "reduce_scatter"), (S.SP_ALLGATHER, "all_reduce"),
                           (S.ROW_SCATTER_ALLREDUCE, "reduce_scatter")):
        colls = decoder_tp_collectives(strategy, cfg, n, tp, attn)
        wire[strategy, attn] = sum(LinkModel.ring_wire_bytes(k, b, tp) for k, b in colls)
        assert len(colls) == 2
    all_reduce = 2 * (tp - 1) * n * row // tp
    assert wire[S.SP_ALLGATHER, "reduce_scatter"] == all_reduce
    assert wire[S.ROW_SCATTER_ALLREDUCE, "reduce_scatter"] == 2 * all_reduce
    assert wire[S.SP_ALLGATHER, "all_reduce"] == all_reduce + (tp - 1) * n * row // tp
    assert decoder_tp_collectives(S.LOCAL, cfg, n, 1) == []


_DEEPSEEK = load_model_config(EXAMPLES / "deepseek-v3.json")


def _recommend(layout=ParallelLayout(4, 2, True), model=_DEEPSEEK, **kw):
    kw = {"supports_sp": True, "supports_row_scatter": True, "num_tokens": 128, **kw}
    return recommend_strategy(layout, model, **kw)


def test_recommendation_follows_the_shared_expert_budget():
    # DeepSeek-V3: 58 MoE layers x one shared expert of 3 x 2048 x 7168 bf16 values
    replicated = 58 * 3 * 2048 * 7168 * 2
    assert _recommend().strategy is S.SP_ALLGATHER  # no budget: SP, fewer TP bytes
    fits = _recommend(shared_expert_budget_bytes=replicated)
    assert fits.strategy is S.SP_ALLGATHER and "within the budget" in fits.reason
    over = _recommend(shared_expert_budget_bytes=replicated - 1)
    assert over.strategy is S.ROW_SCATTER_ALLREDUCE
    assert "exceed the budget" in over.reason and "4.76 GiB per rank" in over.reason
    # the numbers behind it, in the reason: 128 tokens x 7168 bf16, tp 2
    ar = 128 * 7168 * 2
    assert f"SP_ALLGATHER sends {ar} B in 2" in over.reason
    assert f"ROW_SCATTER_ALLREDUCE {2 * ar} B in 2" in over.reason
    # single collective off: SP against GATHER_PLUS_ALLREDUCE
    off = _recommend(shared_expert_budget_bytes=0, single_collective=False)
    assert off.strategy is S.GATHER_PLUS_ALLREDUCE
    with pytest.raises(ValueError, match="shared_expert_budget_bytes must be >= 0"):
        _recommend(shared_expert_budget_bytes=-1)


@pytest.mark.parametrize("layout,caps,shared", [
    (ParallelLayout(1, 4, True), (True, True), 2048),    # dp 1: TP_UNIFIED, no SP
    (ParallelLayout(4, 1, True), (True, True), 2048),    # tp 1: LOCAL
    (ParallelLayout(4, 2, True), (False, True), 2048),   # backend without SP
    (ParallelLayout(4, 2, True), (True, True), 0),       # no shared expert: SP, one all_gather
], ids=["dp1", "tp1", "no-sp-backend", "no-shared"])
def test_recommendation_without_a_choice_is_choose_strategy(layout, caps, shared):
    cfg = dataclasses.replace(_DEEPSEEK.moe, shared_intermediate=shared)
    got = _recommend(layout, cfg, supports_sp=caps[0], supports_row_scatter=caps[1],
                     shared_expert_budget_bytes=0)
    want = choose_strategy(layout, supports_sp=caps[0], supports_row_scatter=caps[1],
                           has_shared_expert=shared > 0)
    assert got == want


def test_plan_recommends_what_recommend_strategy_says():
    layout = ParallelLayout(2, 2, True)
    for budget, want in ((None, S.SP_ALLGATHER), (0, S.ROW_SCATTER_ALLREDUCE)):
        plan = plan_layer(_cfg(), layout, 8, get_backend("torch"),
                          shared_expert_budget_bytes=budget)
        assert plan.recommended.strategy is want
        assert plan.default.strategy is S.ROW_SCATTER_ALLREDUCE  # what a layer picks alone
        sp = plan.strategy(S.SP_ALLGATHER)
        rs = plan.strategy(S.ROW_SCATTER_ALLREDUCE)
        assert sp.ranks[0].shared_weight_bytes == 2 * rs.ranks[0].shared_weight_bytes - 256 * 4
        assert sp.num_decoder_tp_collectives == rs.num_decoder_tp_collectives == 2


def test_model_config_sets_the_sp_attention_reduction():
    assert _DEEPSEEK.sp_attention == "reduce_scatter"
    assert load_model_config(EXAMPLES / "qwen3-30b-a3b.json").sp_attention == "all_reduce"
    with pytest.raises(ValueError, match="sp_attention must be one of"):
        ModelSpec(_cfg(), sp_attention="all_gather")


def test_cli_plan_shared_expert_budget():
    flags = ["plan", "--model-config", str(EXAMPLES / "deepseek-v3.json"), "--dp", "4", "--tp",
             "2", "--ep", "--tokens", "128", "--json"]
    free = {r["strategy"]: r for r in _json_lines(_cli(*flags))}
    tight = {r["strategy"]: r for r in _json_lines(_cli(*flags, "--shared-expert-budget-gb", "1"))}
    assert free["SP_ALLGATHER"]["recommended"] and not free["ROW_SCATTER_ALLREDUCE"]["recommended"]
    assert tight["ROW_SCATTER_ALLREDUCE"]["recommended"]
    assert "exceed the budget of 1.00 GiB" in tight["ROW_SCATTER_ALLREDUCE"]["reason"]
    proc = _cli(*flags, "--shared-expert-budget-gb", "-1")
    assert proc.returncode == 2
    assert "argument --shared-expert-budget-gb: must be >= 0, got -1" in proc.stderr
    # issue 28: nan and inf did not name the flag (nan) or passed as no limit (inf)
    for value in ("nan", "inf", "-inf"):
        proc = _cli(*flags, "--shared-expert-budget-gb", value)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
        assert (f"argument --shared-expert-budget-gb: must be a finite number, got '{value}'"
                in proc.stderr)
    zero = {r["strategy"]: r for r in _json_lines(_cli(*flags, "--shared-expert-budget-gb", "0"))}
    assert zero["ROW_SCATTER_ALLREDUCE"]["recommended"]  # 0 is a budget, the smallest


@pytest.mark.parametrize("budget,error", [(float("nan"), TypeError), (1.5, TypeError),
                                          (True, TypeError), ("1", TypeError), (-1, ValueError)])
def test_recommendation_refuses_a_budget_that_is_not_bytes(budget, error):
    with pytest.raises(error, match="shared_expert_budget_bytes must be"):
        _recommend(shared_expert_budget_bytes=budget)


# --------------------------------------------------------------------------------------------
# Low-latency backends: what their kernels send, against their own counters
# --------------------------------------------------------------------------------------------
LL_BACKENDS = LOW_LATENCY  # the registry's low-latency backends (tests/backend_lists.py)
LL_CASES = [(ParallelLayout(2, 2, True), S.ROW_SCATTER_ALLREDUCE, (5, 3), QuantSpec()),
            (ParallelLayout(2, 2, True), S.SP_ALLGATHER, (5, 3), QuantSpec(QuantScheme.FP8_BLOCK128)),
            (ParallelLayout(4, 1, True), S.LOCAL, (3, 0, 2, 1), QuantSpec())]


@pytest.mark.multirank
@pytest.mark.parametrize("layout,strategy,tokens,quant", LL_CASES,
                         ids=[f"dp{l.dp}-tp{l.tp}-{s.value}-{_quant_id(q)}"
                              for l, s, _, q in LL_CASES])
@pytest.mark.parametrize("backend", LL_BACKENDS)
def test_low_latency_plan_equals_the_backends_counters(rank_pool, backend, layout, strategy,
                                                       tokens, quant):
    """hidden 256 travels as 2048 (the smallest kernel size) with a 16-byte header per
    (token, expert) message. The plan's sent bytes equal the backend's DispatchStats; with the
    measured routing, what each rank received in the dispatch equals what torch.distributed
    delivered to it through the emulated kernels' all-to-all."""
    from tests.planner import plan_ranks as prf

    cfg = _cfg(torch.bfloat16)
    results = rank_pool(layout.world_size).run(prf.measure_ll_layer, backend, layout, cfg,
                                               strategy, tokens, quant)
    assert_matches_reference(results, layout, cfg, list(tokens), quant)
    routing = Routing.from_topk_ids([r["prepared_topk_ids"] for r in results], cfg.num_experts)
    for given in (None, routing):
        plan = plan_layer(cfg, layout, tokens, get_backend(backend), quant, routing=given)
        assert plan.wire.wire_hidden == 2048 and plan.wire.per_pair
        sp = plan.strategy(strategy)
        for rp, res in zip(sp.ranks, results):
            st = res["stats"]
            assert rp.pairs == st["pairs"] and rp.rows.min == rp.rows.max == st["rows"]
            assert (rp.act_bytes.min, rp.sf_bytes.min, rp.meta_bytes.min) == (
                st["act_bytes"], st["sf_bytes"], st["meta_bytes"])
            assert rp.meta_bytes.min == 16 * st["pairs"]
            # the backend counts combine rows coming back to its own pairs
            assert rp.recv_combine_bytes.min == st["combine_bytes"] == st["pairs"] * 2048 * 2
            planned = [(c.kind, c.bytes) for c in rp.tp_collectives]
            assert planned == res["recorded"]
            assert planned == [(_kind(n), b) for n, b in res["calls"] if n != "all_to_all_single"]
    for rp, res in zip(sp.ranks, results):
        a2a = [b for n, b in res["calls"] if n == "all_to_all_single"]
        # dispatch: message counts, then the messages; combine: the same again
        assert len(a2a) == 4 and a2a[0] == layout.world_size * 8
        assert rp.recv_dispatch_bytes.is_exact and rp.recv_dispatch_bytes.min == a2a[1]


@pytest.mark.parametrize("backend", LL_BACKENDS)
@pytest.mark.parametrize("change,message", [
    (dict(dtype=torch.float32), "the low-latency kernels move bfloat16 activations"),
    (dict(hidden=8320), "hidden=8320 is larger than the largest hidden size"),
    (dict(num_topk=12, num_experts=16), "num_topk=12 exceeds the dispatch kernel's limit of 11"),
])
def test_plan_refuses_what_the_low_latency_backend_refuses(backend, change, message):
    cfg = dataclasses.replace(_cfg(torch.bfloat16), **change)
    with pytest.raises(ValueError, match=message) as e:
        plan_layer(cfg, ParallelLayout(2, 1, True), 4, get_backend(backend))
    if "hidden" not in change:
        assert str(e.value).startswith(f"{backend}: ")  # the backend's own error, by name
    # pad_hidden=False: a hidden that is not a kernel size is the backend's error too
    if "hidden" not in change:
        return
    opts = get_backend(backend).manager.options_type(pad_hidden=False)
    with pytest.raises(ValueError, match="hidden=256 is not a size the kernels are compiled for"):
        plan_layer(_cfg(torch.bfloat16), ParallelLayout(2, 1, True), 4, get_backend(backend),
                   backend_options=opts)


def test_cli_plan_low_latency_padding_and_refusal():
    flags = ["plan", "--ranks", "4", "--ep", "--tokens", "4", "--backend", "deepep_ll"]
    rows = _json_lines(_cli(*flags, "--dtype", "bfloat16", "--json"))
    assert rows[0]["wire_hidden"] == 2048
    assert rows[0]["dispatch_meta_bytes"][0]["min"] == 4 * 2 * 16  # tokens x topk x header
    proc = _cli(*flags)  # float32 by default
    assert proc.returncode == 2
    assert "deepep_ll: the low-latency kernels move bfloat16 activations" in proc.stderr


def test_cli_plan_sp_attention():
    """Qwen-family configs keep the attention's all_reduce under SP (vLLM's Qwen3-MoE); the flag
    overrides what the config implies."""
    flags = ["plan", "--ranks", "4", "--tp", "2", "--ep", "--tokens", "4", "--json"]
    kinds = {}
    for extra in ([], ["--sp-attention", "all_reduce"]):
        rows = {r["strategy"]: r for r in _json_lines(_cli(*flags, *extra))}
        sp = rows["SP_ALLGATHER"]
        kinds[tuple(extra)] = [c["kind"] for c in sp["decoder_tp_collective_detail"]]
        assert sp["sp_attention"] == (extra[1] if extra else "reduce_scatter")
    assert kinds[()] == ["reduce_scatter", "all_gather"]
    assert kinds[("--sp-attention", "all_reduce")] == ["all_reduce", "all_gather"]
