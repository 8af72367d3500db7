"""Rank function of tests/backends/test_mask_contract.py: our masked flag against the word the
emulated library stores (tests/emulation), read through the library's own query."""
from __future__ import annotations

import torch

from moe_plugins.config import MoEConfig
from moe_plugins.layout import ParallelLayout
from tests.backends.low_latency_ranks import built


def flag_and_library_word(rank: int, world: int, backend: str, cfg: MoEConfig) -> list[dict]:
    """Mask the next rank, then take it back: after each, our masked_ranks() and the library's
    raw mask words (int32 [world], from its query method)."""
    peer = (rank + 1) % world
    rows = []
    with built(backend, ParallelLayout(world, 1, True), cfg,
               options={"enable_shrink": True} if backend.startswith("deepep") else None) as pf:
        manager = pf.manager
        for masked in (True, False):
            manager.set_rank_masked(peer, masked)
            words = torch.zeros(world, dtype=torch.int32)
            getattr(manager.buffer, manager.query_mask_method)(words)
            rows.append(dict(masked=masked, peer=peer, ours=manager.masked_ranks(),
                             library=words.tolist(), word=manager.mask_word))
    return rows
