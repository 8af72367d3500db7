"""Finding a lost EP peer in seconds, and one decision about it that every survivor shares.

Why a heartbeat on the store, not the fault notices: a notice (:mod:`moe_plugins.callbound.
fault_notice`) is posted by a rank that raised and lives; a rank that was killed, or is
stopped, posts nothing. So each rank of the group beats: a thread sets its key in the job's
store every ``beat_s`` and reads its peers' keys. A peer whose key has not changed for
``detect_s`` while this rank has a call in flight is suspected. Nothing of this runs on the
call's path (no GPU to CPU sync, no store round trip): a call counts itself in and out.

One decision: a suspecting rank proposes the lost ranks with ``compare_set`` on the group's
next decision key; the first proposal stays, and every rank (a survivor that suspected nothing
yet, and a stopped rank once it runs again) reads that one record. So all survivors mask,
re-home and regroup from the same values. A rank that finds itself in the record is
*evicted*: it stops sending to its peers (its calls raise
:class:`moe_plugins.survival.errors.RankEvictedError`).

The thread makes no CUDA call: a library call that launches a kernel keeps the interpreter
lock, and a launch may wait in the driver behind the call in flight (a kernel spinning on the
lost peer, another thread's synchronous copy), which would hold every thread of the process,
this one's beats too. Nor would a mask it queued help the call in flight: the libraries read a
peer's mask word once, as each send and each wait begins (DeepEP 567632d, NIXL EP), and a mask
queued on a stream behind that call's kernels lands after them. A wait already spinning on the
lost peer ends at the library's kernel timeout, which masks that peer; a call that ends with
such a mask proposes those ranks itself (:meth:`PeerWatch.declare`): the library's timeout is
a detection too. The caller's thread then recovers (:meth:`PeerWatch.recover`): a host group of
the survivors (bounded), a barrier (every survivor left the faulted call), the buffers cleaned
and the lost ranks masked, a second barrier (every survivor cleaned before anyone sends).

The thread talks to the store on a connection of its own (``Store.clone``): a connection
serves one operation at a time, and the caller's blocking ones (the survivors' group
rendezvous in :meth:`PeerWatch.recover`, which waits for a survivor whose faulted call still
spins on the lost peer) would otherwise hold the beats for their whole length, and the peers
would take this live rank for lost.

The store is the one ``torch.distributed`` was initialized with; if its server goes away (its
host process died) the thread says so once and stops: the library's timeout or the call bound
ends the calls then.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch.distributed as dist

from moe_plugins.faults import group_faults
from moe_plugins.survival.errors import RankEvictedError

__all__ = ["PeerWatch", "peer_watch_for", "WATCH_PREFIX"]

logger = logging.getLogger(__name__)

WATCH_PREFIX = "moe_plugins/peers/"
_LEFT = b"left"


class PeerWatch:
    """The watch of one EP process group on this rank. ``ranks``: the group's global ranks;
    ``me``: this rank's index in the group; ``detect_s``/``beat_s``: see the module doc;
    ``group_timeout_s``: the survivors' group's collective timeout."""

    def __init__(self, store: Any, prefix: str, ranks: Sequence[int], me: int, detect_s: float,
                 beat_s: float, group_timeout_s: float) -> None:
        self.store, self.prefix, self.ranks, self.me = (_own_connection(store), prefix,
                                                         list(ranks), me)
        self.detect_s, self.beat_s, self.group_timeout_s = detect_s, beat_s, group_timeout_s
        self.lost: tuple[int, ...] = ()  # EP ranks decided lost, ascending
        self.epoch = 0  # decisions adopted
        self.recovered_epoch = 0
        self.evicted = False
        self.store_lost = False
        self.calls_in_flight = 0
        self.host_group: Any = None  # the survivors' group after a recovery
        #: the fault state of the group the layers run on: its notice is silenced on a
        #: decision (a survivor's faulted call must not tell its peers' watchdogs it failed)
        self.faults: Any = None
        #: per decision: lost ranks, time.time() of the decision, the peers' silence (s)
        self.decisions: list[dict] = []
        self.last_beat = time.monotonic()  # this rank's last beat that reached the store
        self._managers: list[weakref.ref] = []
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beats = 0
        self._beat()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="moe-plugins-peer-watch")
        self._thread.start()

    # -- registration ---------------------------------------------------------------------
    def register(self, manager: Any) -> None:
        """A manager (``RankMasking``) whose buffer the decisions mask."""
        self._managers.append(weakref.ref(manager))

    def unregister(self, manager: Any) -> None:
        """The manager's layer is destroyed; the watch closes with its last manager."""
        self._managers = [r for r in self._managers if r() is not None and r() is not manager]
        if not self._managers:
            self.close()

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def _live_managers(self) -> list[Any]:
        found, buffers = [], set()
        for ref in self._managers:
            m = ref()
            if m is not None and id(m.buffer) not in buffers and m.buffer is not None:
                buffers.add(id(m.buffer))
                found.append(m)
        return found

    # -- the thread -----------------------------------------------------------------------
    def _key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(self._key("hb", self.me), str(self._beats))
        self.last_beat = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self._step()
            except Exception as e:  # the store's server is gone with its host: say it once
                self.store_lost = True
                logger.warning("moe-plugins: the store of EP group %s does not answer (%s: %s); "
                               "its host process died? Lost peers are no longer detected on "
                               "this group: the library's timeout or the call bound ends the "
                               "calls", self.prefix, type(e).__name__, str(e).splitlines()[0]
                               if str(e) else "")
                return

    def _step(self) -> None:
        if self.evicted:
            return
        # the group's decision first, then the beat: a caller that finds this rank's beat
        # fresh (check_lease) finds a decision taken while this rank was stopped adopted too
        self._read_decision()
        if self.evicted:
            return
        self._beat()
        now = time.monotonic()
        suspects = []
        for r in range(len(self.ranks)):
            if r == self.me or r in self.lost:
                continue
            key = self._key("hb", r)
            if not self.store.check([key]):
                continue  # not started yet: judged once seen
            value = self.store.get(key)
            seen = self._seen.get(r)
            if seen is None or seen[0] != value:
                self._seen[r] = (value, now)
            elif value != _LEFT and self.calls_in_flight > 0 and now - seen[1] > self.detect_s:
                suspects.append(r)
        if suspects:
            self._propose(suspects, now)

    def _propose(self, ranks: Sequence[int], now: float) -> None:
        """Propose ``ranks`` as lost on the group's next decision key (the first proposal
        stays) and adopt the record that stands."""
        key = self._key("loss", len(self.decisions) + 1)
        self._adopt(self.store.compare_set(key, "", ",".join(str(r) for r in sorted(ranks))),
                    now)

    def _adopt(self, record: bytes | str, now: float) -> None:
        """Take the group's decision ``record`` ("r1,r2"): the lost ranks and the epoch; the
        caller's thread recovers (masks, cleans, regroups: :meth:`recover`)."""
        text = record.decode() if isinstance(record, bytes) else record
        with self._lock:  # the thread and a caller's check_lease may read one record
            newly = sorted({int(r) for r in text.split(",") if r} - set(self.lost))
            if not newly:
                return
            silence = {r: round(now - self._seen[r][1], 3) for r in newly if r in self._seen}
            if self.faults is not None:  # a faulted call on this rank tells no watchdog
                self.faults.notice = None
            self.decisions.append(dict(lost=newly, decided_at=time.time(), silent_s=silence))
            self.lost = tuple(sorted(set(self.lost) | set(newly)))
            self.evicted = self.me in self.lost
            self.epoch += 1
        logger.warning("moe-plugins: EP ranks %s of group %s are lost (silent %s s)%s", newly,
                       self.prefix, silence, "; this rank was declared lost by its peers"
                       if self.evicted else "; masking them, continuing on the survivors")

    def declare(self, ranks: Sequence[int]) -> None:
        """The library's kernels on this rank timed out waiting for EP ``ranks`` and masked
        them (a call just ended): propose them as lost, as a suspecting thread does, and adopt
        the group's record (this proposal, or one already taken). Nothing where the store does
        not answer: the caller, finding no decision, keeps the library's error."""
        if self.store_lost or self.evicted:
            return
        try:
            self._propose(ranks, time.monotonic())
        except Exception as e:  # the store's host process died
            logger.debug("moe-plugins: no decision on ranks %s: %s", list(ranks), e)

    def check_lease(self) -> None:
        """At a call's start and end, cheap: if this rank's own beats stopped for longer than
        half the detection time (it was stopped, or starved), its peers may have declared it
        lost: read the decision now, before the call sends anything or returns its result
        (a rank stopped mid-call and continued may complete that call from what its peers had
        sent before deciding: a result, but one of a rank they no longer count on)."""
        if time.monotonic() - self.last_beat <= self.detect_s / 2 or self.store_lost:
            return
        self._read_decision()

    def _read_decision(self) -> None:
        """Adopt the group's next decision record where one was taken."""
        key = self._key("loss", len(self.decisions) + 1)
        if self.store.check([key]):
            self._adopt(self.store.get(key), time.monotonic())

    # -- recovery (the caller's thread) ----------------------------------------------------
    def recover(self, layer: str) -> None:
        """After a decision (once per decision, whichever layer comes first): the survivors'
        host group, the buffers cleaned with the lost ranks masked, in step with every
        survivor. Raises :class:`RankEvictedError` on an evicted rank."""
        if self.evicted:
            raise RankEvictedError(
                f"{layer}: this rank's EP peers declared it lost (it did not answer within "
                f"{self.detect_s:g} s: stopped or starved) and continue without it; it must "
                "not send to them again. Restart this rank's process; the survivors serve on")
        if self.recovered_epoch == self.epoch:
            return
        survivors = [g for r, g in enumerate(self.ranks) if r not in self.lost]
        timeout = timedelta(seconds=self.group_timeout_s)
        group = dist.new_group(survivors, timeout=timeout, use_local_synchronization=True)
        dist.barrier(group=group)  # every survivor has left the faulted call
        for m in self._live_managers():
            m.clean_buffers()
            for r in self.lost:
                m.set_rank_masked(r, True)
        dist.barrier(group=group)  # every survivor cleaned before anyone sends again
        self.host_group, self.recovered_epoch = group, self.epoch
        self.faults = group_faults(group)

    def close(self) -> None:
        """Stop beating; the peers stop judging this rank (its key says it left)."""
        self._stop.set()
        if not self.store_lost:
            try:
                self.store.set(self._key("hb", self.me), _LEFT)
            except Exception as e:
                logger.debug("moe-plugins: could not mark rank as left (%s)", e)


def _own_connection(store: Any) -> Any:
    """A connection to ``store``'s server for the watch alone (module doc: why); ``store``
    itself where its kind cannot be cloned (a WARNING: the caller's blocking store operations
    then hold the beats)."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError) as e:  # no Store.clone there
        logger.warning("moe-plugins: the job's store (%s) gives no second connection (%s); the "
                       "peer watch shares the caller's, so a blocking store operation of the "
                       "caller holds this rank's heartbeat and a long one makes its peers take "
                       "it for lost: use a TCPStore (torch.distributed's env:// or tcp://)",
                       type(store).__name__, e)
        return store


_WATCHES: dict[str, PeerWatch] = {}
_CREATED: dict[str, int] = {}  # watches built per group: each its own keys (pools reuse a store)


def peer_watch_for(group: Any, detect_s: float, beat_s: float,
                   group_timeout_s: float) -> PeerWatch:
    """The one watch of EP process group ``group`` (None: the default group) in this process;
    the first caller's times hold for the group."""
    pg = group if group is not None else dist.group.WORLD
    name = pg.group_name
    watch = _WATCHES.get(name)
    if watch is None or watch.closed:
        _CREATED[name] = _CREATED.get(name, 0) + 1  # every rank builds them in one order
        store = dist.distributed_c10d._get_default_store()
        watch = _WATCHES[name] = PeerWatch(
            store, f"{WATCH_PREFIX}{name}/{_CREATED[name]}/", dist.get_process_group_ranks(pg),
            dist.get_rank(pg), detect_s, beat_s, group_timeout_s)
        watch.faults = group_faults(pg)
    return watch
