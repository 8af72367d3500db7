"""Multi-rank (real gloo process groups on 127.0.0.1) against the single-process reference."""
from __future__ import annotations

import pytest
import torch

from tests.runner import multirank_ranks as rank_fns
from tests.checks import assert_matches_reference
from moe_plugins.runner.launch import RankError
from moe_plugins.layout import ParallelLayout
from moe_plugins.config import MoEConfig
from moe_plugins.quant import QuantScheme, QuantSpec
from moe_plugins.strategy import ReductionStrategy as S

pytestmark = pytest.mark.multirank


def _cfg(dtype: torch.dtype = torch.float32, **kw: object) -> MoEConfig:
    return MoEConfig(**{"hidden": 256, "num_experts": 8, "num_topk": 2, "intermediate": 64,
                        "shared_intermediate": 128, "dtype": dtype, **kw})


LAYOUTS = [
    (ParallelLayout(1, 2, False), S.TP_UNIFIED),
    (ParallelLayout(1, 4, False), S.TP_UNIFIED),
    (ParallelLayout(1, 2, True), S.TP_UNIFIED),
    (ParallelLayout(2, 1, True), S.LOCAL),
    (ParallelLayout(4, 1, True), S.LOCAL),
    (ParallelLayout(2, 2, True), S.SP_ALLGATHER),
    (ParallelLayout(2, 2, True), S.ROW_SCATTER_ALLREDUCE),
    (ParallelLayout(2, 2, True), S.GATHER_PLUS_ALLREDUCE),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout,strategy", LAYOUTS,
                         ids=[f"dp{l.dp}-tp{l.tp}-{'ep' if l.ep else 'noep'}-{s.value}"
                              for l, s in LAYOUTS])
def test_layout_matches_reference(rank_pool, layout, strategy, dtype):
    cfg = _cfg(dtype)
    results = rank_pool(layout.world_size).run(rank_fns.run_layer, layout, cfg, strategy, 8)
    assert all(r["strategy"] is strategy for r in results)
    assert_matches_reference(results, layout, cfg, 8)


TOKEN_LAYOUTS = [
    (ParallelLayout(1, 2, True), S.ROW_SCATTER_ALLREDUCE),
    (ParallelLayout(1, 4, True), S.ROW_SCATTER_ALLREDUCE),
    (ParallelLayout(1, 4, True), S.GATHER_PLUS_ALLREDUCE),
    (ParallelLayout(2, 2, True), S.SP_ALLGATHER),
]


@pytest.mark.parametrize("num_tokens", [1, 3, 5, 8, 9])
@pytest.mark.parametrize("layout,strategy", TOKEN_LAYOUTS,
                         ids=[f"dp{l.dp}-tp{l.tp}-{s.value}" for l, s in TOKEN_LAYOUTS])
def test_ragged_token_counts(rank_pool, layout, strategy, num_tokens):
    """Ragged tails and TP ranks that own zero rows (1 token over tp=4: three ranks own none)."""
    cfg = _cfg()
    results = rank_pool(layout.world_size).run(rank_fns.run_layer, layout, cfg, strategy, num_tokens)
    assert_matches_reference(results, layout, cfg, num_tokens)
    # Every rank dispatched exactly its owned rows x topk pairs, never num_tokens x topk.
    for r in results:
        assert r["pairs"] == r["owned"] * cfg.num_topk
    assert sum(r["owned"] for r in results) == num_tokens * layout.dp


def _tp_collectives(calls: list[tuple[str, int]]) -> list[str]:
    return [name for name, _ in calls if name != "all_to_all_single"]


def test_row_scatter_needs_one_tp_collective_where_gather_needs_two(rank_pool):
    layout, cfg = ParallelLayout(2, 2, True), _cfg()
    pool = rank_pool(4)
    row = pool.run(rank_fns.run_layer, layout, cfg, S.ROW_SCATTER_ALLREDUCE, 9)
    gather = pool.run(rank_fns.run_layer, layout, cfg, S.GATHER_PLUS_ALLREDUCE, 9)
    for r, g in zip(row, gather):
        torch.testing.assert_close(r["out"], g["out"], atol=1e-5, rtol=1e-5)
        # counted by wrapping torch.distributed itself, not by the layer's own log
        assert _tp_collectives(r["calls"]) == ["all_reduce"]
        assert sorted(_tp_collectives(g["calls"])) == ["all_gather_single", "all_reduce"] or \
            sorted(_tp_collectives(g["calls"])) == ["all_gather_into_tensor", "all_reduce"]
        # and the layer's own log agrees with what torch.distributed saw
        assert [k for k, _ in r["recorded"]] == ["all_reduce"]
        assert sorted(k for k, _ in g["recorded"]) == ["all_gather", "all_reduce"]


def test_sp_allgather_is_one_all_gather(rank_pool):
    results = rank_pool(4).run(rank_fns.run_layer, ParallelLayout(2, 2, True), _cfg(),
                               S.SP_ALLGATHER, 5)
    for r in results:
        assert len(_tp_collectives(r["calls"])) == 1
        assert _tp_collectives(r["calls"])[0].startswith("all_gather")


def test_tp_unified_does_not_dispatch(rank_pool):
    results = rank_pool(2).run(rank_fns.run_layer, ParallelLayout(1, 2, True), _cfg(),
                               S.TP_UNIFIED, 8)
    for r in results:
        assert [n for n, _ in r["calls"]] == ["all_reduce"] and r["pairs"] == 0


def test_token_goes_to_each_rank_once(rank_pool):
    """topk 4 of 8 experts over 2 ranks: a token hitting both ranks' experts is sent twice, never
    4 times; rows sent <= pairs and <= owned x ranks."""
    cfg = _cfg(num_topk=4)
    results = rank_pool(2).run(rank_fns.run_layer, ParallelLayout(2, 1, True), cfg, S.LOCAL, 8)
    for r in results:
        assert r["pairs"] == 8 * 4
        assert 8 <= r["rows_sent"] <= 8 * 2
    assert_matches_reference(results, ParallelLayout(2, 1, True), cfg, 8)


QUANTS = [
    QuantSpec(QuantScheme.FP8_BLOCK128),
    QuantSpec(QuantScheme.FP8_BLOCK128, defer_input_quant=True),
    QuantSpec(QuantScheme.NVFP4),
    QuantSpec(QuantScheme.NVFP4, defer_input_quant=True),
]


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.scheme.value + ("-deferred" if q.defer_input_quant else ""))
def test_quantized_dispatch_matches_reference(rank_pool, quant):
    layout, cfg = ParallelLayout(2, 2, True), _cfg()
    results = rank_pool(4).run(rank_fns.run_layer, layout, cfg, S.ROW_SCATTER_ALLREDUCE, 9, quant)
    assert_matches_reference(results, layout, cfg, 9, quant)
    for r in results:
        assert (r["sf_bytes"] > 0) == (quant.quantized_on_wire and r["owned"] > 0)


@pytest.mark.parametrize("scheme", [QuantScheme.FP8_BLOCK128, QuantScheme.NVFP4])
def test_deferred_quant_equals_dispatch_quant(rank_pool, scheme):
    """Deferred quant rounds in the experts exactly as dispatch would: identical outputs."""
    layout, cfg, pool = ParallelLayout(2, 1, True), _cfg(), rank_pool(2)
    early = pool.run(rank_fns.run_layer, layout, cfg, S.LOCAL, 8, QuantSpec(scheme))
    late = pool.run(rank_fns.run_layer, layout, cfg, S.LOCAL, 8, QuantSpec(scheme, True))
    for a, b in zip(early, late):
        torch.testing.assert_close(a["out"], b["out"], atol=1e-6, rtol=1e-6)


X_SF_CASES = [
    (QuantSpec(), torch.float32, None),
    (QuantSpec(QuantScheme.FP8_BLOCK128), torch.float8_e4m3fn, (torch.float32, 256 // 128)),
    (QuantSpec(QuantScheme.FP8_BLOCK128, defer_input_quant=True), torch.float32, None),
    (QuantSpec(QuantScheme.NVFP4), torch.uint8, (torch.float8_e4m3fn, 256 // 16)),
    (QuantSpec(QuantScheme.NVFP4, defer_input_quant=True), torch.float32, None),
]


@pytest.mark.parametrize("quant,x_dtype,sf", X_SF_CASES,
                         ids=["none", "fp8", "fp8-deferred", "nvfp4", "nvfp4-deferred"])
def test_prepare_x_sf(rank_pool, quant, x_dtype, sf):
    results = rank_pool(2).run(rank_fns.run_prepare, ParallelLayout(2, 1, True), _cfg(), 8, quant)
    for r in results:
        assert r["x_dtype"] == x_dtype
        recv = r["x_shape"][0]
        if sf is None:
            assert r["x_sf"] is None
            # the header, then one message per row (ids, weights, x): no scale traffic at all
            assert r["a2a_calls"] == 2 and r["sf_bytes"] == 0
        else:
            assert r["x_sf"] == (sf[0], (recv, sf[1]))
            # the scales travel in the rows' one message too
            assert r["a2a_calls"] == 2 and r["sf_bytes"] > 0


@pytest.mark.parametrize("quant", [QuantSpec(), QuantSpec(QuantScheme.FP8_BLOCK128)],
                         ids=["none", "fp8"])
def test_prepared_rows_are_row_major_even_for_one_row(rank_pool, quant):
    """The rows travel packed (ids, weights, x, scales in one message); what prepare hands the
    experts has row-major strides, one received row included (vLLM's CPU experts read the
    row stride: a view of the packed row would give theirs the message's)."""
    cfg = _cfg()
    for r in rank_pool(1).run(rank_fns.run_prepare, ParallelLayout(1, 1, True), cfg, 1, quant):
        assert r["x_shape"][0] == 1
        assert r["x_stride"] == (r["x_shape"][1], 1)
        assert r["weights_stride"] == (cfg.num_topk, 1)
        if r["x_sf"] is not None:
            assert r["x_sf_stride"] == (r["x_sf"][1][1], 1)


def test_prepare_rejects_mismatched_token_counts(rank_pool):
    with pytest.raises(RankError) as e:
        rank_pool(2).run(rank_fns.prepare_mismatched, ParallelLayout(2, 1, True), _cfg())
    assert e.value.exc_type == "ValueError"
    assert "(4, 256)" in e.value.message and "(8, 2)" in e.value.message


def test_expert_token_counts_match_received_rows(rank_pool):
    """The per-expert counts (made when read) equal the received rows' local ids and, computed
    here from every DP rank's routing, the tokens routed to each of the rank's experts."""
    from moe_plugins.runner.demo import demo_inputs
    from moe_plugins.runner.model import MoEWeights, route

    cfg, n = _cfg(num_topk=4), 9
    router = MoEWeights.random(cfg, 0).router
    routed = torch.cat([route(demo_inputs(cfg, n, dp, 0), router, cfg.num_topk,
                              cfg.renormalize)[1] for dp in range(2)])  # [2 * n, num_topk]
    per_rank = cfg.num_experts // 2
    results = rank_pool(2).run(rank_fns.expert_counts, ParallelLayout(2, 1, True), cfg, n)
    for rank, r in enumerate(results):
        ids = r["local_ids"]
        expected = [int((ids == e).any(dim=1).sum()) for e in range(per_rank)]
        assert r["counts"].dtype == torch.int32 and r["counts"].tolist() == expected
        assert expected == [int((routed == rank * per_rank + e).sum()) for e in range(per_rank)]
        assert sum(expected) > 0


def test_manager_calls_the_process_group_and_the_public_function_under_a_trace(rank_pool):
    """The torch backend's all-to-alls go to the process group's own method eager (no
    ``dist.all_to_all_single`` wrapper), and to the public function while torch.compile traces;
    both give the same result bit for bit, with the same three all-to-alls per forward."""
    layout = ParallelLayout(2, 1, True)
    results = rank_pool(2).run(rank_fns.run_compiling_and_eager, layout, _cfg(), 5)
    for r in results:
        assert r["eager"]["a2a"] == r["compiling"]["a2a"] == 3  # header, dispatch, combine
        assert r["eager"]["public"] == 0 and r["compiling"]["public"] == 3
        assert torch.equal(r["eager"]["out"], r["compiling"]["out"])


def test_a_blocking_call_that_returns_no_work_is_not_waited_on():
    """A backend that completes a blocking all-to-all in C++ returns no work object (NCCL in
    torch 2.11 on the current stream; dist.all_to_all_single allows for it): the backend's
    blocking all-to-all returns the received rows without waiting on anything."""
    import torch.distributed as dist

    from types import SimpleNamespace

    from moe_plugins.prepare_finalize.torch import TorchPrepareFinalize

    class _SyncInCpp:  # the ProcessGroup surface the backend calls, completing at once
        def alltoall_base(self, recv, send, recv_splits, send_splits, opts):
            assert opts.asyncOp is False
            recv.copy_(send)
            return None

    blocking = dist.AllToAllOptions()
    blocking.asyncOp = False
    pf = object.__new__(TorchPrepareFinalize)
    pf.manager = SimpleNamespace(group=None, pg=_SyncInCpp(), blocking_opts=blocking,
                                 async_opts=dist.AllToAllOptions())
    rows = torch.arange(12.0).view(4, 3)
    got, work = pf._all_to_all(rows, [4], [4], blocking=True)
    assert work is None and torch.equal(got, rows)
    header = torch.arange(4).view(1, 4)
    assert torch.equal(pf._exchange_header(header), header)
