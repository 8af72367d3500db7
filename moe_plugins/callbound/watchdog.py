"""A bound on each layer call: a peer that dies or hangs mid-call ends this process with a clear
error within ``call_timeout_s``, instead of after the library's own timeout.

Why a process end. Once a dispatch is on the wire, this rank's kernels wait for the peers: DeepEP's
kernels spin until their own timeout (``NUM_TIMEOUT_CYCLES``, about 100 s on an H200) and then
trap, which ends the CUDA context with "unspecified launch failure"; on a GPU shared with other
ranks a peer may not even see the trap (docs/design.md, "Faults"). A spinning kernel cannot be
cancelled from the host, and the host thread that waits on it sits in the driver, where no Python
exception reaches it. What a bounded failure can do is what NCCL's watchdog does for its own
collectives (``TORCH_NCCL_ASYNC_ERROR_HANDLING``): a watchdog thread that sees a call overdue logs
the error and ends the process, so the serving engine sees a dead worker within the bound. The
same bound also covers the host-side waits of the ``torch`` backend (a peer that hangs without
dying holds gloo/NCCL until the process group's timeout).

How completion is seen, without disturbing CUDA. The watchdog thread makes no CUDA call at all:
it reads host memory only. Each watched call takes a slot of a preallocated ring
(:data:`RING_SLOTS`; no allocation and no lock per call). On CPU the call is complete when it
returns (:meth:`WatchedCall.end` writes the slot on the host). On CUDA, :meth:`WatchedCall.end`
enqueues on the call's stream, after the call's work, a 4-byte write of the call's sequence
number into a page-locked host buffer mapped into the GPU's address space (the CUDA driver's
``cuStreamWriteValue32``, else ``cuMemsetD32Async``; chosen once, by a probe, on the first CUDA
call): the call is complete when the GPU has written it. No CUDA event, nothing per call that
can leak. A CUDA call the watchdog thread made (``event.query()``, as before) would fail, and
invalidate the capture, while any stream of the process captures a CUDA graph in the default
(global) capture mode.

CUDA graphs. During a capture nothing is enqueued for the watchdog (the calls are recorded only),
and nothing in a graph is watched by itself: the host makes no call per replay. A replay is
bounded when its launcher says so: ``with capture_calls() as captured:`` around the capture
records the calls captured; ``with expect_replay(captured):`` around each ``graph.replay()``
watches the replay from its launch on the host to the completion on the GPU of everything it
enqueued (one stream write after the replay: host runs ahead of the GPU by any number of
replays and each is told apart), under the largest bound of the calls in it. A capture under a
bound that no such launcher records logs one WARNING: its replays are not bounded.

Step windows. An engine can watch each forward step as a whole, eager or replayed:
``with watch_step():`` around the step watches it from its launch to the completion on the GPU
of what it enqueued on the current stream, under the largest bound of the process's layers.
Layer calls inside that end on the same stream take the step's one completion mark (a call is
complete when the step is): one driver call per step instead of one per layer, while each call
keeps its own deadline and name. The vLLM glue opens a window around each of vLLM's forward
passes and full-graph replays (:mod:`moe_plugins.vllm.step_window`): under vLLM the replays of
captured decode steps are bounded too.

A library's host wait. A Python thread cannot run while a library call keeps the interpreter
lock, as DeepEP's normal-mode dispatch does while it waits on the host for its peers: around
such calls the layers arm faulthandler's timer (a C thread; :mod:`moe_plugins.callbound.host_timer`),
which ends the process one poll after the call's deadline with every thread's traceback (exit
status 1).

Each layer's bound, its start-up bound and the backstop where no bound is set:
:mod:`moe_plugins.callbound.layer_bound`.

Off by default. On with ``call_timeout_s`` (``MoELayer``) or ``$MOE_PLUGINS_CALL_TIMEOUT_S``
(the vLLM glue, and layers built without the argument); 0 turns it off in either. Cost when on:
host time per watched call, most of it the driver call that enqueues the progress write, which
the calls of a step window share (figures: docs/results.md, "The call bound's host cost"); 16
KiB of page-locked host memory per process, and a daemon thread that wakes every
:data:`POLL_S` s.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import math
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from moe_plugins.callbound.errors import (EXIT_CODE, CallTimeoutError, PeerFailedError,
                                           peer_failed_error, timeout_error)
from moe_plugins.callbound.settings import (CALL_TIMEOUT_ENV, FIRST_CALL_TIMEOUT_ENV,
                                             MIN_TIMEOUT_S, POLL_S, call_timeout_seconds,
                                             first_call_timeout_seconds, UNSET, environment_seconds)
from moe_plugins.callbound.fault_notice import READ_AFTER_S, FaultNotice
from moe_plugins.callbound.gpu_progress import CudaProgress as _CudaProgress
from moe_plugins.callbound.gpu_progress import raw_stream as _raw_stream
from moe_plugins.callbound.step_state import LayerBounds, StepLocal

__all__ = ["CALL_TIMEOUT_ENV", "FIRST_CALL_TIMEOUT_ENV", "EXIT_CODE", "POLL_S", "MIN_TIMEOUT_S",
           "RING_SLOTS", "CallTimeoutError", "PeerFailedError", "WatchedCall", "CapturedCalls",
           "call_timeout_seconds", "first_call_timeout_seconds", "watch_call", "on_call_timeout",
           "capture_calls", "expect_replay", "watch_step", "replays_in_step_windows",
           "bound_on", "bounds_changed", "watchdog_alive"]

logger = logging.getLogger(__name__)

#: Watched calls in flight at once before the oldest slot is reused (a power of two).
RING_SLOTS = 4096
_MASK = RING_SLOTS - 1
_U32 = 0xFFFFFFFF
_ERROR_EVERY_S = 60.0  # the watchdog's own errors: logged at most this often


class WatchedCall:
    """One call under the watchdog: :meth:`end` when the call has enqueued all its work.

    The objects are preallocated, one per ring slot, and reused: ``seq`` (the process's call
    count at its start) says which call a slot holds now."""

    __slots__ = ("slot", "seq", "name", "number", "what", "why", "started", "bound", "deadline",
                 "done", "gpu", "covered", "cover", "cover_seq", "notice")

    def __init__(self, slot: int) -> None:
        self.slot, self.seq = slot, -1
        self.name, self.number, self.what = "", 0, "call"
        self.why = ""  # where the bound comes from, when it is not the user's (the backstop)
        self.started = self.bound = self.deadline = 0.0
        self.done = self.gpu = -1  # seq of the call ended on the host / whose GPU write is queued
        # seq of the call whose completion is the mark of the step window it ran in (cover, the
        # window's call, when it held cover_seq)
        self.covered = self.cover_seq = -1
        self.cover: Optional[WatchedCall] = None
        self.notice: Optional[FaultNotice] = None  # its EP group's (moe_plugins.callbound.fault_notice)

    def end(self, device: torch.device) -> None:
        """The call's work is enqueued: on CUDA it completes when the GPU has written the
        call's progress word after that work (on the current stream); elsewhere it is complete
        now."""
        wd = _WATCHDOG
        if device is not wd.last_device:  # torch.device.type costs half a microsecond: once
            if device.type != "cuda":
                wd.last_device, wd.last_index = device, -1
            elif device.index is not None:
                wd.last_device, wd.last_index = device, device.index
            else:  # "cuda": the current device, asked each time
                wd.end_on_gpu(self, torch.cuda.current_device())
                return
        if wd.last_index < 0:
            self.done = self.seq
        else:
            wd.end_on_gpu(self, wd.last_index)

    def finished(self) -> bool:
        """The call (``seq``) completed: on the host, or its progress word arrived (host memory
        only: no CUDA call)."""
        seq = self.seq
        if self.done == seq:
            return True
        if self.covered == seq:  # the window's slot reused: its call long since started anew
            cover = self.cover
            return cover is not None and (cover.seq != self.cover_seq or cover.finished())
        words = _WATCHDOG.words
        return self.gpu == seq and words is not None and words[self.slot] == seq & _U32


@dataclass
class CapturedCalls:
    """The watched calls captured into one CUDA graph (:func:`capture_calls`): (name, number,
    bound in seconds) each; ``replays`` counts :func:`expect_replay`."""

    calls: list[tuple[str, int, float]] = field(default_factory=list)
    replays: int = 0
    name: str = ""  # how the watchdog names its replays (made at the first)

    @property
    def timeout_s(self) -> Optional[float]:
        """The bound of a replay: the largest of its calls' (None: no call under a bound)."""
        return max((t for *_, t in self.calls), default=None)

    def describe(self) -> str:
        names = sorted({n for n, *_ in self.calls})
        return f"{len(self.calls)} captured call(s) of {', '.join(names) or 'no layer'}"


class _Watchdog:
    """The process's watchdog thread and the ring of calls it watches."""

    def __init__(self) -> None:
        self.ring = [WatchedCall(i) for i in range(RING_SLOTS)]
        self.counter = itertools.count(1)  # next() is atomic: several calling threads are fine
        self.tail = 1  # the oldest call that may still be in flight (the thread's own)
        self.hooks: list[Callable[[CallTimeoutError], None]] = []
        self.lock = threading.Lock()
        self.thread: Optional[threading.Thread] = None
        self.cuda: Optional[_CudaProgress] = None
        self.words: Optional[ctypes.Array] = None  # cuda.words once it works
        self.capture: Optional[CapturedCalls] = None  # the open capture_calls() record
        # the device of the last end(): its CUDA index, -1 when it is not a CUDA device
        self.last_device: Optional[torch.device] = None
        self.last_index = -1
        self.warned_capture = False
        self.replays_bounded_by = ""  # who wraps every graph replay in a step window
        self.steps = 0
        self.last_error = -math.inf

    def reset_after_fork(self) -> None:
        """In a forked child: no thread (threads do not fork), no CUDA (it does not either), no
        open step window; the hooks stay."""
        hooks, bounded_by = self.hooks, self.replays_bounded_by
        self.__init__()  # type: ignore[misc]
        self.hooks, self.replays_bounded_by = hooks, bounded_by  # the engine's glue is forked too
        _STEP.window = None

    def start(self) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="moe-plugins-watchdog",
                                               daemon=True)
                self.thread.start()

    def prepare_cuda(self) -> _CudaProgress:
        """The progress buffer and its driver call, made once (page-locked memory is allocated:
        done where a layer is built, not during another thread's CUDA-graph capture)."""
        with self.lock:
            if self.cuda is None:
                self.cuda = _CudaProgress(RING_SLOTS)
                self.words = self.cuda.words if self.cuda.ok else None
            return self.cuda

    def end_on_gpu(self, call: WatchedCall, index: int) -> None:
        """:meth:`WatchedCall.end` of a call on CUDA device ``index``."""
        cuda = self.cuda
        if cuda is None:
            cuda = self.prepare_cuda()
        seq = call.seq
        if cuda.ok:
            stream = _raw_stream(index)
            window = _STEP.window
            if window is not None:
                if window[1] == stream and window[3] == index:
                    # the window's one mark, after everything on this stream, completes it
                    call.cover, call.cover_seq = window[0], window[2]
                    call.covered = seq  # published last: finished() reads it first
                    return
                if _capturing():  # watch_call left the query to here: enqueue nothing
                    call.done = seq
                    return
            rc = cuda.write(stream, call.slot, seq & _U32)
            if rc == 0:
                call.gpu = seq
                return
            self._error(RuntimeError(f"{cuda.how} failed on cuda:{index} with CUresult {rc}"))
        call.done = seq  # no GPU path: watched until its host part returned

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            try:
                self.check(time.monotonic())
            except Exception as e:  # never die silently: say so and keep watching
                self._error(e)

    def _error(self, e: BaseException) -> None:
        now = time.monotonic()
        if now - self.last_error >= _ERROR_EVERY_S:
            self.last_error = now
            logger.error("moe-plugins watchdog: internal error, still watching: %s: %s",
                         type(e).__name__, e, exc_info=e)

    def check(self, now: float) -> None:
        """One look at every call in flight (host memory only): the finished ones at the tail
        are dropped, an overdue one ends the process."""
        seq, ring = self.tail, self.ring
        at_tail = True
        while True:
            call = ring[seq & _MASK]
            held = call.seq
            if held < seq:  # not started yet (or being published): nothing beyond it
                break
            if held > seq:  # the ring reused this call's slot: every call up to held - RING
                # started its successor in its slot too (no longer watched: documented)
                seq = max(seq, held - RING_SLOTS)
            elif not call.finished():
                deadline = call.deadline
                if now > deadline and call.seq == seq:  # still the same call
                    self._expire(call, now)
                notice = call.notice
                if notice is not None and now - call.started >= READ_AFTER_S:
                    if notice.told is not None and call.seq == seq:
                        self._end(peer_failed_error(call, notice.told, now))
                    notice.want(now)  # read in the notices' thread: the store may block
                at_tail = False
            if at_tail:
                self.tail = seq + 1
            seq += 1

    def _expire(self, call: WatchedCall, now: float) -> None:
        self._end(timeout_error(call, now))

    def _end(self, error: CallTimeoutError) -> None:
        """Log ``error``, run the hooks, end the process (exit status :data:`EXIT_CODE`)."""
        logger.error("%s", error)
        for hook in reversed(self.hooks):  # last registered first, as atexit
            try:
                hook(error)
            except BaseException:  # a hook must not keep the process alive
                logger.exception("moe-plugins watchdog: a call-timeout hook raised")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(EXIT_CODE)


_WATCHDOG = _Watchdog()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCHDOG.reset_after_fork)
_CUDA: list[bool] = []  # whether this process's torch has CUDA (asked once)
_STEP = StepLocal()  # this thread's open step window
_BOUNDS = LayerBounds()  # the layers' bounds: a step window's is their largest
_IS_CAPTURING: list[Callable[[], bool]] = []


def _has_cuda() -> bool:
    """Whether this process's torch has a CUDA device (asked once; layers ask it when they are
    built, so no capture is under way then)."""
    if not _CUDA:
        _CUDA.append(torch.cuda.is_available())
        binding = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
        if _CUDA[0] and binding is not None and not isinstance(binding, type):
            _IS_CAPTURING.append(binding)
    return _CUDA[0]


def _capturing() -> bool:
    """Whether the caller's current CUDA stream is capturing a graph (the caller's thread asks
    its own stream: legal during any capture)."""
    if not (_CUDA[0] if _CUDA else _has_cuda()):
        return False
    # torch's own binding, without the wrapper torch.cuda.is_current_stream_capturing adds
    # (about a microsecond per call on an H200 host); a CPU build has only a placeholder
    return _IS_CAPTURING[0]() if _IS_CAPTURING else torch.cuda.is_current_stream_capturing()


def watch_call(name: str, number: int, timeout_s: Optional[float], what: str = "call",
               notice: Optional[FaultNotice] = None, why: str = "") -> Optional[WatchedCall]:
    """Start watching call ``number`` of layer ``name`` under ``timeout_s`` seconds (None: off,
    nothing watched). During a CUDA-graph capture nothing is watched (None): the call is recorded
    for :func:`capture_calls`, and no CUDA call is made for it. ``what`` names it in the
    error ("call", "start-up call", "CUDA-graph replay"). ``notice``: its EP group's, read while
    the call is in flight (a peer's failure then ends the process at once). ``why``: where the
    bound comes from when it is not the user's (the error says it; see
    :meth:`moe_plugins.callbound.layer_bound.CallBound.backstop`)."""
    if timeout_s is None:
        return None
    # Inside this thread's open step window the driver's capture query (half a microsecond) is
    # left to end(): a call that ends on the window's stream enqueues nothing (the window's mark
    # completes it), one that ends on a capturing stream ends on the host. A call captured
    # inside a window is so watched, not recorded for capture_calls: the window that replays
    # the graph bounds the replay.
    if _STEP.window is None and _capturing():
        _captured(name, number, timeout_s)
        return None
    return _start(name, number, timeout_s, what, notice, why=why)


def _start(name: str, number: int, timeout_s: float, what: str,
           notice: Optional[FaultNotice], late_s: float = 0.0, why: str = "") -> WatchedCall:
    """Publish a watched call in its ring slot (no capture check: the caller made it);
    ``late_s``: its deadline that much after its bound."""
    wd = _WATCHDOG
    seq = next(wd.counter)
    call = wd.ring[seq & _MASK]
    call.name, call.number, call.what, call.why = name, number, what, why
    call.started = now = time.monotonic()
    call.bound = timeout_s
    call.deadline = now + timeout_s + late_s
    call.notice = notice
    call.seq = seq  # published last: the thread reads seq first
    if wd.thread is None:
        wd.start()
    return call


def _captured(name: str, number: int, timeout_s: float) -> None:
    record = _WATCHDOG.capture
    if record is not None:
        record.calls.append((name, number, timeout_s))
    elif not _WATCHDOG.warned_capture and not _WATCHDOG.replays_bounded_by:
        _WATCHDOG.warned_capture = True
        logger.warning("%s: captured into a CUDA graph under a call bound (%g s); its replays "
                       "are bounded only where the code that replays the graph wraps each "
                       "replay in moe_plugins.callbound.watchdog.expect_replay (vLLM's graph runner does "
                       "not): otherwise a peer that dies during a replay ends this rank only by "
                       "the library's own timeout", name, timeout_s)


@contextmanager
def capture_calls() -> Iterator[CapturedCalls]:
    """Around a CUDA-graph capture: records the watched calls captured (yielded, filled when
    the block ends), to hand to :func:`expect_replay` at each replay."""
    record = CapturedCalls()
    outer, _WATCHDOG.capture = _WATCHDOG.capture, record
    try:
        yield record
    finally:
        _WATCHDOG.capture = outer


@contextmanager
def expect_replay(captured: CapturedCalls,
                  device: Optional[torch.device] = None) -> Iterator[Optional[WatchedCall]]:
    """Around one ``graph.replay()`` of a graph whose capture ``captured`` recorded: the replay
    is watched from here to the completion on the GPU of what it enqueued, under the largest
    bound of its calls (nothing is watched when none was under a bound). ``device``: the
    graph's (default: the current CUDA device)."""
    bound = captured.timeout_s
    captured.replays += 1
    if not captured.name:
        captured.name = captured.describe()
    call = watch_call(captured.name, captured.replays, bound, "CUDA-graph replay")
    try:
        yield call
    finally:
        if call is not None:
            call.end(device or torch.device("cuda", torch.cuda.current_device()))


class _StepWindow:
    """What :func:`watch_step` returns: a context manager (a class, not a generator: a step
    window is entered once per forward step, and a generator's frame costs a microsecond)."""

    __slots__ = ("device", "name", "call", "index")

    def __init__(self, device: Optional[torch.device], name: str) -> None:
        self.device, self.name = device, name
        self.call: Optional[WatchedCall] = None
        # the step's device as its CUDA index, -1 not CUDA, -2 not resolved yet (an engine makes
        # a window per step: no torch.device is built or asked per step on its default path)
        self.index = -2

    def _resolve(self) -> int:
        device = self.device
        if device is None:  # the current CUDA device, asked each step
            return torch.cuda.current_device() if _has_cuda() else -1
        if device.type != "cuda":
            self.index = -1
        else:
            self.index = torch.cuda.current_device() if device.index is None else device.index
        return self.index

    def __enter__(self) -> Optional[WatchedCall]:
        bound = _BOUNDS.largest()
        # no layer has a bound (first: the engine's steps cost nothing then), a window of this
        # thread is open, or a capture is under way
        if bound is None or _STEP.window is not None or _capturing():
            return None
        index = self.index
        if index == -2:
            index = self._resolve()
        wd = _WATCHDOG
        wd.steps += 1
        # one poll later than its bound: a layer call overdue in it is named first (the step
        # started before it, under a bound at least as large)
        call = self.call = _start(self.name, wd.steps, bound, "forward step", None, POLL_S)
        if index >= 0:
            _STEP.window = (call, _raw_stream(index), call.seq, index)
        return call

    def __exit__(self, *exc: object) -> None:
        call = self.call
        if call is None:
            return
        self.call = None
        window, _STEP.window = _STEP.window, None
        if window is None:  # not on CUDA: complete now
            call.done = call.seq
        elif _capturing():  # a capture began inside and is still open: enqueue nothing
            call.done = call.seq
        else:
            _WATCHDOG.end_on_gpu(call, window[3])


def watch_step(device: Optional[torch.device] = None, name: str = "engine") -> _StepWindow:
    """``with watch_step():`` around an engine's forward step (eager, or a CUDA-graph replay):
    the step is watched from there to the completion on the GPU of what it enqueued on the
    current stream, under the largest bound of the process's layers (their start-up bound while
    one is starting); the ``with`` yields the step's :class:`WatchedCall`, or None when nothing
    is watched: no layer has a bound, a capture is under way, or another window of this thread
    is open. Layer calls inside that end on the same stream take the step's one completion mark
    instead of one each: one driver call per step, not per layer. ``device``: the step's
    (default: the current CUDA device, else CPU); ``name``: who runs the steps, for the
    error ("engine: forward step 7 did not complete ...")."""
    return _StepWindow(device, name)


def replays_in_step_windows(who: str) -> None:
    """Say that ``who`` (an engine's glue) runs every CUDA-graph replay inside
    :func:`watch_step`: a layer captured under a bound then logs no warning about unbounded
    replays."""
    _WATCHDOG.replays_bounded_by = who


def on_call_timeout(hook: Callable[[CallTimeoutError], None]) -> Callable[[], None]:
    """Run ``hook(error)`` when the watchdog ends this process (last registered first; in the
    watchdog's thread, just before the exit): e.g. report the error to a supervisor. Returns a
    function that unregisters it."""
    _WATCHDOG.hooks.append(hook)

    def remove() -> None:
        if hook in _WATCHDOG.hooks:
            _WATCHDOG.hooks.remove(hook)
    return remove


def bound_on(bound: Any, device: Optional[torch.device]) -> None:
    """A layer's bound is on (:class:`moe_plugins.callbound.layer_bound.CallBound`, held weakly;
    anything with ``current_timeout_s()``): step windows count it, and on a CUDA device the progress buffer is made now (with a CUDA context current
    on this thread), not at a first call during a capture."""
    if _has_cuda() and device is not None and device.type == "cuda":
        _WATCHDOG.prepare_cuda()
    _BOUNDS.add(bound)


def bounds_changed() -> None:
    """A layer's current bound changed (its start-up ended): step windows ask again."""
    _BOUNDS.changed()


def watchdog_alive() -> bool:
    """Whether this process's watchdog thread runs (False before the first watched call)."""
    thread = _WATCHDOG.thread
    return thread is not None and thread.is_alive()
