"""The one-device EP harness (tests/gpu/ep_harness.py) on CPU: it reports steps and results as
they come, bounds a hang and says where each rank stopped, leaves no process behind (also when
the parent is interrupted), turns a mismatch into a failure and reports a dead rank."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.gpu.ep_harness import run_world, verdict
from tests.runner import ep_harness_ranks as fns

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[2]


def _is_a_failure(raised: BaseException) -> None:
    """pytest.fail's own exception, not pytest.xfail's (an expected failure; its exception is a
    subclass of fail's, so ``pytest.raises(pytest.fail.Exception)`` alone accepts it too)."""
    assert type(raised) is pytest.fail.Exception, type(raised)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


def test_steps_and_results_are_reported_in_order():
    run = run_world(fns.steps_and_results, 2, 3, device="cpu", timeout_s=60)
    assert run.ok, run.summary()
    assert run.values == [0, 10]
    for o in run.outcomes:
        assert [s[0] for s in o.steps] == ["step 0", "step 1", "step 2"]
        assert [r["sum"] for r in o.results] == [1.0, 3.0, 5.0]
        assert o.steps[0][1] <= o.steps[-1][1] and o.ended_s is not None
    rec = run.record()
    assert rec["ranks"][1]["last_step"] == "step 2" and rec["stray"] == []
    verdict(run, "steps")  # returns: every rank returned


@pytest.mark.parametrize("where", ["sleep", "collective"])
def test_a_hang_is_bounded_reported_with_its_step_and_leaves_no_process(where):
    t0 = time.monotonic()
    run = run_world(fns.hang, 2, where, device="cpu", timeout_s=8, pg_timeout_s=120)
    took = time.monotonic() - t0
    assert run.timed_out and not run.ok
    assert took < 8 + 8, f"the 8 s bound took {took:.1f} s to end"
    last = {o.rank: (o.status, o.last_step) for o in run.outcomes}
    if where == "sleep":
        assert last == {0: ("ok", "start"), 1: ("timed_out", "sleep forever")}
    else:
        assert last == {0: ("timed_out", "all_reduce that rank 1 never joins"),
                        1: ("timed_out", "sleep instead of the all_reduce")}
    assert run.stray == [] and all(code is not None for code in run.bounded.exitcodes)
    assert "did not finish within 8 s" in run.summary()
    # a run that did not finish failed (never an expected failure): it showed nothing
    with pytest.raises(pytest.fail.Exception, match="hang did not finish within 8 s: .*"
                                                    "(sleep|all_reduce)") as failed:
        verdict(run, "hang")
    _is_a_failure(failed.value)
    # after a fault, ranks that did not end in time are what the run is there to catch
    with pytest.raises(pytest.fail.Exception,
                       match="did not end within 8 s after the fault") as failed:
        verdict(run, "hang", fault=True)
    _is_a_failure(failed.value)


def test_a_process_a_killed_rank_started_ends_with_it(tmp_path):
    """A rank killed at the bound takes what it started with it (its process group): a
    library's JIT build (ninja, the compiler) left running would hold the host's cores and its
    build directory's lock for the next run."""
    pid_file = tmp_path / "child"
    run = run_world(fns.hang_beside_a_child, 2, str(pid_file), device="cpu", timeout_s=8)
    assert run.timed_out and run.stray == []
    child = int(pid_file.read_text())
    end = time.monotonic() + 5
    while not _gone(child) and time.monotonic() < end:
        time.sleep(0.1)
    assert _gone(child), f"process {child}, started by the killed rank 1, outlived it"


def test_the_stack_dumps_name_where_a_hanging_rank_waits(tmp_path):
    """EP_HARNESS_DUMP_S: every rank writes every thread's Python stack that often (from a
    thread holding the interpreter lock), so a rank that hangs shows where."""
    env = {"EP_HARNESS_DUMP_S": "1", "EP_HARNESS_DUMP_DIR": str(tmp_path)}
    run = run_world(fns.hang, 2, "sleep", device="cpu", timeout_s=8, env=env)
    assert run.timed_out
    (dump,) = tmp_path.glob("rank1-*.txt")
    text = dump.read_text()
    assert "== dump 2 at " in text, text[:2000]
    assert "MainThread" in text and "in hang" in text and "time.sleep(1)" in text, text[-3000:]


def test_a_mismatch_is_a_failure_not_an_expected_failure():
    run = run_world(fns.mismatch, 2, device="cpu", timeout_s=60)
    assert not run.timed_out and not run.ok
    assert run.outcomes[0].status == "ok" and run.outcomes[1].status == "error"
    assert run.outcomes[1].results == [{"case": "compare", "ok": False, "max_abs_err": 0.5}]
    assert run.outcomes[1].error[0] == "AssertionError"
    with pytest.raises(pytest.fail.Exception, match="rank 1 raised at step 'compare'") as failed:
        verdict(run, "mismatch")
    _is_a_failure(failed.value)


@pytest.mark.parametrize("how,cause", [("exit", "exit code 3"),
                                       ("kill", "killed by signal SIGKILL")])
def test_a_dead_rank_is_reported_and_its_peer_ends(how, cause):
    run = run_world(fns.die, 2, how, device="cpu", timeout_s=60, pg_timeout_s=30,
                    stop_on_death=False)
    dead, peer = run.outcomes[1], run.outcomes[0]
    assert (dead.status, dead.cause, dead.last_step) == ("died", cause, f"dying ({how})")
    # the survivor ran on to its own error: gloo saw the peer's connection close
    assert peer.status == "error" and peer.last_step == "all_reduce with the dead rank"
    assert peer.results and peer.results[0]["seconds"] < 30
    assert run.stray == []
    rec = run.record()
    assert rec["ranks"][1]["cause"] == cause and rec["ranks"][0]["error"]["type"] == "RuntimeError"
    with pytest.raises(pytest.fail.Exception, match="rank 1 died") as failed:
        verdict(run, "death")
    _is_a_failure(failed.value)


def test_a_dead_rank_stops_the_others_by_default():
    run = run_world(fns.die, 2, "exit", device="cpu", timeout_s=60, pg_timeout_s=120)
    assert run.outcomes[1].status == "died"
    # rank 0 waits in gloo for 120 s: the harness ends it a second after the death
    assert run.outcomes[0].status in ("stopped", "error") and run.elapsed_s < 30
    assert not run.timed_out and run.stray == []


def test_an_interrupted_parent_leaves_no_rank_behind(tmp_path):
    """SIGINT to a process inside run_world (ranks hanging): KeyboardInterrupt ends the run and
    every rank process is gone."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        from tests.gpu.ep_harness import run_world
        from tests.runner import ep_harness_ranks as fns
        if __name__ == "__main__":
            run_world(fns.hang, 2, "sleep", {str(pid_dir)!r}, device="cpu", timeout_s=300)
    """))
    proc = subprocess.Popen([sys.executable, str(driver)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while len(list(pid_dir.iterdir())) < 2:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in pid_dir.iterdir()]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        out = proc.stdout.read().decode()
        assert "KeyboardInterrupt" in out, out[-2000:]
        end = time.monotonic() + 10
        while not all(_gone(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.2)
        assert all(_gone(p) for p in pids), f"ranks {pids} outlived the interrupted parent"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_stall_ends_the_run_long_before_its_bound():
    """No rank reports anything for ``stall_s``: the run ends then (a hang costs that, not the
    whole bound), as a timed-out run naming where each rank stopped."""
    run = run_world(fns.hang, 2, "sleep", device="cpu", timeout_s=300, stall_s=4)
    assert run.timed_out and run.bounded.stalled_s == 4
    assert run.bounded.elapsed_s < 15 and run.stray == []
    assert (run.outcomes[1].status, run.outcomes[1].last_step) == ("timed_out", "sleep forever")
    assert "no rank reported anything for 4 s" in run.summary()
    assert run.record()["stalled_s"] == 4
