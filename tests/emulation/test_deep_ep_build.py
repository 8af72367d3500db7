"""The emulated DeepEP follows its build and platform (tests/emulation/deep_ep.py): the
low-latency dispatch's RC QP check as 567632d makes it and as DeepEP PR #695 changes it, and
the kernels' timeout from the build record. Checked on the emulated Buffer itself and through
deepep_ll's layer, element-wise against the reference."""
from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.distributed as dist

from moe_plugins.config import MoEConfig
from moe_plugins.layout import ParallelLayout
from moe_plugins.runner.launch import RankError
from tests.checks import assert_matches_reference
from tests.emulation import installed
from tests.emulation.deep_ep import Platform

pytestmark = pytest.mark.multirank

HIDDEN, TOKENS, TOPK, EXPERTS = 2048, 4, 2, 8
FENCE, RC_QP = "pr642-combine-fence", "pr695-rc-qp-assert"
ONE_HOST_NVSHMEM_37 = Platform(nvshmem=(3, 7, 2), ibgda=False)  # torch 2.15's NVSHMEM, no NIC


def _record(*patches: str, timeouts: Optional[dict] = None) -> dict:
    """A build record as scripts/deepep/build.sh writes it."""
    record: dict = {"line": "v1", "commit": "567632d", "patches": list(patches)}
    if timeouts is not None:
        record["timeouts"] = timeouts
    return record


def dispatch_twice(rank: int, world: int, build: dict, platform: Platform,
                   allow_nvlink: bool) -> list[Optional[str]]:
    """Two low-latency dispatch + combine round trips on the emulated Buffer built with
    ``build`` on ``platform``; per round trip the error (None: it ran and combine gave
    x * sum of the valid weights)."""
    with installed("deep_ep", deep_ep_build=build, platform=platform):
        import deep_ep

        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(TOKENS, HIDDEN, world, EXPERTS)
        buffer = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True,
                                num_qps_per_rank=EXPERTS // world,
                                allow_nvlink_for_low_latency_mode=allow_nvlink,
                                explicitly_destroy=True)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
        topk_idx = torch.randperm(EXPERTS, generator=g)[:TOPK].repeat(TOKENS, 1)
        weights = torch.rand(TOKENS, TOPK, generator=g)
        errors: list[Optional[str]] = []
        for _ in range(2):
            try:
                recv, _count, handle, _event, _hook = buffer.low_latency_dispatch(
                    x, topk_idx, TOKENS, EXPERTS, use_fp8=False)
                out, _event, _hook = buffer.low_latency_combine(recv, topk_idx, weights, handle)
                torch.testing.assert_close(out.float(), x.float() * weights.sum(1, True),
                                           atol=0.05, rtol=0.01)
                errors.append(None)
            except RuntimeError as e:
                errors.append(str(e))
        if errors[-1] is None:
            buffer.destroy()
        return errors


def test_without_pr695_nvshmem_37_on_one_host_traps_the_first_dispatch(rank_pool):
    """567632d as built before PR #695, NVSHMEM 3.7 (torch 2.15's) on one host without IBGDA:
    num_rc_per_pe is 0 < 4 local experts, the first SM's EP_DEVICE_ASSERT traps, and the lost
    CUDA context fails the next call too."""
    for errors in rank_pool(2).run(dispatch_twice, _record(FENCE), ONE_HOST_NVSHMEM_37, True):
        first, second = errors
        assert first is not None and first.startswith("CUDA error: unspecified launch failure")
        assert "ibgda_get_state()->num_rc_per_pe >= num_local_experts" in first
        assert second == first


def test_with_pr695_nvshmem_37_on_one_host_runs(rank_pool):
    """The same with PR #695: every peer is P2P-reachable, so no RC QP is needed: both round
    trips run and combine right."""
    for errors in rank_pool(2).run(dispatch_twice, _record(FENCE, RC_QP), ONE_HOST_NVSHMEM_37,
                                   True):
        assert errors == [None, None]


@pytest.mark.parametrize("case,build,platform,allow_nvlink,traps", [
    ("nvshmem-3.4.5-no-ibgda", _record(FENCE), Platform(), True, False),
    ("nvshmem-3.7-ibgda", _record(FENCE), Platform((3, 7, 2), ibgda=True), True, False),
    ("pr695-nvlink-off", _record(FENCE, RC_QP), ONE_HOST_NVSHMEM_37, False, True),
    ("pr695-two-hosts-no-ibgda", _record(FENCE, RC_QP),
     Platform((3, 7, 2), ranks_per_node=1), True, True),
    ("pr695-two-hosts-ibgda", _record(FENCE, RC_QP),
     Platform((3, 7, 2), ibgda=True, ranks_per_node=1), True, False),
], ids=lambda v: v if isinstance(v, str) else "")
def test_the_qp_check_follows_nvshmem_ibgda_and_p2p(rank_pool, case, build, platform,
                                                     allow_nvlink, traps):
    """NVSHMEM before 3.6 keeps the requested QPs without IBGDA; with IBGDA every version has
    them; with PR #695 a peer outside P2P reach (NVLink off, which disables P2P, or another
    host) still needs them."""
    for errors in rank_pool(2).run(dispatch_twice, build, platform, allow_nvlink):
        if traps:
            assert errors[0] is not None and "num_rc_per_pe >= num_local_experts" in errors[0]
        else:
            assert errors == [None, None], case


#: a bf16 layer whose kernel hidden (3072) no other test's buffer has: the pool's processes keep
#: buffers alive between tests (one per EP group and size), and this one must be built here, on
#: this build of the library (and log its INFO line)
LAYER_CFG = MoEConfig(hidden=3072, num_experts=8, num_topk=2, intermediate=32,
                      shared_intermediate=64, dtype=torch.bfloat16)


def layer_calls(rank: int, world: int, build: dict, platform: Platform) -> dict:
    """deepep_ll's MoELayer (EP ``world``) on the emulated DeepEP ``build`` on ``platform``:
    its INFO line's DeepEP words and two calls' outputs (or the first call's error)."""
    import logging

    from moe_plugins.groups import make_dist_context
    from moe_plugins.overlap import OverlapConfig
    from moe_plugins.quant import QuantSpec
    from moe_plugins.registry import get_backend
    from moe_plugins.runner.demo import demo_inputs
    from moe_plugins.runner.layer import MoELayer
    from moe_plugins.runner.model import MoEWeights
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    keep = Keep(logging.INFO)
    # the buffer's own logger, kept at INFO and enabled whatever an earlier test in this pool
    # process did to the loggers above it (propagation, levels, logging.disable)
    logger = logging.getLogger("moe_plugins.lowlat.manager")
    logger.addHandler(keep)
    level, logger.level = logger.level, logging.INFO
    disabled, logger.disabled = logger.disabled, False
    logging.disable(logging.NOTSET)
    try:
        with installed("deep_ep", deep_ep_build=build, platform=platform):
            ctx = make_dist_context(ParallelLayout(world, 1, True), timeout_s=60.0,
                                    fresh_ep_group=True)
            layer = MoELayer(MoEWeights.random(LAYER_CFG, 0), ctx, get_backend("deepep_ll"), None,
                             QuantSpec(), OverlapConfig(overlap=False), max_tokens_per_rank=8,
                             call_timeout_s=0)
            x = demo_inputs(LAYER_CFG, 6, rank, 0)
            try:
                outs = [layer(x), layer(x)]
            except Exception as e:  # the trap: every rank's first call
                return {"lines": lines, "error": f"{type(e).__name__}: {e}",
                        "cause": str(e.__cause__ or "")}
            return {"lines": lines, "outs": outs}
    finally:
        logger.removeHandler(keep)
        logger.level, logger.disabled = level, disabled


@pytest.mark.parametrize("patched", [False, True], ids=["567632d+pr642", "+pr695"])
def test_deepep_ll_on_nvshmem_37_on_one_host(rank_pool, patched):
    """Through deepep_ll's layer, EP 2 on one host with NVSHMEM 3.7 and no IBGDA: without PR
    #695 the first call fails on every rank with the trap; with it both calls equal the
    reference. The buffer's INFO line names the patches of the build."""
    build = _record(FENCE, RC_QP) if patched else _record(FENCE)
    results = rank_pool(2).run(layer_calls, build, ONE_HOST_NVSHMEM_37)
    for r in results:
        info = [line for line in r["lines"] if line.startswith("deepep_ll: buffer for EP rank")]
        words = "commit 567632d with pr642-combine-fence" + (", pr695-rc-qp-assert"
                                                             if patched else "")
        assert len(info) == 1 and info[0].endswith(words), r["lines"]
        if patched:
            assert "outs" in r, r.get("error")
        else:
            assert "outs" not in r
            assert "unspecified launch failure" in r["error"] + r["cause"], r["error"]
            assert "num_rc_per_pe >= num_local_experts" in r["error"] + r["cause"]
    if patched:
        for call in (0, 1):
            assert_matches_reference([dict(out=r["outs"][call]) for r in results],
                                     ParallelLayout(2, 1, True), LAYER_CFG, 6)
