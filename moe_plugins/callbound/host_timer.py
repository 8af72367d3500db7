"""A timer of the C runtime over a library call that may wait on the host while holding the
interpreter lock (DeepEP's normal-mode dispatch waits there for its peers' counts): the call
bound's watchdog thread (:mod:`moe_plugins.callbound.watchdog`) cannot run while the lock is held, so
faulthandler's timer, a C thread that needs no lock, ends the process instead.

Who arms it: a layer knows the call and its deadline, the backend knows which of its library
calls waits (deepep_auto only in normal mode, chosen inside the call). So a layer calling a
backend with ``PrepareFinalize.waits_on_host`` names its watched call for the thread
(:func:`bound_host_waits`), and the backend wraps each library call that waits in
:func:`host_wait`, which arms the timer under that call's deadline for the library call alone.
An arm starts a thread of the C runtime (tens of microseconds): never on a low-latency call."""
from __future__ import annotations

import faulthandler
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from moe_plugins.callbound.settings import POLL_S

__all__ = ["arm_host_timer", "disarm_host_timer", "bound_host_waits", "host_wait"]


def arm_host_timer(call: Optional[Any]) -> None:
    """Before a library call that may wait on the host holding the interpreter lock (DeepEP's
    normal-mode dispatch waits there for the peers' counts): the watchdog thread cannot run
    while the lock is held, so a timer of the C runtime that needs no lock (faulthandler's)
    ends the process one poll after ``call``'s deadline, having written every thread's
    traceback to stderr (exit status 1: the hooks do not run). One per process: a later arm
    replaces it, :func:`disarm_host_timer` cancels it. None: nothing is armed."""
    if call is None:
        return
    left = call.deadline - time.monotonic() + POLL_S
    faulthandler.dump_traceback_later(max(left, POLL_S), exit=True, file=2)


def disarm_host_timer() -> None:
    """Cancel :func:`arm_host_timer`'s timer (the library call returned)."""
    faulthandler.cancel_dump_traceback_later()


class _HostWaits(threading.local):
    """The watched call whose deadline bounds this thread's host waits (None: none)."""

    call: Optional[Any] = None


_HOST_WAITS = _HostWaits()


def bound_host_waits(call: Optional[Any]) -> None:
    """A layer, around a watched call (:class:`moe_plugins.callbound.watchdog.WatchedCall`) of a backend
    that may wait on the host: the library calls in :func:`host_wait` on this thread run under
    ``call``'s deadline until this is called with None."""
    _HOST_WAITS.call = call


@contextmanager
def host_wait() -> Iterator[None]:
    """A backend, around one library call that may wait on the host holding the interpreter
    lock: the lock-free timer is armed under the deadline of the call the layer named
    (:func:`bound_host_waits`) and cancelled when the library call returns or raises. Nothing
    when no call is named (the bound is off)."""
    call = _HOST_WAITS.call
    if call is None:
        yield
        return
    arm_host_timer(call)
    try:
        yield
    finally:
        disarm_host_timer()
