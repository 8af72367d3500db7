"""The peer watch's own store connection (moe_plugins.survival.peer_watch): a store that can
be cloned gives the watch a second connection; one that cannot is shared, with a WARNING
saying what that costs. The multi-rank case (a blocking store operation of the caller does not
hold the beats) is tests/runner/test_peer_loss.py's
``test_a_survivor_waiting_in_its_recovery_keeps_beating``."""
from __future__ import annotations

import logging

import torch.distributed as dist

from moe_plugins.survival.peer_watch import _own_connection


class _PythonStore(dist.Store):
    """A store written in Python, as a user may pass to init_process_group: no clone."""


def test_a_cloneable_store_gives_a_second_connection():
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    own = _own_connection(store)
    assert own is not store
    own.set("k", "v")  # the same data behind both
    assert store.get("k") == b"v"


def test_a_store_without_clone_is_shared_with_a_warning(caplog):
    store = _PythonStore()
    with caplog.at_level(logging.WARNING, logger="moe_plugins.survival.peer_watch"):
        assert _own_connection(store) is store
    assert "gives no second connection" in caplog.text and "TCPStore" in caplog.text
