"""A rank's death costs one call, not the layer (``MoELayer(on_peer_loss=...)``): EP 4 on gloo
CPU ranks over the emulated DeepEP LL (``enable_shrink``) and NIXL EP, 8 logical experts with 2
replicas each on different ranks; rank 3 SIGKILLed, or SIGSTOPped and later continued, inside
its experts of call 3. Every survivor's faulted call raises the retryable PeerLostError naming
rank 3; its next calls equal the single-process reference element-wise; every process ends.

The libraries' kernel timeout is 6 s (peer_loss_ranks.LIBRARY_TIMEOUT_S): a survivor's wait
already spinning on the dead peer ends there, as the real kernels' does. The time from the
death to each survivor's first correct call is printed (and written as JSON lines to
``$MOE_PEER_LOSS_RESULTS`` when set): a record, not a check.
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from moe_plugins.runner.demo import demo_inputs
from moe_plugins.runner.launch import RankPool
from moe_plugins.runner.model import MoEWeights
from moe_plugins.runner.reference import reference_moe, tolerance_for
from moe_plugins.survival.rehoming import rehome
from moe_plugins.placement import ExpertPlacement
from tests.runner import peer_loss_ranks as ranks

BACKENDS = ["deepep_ll", "nixl_ep"]
WORLD = 4
pytestmark = pytest.mark.multirank


def _run(backend: str, fault: str, **kw: object) -> tuple[list, object]:
    with RankPool(WORLD, timeout_s=60) as pool:
        run = pool.run_bounded(ranks.survive, backend, fault, deadline_s=150, stop_on_death=False,
                               stall_s=60, **kw)
        pids = [p.pid for p in pool._procs]
    for pid in pids:  # no stray process: every rank reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    return run.outcomes, run


def _assert_exact(row: dict, rank: int, weights: MoEWeights) -> None:
    x = demo_inputs(ranks.CFG, ranks.TOKENS, 0, row["seed"])
    ref = reference_moe(x, weights)
    atol, rtol = tolerance_for(ref, ranks.CFG.dtype)
    torch.testing.assert_close(row["out"].float(), ref, atol=atol, rtol=rtol,
                               msg=lambda m: f"rank {rank} call {row['call']}: {m}")


def _record(backend: str, fault: str, outcomes: list) -> None:
    lines = []
    for o in outcomes[:ranks.VICTIM]:
        v = o.value
        lines.append(dict(backend=backend, fault=fault, rank=o.rank,
                          death_to_first_correct_s=v["death_to_first_correct_s"],
                          detection_silence_s=[d["silent_s"] for d in v["decisions"]],
                          conditions="EP 4 gloo CPU ranks, emulated library, store fabric, "
                                     "detect_s=2 and library timeout "
                                     f"{ranks.LIBRARY_TIMEOUT_S:g} s unless the fault says"))
    for line in lines:
        print(json.dumps(line))
    path = os.environ.get("MOE_PEER_LOSS_RESULTS")
    if path:
        with open(path, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


def _survivors_continue(backend: str, fault: str, outcomes: list) -> None:
    weights = MoEWeights.random(ranks.CFG, 0)
    for o in outcomes[:ranks.VICTIM]:
        assert o.status == "ok", o.describe()
        rows = o.value["rows"]
        before = rows[:ranks.FAULT_CALL - 1]
        faulted = rows[len(before)]
        after = rows[len(before) + 1:]
        for row in before:
            _assert_exact(row, o.rank, weights)
        assert faulted["error"] == "PeerLostError", faulted
        assert faulted["retryable"] is True and faulted["lost_ranks"] == (ranks.VICTIM,)
        assert "the layer continues" in faulted["text"] and "[3]" in faulted["text"]
        assert len(after) == 5
        for row in after:  # every later call exact, all experts present
            assert "out" in row, row
            _assert_exact(row, o.rank, weights)
    _record(backend, fault, outcomes)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_killed_peer_costs_one_call(backend):
    outcomes, run = _run(backend, "kill")
    victim = outcomes[ranks.VICTIM]
    assert victim.status == "died" and "SIGKILL" in victim.cause, victim.describe()
    _survivors_continue(backend, "kill", outcomes)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_library_timeout_shorter_than_the_detection_is_a_detection_too(backend):
    """The library's kernels time out on the dead peer (3 s) before the heartbeat would find it
    (detect_s=10) and mask it themselves: that mask is proposed to the group, so the faulted
    call still raises PeerLostError (not the PeerMaskedError of a layer without on_peer_loss)
    and the next calls are exact."""
    outcomes, _ = _run(backend, "kill", detect_s=10.0, library_timeout_s=3.0)
    _survivors_continue(backend, "kill, library timeout 3 s, detect_s=10", outcomes)
    for o in outcomes[:ranks.VICTIM]:
        assert o.value["death_to_first_correct_s"] < 10.0, o.value  # before any heartbeat


def test_the_call_bound_and_continuing_work_together():
    """A 30 s call bound: the faulted call ends in PeerLostError, not in the watchdog."""
    outcomes, _ = _run("nixl_ep", "kill", call_timeout_s=30.0)
    _survivors_continue("nixl_ep", "kill, bound 30 s", outcomes)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stopped_peer_costs_one_call_and_ends_with_our_error_when_continued(backend):
    outcomes, run = _run(backend, "stop")
    _survivors_continue(backend, "stop", outcomes)
    victim = outcomes[ranks.VICTIM]
    assert victim.status == "ok", victim.describe()
    rows = victim.value["rows"]
    # continued, it wrote nothing a survivor read (their calls after the wake are exact, above)
    # and its faulted call and every later one end with our error
    assert [r.get("error") for r in rows[ranks.FAULT_CALL - 1:]] == ["RankEvictedError"] * 2
    assert "declared it lost" in rows[-1]["text"]


def test_a_lost_expert_without_replica_stops_the_layer():
    outcomes, _ = _run("nixl_ep", "kill", redundant=False)
    for o in outcomes[:ranks.VICTIM]:
        assert o.status == "ok", o.describe()
        rows = o.value["rows"]
        lost, after = rows[ranks.FAULT_CALL - 1], rows[ranks.FAULT_CALL]
        assert lost["error"] == "ExpertsLostError" and lost["retryable"] is False
        assert lost["lost_experts"] == (6, 7) and lost["lost_ranks"] == (3,)
        assert "[6, 7]" in lost["text"] and "at least two ranks" in lost["text"]
        assert after["error"] == "LayerBrokenError"


def test_degraded_mode_leaves_the_lost_experts_terms_out(caplog):
    outcomes, _ = _run("deepep_ll", "kill", redundant=False, degraded=True)
    weights = MoEWeights.random(ranks.CFG, 0)
    w2 = weights.w2.clone()
    w2[[6, 7]] = 0  # the reference without experts 6 and 7's terms (weights not renormalized)
    without = dataclasses.replace(weights, w2=w2)
    for o in outcomes[:ranks.VICTIM]:
        assert o.status == "ok", o.describe()
        rows = o.value["rows"]
        faulted = rows[ranks.FAULT_CALL - 1]
        assert faulted["error"] == "PeerLostError" and faulted["lost_experts"] == (6, 7)
        for row in rows[ranks.FAULT_CALL:]:
            _assert_exact(row, o.rank, without)
        with pytest.raises(AssertionError):  # and they do differ from the full reference
            _assert_exact(rows[-1], o.rank, weights)


def test_rehoming_uses_only_surviving_replicas():
    placement = ranks.redundant_placement()
    plan = rehome(placement, [3])
    assert plan.lost_experts == ()
    ids = torch.arange(8).repeat(5, 1)  # every logical expert, 5 tokens
    phys = plan.placement.to_physical(ids)
    assert not bool((plan.placement.rank_of(phys) == 3).any())
    assert (torch.tensor(placement.physical_to_logical)[phys] == ids).all()
    linear = rehome(ExpertPlacement.linear(8, 4), [3])
    assert linear.lost_experts == (6, 7)
    assert linear.placement.to_physical(torch.tensor([[6, 0]])).tolist() == [[-1, 0]]


@pytest.mark.parametrize("backend,options,bound,why", [
    ("torch", {}, None, "cannot mask EP ranks"),
    ("deepep_ll", {}, None, "enable_shrink=True"),
    ("deepep_ll", {"enable_shrink": True}, None, "built"),
    ("nixl_ep", {}, None, "built"),
    ("nixl_ep", {}, 20.0, "shorter than a faulted call"),  # 3 s detection + 30 s recovery
    ("nixl_ep", {}, 40.0, "built"),
])
def test_backends_without_rank_masking_refuse_the_option(rank_pool, backend, options, bound,
                                                          why):
    results = rank_pool(2).run(ranks.refused, backend, options, bound)
    for r in results:
        assert why in r, r


def test_a_survivor_waiting_in_its_recovery_keeps_beating():
    """Rank 0 recovers 3 s before the other survivors (their faulted calls still spinning):
    its host-group rendezvous blocks on the job's store for those 3 s, and its heartbeat goes
    on through them, so no survivor is taken for lost (on one store connection shared with the
    rendezvous, its beats stopped and its peers evicted it)."""
    with RankPool(4, timeout_s=60) as pool:
        run = pool.run_bounded(ranks.late_recovery, 3.0, deadline_s=60, stop_on_death=False,
                               stall_s=40)
    outcomes = run.outcomes
    assert outcomes[3].status == "died", outcomes[3].describe()
    for o in outcomes[:3]:
        assert o.status == "ok", o.describe()
        assert o.value == dict(lost=(3,), evicted=False, decisions=[[3]]), (o.rank, o.value)
