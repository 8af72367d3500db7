"""A timer of the C runtime over a library call that may wait on the host while holding the
interpreter lock (DeepEP's normal-mode dispatch waits there for its peers' counts): the call
bound's watchdog thread (:mod:`moe_plugins.watchdog`) cannot run while the lock is held, so
faulthandler's timer, a C thread that needs no lock, ends the process instead."""
from __future__ import annotations

import faulthandler
import time
from typing import Any, Optional

from moe_plugins.call_bound_settings import POLL_S

__all__ = ["arm_host_timer", "disarm_host_timer"]


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
