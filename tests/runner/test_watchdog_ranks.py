"""The call bound on CPU ranks (gloo, torch backend): a slow start-up ends no healthy rank, a
peer that hangs later is ended by the bound (moe_plugins.callbound.watchdog), and a peer that raises
mid-call tells the others, who raise at once with its error, bound on or off
(moe_plugins.callbound.fault_notice)."""
from __future__ import annotations

import pytest

from moe_plugins.layout import ParallelLayout
from moe_plugins.callbound import EXIT_CODE
from tests.checks import assert_matches_reference
from tests.gpu.ep_harness import run_world
from tests.runner import watchdog_ranks as ranks

pytestmark = pytest.mark.multirank

BOUND_S = 2.0
LATE_S = 4 * BOUND_S  # a peer 4 x the bound late in its first call, and again before its second
SLACK_S = 2.5  # the watchdog's poll (0.2 s) and two shared cores


def test_a_late_start_ends_nobody_and_a_later_hang_ends_the_rest_within_the_bound():
    world, victim = 4, 1
    run = run_world(ranks.slow_start_then_hang, world, victim, BOUND_S, LATE_S, device="cpu",
                    timeout_s=120, pg_timeout_s=120, stop_on_death=False)
    timed_out = 0
    for rank, o in enumerate(run.outcomes):
        calls = {r["call"]: r for r in o.results}
        # the slow start-up: calls 1-3 returned on every rank, none was ended
        assert {1, 2, 3} <= set(calls), f"rank {rank}: {o.describe()}"
        if rank == victim:
            continue
        # its own watchdog ended it, or (a race the transport decides) the exit of a peer the
        # watchdog ended first closed gloo's connection under it: CollectiveError, still after
        # the bound and within the slack
        assert o.status == "error" and o.error[0] in ("CallTimeoutError", "CollectiveError"), \
            o.describe()
        if o.error[0] == "CallTimeoutError":
            timed_out += 1
            # reported by the watchdog's hook, just before its exit (70 unless still exiting)
            assert run.bounded.exitcodes[rank] in (None, EXIT_CODE)
            assert f"call 4 did not complete within {BOUND_S:g} s" in calls[4]["error"]
            assert BOUND_S <= calls[4]["seconds"] < BOUND_S + SLACK_S, calls[4]
        else:
            assert "went away" in o.error[1] or "did not complete" in o.error[1], o.describe()
    assert timed_out >= 1, [o.describe() for o in run.outcomes]
    outs = [dict(out=r["out"]) for o in run.outcomes for r in o.results if r.get("call") == 3]
    assert_matches_reference(outs, ParallelLayout(world, 1, True), ranks.CFG, 6)
    assert not run.stray


@pytest.mark.parametrize("bound", [30.0, None], ids=["bound-30s", "bound-off"])
def test_a_peer_that_raises_mid_call_makes_the_others_raise_at_once_with_its_error(bound):
    """EP 4: rank 1's experts raise in call 3, after its dispatch was sent. The others wait for
    it in call 3's combine; its notice makes them raise within a few seconds (not at the bound,
    not at the process group's 120 s), bound on or off, CollectiveError naming rank 1's
    ValueError; their processes live, and the next call raises LayerBrokenError at once.
    Rank 1 raises its own error."""
    world, victim = 4, 1
    run = run_world(ranks.raise_after_dispatch, world, victim, bound, device="cpu",
                    timeout_s=120, pg_timeout_s=120, stop_on_death=False)
    for rank, o in enumerate(run.outcomes):
        assert o.status == "ok", o.describe()  # every process lived and returned
        calls = {r["call"]: r for r in o.results}
        third, fourth = calls[3], calls[4]
        if rank == victim:
            assert third["type"] == "ValueError" and "failed on purpose" in third["error"]
        else:
            assert third["type"] == "CollectiveError", third
            assert "combine all-to-all (call 3) cannot complete" in third["error"], third
            assert f"told its peers: EP rank {victim}: " in third["error"], third
            assert "failed on purpose" in third["error"], third["error"]
            assert third["seconds"] < 6.0, third  # the notice is read after 1 s of waiting
        assert fourth["type"] == "LayerBrokenError" and fourth["seconds"] < 1.0, fourth
    outs = [dict(out=r["out"]) for o in run.outcomes for r in o.results if r.get("call") == 2]
    assert_matches_reference(outs, ParallelLayout(world, 1, True), ranks.CFG, 6)
    assert not run.stray


def test_with_no_bound_set_the_backstop_ends_every_survivor_before_the_library_traps():
    """EP 4, deepep_ll on the emulated DeepEP whose own timeout is made 3 s (it traps there:
    no mask buffer), no call bound set: the layers run under the backstop, 0.9 of the
    library's timeout (moe_plugins.callbound.CallBound.backstop), stated in their INFO line.
    MoELayer's calls have no start-up bound under the backstop (nothing in them compiles on
    first use), so a peer that hangs in call 2, before any call after the first completed (the
    layer is not warm yet), is bounded too: rank 1 hangs there, between its dispatch and its
    combine; every survivor is ended by its watchdog 2.7 s after call 2 began (exit 70), not at
    a start-up bound of 600 s, with the error that names the backstop and says every rank must
    restart; call 1 was right."""
    world, victim, library_s = 4, 1, 3.0
    run = run_world(ranks.hang_under_the_backstop, world, victim, library_s, None, 2,
                    device="cpu", timeout_s=60, pg_timeout_s=120, stop_on_death=False)
    backstop_s = 0.9 * library_s
    for rank, o in enumerate(run.outcomes):
        reported = [r for r in o.results if "bound" in r]
        assert reported and reported[0]["bound"].startswith(
            f"{backstop_s:g} s (first calls {backstop_s:g} s)"), (rank, reported)
        assert "no bound set, the backstop under deepep_ll's 3 s timeout" in reported[0]["bound"]
        if rank == victim:
            continue
        calls = {r["call"]: r for r in o.results if "call" in r}
        assert "seconds" in calls.get(2, {}), f"rank {rank}: {o.describe()}"
        hung = calls[2]
        assert hung["type"] == "CallTimeoutError", hung
        assert f"call 2 did not complete within {backstop_s:g} s" in hung["error"], hung
        assert "no call bound was set; this is moe-plugins' backstop" in hung["error"], hung
        assert "restart every rank of the EP group" in hung["error"], hung
        assert backstop_s <= hung["seconds"] < backstop_s + SLACK_S, hung
        assert run.bounded.exitcodes[rank] in (None, EXIT_CODE), run.bounded.exitcodes
    outs = [dict(out=r["out"]) for o in run.outcomes for r in o.results
            if r.get("call") == 1 and "out" in r]
    assert_matches_reference(outs, ParallelLayout(world, 1, True), ranks.BF16_CFG, 6)
    assert not run.stray


def test_with_the_bound_off_the_emulated_deepep_traps_at_its_built_timeout():
    """The emulation honours the built timeout: EP 2, deepep_ll on the emulated DeepEP built
    with a 3 s timeout, the call bound off (0). Rank 1 hangs between its dispatch and its
    combine; rank 0's combine kernel traps 3 s into call 3 (the emulated "unspecified launch
    failure"), which the layer reports as the library's own timeout: a peer died or hangs,
    the CUDA context is lost, restart every rank."""
    world, victim, library_s = 2, 1, 3.0
    run = run_world(ranks.hang_under_the_backstop, world, victim, library_s, 0, device="cpu",
                    timeout_s=120, pg_timeout_s=120, stop_on_death=False)
    survivor = run.outcomes[0]
    assert survivor.results[0]["bound"] == "off"
    third = {r["call"]: r for r in survivor.results if "call" in r}[3]
    assert third["type"] == "CollectiveError", third
    assert "deepep_ll's wait for a peer ended at the library's own timeout (about 3 s" \
        in third["error"], third
    assert "unspecified launch failure" in third["cause"], third
    assert "this process's CUDA context is lost" in third["error"], third
    assert library_s <= third["seconds"] < library_s + SLACK_S, third
    assert not run.stray


@pytest.mark.parametrize("backend,bound_s,words", [
    ("deepep_ll", 270.0, "under deepep_ll's 300 s timeout"),
    ("deepep_ht", 320.0, "past deepep_ht's 300 s timeout")])
def test_a_deepep_built_with_a_300_s_timeout_moves_the_backstop(backend, bound_s, words):
    """A DeepEP built with DEEPEP_TIMEOUT_S=300 (its build record): deepep_ll's backstop is 0.9
    of its kernels' 300 s (they trap), 270 s; deepep_ht's 20 s past its host wait's 300 s (it
    raises), 320 s; DeepEP's default 100 s gives 90 s and 120 s."""
    run = run_world(ranks.bound_of_a_build, 2, backend, 300.0, device="cpu", timeout_s=120)
    for o in run.outcomes:
        assert o.status == "ok", o.describe()
        got = o.value
        assert got["seconds"] == bound_s, got
        assert got["bound"].startswith(f"{bound_s:g} s (first calls") and words in got["bound"]
    assert not run.stray


def test_a_library_timeout_reaches_the_caller_as_what_it_means():
    """EP 2, deepep_ht on the emulated DeepEP built with a 2 s timeout (its build record), no
    bound: a peer that sits out call 2 leaves the other in DeepEP's host wait for the counts,
    which raises the library's own "CPU recv timeout" (100 s in a default build). MoELayer raises CollectiveError saying a peer
    died or hangs and every rank must restart, from the library's error, at that timeout."""
    world, victim, library_s = 2, 1, 2.0
    run = run_world(ranks.library_times_out, world, victim, library_s, device="cpu",
                    timeout_s=60, pg_timeout_s=60, stop_on_death=False)
    survivor = [r for r in run.outcomes[0].results if r.get("call") == 2]
    assert survivor, run.outcomes[0].describe()
    got = survivor[0]
    assert got["type"] == "CollectiveError", got
    assert ("deepep_ht's wait for a peer ended at the library's own timeout (about 2 s; "
            "RuntimeError: DeepEP error: CPU recv timeout): a peer rank died or hangs") \
        in got["error"], got
    assert "Restart every rank of the EP group" in got["error"], got
    assert got["cause"] == "DeepEP error: CPU recv timeout", got
    assert library_s <= got["seconds"] < library_s + SLACK_S, got
    outs = [dict(out=r["out"]) for o in run.outcomes for r in o.results if r.get("call") == 1]
    assert_matches_reference(outs, ParallelLayout(world, 1, True), ranks.BF16_CFG, 6)
