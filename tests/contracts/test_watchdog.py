"""moe_plugins.callbound.watchdog: the ring of watched calls, completion read from host memory
only, the start-up bound, CUDA-graph captures and replays, and a watchdog thread that survives
its own errors (its settings: test_callbound_settings.py). (The watchdog ending a process is
tested on real ranks: tests/runner/test_watchdog_ranks.py, tests/vllm_glue/test_vllm_faults.py
and the reduced EP matrix's fault-hang-watchdog job; on the GPU, tests/gpu/test_watchdog_gpu.py
and the matrix's kill faults.)"""
from __future__ import annotations

import ctypes
import logging
import re
import threading

import pytest
import torch

from moe_plugins.callbound import watchdog
from moe_plugins.callbound.layer_bound import CallBound
from moe_plugins.callbound.watchdog import (RING_SLOTS, capture_calls, expect_replay,
                                           replays_in_step_windows, watch_call, watch_step)

from moe_plugins.callbound.settings import (CALL_TIMEOUT_ENV, FIRST_CALL_TIMEOUT_ENV,
                                            reread_environment)

CPU = torch.device("cpu")


@pytest.fixture
def fresh(fresh_watchdog):
    return fresh_watchdog


# -- the ring and completion --------------------------------------------------------------------
def test_calls_take_preallocated_slots_and_complete_on_the_host_on_cpu(fresh):
    first = watch_call("layer", 1, 60.0)
    assert first is not None and not first.finished()
    first.end(CPU)
    assert first.finished()
    for n in range(RING_SLOTS - 1):
        watch_call("layer", n + 2, 60.0).end(CPU)
    again = watch_call("layer", RING_SLOTS + 1, 60.0)
    assert again is first and not again.finished()  # the same object, another call now
    fresh.check(0.0)
    assert fresh.tail == again.seq  # everything before the open call was dropped


def test_an_overdue_call_is_found_by_reading_host_memory_only(fresh):
    done = watch_call("done", 1, 1.0)
    done.end(CPU)
    late = watch_call("late", 7, 1.0)
    fresh.check(late.started + 0.5)
    assert fresh.expired == []
    fresh.check(late.started + 1.5)
    assert fresh.expired == [("late", 7)]


def test_a_gpu_call_completes_when_its_progress_word_arrives(fresh, monkeypatch):
    """end() on a CUDA device enqueues the write of the call's number into its slot of the
    mapped host buffer (a driver call on the caller's stream, faked here); the call is complete
    when that word holds it: read from host memory, with no CUDA call."""
    words = (ctypes.c_uint32 * (RING_SLOTS + 1))()
    writes: list = []

    class FakeProgress:
        ok, how = True, "fake"

        def write(self, stream, slot, value):
            writes.append((stream, slot, value))
            return 0  # the driver's CUresult

    fresh.cuda, fresh.words = FakeProgress(), words
    monkeypatch.setattr(watchdog, "_raw_stream", lambda index: 1234 + index)
    call = watch_call("layer", 1, 60.0)
    call.end(torch.device("cuda", 3))
    assert writes == [(1237, call.slot, call.seq)]
    assert not call.finished()
    words[call.slot] = call.seq  # what the GPU writes once the call's work is done
    assert call.finished()


def test_a_failed_gpu_write_falls_back_to_the_host_end_and_says_so(fresh, monkeypatch, caplog):
    class Broken:
        ok, how = True, "fake"

        def write(self, stream, slot, value):
            return 1  # CUDA_ERROR_INVALID_VALUE

    fresh.cuda = Broken()
    monkeypatch.setattr(watchdog, "_raw_stream", lambda index: 0)
    call = watch_call("layer", 1, 60.0)
    with caplog.at_level(logging.ERROR, logger="moe_plugins.callbound.watchdog"):
        call.end(torch.device("cuda", 0))
    assert call.finished()
    assert any("internal error" in r.getMessage() for r in caplog.records)


# -- start-up -----------------------------------------------------------------------------------
def test_first_calls_run_under_the_start_up_bound_until_a_later_call_completed(fresh):
    bound = CallBound("layer", 2.0, 40.0)
    c1 = bound.watch(1)
    assert c1.deadline - c1.started == 40.0 and c1.what == "start-up call"
    c2 = bound.watch(2)  # started before call 1 completed (a peer may still be in call 1)
    assert c2.deadline - c2.started == 40.0
    c1.end(CPU)
    c3 = bound.watch(3)  # call 2 not complete yet: a peer may still be in its first call
    assert c3.deadline - c3.started == 40.0
    c2.end(CPU)
    c3.end(CPU)
    c4 = bound.watch(4)
    assert c4.deadline - c4.started == 2.0 and c4.what == "call"


# -- CUDA graphs --------------------------------------------------------------------------------
def test_a_capture_is_recorded_without_cuda_calls_and_replays_are_watched(fresh, monkeypatch):
    """During a capture (the CUDA runtime's answer stood in on CPU) a watched call is recorded,
    not watched; expect_replay watches each replay under the largest bound of its calls."""
    monkeypatch.setattr(watchdog, "_CUDA", [True])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with capture_calls() as captured:
        assert watch_call("layer A", 3, 30.0) is None
        assert watch_call("layer B", 3, 45.0) is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert captured.calls == [("layer A", 3, 30.0), ("layer B", 3, 45.0)]
    for n in (1, 2):
        with expect_replay(captured, CPU) as replay:
            assert replay.deadline - replay.started == 45.0 and replay.number == n
            assert "2 captured call(s) of layer A, layer B" in replay.name
            assert not replay.finished()
        assert replay.finished()


def test_a_capture_without_the_replay_hook_says_once_that_replays_are_not_bounded(
        fresh, monkeypatch, caplog):
    monkeypatch.setattr(watchdog, "_CUDA", [True])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with caplog.at_level(logging.WARNING, logger="moe_plugins.callbound.watchdog"):
        assert watch_call("layer", 1, 30.0) is None
        assert watch_call("layer", 2, 30.0) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "expect_replay" in warnings[0], warnings


# -- step windows -------------------------------------------------------------------------------
class FakeGpu:
    """The driver's side of the completion marks, faked: the writes it was asked to enqueue, on
    which stream, and the mapped words the GPU would write (tests write them by hand)."""

    ok, how = True, "fake"

    def __init__(self) -> None:
        self.words = (ctypes.c_uint32 * (RING_SLOTS + 1))()
        self.writes: list = []

    def write(self, stream, slot, value):
        self.writes.append((stream, slot, value))
        return 0

    def arrive(self, call) -> None:
        """The GPU reached the write enqueued for ``call``."""
        self.words[call.slot] = call.seq


@pytest.fixture
def gpu(fresh, monkeypatch):
    fake = FakeGpu()
    fresh.cuda, fresh.words = fake, fake.words
    stream = {"now": 7}  # the caller's current stream handle
    monkeypatch.setattr(watchdog, "_raw_stream", lambda index: stream["now"])
    fake.stream = stream
    return fake


def test_calls_in_a_step_window_share_its_one_completion_mark(fresh, gpu):
    """Layer calls that end on the window's stream enqueue nothing: the window's mark, enqueued
    after all of them, completes them; a call on another stream (a micro-batch's) marks
    itself."""
    dev = torch.device("cuda", 0)
    a, b = CallBound("layer A", 30.0, 0), CallBound("layer B", 45.0, 0)
    with watch_step(dev) as step:
        assert step.what == "forward step" and step.bound == 45.0
        calls = [bound.watch(1) for bound in (a, b)]
        for call in calls:
            call.end(dev)
        assert gpu.writes == []  # no driver call per layer
        gpu.stream["now"] = 9
        other = a.watch(2)
        other.end(dev)
        assert gpu.writes == [(9, other.slot, other.seq)]
        gpu.stream["now"] = 7
    assert gpu.writes[-1] == (7, step.slot, step.seq) and len(gpu.writes) == 2
    assert not any(c.finished() for c in calls + [step])
    gpu.arrive(step)
    assert all(c.finished() for c in calls + [step])


def test_a_call_in_a_window_that_never_completes_expires_under_its_own_name(fresh, gpu):
    dev = torch.device("cuda", 0)
    bound = CallBound("layer A", 30.0, 0)
    with watch_step(dev) as step:
        call = bound.watch(5)
        call.end(dev)
    fresh.check(call.started + 29.0)
    assert fresh.expired == []
    fresh.check(call.started + 30.1)  # the window's mark never came: a peer hangs
    assert fresh.expired == [("layer A", 5)]  # the layer's call is named, not only the step
    message = str(watchdog.timeout_error(call, call.started + 30.1))
    assert message.startswith("layer A: call 5 (or a later call of forward step 1, whose "
                              "completion it shares) did not complete within 30 s"), message
    gpu.arrive(step)
    fresh.expired.clear()
    fresh.check(call.started + 90.0)
    assert fresh.expired == []


def test_a_window_runs_under_the_start_up_bound_while_a_layer_starts(fresh, gpu):
    dev = torch.device("cuda", 0)
    warm, starting = CallBound("warm", 30.0, 0), CallBound("starting", 20.0, 900.0)
    with watch_step(dev) as step:
        assert step.bound == 900.0
    del starting
    with watch_step(dev) as step:  # the starting layer dropped: the warm one's bound
        assert step.bound == 30.0
    assert warm.timeout_s == 30.0


def test_a_window_watches_nothing_without_bounds_when_nested_or_capturing(fresh, gpu,
                                                                          monkeypatch):
    dev = torch.device("cuda", 0)
    with watch_step(dev) as step:
        assert step is None  # no layer has a bound
    bound = CallBound("layer", 30.0, 0)
    with watch_step(dev) as outer:
        with watch_step(dev) as inner:
            assert inner is None
        assert outer is not None
    monkeypatch.setattr(watchdog, "_CUDA", [True])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with watch_step(dev) as step:
        assert step is None
    assert bound.timeout_s == 30.0


def test_a_capture_begun_inside_a_window_gets_no_enqueue(fresh, gpu, monkeypatch):
    """vLLM's runner V1 captures on the current stream inside its forward context: a layer call
    there, on the window's stream, skips the driver's capture query and enqueues nothing (the
    window's mark completes it); on another, capturing stream the call ends on the host, with
    nothing enqueued into the capture, as does a call begun on the window's stream that ends on
    a capturing one."""
    dev = torch.device("cuda", 0)
    bound = CallBound("layer", 30.0, 0)
    capturing = {"now": False}
    monkeypatch.setattr(watchdog, "_CUDA", [True])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    with watch_step(dev) as step:
        capturing["now"] = True  # a capture begins on the window's stream
        on_window = bound.watch(1)
        on_window.end(dev)
        gpu.stream["now"] = 9  # another stream, capturing: the call ends on the host
        other = bound.watch(2)
        other.end(dev)
        assert other.finished()
        gpu.stream["now"] = 7
        moved = bound.watch(3)
        gpu.stream["now"] = 9
        moved.end(dev)
        assert moved.finished()  # ended on the host: nothing enqueued into the capture
        gpu.stream["now"] = 7
        capturing["now"] = False  # the capture ended
    assert gpu.writes == [(7, step.slot, step.seq)]
    assert not on_window.finished()
    gpu.arrive(step)
    assert on_window.finished()


def test_a_window_that_raises_still_ends_and_closes(fresh, gpu):
    dev = torch.device("cuda", 0)
    bound = CallBound("layer", 30.0, 0)
    with pytest.raises(KeyError):
        with watch_step(dev) as step:
            raise KeyError("the engine's own error")
    assert gpu.writes == [(7, step.slot, step.seq)]
    call = bound.watch(1)
    call.end(dev)  # no window open any more: the call marks itself
    assert gpu.writes[-1] == (7, call.slot, call.seq)


def test_a_capture_under_an_engine_that_bounds_replays_warns_nothing(fresh, monkeypatch,
                                                                    caplog):
    monkeypatch.setattr(watchdog, "_CUDA", [True])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    replays_in_step_windows("the engine's glue")
    with caplog.at_level(logging.WARNING, logger="moe_plugins.callbound.watchdog"):
        assert watch_call("layer", 1, 30.0) is None
    assert caplog.records == []


# -- the thread ---------------------------------------------------------------------------------
def test_the_thread_logs_its_own_error_and_keeps_watching(monkeypatch, caplog):
    wd = watchdog._Watchdog()
    looked = threading.Event()
    errors = iter([RuntimeError("boom")])

    def check(now: float) -> None:
        err = next(errors, None)
        if err is not None:
            raise err
        looked.set()

    monkeypatch.setattr(wd, "check", check)
    with caplog.at_level(logging.ERROR, logger="moe_plugins.callbound.watchdog"):
        wd.start()
        assert looked.wait(30), "the watchdog did not look again after its error"
    assert wd.thread.is_alive()
    assert any("internal error, still watching: RuntimeError: boom" in r.getMessage()
               for r in caplog.records)


def test_a_forked_child_starts_afresh_and_keeps_the_hooks(fresh):
    hook = lambda error: None  # noqa: E731
    fresh.hooks.append(hook)
    watch_call("layer", 1, 60.0)
    fresh.thread = object()  # as if started
    fresh.reset_after_fork()
    assert fresh.thread is None and fresh.cuda is None and fresh.hooks == [hook]
    assert fresh.tail == 1 and all(c.seq == -1 for c in fresh.ring)


# -- a library that waits on the host holding the interpreter lock ------------------------------
_HOLDING_CHILD = """
import ctypes, sys, time
from moe_plugins.callbound.host_timer import arm_host_timer
from moe_plugins.callbound import CallBound, on_call_timeout
bound = CallBound("layer", 1.0, 0)
on_call_timeout(lambda e: print("WATCHDOG", flush=True))
call = bound.watch(1)
if sys.argv[1] == "armed":
    arm_host_timer(call)
t0 = time.monotonic()
ctypes.PyDLL(None).sleep(int(sys.argv[2]))  # a C call that keeps the interpreter lock
print("RETURNED", round(time.monotonic() - t0, 1), flush=True)
time.sleep(5)
"""


def _holding(mode: str, seconds: int) -> tuple[int, str, str, float]:
    import subprocess
    import sys
    import time

    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _HOLDING_CHILD, mode, str(seconds)],
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr, time.monotonic() - t0


def test_a_call_holding_the_interpreter_lock_is_ended_by_the_lock_free_timer():
    """While a C call keeps the interpreter lock (as DeepEP's normal-mode dispatch does in its
    host wait), the watchdog thread cannot run: with a 1 s bound it ends the process only once
    the 4 s call returned. With arm_host_timer, faulthandler's timer (a C thread) ends it one
    poll after the bound, in the middle of a 30 s call, with every thread's traceback."""
    code, out, err, took = _holding("unarmed", 4)
    assert code == watchdog.EXIT_CODE and "WATCHDOG" in out, (code, out, err[-2000:])
    # not at the bound (1 s) but once the lock was let go, 4 s in
    assert re.search(r"call 1 did not complete within 1 s \(started [45]\.\d s ago", err), err
    code, out, err, took = _holding("armed", 30)
    assert code == 1 and "RETURNED" not in out, (code, out, err[-2000:])
    assert took < 15, took
    assert "Timeout (0:00:01" in err and "<string>" in err, err[-2000:]


# -- the backstop (no bound set) -------------------------------------------------------------------
@pytest.mark.parametrize("traps,expected", [(True, 90.0), (False, 120.0)],
                         ids=["library-traps", "library-masks"])
def test_with_no_bound_set_the_backstop_follows_the_library(fresh, monkeypatch, traps, expected):
    """Unset (argument None, variable absent or empty): a library that traps at its timeout gets
    0.9 of it (the process ends with our error before the trap), one that masks or raises gets
    20 s after it (its own outcome first); the INFO line and the error say it is the backstop."""
    monkeypatch.delenv(FIRST_CALL_TIMEOUT_ENV, raising=False)
    reread_environment()
    for raw in (None, "", "  "):
        if raw is None:
            monkeypatch.delenv(CALL_TIMEOUT_ENV, raising=False)
        else:
            monkeypatch.setenv(CALL_TIMEOUT_ENV, raw)
        reread_environment()
        bound = CallBound("layer", device=CPU)
        assert bound.timeout_s is None and bound.describe() == "off"
        bound.backstop("deepep_ll", 100.0, traps)
        assert bound.timeout_s == expected
        assert bound.first_timeout_s == max(10 * expected, 600.0)
        assert "no bound set, the backstop" in bound.describe()
        call = bound.watch(1)
        assert call is not None and "no call bound was set" in call.why
        call.end(CPU)
        text = str(watchdog.timeout_error(call, call.started + expected + 1))
        assert "backstop" in text and "restart every rank of the EP group" in text


@pytest.mark.parametrize("given,env", [(0, None), (None, "0"), (30.0, None), (None, "30")],
                         ids=["argument-0", "env-0", "argument-30", "env-30"])
def test_a_bound_the_user_set_or_turned_off_is_never_replaced(fresh, monkeypatch, given, env):
    if env is None:
        monkeypatch.delenv(CALL_TIMEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(CALL_TIMEOUT_ENV, env)
    reread_environment()
    bound = CallBound("layer", given, device=CPU)
    before = bound.timeout_s
    bound.backstop("deepep_ll", 100.0, True)
    assert bound.timeout_s == before and bound.why == ""


def test_no_library_timeout_no_backstop(fresh, monkeypatch):
    monkeypatch.delenv(CALL_TIMEOUT_ENV, raising=False)
    reread_environment()
    bound = CallBound("layer", device=CPU)
    bound.backstop("torch", None, False)
    assert bound.timeout_s is None and bound.watch(1) is None
