"""moe_plugins.fault_notice: a rank whose call fails mid-way posts its error in the store its
group shares (the first failure stays, a rank does not read its own), the group's fault state
posts it when it breaks, clearing the state clears it, and the watchdog ends a call in flight
on the group once the notice is read. Across real ranks: tests/runner/test_watchdog_ranks.py."""
from __future__ import annotations

import torch.distributed as dist

from moe_plugins.fault_notice import NOTICE_PREFIX, FaultNotice
from moe_plugins.faults import GroupFaults
from moe_plugins.watchdog import PeerFailedError, watch_call


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
    assert fresh_watchdog.wanted == set()
    fresh_watchdog.check(call.started + 1.5)
    assert fresh_watchdog.wanted == {a} and fresh_watchdog.ended == []
    b.post("MoE layer raised on this rank: ValueError: bad experts")
    a.told = a.read()  # what the reader thread does
    fresh_watchdog.check(call.started + 1.7)
    [error] = fresh_watchdog.ended
    assert isinstance(error, PeerFailedError)
    assert str(error).startswith("layer: call 3 cannot complete (started 1.7 s ago): a peer's "
                                 "call on this EP group failed mid-way and told its peers: EP "
                                 "rank 1: MoE layer raised"), str(error)
