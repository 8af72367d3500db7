"""moe_plugins.callbound.fault_notice: a rank whose call fails mid-way posts its error in the store its
group shares (the first failure stays, a rank does not read its own), the group's fault state
posts it when it breaks, clearing the state clears it, and the watchdog ends a call in flight
on the group once the notice is read, and a wait on a gloo collective hears it between slices.
Across real ranks: tests/runner/test_watchdog_ranks.py."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from moe_plugins.callbound.fault_notice import NOTICE_PREFIX, READ_AFTER_S, FaultNotice, wait_or_told
from moe_plugins.faults import GroupFaults
from moe_plugins.callbound import PeerFailedError, watch_call


def _pair() -> tuple[FaultNotice, FaultNotice, dist.Store]:
    store = dist.HashStore()  # the store every rank of a job shares
    key = NOTICE_PREFIX + "7"
    return FaultNotice(store, key, 0), FaultNotice(store, key, 1), store


def test_the_first_failure_is_posted_and_read_by_the_peers_only():
    a, b, _ = _pair()
    assert a.read() is None and b.read() is None
    b.post("MoE layer raised on this rank: ValueError: bad experts")
    a.post("a consequence: CollectiveError")  # later: the first stays
    assert a.read() == "EP rank 1: MoE layer raised on this rank: ValueError: bad experts"
    assert b.read() is None  # its own


def test_a_broken_group_posts_its_first_failure_and_clearing_forgets_it():
    a, b, _ = _pair()
    faults = GroupFaults([0, 1], 1, notice=b)
    faults.mark_broken("MoE layer raised on this rank", ValueError("bad experts"))
    faults.mark_broken("a later consequence")
    assert a.read() == "EP rank 1: MoE layer raised on this rank: ValueError: bad experts"
    a.told = a.read()
    a.clear()
    assert a.read() is None and a.told is None


def test_a_store_that_fails_is_logged_not_raised(caplog):
    class Gone:
        def compare_set(self, *args):
            raise RuntimeError("Connection reset by peer")

    FaultNotice(Gone(), NOTICE_PREFIX + "7", 1).post("its error")
    assert any("could not tell the EP group's peers" in r.getMessage() for r in caplog.records)


def test_the_watchdog_ends_a_call_in_flight_once_a_peer_told(fresh_watchdog):
    a, b, _ = _pair()
    call = watch_call("layer", 3, 30.0, notice=a)
    fresh_watchdog.check(call.started + 0.5)  # too young to ask
    assert a.wanted == 0.0
    fresh_watchdog.check(call.started + 1.5)
    assert a.wanted == call.started + 1.5 and fresh_watchdog.ended == []
    b.post("MoE layer raised on this rank: ValueError: bad experts")
    a.told = a.read()  # what the reader thread does
    fresh_watchdog.check(call.started + 1.7)
    [error] = fresh_watchdog.ended
    assert isinstance(error, PeerFailedError)
    assert str(error).startswith("layer: call 3 cannot complete (started 1.7 s ago): a peer's "
                                 "call on this EP group failed mid-way and told its peers: EP "
                                 "rank 1: MoE layer raised"), str(error)


def _gloo_pair(timeout_s: float) -> list:
    """Two real gloo process groups of one world of 2, in this process (ranks 0 and 1), over
    one store: a collective of rank 0 waits until rank 1 takes part."""
    store = dist.HashStore()
    pgs: list = [None, None]

    def make(rank: int) -> None:
        pgs[rank] = dist.ProcessGroupGloo(dist.PrefixStore("pair", store), rank, 2,
                                          timedelta(seconds=timeout_s))
    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(pgs), "the gloo pair did not connect"
    return pgs


def _all_to_all(pg, value: float) -> tuple:
    send, recv = torch.full((4,), value), torch.empty(4)
    return pg.alltoall_base(recv, send, [], [], dist.AllToAllOptions()), recv


def _later(seconds: float, fn) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(seconds), fn()), daemon=True)
    t.start()
    return t


def test_a_gloo_wait_hears_a_peers_failure_while_the_collective_is_pending():
    pgs = _gloo_pair(timeout_s=4.0)  # the pending collective ends itself after 4 s
    a, b, _ = _pair()
    work, _ = _all_to_all(pgs[0], 1.0)
    _later(0.3, lambda: b.post("MoE layer raised on this rank: ValueError: bad experts"))
    t0 = time.monotonic()
    told = wait_or_told(work, a)
    waited = time.monotonic() - t0
    assert told == "EP rank 1: MoE layer raised on this rank: ValueError: bad experts"
    # read once the wait lasted READ_AFTER_S, then every poll: well before gloo's 4 s
    assert READ_AFTER_S <= waited < READ_AFTER_S + 1.5, waited
    assert not work.is_completed()  # left pending: the caller raises, the group is out of step


def test_a_gloo_wait_in_slices_returns_the_data_of_a_late_peer():
    pgs = _gloo_pair(timeout_s=30.0)
    a, _, _ = _pair()
    work, recv = _all_to_all(pgs[0], 1.0)
    later: list = []
    _later(READ_AFTER_S + 0.8, lambda: later.append(_all_to_all(pgs[1], 2.0)))  # several slices
    assert wait_or_told(work, a) is None
    assert recv.tolist() == [1.0, 1.0, 2.0, 2.0]
    work1, recv1 = later[0]
    work1.wait()
    assert recv1.tolist() == [1.0, 1.0, 2.0, 2.0]


def test_a_gloo_wait_raises_the_collectives_own_error_not_a_slices_timeout():
    pgs = _gloo_pair(timeout_s=2.0)
    a, _, _ = _pair()
    work, _ = _all_to_all(pgs[0], 1.0)  # rank 1 never takes part, nobody posts
    with pytest.raises(RuntimeError) as e:
        wait_or_told(work, a)
    assert "Operation timed out!" not in str(e.value)  # a slice's timeout never escapes
    assert "imed out" in str(e.value)  # gloo's own, after the group's 2 s


_SERVER = """
import sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(600)
"""


class _Counting:
    """A real TCPStore client, its reads counted (what the reader thread asks the server)."""

    def __init__(self, store: dist.Store) -> None:
        self.store, self.reads = store, 0

    def check(self, keys: list) -> bool:
        self.reads += 1
        return self.store.check(keys)

    def get(self, key: str) -> bytes:
        return self.store.get(key)


def test_a_store_whose_server_died_is_read_once_said_once_and_never_polled_again(caplog):
    """The store's server (the process that hosts it, like the job's first rank) is killed
    while a call waits and asks for the notice every poll: one failed read, one WARNING, no
    read after it; a later error path's read_within answers None at once."""
    import subprocess
    import sys

    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, is_master=False,
                               timeout=timedelta(seconds=5))
        store = _Counting(client)
        notice = FaultNotice(store, NOTICE_PREFIX + "gone", 0)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # a call in flight asks every poll; the store answers
            notice.want(time.monotonic())
            time.sleep(0.05)
        assert store.reads >= 2 and notice.told is None and not notice.lost
        server.kill()
        server.wait(timeout=10)
        end = time.monotonic() + 3.0
        while time.monotonic() < end:  # the call keeps asking after the server died
            notice.want(time.monotonic())
            time.sleep(0.05)
        reads = store.reads
        time.sleep(1.0)
        notice.want(time.monotonic())
        time.sleep(0.5)
    finally:
        server.kill()
        server.wait(timeout=10)
    assert notice.lost and store.reads == reads  # no read after the loss was seen
    said = [r for r in caplog.records if "failed a read" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING", [r.getMessage() for r in said]
    t0 = time.monotonic()
    assert notice.read_within(2.0) is None and time.monotonic() - t0 < 0.5
