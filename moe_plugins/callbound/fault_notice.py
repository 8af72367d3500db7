"""A rank whose call fails mid-way tells its peers (:mod:`moe_plugins.faults`, rule "mid-way
failures"): their calls on the group then end in seconds with the true cause, instead of at
the process-group timeout or, with the call bound on, at the bound with "a peer died or hangs".

The notice is one key of the process group's store (the store every rank of the job shares, set
up by ``torch.distributed``): the first failure of the group posts it (``compare_set``: later
ones are consequences), with the failing rank and its error. Once a call of this rank on the
group has waited :data:`READ_AFTER_S`, a reader thread looks at the key every poll
(:meth:`FaultNotice.want`); who acts on what it read depends on how the call waits:

* a wait on the host that can be cut into slices (a gloo collective: :func:`wait_or_told`) reads
  the answer between slices, and the backend raises
  :class:`moe_plugins.faults.CollectiveError` naming the peer's error: bound on or off, the
  process lives;
* a collective or a kernel that cannot be interrupted (the GPU libraries' waits) is left to the
  call bound's watchdog (:mod:`moe_plugins.callbound.watchdog`), which ends the process with
  :class:`moe_plugins.callbound.watchdog.PeerFailedError`. With the bound off such a peer ends at the
  library's or the process group's timeout, and a collective of ours that fails then reads the
  notice (:meth:`FaultNotice.read_within`) and names the peer's error as the cause.

The store can block (its server, on the job's first rank, stopped): it is read in a thread of
its own, never in the watchdog's or the caller's, and posted by the failing rank with its error
already recorded. A store that fails a read has lost its server (its host process died): that
is read once and said once (one WARNING), and the notice is not read again (each further read
would only fail the same way, and torch's client logs a stack trace for each).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any, Optional

from moe_plugins.callbound.settings import POLL_S

__all__ = ["FaultNotice", "NOTICE_PREFIX", "READ_AFTER_S", "notice_for", "wait_or_told"]

logger = logging.getLogger(__name__)

#: Store keys of the notices: this prefix and the process group's name.
NOTICE_PREFIX = "moe_plugins/fault/"
#: A call in flight this long (seconds) has its group's notice read: calls that complete sooner
#: need no store traffic.
READ_AFTER_S = 1.0
_MAX_CHARS = 800


class FaultNotice:
    """The notice of one EP process group on this rank: :meth:`post` (the rank that failed),
    :meth:`read` (its peers' reader thread), ``told`` (what was read: the watchdog's answer).

    ``store``: a ``torch.distributed.Store``; ``key``: the group's key; ``rank``: this
    process's global rank."""

    __slots__ = ("store", "key", "rank", "told", "wanted", "lost", "__weakref__")

    def __init__(self, store: Any, key: str, rank: int) -> None:
        self.store, self.key, self.rank = store, key, rank
        self.told: Optional[str] = None  # a peer's failure, once read
        self.wanted = 0.0  # monotonic time a call in flight last asked for the notice
        self.lost = False  # the store failed a read: its server is gone, never read again

    def post(self, what: str) -> None:
        """Tell the group's other ranks that this rank's call failed mid-way (``what``: the
        error); the first post of the group stays. A store error is logged, never raised: the
        caller raises its own error next."""
        text = f"EP rank {self.rank}: {what}"[:_MAX_CHARS]
        try:
            self.store.compare_set(self.key, "", text)
        except Exception as e:  # the store's server may be gone with its rank
            logger.warning("moe-plugins: could not tell the EP group's peers of this rank's "
                           "failure through the store (%s: %s); they end at their own bound",
                           type(e).__name__, e)

    def clear(self) -> None:
        """Forget a posted failure (every rank of the group clears it at one point:
        :func:`moe_plugins.faults.clear_group_faults`)."""
        self.told = None
        try:
            self.store.delete_key(self.key)
        except Exception as e:
            logger.debug("moe-plugins: could not clear the fault notice %s (%s)", self.key, e)

    def read(self) -> Optional[str]:
        """The failure a rank of the group posted, or None (may block while the store's server
        does not answer: called from the reader thread only)."""
        if not self.store.check([self.key]):
            return None
        text = self.store.get(self.key).decode("utf-8", errors="replace")
        return None if text.startswith(f"EP rank {self.rank}:") else text  # not our own

    def want(self, now: float) -> None:
        """A call on the group has waited :data:`READ_AFTER_S` (``now``: ``time.monotonic()``):
        the reader thread reads the notice every poll into :attr:`told` until no call has asked
        for :data:`READ_AFTER_S`."""
        if self.lost:
            return
        self.wanted = now
        _READER.want(self)

    def store_failed(self, error: BaseException) -> None:
        """A read of the notice failed: the store's server is gone (its host process died).
        Said once; the notice is not read again."""
        if self.lost:
            return
        self.lost = True
        lines = str(error).strip().splitlines()
        logger.warning("moe-plugins: the store carrying the EP group's fault notices (%s) failed "
                       "a read (%s: %s): its server's process (the job's first rank or its "
                       "launcher) is gone; the notice is no longer read, and the call bound or "
                       "the library's timeout ends a call that waits for a failed peer",
                       self.key, type(error).__name__, lines[0] if lines else "")

    def read_within(self, seconds: float) -> Optional[str]:
        """:meth:`read` on an error path: None when the store does not answer within
        ``seconds`` (its server stopped) or fails (its server gone); the read is left to a
        daemon thread then."""
        found: list[Optional[str]] = []
        if self.lost:
            return None

        def read() -> None:
            try:
                found.append(self.read())
            except Exception as e:  # the store's server may be gone with its rank
                self.store_failed(e)

        reader = threading.Thread(target=read, name="moe-plugins-fault-notice", daemon=True)
        reader.start()
        reader.join(seconds)
        return found[0] if found else None


class _Reader:
    """The process's reader thread: the notices wanted lately (:meth:`FaultNotice.want`)."""

    def __init__(self) -> None:
        self.wanted: set[FaultNotice] = set()
        self.thread: Optional[threading.Thread] = None
        self.lock = threading.Lock()

    def want(self, notice: FaultNotice) -> None:
        self.wanted.add(notice)
        if self.thread is None:
            with self.lock:
                if self.thread is None:
                    self.thread = threading.Thread(target=self._run, daemon=True,
                                                   name="moe-plugins-fault-notices")
                    self.thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            now = time.monotonic()
            for notice in list(self.wanted):
                if notice.told is not None or now - notice.wanted > READ_AFTER_S:
                    self.wanted.discard(notice)  # told, or no call asks any more
                    continue
                try:
                    notice.told = notice.read()
                except Exception as e:  # the store's server is gone: the bounds still hold
                    notice.store_failed(e)
                    self.wanted.discard(notice)

    def reset_after_fork(self) -> None:
        self.__init__()  # type: ignore[misc]  # threads do not fork


_READER = _Reader()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_READER.reset_after_fork)
_FIRST_SLICE = timedelta(seconds=READ_AFTER_S)
_SLICE = timedelta(seconds=POLL_S)


def _waited(work: Any, timeout: timedelta) -> bool:
    """``work.wait(timeout)``: True once the work completed (its error raised, as ``wait()``),
    False when the slice ran out first (the work stays pending and can be waited for again)."""
    try:
        work.wait(timeout)
        return True
    except RuntimeError:
        if not work.is_completed():  # "Operation timed out!": only this slice
            return False
        work.wait()  # completed meanwhile, or failed: its own outcome
        return True


def wait_or_told(work: Any, notice: FaultNotice) -> Optional[str]:
    """Wait for a pending gloo collective (``work``, a ``torch.distributed.Work``) while
    hearing the group's notice: None once the work completed (its error raised, as
    ``work.wait()``), or the failure a peer posted while this rank waited (the work is left
    pending: the group is out of step, and the caller raises). The wait is cut into slices of a
    poll once it has lasted :data:`READ_AFTER_S`; a healthy collective costs what ``wait()``
    does. Only for waits whose slices time out on the host (gloo): an NCCL work's ``wait``
    only orders streams."""
    if _waited(work, _FIRST_SLICE):
        return None
    while True:
        notice.want(time.monotonic())
        if notice.told is not None:
            return notice.told
        if _waited(work, _SLICE):
            return None


def notice_for(group: Any, rank: int) -> Optional[FaultNotice]:
    """The notice of process group ``group`` (None: the default group) on global rank
    ``rank``; None where torch.distributed has no store (not initialized)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        pg = group if group is not None else dist.group.WORLD
        name = pg.group_name
    except (AttributeError, RuntimeError, ValueError) as e:
        logger.debug("moe-plugins: no store for fault notices (%s)", e)
        return None
    return FaultNotice(store, NOTICE_PREFIX + name, rank)
