"""Expert placement as data (moe_plugins.placement): the tables, the layout helpers, and layers on
gloo ranks under random placements with redundant experts, EPLB rebalances between forward
passes and shared-expert overlap, element-wise against the single-process reference."""
from __future__ import annotations

import pytest
import torch

from tests.backend_lists import PLACEMENTS
from tests.contracts import placement_ranks as prf
from tests.checks import assert_matches_reference
from moe_plugins.layout import ParallelLayout, destination_ranks, local_expert_ids
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights
from moe_plugins.placement import ExpertPlacement
from moe_plugins.registry import get_backend
from moe_plugins.runner.reference import tolerance_for
from moe_plugins.strategy import ReductionStrategy as S


# -- the tables ------------------------------------------------------------------------------

def test_linear_and_round_robin_tables():
    lin = ExpertPlacement.linear(8, 2)
    assert lin.is_linear and lin.local_logical(1) == [4, 5, 6, 7]
    rr = ExpertPlacement.round_robin(8, 2)
    assert not rr.is_linear
    assert rr.local_logical(0) == [0, 2, 4, 6] and rr.local_logical(1) == [1, 3, 5, 7]
    # logical e sits on rank e % 2 in slot e // 2
    g2p = rr.global_to_physical()
    assert torch.equal(rr.rank_of(g2p), torch.arange(8) % 2)
    assert torch.equal(g2p % rr.num_local, torch.arange(8) // 2)


def test_to_physical_lands_on_a_replica_and_spreads_them():
    p = ExpertPlacement.eplb([3, 0, 1, 3, 2, 3], num_ranks=2)
    assert (p.num_logical, p.num_physical, p.num_local, p.num_redundant) == (4, 6, 3, 2)
    logical = torch.full((9, 1), 3)
    phys = p.to_physical(logical)
    assert all(p.physical_to_logical[int(i)] == 3 for i in phys.flatten())
    assert set(phys.flatten().tolist()) == {0, 3, 5}  # every replica of expert 3 used
    table, count = p.logical_to_physical_map()
    assert count.tolist() == [1, 1, 1, 3] and table[3].tolist() == [0, 3, 5]
    with pytest.raises(ValueError, match="redundant copies"):
        p.global_to_physical()


@pytest.mark.parametrize("bad,match", [
    (dict(num_ranks=2, num_logical=4, physical_to_logical=(0, 1, 2)), "evenly"),
    (dict(num_ranks=2, num_logical=4, physical_to_logical=(0, 1, 2, 2)), r"missing \[3\]"),
    (dict(num_ranks=1, num_logical=2, physical_to_logical=(0, 1, 5, 1)), r"out of range \[5\]"),
])
def test_invalid_placements_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        ExpertPlacement(**bad)


def test_layout_helpers_follow_the_placement():
    p = prf.random_placement(8, 4, 4, seed=3)  # 12 physical experts, 3 per rank
    ids = torch.randint(0, p.num_physical, (10, 3))
    hit = destination_ranks(ids, p)
    for t in range(10):
        expected = {int(i) // 3 for i in ids[t]}
        assert set(hit[t].nonzero().flatten().tolist()) == expected
    for rank in range(4):
        local = local_expert_ids(ids, p, rank)
        for (t, k), slot in zip(torch.cartesian_prod(torch.arange(10), torch.arange(3)).tolist(),
                                local.flatten().tolist()):
            held = [rank * 3 + j for j in range(3)]
            assert slot == (held.index(int(ids[t, k])) if int(ids[t, k]) in held else -1)


def test_local_experts_load_the_slots_logical_weights():
    cfg = MoEConfig(hidden=16, num_experts=4, num_topk=2, intermediate=8, shared_intermediate=0)
    w = MoEWeights.random(cfg, 0)
    p = ExpertPlacement.eplb([3, 0, 1, 3, 2, 3], num_ranks=2)
    local = w.local_experts(2, 1, p)
    assert local.first_expert == 3
    for slot, e in enumerate([3, 2, 3]):
        assert torch.equal(local.w13[slot], w.w13[e]) and torch.equal(local.w2[slot], w.w2[e])


# -- layers on gloo ranks --------------------------------------------------------------------

def _cfg(dtype: torch.dtype, hidden: int) -> MoEConfig:
    return MoEConfig(hidden=hidden, num_experts=8, num_topk=3, intermediate=32,
                     shared_intermediate=64, dtype=dtype)


def _dtype_hidden(backend: str) -> tuple[torch.dtype, int]:
    """float32 where the kernels take any dtype; else bfloat16 at hidden 2048, the smallest
    hidden the low-latency kernels run unpadded (deepep_auto's low-latency side too)."""
    return (torch.float32, 128) if get_backend(backend).dtypes is None else (torch.bfloat16, 2048)


# (backend, dtype, hidden) of every backend with the placements capability (the registry's,
# tests/backend_lists.py)
BACKENDS = [(b, *_dtype_hidden(b)) for b in PLACEMENTS]
IDS = [b[0] for b in BACKENDS]
LAYOUTS = [(ParallelLayout(2, 1, True), S.LOCAL),
           (ParallelLayout(2, 2, True), S.ROW_SCATTER_ALLREDUCE)]


@pytest.mark.multirank
@pytest.mark.parametrize("layout,strategy", LAYOUTS, ids=["dp2-tp1", "dp2-tp2-row_scatter"])
@pytest.mark.parametrize("backend,dtype,hidden", BACKENDS, ids=IDS)
def test_random_redundant_placement_matches_reference(rank_pool, backend, dtype, hidden, layout,
                                                      strategy):
    cfg = _cfg(dtype, hidden)
    world = layout.world_size
    placements = [prf.random_placement(8, world, world * 2, seed=s) for s in (1, 2)]
    results = rank_pool(world).run(prf.run_placed_layer, backend, layout, cfg, strategy, 9,
                                   placements)
    # placements[1] is reached by a rebalance of the layer built for placements[0]
    _check_outputs(results, layout, cfg, 9, len(placements))
    w = MoEWeights.random(cfg, 0)
    for rank, res in enumerate(results):
        assert res["held"] == [p.local_logical(rank) for p in placements]
        assert torch.equal(res["experts_w13"], w.w13[placements[-1].local_logical(rank)])
    # not vacuous: the two maps differ and some logical expert has several replicas
    assert placements[0] != placements[1]
    assert all(p.num_redundant > 0 for p in placements)


def _check_outputs(results: list[dict], layout: ParallelLayout, cfg: MoEConfig, num_tokens: int,
                   passes: int) -> None:
    for i in range(passes):
        for res in results:
            res[f"out{i}"] = res["outs"][i]
        assert_matches_reference(results, layout, cfg, num_tokens, key=f"out{i}")


@pytest.mark.multirank
@pytest.mark.parametrize("backend,dtype,hidden", BACKENDS, ids=IDS)
def test_round_robin_placement_matches_reference(rank_pool, backend, dtype, hidden):
    cfg, layout = _cfg(dtype, hidden), ParallelLayout(4, 1, True)
    results = rank_pool(4).run(prf.run_placed_layer, backend, layout, cfg, S.LOCAL, 5,
                               [ExpertPlacement.round_robin(8, 4)])
    _check_outputs(results, layout, cfg, 5, 1)
    assert [r["held"][0] for r in results] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.multirank
@pytest.mark.parametrize("backend,dtype,hidden", BACKENDS, ids=IDS)
def test_eplb_rebalance_between_passes_keeps_outputs(rank_pool, backend, dtype, hidden):
    """linear -> EPLB's (redundant copies) -> another EPLB map, on one layer: weights moved, map
    changed, every pass equals the reference and the first pass."""
    cfg, layout = _cfg(dtype, hidden), ParallelLayout(2, 2, True)
    linear_with_spares = ExpertPlacement.eplb(list(range(8)) + [0, 1, 2, 3, 4, 5, 6, 7], 4)
    placements = [linear_with_spares, prf.random_placement(8, 4, 8, seed=5),
                  prf.random_placement(8, 4, 8, seed=6)]
    results = rank_pool(4).run(prf.run_placed_layer, backend, layout, cfg,
                               S.ROW_SCATTER_ALLREDUCE, 9, placements)
    _check_outputs(results, layout, cfg, 9, 3)
    for res in results:
        assert res["held"][0] != res["held"][1] or res["held"][1] != res["held"][2]
        atol, rtol = tolerance_for(res["outs"][0].float(), dtype)
        for out in res["outs"][1:]:
            torch.testing.assert_close(out.float(), res["outs"][0].float(), atol=atol, rtol=rtol)
    assert not all(torch.equal(a["ids"][0], a["ids"][1]) for a in results)  # the map changed


@pytest.mark.multirank
@pytest.mark.parametrize("backend,dtype,hidden", BACKENDS, ids=IDS)
def test_shared_overlap_with_eplb_equals_overlap_off(rank_pool, backend, dtype, hidden):
    """vLLM #28377 (EPLB + DeepEP LL + shared-expert overlap gave wrong answers): with EPLB's
    placement and a rebalance, overlap on gives exactly the outputs of overlap off."""
    cfg, layout = _cfg(dtype, hidden), ParallelLayout(2, 2, True)
    placements = [prf.random_placement(8, 4, 4, seed=7), prf.random_placement(8, 4, 4, seed=8)]
    pool = rank_pool(4)
    off = pool.run(prf.run_placed_layer, backend, layout, cfg, S.ROW_SCATTER_ALLREDUCE, 9,
                   placements, False)
    on = pool.run(prf.run_placed_layer, backend, layout, cfg, S.ROW_SCATTER_ALLREDUCE, 9,
                  placements, True)
    for a, b in zip(off, on):
        for x, y in zip(a["outs"], b["outs"]):
            assert torch.equal(x, y)
    _check_outputs(on, layout, cfg, 9, 2)


# -- the capability matrix and the plan --------------------------------------------------------

def test_registry_refuses_a_placement_for_a_linear_only_backend():
    import dataclasses

    from moe_plugins.quant import QuantScheme
    from moe_plugins.registry import get_backend, refusal_reason

    spec = get_backend("torch")
    linear_only = dataclasses.replace(
        spec, name="linear_only",
        capabilities=dataclasses.replace(spec.capabilities, placements=False))
    layout, rr = ParallelLayout(2, 1, True), ExpertPlacement.round_robin(8, 2)
    assert refusal_reason(spec, layout, QuantScheme.NONE, placement=rr) is None
    why = refusal_reason(linear_only, layout, QuantScheme.NONE, placement=rr)
    assert why is not None and "round_robin" in why and "contiguous expert blocks" in why
    assert refusal_reason(linear_only, layout, QuantScheme.NONE,
                          placement=ExpertPlacement.linear(8, 2)) is None


def test_plan_counts_the_redundant_copies_memory():
    from moe_plugins.planner.plan import plan_layer
    from moe_plugins.registry import get_backend

    cfg = _cfg(torch.float32, 128)
    layout = ParallelLayout(2, 1, True)
    spares = ExpertPlacement.eplb(list(range(8)) + [0, 1, 2, 3], 2)  # 6 slots per rank, not 4
    lin = plan_layer(cfg, layout, 8, get_backend("torch"))
    eplb = plan_layer(cfg, layout, 8, get_backend("torch"), placement=spares)
    a, b = lin.strategies[0].ranks[0], eplb.strategies[0].ranks[0]
    assert b.expert_weight_bytes * 4 == a.expert_weight_bytes * 6
    assert eplb.placement == spares and lin.placement is None
