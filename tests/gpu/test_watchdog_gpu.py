"""The call bound on a CUDA GPU (moe_plugins.callbound.watchdog): completion is the GPU's write into mapped
host memory, layer calls in a step window share the window's one write, a capture in a loop with
calls in flight never fails and never kills the watchdog, a stuck eager call or CUDA-graph
replay (alone or in a step window) ends the process within its bound, and at EP 4 a peer killed
between replays of a captured layer (under expect_replay, or in step windows), or between the
combine's send and receive of hook mode under vLLM's modular kernel, ends every survivor within
the bound.

Skipped without CUDA; the deepep_ll cases also without DeepEP's V1 line. Each case that needs a
process group runs in fresh processes (tests/gpu/ep_harness.py).

Run: ``python -m pytest -m gpu tests/gpu/test_watchdog_gpu.py -rA`` (or scripts/gpu/watchdog.sh)
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from moe_plugins.callbound import watchdog  # noqa: E402
from moe_plugins.callbound import (EXIT_CODE, CallBound, capture_calls, expect_replay,  # noqa: E402
                                  watch_call, watch_step, watchdog_alive)
from tests.gpu.cuda_graphs import capture  # noqa: E402

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
DEV = torch.device("cuda", 0)
#: how late after its bound the watchdog may end a process: its poll (0.2 s), the hook's report
#: and, at EP 4 on one GPU, ranks that time-slice the device
SLACK_S = 5.0


def _deep_ep() -> None:
    pytest.importorskip("deep_ep", reason="needs DeepEP's V1 line built from source")


def test_a_call_is_complete_when_the_gpu_wrote_its_progress_word():
    """end() enqueues the write after the call's work: while a 1 s kernel runs the call is
    not complete; after it (stream order) it is, read from host memory."""
    torch.cuda.set_device(0)
    torch.ones(1, device=DEV)  # a context on this thread
    call = watch_call("spinning layer", 1, 600.0)
    torch.cuda._sleep(2 * 10**9)
    call.end(DEV)
    assert watchdog._WATCHDOG.cuda is not None and watchdog._WATCHDOG.cuda.ok, \
        "no driver path for the progress words"
    assert watchdog._WATCHDOG.cuda.how in ("cuStreamWriteValue32", "cuMemsetD32Async")
    assert not call.finished(), "complete while its kernel still runs"
    torch.cuda.synchronize()
    assert call.finished()


def test_calls_in_a_step_window_share_its_one_gpu_write(monkeypatch):
    """Three layer calls in a step window, the second behind a 1 s kernel, end on the window's
    stream: the driver is asked for one write (the window's), none is complete until the GPU
    passed it, and all are after; a call on another stream in the window writes its own."""
    torch.cuda.set_device(0)
    torch.ones(1, device=DEV)
    bound = CallBound("windowed layer", 600.0, 600.0, device=DEV)
    cuda = watchdog._WATCHDOG.prepare_cuda()
    assert cuda.ok
    writes: list = []
    real = cuda.write

    def counted(stream: int, slot: int, value: int) -> int:
        writes.append(stream)
        return real(stream, slot, value)

    monkeypatch.setattr(cuda, "write", counted)
    side = torch.cuda.Stream()
    with watch_step(DEV) as step:
        calls = []
        for n in (1, 2, 3):
            call = bound.watch(n)
            if n == 2:
                torch.cuda._sleep(2 * 10**9)
            call.end(DEV)
            calls.append(call)
        with torch.cuda.stream(side):
            own = bound.watch(4)
            own.end(DEV)
        assert writes == [side.cuda_stream], writes
    assert step is not None and len(writes) == 2, writes
    assert not any(c.finished() for c in calls + [step]), "complete while the kernel runs"
    side.synchronize()
    assert own.finished()
    torch.cuda.synchronize()
    assert all(c.finished() for c in calls + [step])


def test_captures_in_a_loop_with_calls_in_flight_never_fail(monkeypatch):
    """20 rounds of (4 watched eager calls left in flight, a capture of a watched call, a
    replay under expect_replay) with the watchdog looking every millisecond: every capture
    succeeds, every replay is right and seen complete, and the watchdog is alive with no
    internal error (the watchdog thread makes no CUDA call: before, its event.query() during a
    capture invalidated it)."""
    monkeypatch.setattr(watchdog, "POLL_S", 0.001)
    bound = CallBound("matmul layer", 60.0, 60.0, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(0)
    w1 = torch.randn(512, 1024, device=DEV, generator=g) / 32
    w2 = torch.randn(1024, 512, device=DEV, generator=g) / 32
    x = torch.randn(64, 512, device=DEV, generator=g)
    number = [0]

    def layer(inp: torch.Tensor) -> torch.Tensor:
        number[0] += 1
        call = bound.watch(number[0])
        out = (inp @ w1).relu() @ w2
        if call is not None:
            call.end(DEV)
        return out

    expected = layer(x)
    torch.cuda.synchronize()
    for r in range(20):
        for _ in range(4):
            layer(x)
        static_x = x.clone()
        with capture_calls() as captured:
            graph, static_out = capture(lambda: layer(static_x))
        assert len(captured.calls) == 1, f"round {r}: {captured.calls}"
        with expect_replay(captured, DEV) as replay:
            graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, expected)
        assert replay is not None and replay.finished(), f"round {r}"
    assert watchdog_alive()
    assert watchdog._WATCHDOG.last_error == float("-inf"), "the watchdog logged an error"


@pytest.mark.parametrize("kind", ["eager", "replay", "step-eager", "step-replay"])
def test_a_stuck_call_ends_the_process_within_its_bound(kind):
    """A watched call whose GPU work spins for a minute (an eager call; a replay of a captured
    one under expect_replay; the second of three layer calls in a step window, where the first
    is named as sharing its step's completion; a graph captured as an engine does, replayed in
    a step window, named as the step), bound 3 s: the
    watchdog ends the process with exit status 70 and CallTimeoutError within the bound plus
    the slack."""
    bound = 3.0
    done = subprocess.run([sys.executable, "-m", "tests.gpu.watchdog_ranks", "stuck", kind,
                           str(bound)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == EXIT_CODE, (done.returncode, done.stdout, done.stderr[-3000:])
    ended = [e for e in events if e["event"] == "timeout"]
    assert ended and bound <= ended[0]["seconds"] < bound + SLACK_S, events
    what = {"eager": "spinning layer: call 1", "replay": "CUDA-graph replay 1",
            "step-eager": "spinning layer: call 1 (or a later call of forward step 1, whose "
                          "completion it shares)", "step-replay": "forward step 1"}[kind]
    assert f"{what} did not complete within 3 s" in ended[0]["message"], ended[0]
    if kind.endswith("replay"):
        assert {"event": "captured", "calls": 1} in events


def test_a_deepep_ll_layer_captured_in_a_loop_never_fails_a_capture():
    """One rank, deepep_ll MoELayer under a 60 s bound, 20 rounds of (4 eager calls in flight,
    a capture, a replay): no failed capture, every result right, the watchdog alive."""
    _deep_ep()
    from tests.gpu.ep_harness import run_world
    from tests.gpu.watchdog_ranks import capture_race_job

    run = run_world(capture_race_job, 1, 20, 60.0, device="cuda", timeout_s=400)
    assert run.ok, run.summary()
    rounds = run.results(0)
    assert len(rounds) == 20, rounds
    failed = [r for r in rounds if not r["captured"]]
    assert not failed, failed
    assert all(r["eager_ok"] and r["replay_ok"] and r["replay_seen_complete"] and r["calls"] >= 1
               for r in rounds), rounds
    assert run.values[0] == {"watchdog_alive": True, "internal_error": False}


@pytest.mark.parametrize("replay_in", ["expect_replay", "step_window"])
def test_a_peer_killed_between_replays_ends_every_survivor_within_the_bound(replay_in):
    """EP 4, deepep_ll captured into a CUDA graph, bound 30 s: two replays right on every
    rank, then rank 2 is killed; every survivor's replay 3 waits for it in DeepEP's kernels
    and is ended by the watchdog (CallTimeoutError, exit status 70) within the bound plus the
    slack, long before DeepEP's own timeout (about 100 s); no rank returns a result of it."""
    _deep_ep()
    from tests.gpu.ep_harness import run_world
    from tests.gpu.watchdog_ranks import graph_kill_job

    bound, victim = 30.0, 2
    run = run_world(graph_kill_job, 4, victim, bound, replay_in, device="cuda", timeout_s=400,
                    pg_timeout_s=300, stop_on_death=False)
    print(json.dumps(run.record(), indent=1)[:20000])
    assert not run.stray, run.summary()
    for rank, o in enumerate(run.outcomes):
        got = {r.get("replay"): r for r in o.results if "replay" in r}
        assert got.get(1, {}).get("ok") and got.get(2, {}).get("ok"), o.describe()
        if rank == victim:
            assert o.status == "died", o.describe()
            continue
        third = got.get(3)
        assert third is not None and third["outcome"] == "ended", o.describe()
        what = "CUDA-graph replay 3" if replay_in == "expect_replay" else "forward step 3"
        assert third["type"] == "CallTimeoutError" and what in third["message"], third
        assert bound <= third["seconds"] < bound + SLACK_S, third
        # 70: the watchdog's exit; -SIGTERM: the pool ended the rank after its hook had sent
        # the answer above and before its exit (every rank had answered)
        assert run.bounded.exitcodes[rank] in (None, EXIT_CODE, -signal.SIGTERM), \
            run.bounded.exitcodes


def test_a_peer_killed_between_the_combines_send_and_receive_ends_every_survivor():
    """EP 4, deepep_ll through vLLM's modular kernel with a shared expert (hook mode: vLLM calls
    our combine's receive after the shared expert), the bound 30 s from
    MOE_PLUGINS_CALL_TIMEOUT_S, each forward in a step window as the vLLM glue opens them: two
    calls right; in call 3 rank 2 dies in its experts, its dispatch received. Every survivor's
    host returns from call 3 (its combine sent, the receive enqueued), its receive waits on the
    GPU for rank 2's rows, and the step window ends it within the bound plus the slack."""
    _deep_ep()
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM's Python (scripts/gpu/h200.sh installs it)")
    from tests.gpu.ep_harness import run_world
    from tests.gpu.watchdog_ranks import hook_kill_job

    bound, victim = 30.0, 2
    run = run_world(hook_kill_job, 4, victim, bound, "cuda", device="cuda", timeout_s=500,
                    pg_timeout_s=300, stop_on_death=False)
    print(json.dumps(run.record(), indent=1)[:20000])
    assert not run.stray, run.summary()
    for rank, o in enumerate(run.outcomes):
        got = {(r.get("call"), "ended" if "outcome" in r else "host"): r for r in o.results}
        for n in (1, 2):
            first = next((r for r in o.results if r.get("call") == n), None)
            assert first is not None and first["ok"] and first["hook_mode"], o.describe()
        if rank == victim:
            assert o.status == "died", o.describe()
            continue
        host = got.get((3, "host"))
        assert host is not None and host["hook_mode"] and host["host_returned"] < bound, \
            o.describe()
        third = got.get((3, "ended"))
        assert third is not None and third["outcome"] == "ended", o.describe()
        assert third["type"] == "CallTimeoutError" and "did not complete" in third["message"], \
            third
        assert bound <= third["seconds"] < bound + SLACK_S, third
        assert run.bounded.exitcodes[rank] in (None, EXIT_CODE, -signal.SIGTERM), \
            run.bounded.exitcodes
