"""Two faults the one-GPU EP matrix exercises on the real libraries, shown on CPU with the
emulated ones (each failed before its fix):

1. A library that masks a slow peer by itself (NIXL EP always; DeepEP with ``enable_shrink``)
   returns results without that peer's experts and no error. ``MoELayer`` now compares the
   library's mask after each call with the ranks its caller masked, and raises
   ``PeerMaskedError`` instead of returning a partial result (moe_plugins/faults.py: never a
   wrong answer). Under vLLM the engine polls the mask itself (``query_fault``).
2. A bad input refused by ``MoELayer`` itself on one rank travels in the torch backend's host
   exchange: its peers raise ``PeerInputError`` at once, and the next call is right.
"""
from __future__ import annotations

import pytest

from tests.backend_lists import RANK_MASKING
from tests.runner import ep_findings_ranks as fns

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("backend", RANK_MASKING)  # from the registry (tests/backend_lists.py)
def test_a_peer_masked_by_the_library_during_a_call_is_an_error_not_a_partial_result(
        rank_pool, backend):
    victim = 1
    results = rank_pool(4).run(fns.library_masks_a_slow_peer, backend, victim)
    for rank, r in enumerate(results):
        assert r["first_ok"], f"rank {rank}: call 1 (nobody masked) differs from the reference"
        if rank == victim:
            continue
        assert r["outcome"] == "raised" and r["type"] == "PeerMaskedError" \
            and f"masked EP rank(s) [{victim}]" in r["message"], (
            f"rank {rank}: call 2 returned (full reference: {r.get('full')}, reference without "
            f"rank {victim}'s experts: {r.get('without_victim')}, library mask now "
            f"{r.get('masked')}) instead of raising")


def test_a_layer_refusal_on_one_rank_reaches_its_peers_and_the_next_call_is_right():
    from tests.gpu.ep_harness import run_world

    run = run_world(fns.layer_refusal_on_one_rank, 2, 1, device="cpu", timeout_s=60,
                    pg_timeout_s=5)
    assert run.ok, run.summary()
    peer, victim = run.values
    assert peer[1][0] == "returned" and peer[1][1] and victim[1][0] == "returned"
    assert victim[2][:2] == ("raised", "ValueError")
    assert peer[2][:2] == ("raised", "PeerInputError") and peer[2][2] < 5, (
        f"rank 0, call 2: {peer[2]}")
    assert peer[3][:2] == ("returned", True) and victim[3][:2] == ("returned", True), (
        f"call 3: rank 0 {peer[3]}, rank 1 {victim[3]}")
