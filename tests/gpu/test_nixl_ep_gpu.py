"""nixl_ep against the REAL NIXL EP ``nixl_ep.Buffer`` on one GPU (EP world size 1).

Needs a CUDA GPU and ``nixl_ep`` (scripts/gpu/nixl_ep.sh builds it from nixl's
examples/device/ep against the host's torch and the nixl-cu13 1.5.1 wheel's libnixl/UCX);
skipped cleanly otherwise. One process; the EP group is a one-rank gloo group initialized from
a real ``torch.distributed.TCPStore``, and the backend gets a ``PrefixStore`` on that store as
its ``tcp_store_group`` (as vLLM passes one), through which ``connect_ranks`` publishes this
rank's NIXL agent metadata. The checks are tests/backends/low_latency_cases.py, shared with deepep_ll.

Run: ``bash scripts/gpu/nixl_ep.sh`` on the GPU machine (it sets PYTHONPATH and NIXL_PLUGIN_DIR).
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
nixl_ep = pytest.importorskip("nixl_ep", reason="needs nixl_ep (scripts/gpu/nixl_ep.sh builds it)")

import torch.distributed as dist  # noqa: E402

from tests.backends.low_latency_cases import *  # noqa: E402,F401,F403  (the shared tests and fixtures)
from tests.backends.low_latency_cases import BF16, TIMEOUT, backend_factory, free_port, one_rank_context  # noqa: E402
from moe_plugins.prepare_finalize.nixl_ep import SPEC  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def store() -> dist.Store:
    return dist.TCPStore("127.0.0.1", free_port(), world_size=1, is_master=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ctx(store):
    with one_rank_context(store=dist.PrefixStore("pg", store)) as c:
        yield c


@pytest.fixture(scope="module")
def build(ctx, store):
    # What an engine passes (NixlEPManager.engine_options): a tcp_store_group on the real store.
    options = SPEC.manager.engine_options(dist.PrefixStore("nixl_ep", store))
    return backend_factory(SPEC, ctx, options)


def test_connect_published_and_removed_the_agent_metadata(build, store):
    """connect_ranks wrote NIXL_EP/0 on the tcp_store_group and deleted it once connected (the
    key lives in the PrefixStore's namespace on the real TCPStore)."""
    pf = build(BF16)
    try:
        assert pf.manager.buffer is not None
        assert not store.check(["nixl_ep/NIXL_EP/0"])
    finally:
        pf.manager.destroy()


def test_calls_go_to_the_runtime_of_1_5_1(build):
    """On nixl_ep 1.5.1 the manager recognises nixl_ep.Buffer's low-latency signatures and the
    prepare/finalize call its C++ runtime directly (all2all/nixl_ep.py); the shared tests in
    this file then check what those calls deliver against the reference and the raw ``Buffer``
    methods."""
    from moe_plugins.all2all.nixl_ep import runtime_calls

    pf = build(BF16)
    try:
        assert runtime_calls(pf.manager.buffer) is not None
        assert pf.runtime_calls is pf.manager.runtime_calls is not None
    finally:
        pf.manager.destroy()


def test_library_limits_beyond_deepeps(one_buffer):
    """nixl main since c345fe3ea (2026-08-12, "support Kimi-K3") dispatches top-16 and hidden
    3584, where DeepEP stops at top-11 and has no 3584 kernels; moe_plugins.lowlat still
    applies DeepEP's limits (MAX_TOPK, KERNEL_HIDDEN_SIZES) to both. The raw Buffer of the
    1.5.1 build is asked for both here (last in the file: a kernel fault would poison the
    context); a pass means our shared limits are stricter than nixl_ep needs."""
    m = one_buffer.manager
    n, hidden, topk = 8, 3584, 16
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(n, hidden, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.rand(n, m.num_experts, device="cuda", generator=g).topk(topk, dim=-1).indices
    ids = ids.to(m.topk_idx_dtype).contiguous()
    weights = torch.full((n, topk), 1.0 / topk, device="cuda")
    recv, count, handle, _event, _hook = m.buffer.low_latency_dispatch(
        x, ids, m.max_tokens_per_rank, m.num_experts, use_fp8=False)
    torch.cuda.synchronize()
    want = torch.bincount(ids.flatten().long(), minlength=m.num_experts)
    assert count.cpu().tolist() == want.cpu().tolist()
    # every expert returns its input unchanged: the combine is sum_k w_k * x = x
    out, _event, _hook = m.buffer.low_latency_combine(recv, ids, weights, handle)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), x.float(), atol=2e-2, rtol=2e-2)
