"""A bound on each layer call: a peer that dies or hangs mid-call ends this process with a clear
error within ``call_timeout_s``, instead of after the library's own timeout.

Why a process end. Once a dispatch is on the wire, this rank's kernels wait for the peers: DeepEP's
kernels spin until their own timeout (``NUM_TIMEOUT_CYCLES``, about 100 s on an H200) and then
trap, which ends the CUDA context with "unspecified launch failure"; on a GPU shared with other
ranks a peer may not even see the trap (docs/design.md, "Faults"). A spinning kernel cannot be
cancelled from the host, and the host thread that waits on it sits in the driver, where no Python
exception reaches it. What a bounded failure can do is what NCCL's watchdog does for its own
collectives (``TORCH_NCCL_ASYNC_ERROR_HANDLING``): a watchdog thread that sees a call overdue logs
the error and ends the process, so the serving engine sees a dead worker in seconds and restarts
the group. The same bound also covers the host-side waits of the ``torch`` backend (a peer that
hangs without dying holds gloo/NCCL until the process group's timeout).

What is watched: each eager call of :class:`moe_plugins.runner.layer.MoELayer` and of the vLLM
adapter, from its start on the host to the completion on the GPU of the work it enqueued (a CUDA
event recorded after it; on CPU, when the call returns). CUDA-graph captures are not watched and
neither are graph replays (the host issues no call there): the library's own timeout applies, and
the first capture under a bound logs a WARNING saying so. The bound counts from the host's start
of a call, so set it well above a forward step's time (the host may run ahead of the GPU by a
step or more).

Off by default. On with ``call_timeout_s`` (``MoELayer``) or ``$MOE_PLUGINS_CALL_TIMEOUT_S`` (the
vLLM glue, and layers built without the argument). Cost when on: one CUDA event per call; a daemon
thread polls every :data:`POLL_S` seconds.
"""
from __future__ import annotations

import collections
import logging
import math
import os
import sys
import threading
import time
from typing import Callable, Optional

import torch

__all__ = ["CALL_TIMEOUT_ENV", "EXIT_CODE", "POLL_S", "CallTimeoutError", "WatchedCall",
           "call_timeout_seconds", "watch_call", "on_call_timeout"]

logger = logging.getLogger(__name__)

CALL_TIMEOUT_ENV = "MOE_PLUGINS_CALL_TIMEOUT_S"
#: The exit status of a process the watchdog ended (BSD's EX_SOFTWARE): told apart from a crash.
EXIT_CODE = 70
#: Seconds between the watchdog's checks: the error comes at most this late after the bound.
POLL_S = 0.2


class CallTimeoutError(RuntimeError):
    """A watched layer call did not complete within its bound (what the watchdog logs and hands
    its hooks before it ends the process)."""


def call_timeout_seconds(given: Optional[float] = None) -> Optional[float]:
    """``given``, else ``$MOE_PLUGINS_CALL_TIMEOUT_S``, else None (off); a positive finite number
    of seconds (ValueError/TypeError naming the source otherwise; 0 or "off" in the environment
    turns it off)."""
    source = "call_timeout_s"
    if given is None:
        raw = os.environ.get(CALL_TIMEOUT_ENV, "").strip()
        if raw.lower() in ("", "0", "off", "none"):
            return None
        source = f"${CALL_TIMEOUT_ENV}"
        try:
            given = float(raw)
        except ValueError:
            raise ValueError(f"{CALL_TIMEOUT_ENV}={raw!r} is not a number of seconds; give the "
                             "bound on one layer call, e.g. 30, or 0 to turn it off") from None
    if isinstance(given, bool) or not isinstance(given, (int, float)):
        raise TypeError(f"{source} must be a number of seconds or None, got {given!r} "
                        f"({type(given).__name__})")
    if not (given > 0 and math.isfinite(given)):
        raise ValueError(f"{source}={given!r}: expected seconds > 0 and finite, e.g. 30 (None, "
                         "or 0 in the environment, turns the bound off)")
    return float(given)


class WatchedCall:
    """One call under the watchdog: :meth:`end` when the call has enqueued all its work."""

    __slots__ = ("name", "number", "started", "deadline", "event", "done")

    def __init__(self, name: str, number: int, timeout_s: float):
        self.name, self.number = name, number
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.event: Optional[torch.cuda.Event] = None
        self.done = False

    def end(self, device: torch.device) -> None:
        """The call's work is enqueued: on CUDA it completes when an event recorded now on the
        current stream does; elsewhere it is complete now."""
        if device.type == "cuda" and not self.done:
            event = torch.cuda.Event()
            event.record()
            self.event = event
        else:
            self.done = True

    def finished(self) -> bool:
        if not self.done and self.event is not None and self.event.query():
            self.done = True
        return self.done


class _Watchdog:
    """The process's watchdog thread and the calls it watches (oldest first)."""

    def __init__(self) -> None:
        self.calls: "collections.deque[WatchedCall]" = collections.deque()
        self.hooks: list[Callable[[CallTimeoutError], None]] = []
        self.lock = threading.Lock()
        self.thread: Optional[threading.Thread] = None
        self.pid = -1

    def watch(self, call: WatchedCall) -> None:
        self.calls.append(call)  # deque.append is atomic: no lock on the call path
        if self.pid != os.getpid():  # first call here, or a forked child (threads do not fork)
            with self.lock:
                if self.pid != os.getpid():
                    self.pid = os.getpid()
                    self.thread = threading.Thread(target=self._run, name="moe-plugins-watchdog",
                                                   daemon=True)
                    self.thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            calls = self.calls
            while calls and calls[0].finished():
                calls.popleft()
            now = time.monotonic()
            for call in list(calls):  # a copy: the caller's thread appends meanwhile
                if not call.finished() and now > call.deadline:
                    self._expire(call, now)

    def _expire(self, call: WatchedCall, now: float) -> None:
        bound = call.deadline - call.started
        error = CallTimeoutError(
            f"{call.name}: call {call.number} did not complete within {bound:g} s "
            f"(call_timeout_s / ${CALL_TIMEOUT_ENV}; started {now - call.started:.1f} s ago): "
            "a peer rank died or hangs in the middle of the call, or this rank's GPU work never "
            "finished. Its kernels cannot be cancelled, so moe-plugins ends this process (exit "
            f"status {EXIT_CODE}) instead of waiting for the library's own timeout; restart the "
            "EP group (the serving engine restarts its workers)")
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
_WARNED_CAPTURE: list[str] = []  # the capture warning is given once per process


def watch_call(name: str, number: int, timeout_s: Optional[float]) -> Optional[WatchedCall]:
    """Start watching call ``number`` of layer ``name`` (None when ``timeout_s`` is None or a
    CUDA graph is being captured: nothing to watch)."""
    if timeout_s is None:
        return None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        if not _WARNED_CAPTURE:
            _WARNED_CAPTURE.append(name)
            logger.warning("%s: the call bound (%g s) does not cover CUDA-graph replays of this "
                           "capture (the host makes no call per replay): a peer that dies "
                           "during a replay ends this rank only by the library's own timeout",
                           name, timeout_s)
        return None
    call = WatchedCall(name, number, timeout_s)
    _WATCHDOG.watch(call)
    return call


def on_call_timeout(hook: Callable[[CallTimeoutError], None]) -> Callable[[], None]:
    """Run ``hook(error)`` when the watchdog ends this process (last registered first; in the
    watchdog's thread, just before the exit): e.g. report the error to a supervisor. Returns a
    function that unregisters it."""
    _WATCHDOG.hooks.append(hook)

    def remove() -> None:
        if hook in _WATCHDOG.hooks:
            _WATCHDOG.hooks.remove(hook)
    return remove
