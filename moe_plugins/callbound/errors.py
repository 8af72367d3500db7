"""The errors of the call bound (:mod:`moe_plugins.callbound.watchdog`): the exceptions the watchdog logs
and hands its hooks before it ends the process, and their messages."""
from __future__ import annotations

from typing import Any, Protocol

from moe_plugins.callbound.settings import CALL_TIMEOUT_ENV, FIRST_CALL_TIMEOUT_ENV

__all__ = ["EXIT_CODE", "CallTimeoutError", "PeerFailedError", "timeout_error",
           "peer_failed_error"]

class WatchedFacts(Protocol):
    """What the messages read of a watched call (moe_plugins.callbound.watchdog.WatchedCall)."""

    name: str
    number: int
    what: str
    why: str
    seq: int
    started: float
    bound: float
    covered: int
    cover: Any  # the step window's call whose completion it shares, or None


#: The exit status of a process the watchdog ended (BSD's EX_SOFTWARE): told apart from a crash.
EXIT_CODE = 70


class CallTimeoutError(RuntimeError):
    """A watched layer call did not complete within its bound (what the watchdog logs and hands
    its hooks before it ends the process)."""


class PeerFailedError(CallTimeoutError):
    """A watched layer call could not complete because a peer's call on its EP group failed
    mid-way and said so (:mod:`moe_plugins.callbound.fault_notice`): logged and handed to the hooks, with
    the peer's error, before the watchdog ends the process."""


def peer_failed_error(call: WatchedFacts, told: str, now: float) -> PeerFailedError:
    """The error of ``call`` whose EP group a peer told of its failure (``told``)."""
    return PeerFailedError(
        f"{call.name}: {call.what} {call.number} cannot complete (started "
        f"{now - call.started:.1f} s ago): a peer's call on this EP group failed mid-way and "
        f"told its peers: {told}. This rank's part of the call waits for that peer and cannot be "
        f"cancelled, so moe-plugins ends this process (exit status {EXIT_CODE}) instead of "
        "waiting for the bound; read that peer's error, fix its cause and restart the EP group "
        "(under vLLM, the engine: its executor shuts down when a worker dies)")


def timeout_error(call: WatchedFacts, now: float) -> CallTimeoutError:
    """The error of ``call`` found overdue at ``now`` (what the watchdog logs before the exit)."""
    bound = call.bound
    what = f"{call.what} {call.number}"
    cover = call.cover
    if call.covered == call.seq and cover is not None:  # its completion is its step's
        what += f" (or a later call of {cover.what} {cover.number}, whose completion it shares)"
    if call.why:  # the backstop: no bound was set
        return CallTimeoutError(
            f"{call.name}: {what} did not complete within {bound:g} s (started "
            f"{now - call.started:.1f} s ago; {call.why}): a peer rank died or hangs in the middle "
            "of the call. Its kernels cannot be cancelled and every rank of the EP group waits "
            f"for that peer, so moe-plugins ends this process (exit status {EXIT_CODE}); restart "
            "every rank of the EP group (under vLLM, the engine: its executor shuts down when a "
            f"worker dies). ${CALL_TIMEOUT_ENV} sets an earlier bound, 0 none")
    return CallTimeoutError(
        f"{call.name}: {what} did not complete within {bound:g} s "
        f"(started {now - call.started:.1f} s ago; ${CALL_TIMEOUT_ENV}, "
        f"${FIRST_CALL_TIMEOUT_ENV} for a layer's first calls): a peer rank died or hangs "
        "in the middle of the call, or this rank's own work took longer than the bound (a "
        "bound below a forward step's time ends healthy ranks: raise it then). Its kernels "
        f"cannot be cancelled, so moe-plugins ends this process (exit status {EXIT_CODE}) "
        "instead of waiting for the library's own timeout; restart the EP group (under "
        "vLLM, the engine: its executor shuts down when a worker dies)")
