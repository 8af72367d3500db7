"""Defects the one-GPU EP matrix points at, shown on CPU with the emulated libraries (each test
fails today and is marked xfail with the reason; the fixes belong to the product code).

1. A library that masks a slow peer by itself (NIXL EP always; DeepEP with ``enable_shrink``)
   makes our layer return an output without that peer's experts, and no error: a wrong answer,
   against the rule of moe_plugins/faults.py ("never a wrong answer"). The matrix's fault jobs
   record it on the GPU (fault/nixl_ep/refuse: the peers' kernels time out after ``timeout_ms``,
   mask the refusing rank and return). Under vLLM the engine polls the mask
   (``query_fault``, --enable-fault-tolerance); ``MoELayer`` / the prepare/finalize never look.
2. A bad input refused by ``MoELayer`` itself on one rank (fault/torch/refuse: a wrong hidden
   size) is not carried in the torch backend's host exchange: the refusing rank's layer marks
   itself broken (its next call: LayerBrokenError at once), its peers wait in the exchange until
   the process-group timeout (CollectiveError after 5 s here, 30 s in the matrix, 300 s by
   default) and are broken afterwards too.
"""
from __future__ import annotations

import pytest

from tests.runner import ep_findings_ranks as fns

pytestmark = pytest.mark.multirank


@pytest.mark.xfail(strict=True, reason=(
    "defect: the low-latency prepare/finalize (moe_plugins/lowlat/prepare_finalize.py) and "
    "MoELayer do not compare the library's rank mask before and after a call; a peer the "
    "library masked during the call (kernel timeout) is silently left out of the result"))
@pytest.mark.parametrize("backend", ["nixl_ep", "deepep_ll"])
def test_a_peer_masked_by_the_library_during_a_call_is_an_error_not_a_partial_result(
        rank_pool, backend):
    victim = 1
    results = rank_pool(4).run(fns.library_masks_a_slow_peer, backend, victim)
    for rank, r in enumerate(results):
        assert r["first_ok"], f"rank {rank}: call 1 (nobody masked) differs from the reference"
        if rank == victim:
            continue
        # what happens today: the call returns the reference without the victim's experts
        assert r["outcome"] == "raised", (
            f"rank {rank}: call 2 returned (full reference: {r.get('full')}, reference without "
            f"rank {victim}'s experts: {r.get('without_victim')}, library mask now "
            f"{r.get('masked')}) instead of raising")


@pytest.mark.xfail(strict=True, reason=(
    "defect: MoELayer.forward (moe_plugins/runner/layer.py) refuses a bad input (wrong hidden "
    "size, non-float) on its own rank before the torch backend's host exchange, so the refusal "
    "does not travel in the exchange's status word (moe_plugins/faults.py, rule 1): the peers "
    "wait in the exchange until the process-group timeout (CollectiveError) and the layer is "
    "broken on every rank after it (LayerBrokenError); README 'Faults' promises PeerInputError "
    "on the peers and a right next call"))
def test_a_layer_refusal_on_one_rank_reaches_its_peers_and_the_next_call_is_right():
    from tests.gpu.ep_harness import run_world

    run = run_world(fns.layer_refusal_on_one_rank, 2, 1, device="cpu", timeout_s=60,
                    pg_timeout_s=5)
    assert run.ok, run.summary()
    peer, victim = run.values
    assert peer[1][0] == "returned" and peer[1][1] and victim[1][0] == "returned"
    assert victim[2][:2] == ("raised", "ValueError")
    # what the README promises for a bad input on one rank (torch backend)
    assert peer[2][:2] == ("raised", "PeerInputError") and peer[2][2] < 5, (
        f"rank 0, call 2: {peer[2]}")
    assert peer[3][:2] == ("returned", True) and victim[3][:2] == ("returned", True), (
        f"call 3: rank 0 {peer[3]}, rank 1 {victim[3]}")
