"""Faults across ranks (moe_plugins.faults): a bad input on one rank, a rank failing mid-way, an
absent peer, ranks in different layers, dead rank processes. Every case must end on every rank
in a clear error (at once, or within the configured timeout), never in a result that belongs to
another batch."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from tests.runner import faults_ranks as frf
from tests.checks import assert_matches_reference
from moe_plugins.runner.launch import RankDiedError, RankError, RankPool, RankTimeoutError
from moe_plugins.layout import ParallelLayout
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights

pytestmark = pytest.mark.multirank

CFG = MoEConfig(hidden=128, num_experts=8, num_topk=2, intermediate=32, shared_intermediate=64)
DP2_TP2 = ParallelLayout(2, 2, True)
TIMEOUT_S = 4.0

@pytest.mark.parametrize("kind", frf.BAD_INPUT_KINDS)
def test_bad_input_on_one_rank_raises_on_every_rank_and_the_next_call_is_right(rank_pool, kind):
    """The issue's case: dp=2 x tp=2, one rank's prepare gets a bad input. Before, the others
    returned results off by 44 with no error. Now every rank raises at the same point (the bad
    rank its own error, the others naming it), and the next call is right everywhere."""
    bad = 1
    results = rank_pool(4).run(frf.bad_prepare_input_on_one_rank, DP2_TP2, CFG, bad, kind, 6,
                               TIMEOUT_S)
    err_type, text = frf.expected_error(kind, CFG)
    for rank, r in enumerate(results):
        assert r["seconds"] < TIMEOUT_S, f"rank {rank} waited for a timeout"
        if rank == bad:
            assert r["err_type"] == err_type and text in r["err"], r["err"]
        else:
            assert r["err_type"] == "PeerInputError", r["err"]
            assert f"rank {bad} " in r["err"] and "not run on any rank" in r["err"]
    assert_matches_reference(results, DP2_TP2, CFG, 6)


def test_rank_failing_mid_way_breaks_every_rank_within_the_timeout(rank_pool):
    bad = 2
    t0 = time.monotonic()
    results = rank_pool(4).run(frf.fail_mid_way_on_one_rank, DP2_TP2, CFG, bad, 6, TIMEOUT_S)
    assert time.monotonic() - t0 < 4 * TIMEOUT_S
    for rank, r in enumerate(results):
        first_type, first, seconds = r["first"]
        if rank == bad:
            assert first_type == "RuntimeError" and "injected expert failure" in first
        else:  # waited in the combine for the failed rank: bounded, and says what and where
            assert first_type == "CollectiveError", first
            assert "combine all-to-all" in first
            assert "torch backend layer" in first and "ranks [0, 1, 2, 3]" in first
            # the true cause, read from the store (moe_plugins.callbound.fault_notice), bound off
            assert f"failed mid-way and told its peers: EP rank {bad}: " in first, first
            assert "injected expert failure" in first, first
            assert seconds < 2 * TIMEOUT_S
        second_type, second, seconds = r["second"]
        assert second_type == "LayerBrokenError" and seconds < 1.0
        assert "out of step" in second


def test_absent_peer_is_a_timeout_naming_layer_collective_and_peers(rank_pool):
    layout = ParallelLayout(2, 1, True)
    results = rank_pool(2).run(frf.absent_peer, layout, CFG, 1, 4, TIMEOUT_S)
    err_type, err, seconds = results[0]["first"]
    assert err_type == "CollectiveError", err
    assert TIMEOUT_S * 0.8 < seconds < TIMEOUT_S * 2.5
    assert "split-size exchange" in err and "torch backend layer (experts=8" in err
    assert "ranks [0, 1]" in err and f"timeout of {TIMEOUT_S:g} s" in err
    assert "the peer that did not answer: rank 1" in err


def test_ranks_in_different_layers_are_out_of_step_on_every_rank(rank_pool):
    results = rank_pool(2).run(frf.ranks_in_different_layers, ParallelLayout(2, 1, True), CFG, 0,
                               4, TIMEOUT_S)
    for r in results:
        err_type, err, seconds = r["first"]
        assert err_type == "OutOfStepError" and "another layer" in err and seconds < TIMEOUT_S


def test_expert_id_minus_one_means_no_expert_on_the_torch_backend(rank_pool):
    layout = ParallelLayout(2, 1, True)
    weights = MoEWeights.random(CFG, 0)
    for r in rank_pool(2).run(frf.expert_ids_minus_one, layout, CFG, 5):
        expected = torch.zeros_like(r["x"])
        for t in range(r["x"].shape[0]):  # per-token loop over the full weights
            for k in range(CFG.num_topk):
                e = int(r["topk_ids"][t, k])
                if e >= 0:
                    g, u = (weights.w13[e] @ r["x"][t]).chunk(2)
                    expected[t] += r["topk_weights"][t, k] * (weights.w2[e] @ (torch.nn.functional.silu(g) * u))
        torch.testing.assert_close(r["out"], expected, atol=1e-5, rtol=1e-5)


def test_finalize_with_other_topk_ids_raises(rank_pool):
    for r in rank_pool(2).run(frf.finalize_with_other_topk_ids, ParallelLayout(2, 1, True), CFG, 4):
        err_type, err, _ = r["err"]
        assert err_type == "ValueError" and "not the ones given to prepare" in err
        torch.testing.assert_close(r["copy"], r["same"], atol=0, rtol=0)


@pytest.mark.parametrize("how,cause", [("exit", "exit code 3"), ("kill", "killed by signal SIGKILL")])
def test_dead_rank_is_reported_at_once_with_the_survivors_errors(how, cause):
    pool = RankPool(3, timeout_s=60)
    try:
        t0 = time.monotonic()
        with pytest.raises(RankDiedError) as e:
            pool.run(frf.die, 1, how, 60.0)
        assert time.monotonic() - t0 < 10, "waited for the timeout instead of noticing the death"
        assert e.value.rank == 1 and e.value.cause == cause
        assert f"rank 1 died ({cause})" in str(e.value)
        # the survivors' own errors (gloo saw the peer go) travel with it, and the pool is gone
        assert {r for r, *_ in e.value.errors} <= {0, 2}
        assert not any(p.is_alive() for p in pool._procs)
    finally:
        pool.close()


def _reaped(pids: list[int]) -> bool:
    """No process of ``pids`` is left, not even a zombie (its parent, this process, reaped it)."""
    return not any(Path(f"/proc/{pid}").exists() for pid in pids)


def _rank_1_does_not_answer(how: str) -> tuple[RankTimeoutError, float, list[int]]:
    """Three ranks, process-group timeout 5 s; rank 1 stops (``how``: "stop", SIGSTOP) or sleeps
    ("sleep") while its peers wait for it in a collective. Returns the pool's error, the
    seconds the run took and the ranks' pids, every one of them checked reaped."""
    pool = RankPool(3, timeout_s=5)
    pids = [p.pid for p in pool._procs]
    try:
        t0 = time.monotonic()
        with pytest.raises(RankTimeoutError) as e:
            pool.run(frf.stop_or_sleep, 1, how, 5.0)
        took = time.monotonic() - t0
        assert _reaped(pids), "a rank process was left behind"
        return e.value, took, pids
    finally:
        pool.terminate()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/stat")
def test_stopped_rank_ends_the_run_in_seconds_naming_it():
    """A rank process stopped (SIGSTOP) while its peers wait for it in a collective: before,
    the pool waited out its own deadline (timeout + 30 s) and raised a bare TimeoutError. Now it
    sees the process stopped, ends every rank at once and names the stopped one."""
    error, took, pids = _rank_1_does_not_answer("stop")
    assert took < 15, f"the pool waited {took:.0f} s for a stopped rank"
    assert error.rank == 1 and error.reason == "stopped" and error.overdue == [1]
    assert isinstance(error, RankError) and isinstance(error, TimeoutError)
    text = str(error)
    assert f"rank 1 is stopped (process {pids[1]} in state T" in text, text
    assert "SIGCONT" in text and "ended every rank" in text, text  # what was done, the fix


def test_rank_not_answering_after_its_peers_failed_is_overdue_within_a_grace():
    """Rank 1 sleeps outside the collective its peers wait in: they fail with the process-group
    timeout (5 s) and answer; rank 1 does not within the grace, so the pool ends the run then
    (not at its deadline, 35 s) naming rank 1, what it was doing and the peers' errors."""
    error, took, pids = _rank_1_does_not_answer("sleep")
    assert took < 25, f"the pool waited {took:.0f} s for an overdue rank"
    assert error.rank == 1 and error.reason == "overdue" and error.overdue == [1]
    assert {r for r, *_ in error.errors} == {0, 2}  # the peers' timeouts travel with it
    text = str(error)
    # whichever peer's timeout fired first (the two fire within microseconds of each other)
    assert "rank 1 did not answer within" in text, text
    assert "after rank 0 raised" in text or "after rank 2 raised" in text, text
    assert f"process {pids[1]} sleeping" in text, text


def test_rank_dying_at_start_up_is_reported_at_once():
    t0 = time.monotonic()
    with pytest.raises(RankDiedError) as e:
        RankPool(2, timeout_s=60, init=frf.exit_at_start)
    assert time.monotonic() - t0 < 15
    assert e.value.rank == 1 and e.value.cause == "exit code 7"


def test_rank_errors_name_the_rank_that_failed_first(rank_pool):
    """The bad rank's own error is the one RankError leads with; the others follow in summary."""
    with pytest.raises(RankError) as e:
        rank_pool(4).run(frf.raise_on, 2)
    assert e.value.rank == 2 and e.value.exc_type == "ValueError"
    assert e.value.summary.startswith("rank 2 raised ValueError: bad on rank 2")
    assert "rank 0 raised PeerInputError" in e.value.summary



def test_vllm_groups_get_a_bounded_timeout(rank_pool):
    pytest.importorskip("vllm")
    results = rank_pool(2).run(frf.vllm_group_bounded, 3.0)
    assert [r["bound"] for r in results] == [3.0, 3.0]
    err_type, err, seconds = results[0]["error"]
    assert err_type is not None and seconds < 3 * 3.0, (err_type, seconds)


def test_check_peers_names_the_peer_and_what_its_status_word_says():
    """The status word of the torch backend's header: STATUS_BAD_INPUT, or the number of tokens
    whose expert ids were out of range; a peer's flag raises PeerInputError on a good rank, the
    flagged rank itself returns (it raises its own error), and a good header passes."""
    from moe_plugins.faults import (STATUS_BAD_INPUT, STATUS_OK, GroupFaults, PeerInputError,
                                    check_peers)

    faults = GroupFaults([0, 1, 2], rank=0)
    good = [[3, 7, 99, STATUS_OK]] * 3
    check_peers(faults, "layer", 0, 7, 99, good)
    for status, text in ((STATUS_BAD_INPUT, "rank 2 rejected its inputs"),
                         (5, "rank 2 got expert ids outside [-1, num_experts) in 5 token(s)")):
        headers = [*good[:2], [3, 7, 99, status]]
        with pytest.raises(PeerInputError, match=text.replace("[", r"\[").replace("(", r"\(")
                           .replace(")", r"\)")):
            check_peers(faults, "layer", 0, 7, 99, headers)
        check_peers(faults, "layer", 2, 7, 99, headers)  # the flagged rank: its own error
    assert faults.broken is None


# -- a refused input costs no rank its layer (moe_plugins.faults, rule "refused inputs") ----------------------

LL_CFG = MoEConfig(hidden=2048, num_experts=8, num_topk=3, intermediate=32, shared_intermediate=64,
                   dtype=torch.bfloat16)
REFUSAL_TEXT = {"wide": ("ValueError", "x must be float [num_tokens, "),
                "numpy": ("TypeError", "x must be a torch.Tensor"),
                "int": ("TypeError", "x must be float [num_tokens, "),
                "too_many_tokens": ("ValueError", "dispatches up to 5, the backend's buffers hold 4"),
                "backend_refusal": ("ValueError", "injected backend refusal")}


def _assert_refused(r: dict, kind: str) -> None:
    err_type, err, seconds = r["first"]
    assert (err_type, REFUSAL_TEXT[kind][1] in (err or "")) == (REFUSAL_TEXT[kind][0], True), err
    assert seconds < TIMEOUT_S, f"the refusing rank waited {seconds:.1f} s"


@pytest.mark.parametrize("layout,bad,kind", [
    (ParallelLayout(1, 1, True), [0], "wide"),
    (ParallelLayout(2, 1, True), [1], "numpy"),
    (DP2_TP2, [2], "int"),
    (DP2_TP2, [0, 3], "wide"),
], ids=["1rank-wide", "dp2-numpy", "dp2tp2-int", "dp2tp2-two-ranks-wide"])
def test_torch_backend_refusal_reaches_every_rank_in_seconds_and_the_layer_stays_usable(
        rank_pool, layout, bad, kind):
    """The torch backend's header carries the refusal of the LAYER's own check: the refusing
    ranks raise their error, every other rank PeerInputError naming them, all within seconds
    (nothing waits for a timeout), and the next call is right on every rank."""
    results = rank_pool(layout.world_size).run(frf.refused_layer_call, "torch", layout, CFG, bad,
                                               kind, 6, 8, TIMEOUT_S)
    for rank, r in enumerate(results):
        if rank in bad:
            _assert_refused(r, kind)
        else:
            err_type, err, seconds = r["first"]
            assert err_type == "PeerInputError" and seconds < TIMEOUT_S, err
            assert all(f"rank {b} rejected its inputs" in err for b in bad), err
        assert r["second"][0] is None and r["broken"] is None, r["second"]
    assert_matches_reference(results, layout, CFG, 6)


@pytest.mark.parametrize("layout,bad,kind", [
    (ParallelLayout(1, 1, True), [0], "too_many_tokens"),
    (ParallelLayout(2, 1, True), [1], "wide"),
    (ParallelLayout(2, 1, True), [0], "too_many_tokens"),
    (ParallelLayout(2, 1, True), [0, 1], "too_many_tokens"),
    (ParallelLayout(2, 1, True), [1], "backend_refusal"),
    (DP2_TP2, [0, 1], "wide"),
], ids=["1rank-capacity", "ep2-wide", "ep2-capacity", "ep2-every-rank-capacity",
        "ep2-backend-refusal", "dp2tp2-dp-group-wide"])
def test_low_latency_refusal_serves_the_peers_and_the_layer_stays_usable(rank_pool, layout, bad,
                                                                        kind):
    """deepep_ll (no host exchange, on the emulated library): a rank that refuses its input,
    by the layer's checks or its backend's (the injected refusal: the path after the backend's
    own checks), takes part in the call with no tokens of its own, so its peers' results of THAT call are right; it raises its error, and the next
    call is right everywhere. (A layer input is the same on every TP rank of a DP group, so
    both TP ranks of DP group 0 refuse it together.)"""
    results = rank_pool(layout.world_size).run(frf.refused_layer_call, "deepep_ll", layout,
                                               LL_CFG, bad, kind, 3, 4, TIMEOUT_S)
    for rank, r in enumerate(results):
        if rank in bad:
            _assert_refused(r, kind)
        else:
            assert r["first"][0] is None, r["first"]
        assert r["second"][0] is None and r["broken"] is None, r["second"]
    firsts = [dict(out=r["outs"][0]) for r in results]
    good = [rank for rank in range(layout.world_size) if rank not in bad]
    assert_matches_reference(firsts, layout, LL_CFG, 3, ranks=good)  # served, not skipped
    assert_matches_reference(results, layout, LL_CFG, 3)


def test_low_latency_capacity_is_checked_on_the_tp_chunk_alike_on_every_tp_rank(rank_pool):
    """9 tokens per DP group, tp=2, buffers of 4 per rank: TP rank 0 would own 5 rows and TP
    rank 1 four. The layer checks the chunk (5) on both, so both refuse together, take part in
    the call without tokens, raise, and the next call is right."""
    results = rank_pool(4).run(frf.refused_layer_call, "deepep_ll", DP2_TP2, LL_CFG, [0, 1, 2, 3],
                               "chunk", 3, 4, TIMEOUT_S)
    for r in results:
        err_type, err, seconds = r["first"]
        assert err_type == "ValueError" and "each TP rank dispatches up to 5" in err, err
        assert r["second"][0] is None and r["broken"] is None, r["second"]
    assert_matches_reference(results, DP2_TP2, LL_CFG, 3)


def test_low_latency_backend_refusal_with_tp_inside_ep_breaks_instead_of_pairing(rank_pool):
    """With TP inside EP, a rank whose BACKEND refuses its owned rows cannot complete the call
    without them (its TP peer sent its own): it raises its error and breaks its group; every
    peer ends in an error within the group timeout, and no rank returns a result of any call.
    The call bound is off (0): with none set, the backstop's watchdog would end the peers' processes
    at once with the refusing rank's error instead (exit 70: tests/runner/test_watchdog_ranks.py)."""
    t0 = time.monotonic()
    results = rank_pool(4).run(frf.refused_layer_call, "deepep_ll", DP2_TP2, LL_CFG, [0],
                               "backend_refusal", 3, 4, TIMEOUT_S, 0)
    assert time.monotonic() - t0 < 6 * TIMEOUT_S
    err_type, err, _ = results[0]["first"]
    assert err_type == "ValueError" and "injected backend refusal" in err, err
    assert results[0]["second"][0] == "LayerBrokenError" and results[0]["outs"] == []
    for rank, r in enumerate(results[1:], start=1):
        assert r["first"][0] is not None, f"rank {rank} returned a result of the refused call"
        assert r["first"][2] < 3 * TIMEOUT_S


@pytest.mark.parametrize("backend", ["deepep_ll", "deepep_ht", "nixl_ep"])
def test_a_peer_killed_mid_call_ends_every_survivor_with_our_error(backend):
    """EP 4 on the emulated library (its collectives on gloo), no call bound set: rank 1 is
    killed (SIGKILL) inside its experts in call 2. Before, the survivors got gloo's raw
    RuntimeError ("Connection closed by peer") within 0.5 s. Now each ends call 2 at once with
    CollectiveError saying a peer went away, naming the layer and the call and quoting the
    transport's error, blaming no survivor (a rank whose transport saw the loss tells its peers
    nothing); its process lives and the next call raises LayerBrokenError. Call 1 was right."""
    from tests.gpu.ep_harness import run_world

    world, victim = 4, 1
    run = run_world(frf.killed_mid_call, world, victim, backend, device="cpu", timeout_s=60,
                    pg_timeout_s=60, stop_on_death=False)
    assert run.outcomes[victim].status == "died", run.outcomes[victim].describe()
    for rank, o in enumerate(run.outcomes):
        if rank == victim:
            continue
        assert o.status == "ok", o.describe()
        calls = {r["call"]: r for r in o.results}
        second, third = calls[2], calls[3]
        assert second["type"] == "CollectiveError", (rank, second)
        assert (f"a collective inside {backend}'s call (call 2) did not complete on the EP "
                "group of ranks [0, 1, 2, 3]: a peer went away") in second["error"], second
        assert f"MoE layer ({backend}, dp=4" in second["error"], second
        assert "by peer" in second["error"], second  # the transport's own words, quoted
        assert "told its peers" not in second["error"], second
        assert second["seconds"] < 5.0, second  # at once, not at a timeout (60 s) or bound
        assert third["type"] == "LayerBrokenError" and third["seconds"] < 1.0, third
    outs = [{"out": r["out"] for r in o.results if r.get("call") == 1} for o in run.outcomes]
    cfg = MoEConfig(hidden=128, num_experts=8, num_topk=2, intermediate=32,
                    shared_intermediate=64, dtype=torch.bfloat16)
    assert_matches_reference(outs, ParallelLayout(world, 1, True), cfg, 6,
                             ranks=[r for r in range(world) if r != victim])
    assert not run.stray
