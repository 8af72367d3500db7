"""vLLM 0.33's CUDA path with our plugin, side by side with vLLM's in-tree DeepEP LL class
(issue 11): one H200, DeepEP V1 (567632d) built there, vLLM's Python files without its
compiled extension (benchmarks/vllm_stand_ins.py says which three stand-ins that needs and why
a MoE layer never uses them). The harness, and what in it is vLLM's and what is not (routing and
batched experts are torch code, the same on both sides), is benchmarks/vllm_cuda_layer.py.

Checked: our prepare/finalize is built by vLLM's ``maybe_make_prepare_finalize`` (our plugin's
hook) for ``moe_plugins_deepep_ll``; through vLLM's ``FusedMoEKernel`` with vLLM's
``SharedExperts`` its output EQUALS the in-tree class's bit for bit (same DeepEP kernels on the
same buffer, same inputs, same experts: any difference would be ours) at 1/8/64/128 tokens,
bf16 and FP8 block-128, and both are within bf16 tolerance of a float32 per-token reference;
shared-expert overlap is engaged on both (``supports_async``); a CUDA graph of the whole kernel
replayed on new inputs equals eager; experts that ask for packed UE8M0 scales get from ours
exactly what the in-tree class sends them.

Run on a GPU host: ``scripts/gpu/h200.sh`` (builds DeepEP, installs the kit's vLLM files).
"""
from __future__ import annotations

from typing import Iterator

import pytest
import torch

from tests.gpu import vllm_harness
from tests.gpu.cuda_graphs import capture

H = vllm_harness.load()

pytestmark = pytest.mark.gpu

TOKENS = (1, 8, 64, 128)
SPEC = vllm_harness.spec()


@pytest.fixture(scope="module", params=[False, True], ids=["bf16", "fp8"])
def layers(request) -> Iterator[H.VllmLayers]:
    yield from vllm_harness.layers(request.param)


def test_ours_is_built_by_vllms_hook_with_overlap(layers):
    from moe_plugins.vllm.prepare_finalize import MoEPluginsPrepareAndFinalize

    assert isinstance(layers.ours.kernel.prepare_finalize, MoEPluginsPrepareAndFinalize)
    assert type(layers.in_tree.kernel.prepare_finalize).__name__ == "DeepEPLLPrepareAndFinalize"
    for side in (layers.ours, layers.in_tree):
        assert side.kernel.can_overlap_shared_experts, side.name  # supports_async
        assert side.kernel.prepare_finalize.max_num_tokens_per_rank() == SPEC.max_tokens


@pytest.mark.parametrize("num_tokens", TOKENS)
def test_ours_equals_in_tree(layers, num_tokens):
    x, w, ids = layers.inputs(num_tokens, seed=num_tokens)
    ours = layers.forward(layers.ours, x, w, ids)
    theirs = layers.forward(layers.in_tree, x, w, ids)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    ref = layers.reference(x, w, ids)
    scale = ref.abs().max().item()
    # bf16 activations and weights (+ FP8 block-128 dispatch): 2% of the output's scale
    torch.testing.assert_close(ours.float(), ref, rtol=0.02, atol=0.02 * scale)


@pytest.mark.parametrize("side", ["ours", "in_tree"])
def test_cuda_graph_replay_equals_eager(layers, side):
    built = getattr(layers, side)
    x, w, ids = (t.clone() for t in layers.inputs(64, seed=1))
    graph, out = capture(lambda: layers.forward(built, x, w, ids))
    for seed in (2, 3):  # new inputs into the captured buffers
        nx, nw, nids = layers.inputs(64, seed=seed)
        x.copy_(nx), w.copy_(nw), ids.copy_(nids)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, layers.forward(built, nx, nw, nids), rtol=0, atol=0)


def test_packed_ue8m0_scales_equal_in_tree(layers):
    if not layers.spec.fp8:
        pytest.skip("UE8M0 scales travel only with FP8 dispatch")
    ours, theirs = layers.build_ue8m0_pair()
    for side in (ours, theirs):
        side.experts.record = True
    x, w, ids = layers.inputs(37, seed=5)
    out_ours = layers.forward(ours, x, w, ids)
    out_theirs = layers.forward(theirs, x, w, ids)
    (xo, sfo, co), (xt, sft, ct) = ours.experts.last, theirs.experts.last
    assert sft is not None and sft.dtype == torch.int32, "in-tree sends packed UE8M0"
    assert sfo is not None and sfo.dtype == torch.int32, f"ours sent {getattr(sfo, 'dtype', None)}"
    torch.testing.assert_close(co, ct, rtol=0, atol=0)
    for e, n in enumerate(ct.tolist()):
        # DeepEP fills an expert's slots in arrival order (atomics): compare the received
        # (row, scales) pairs as multisets.
        assert _rows(xo[e, :n], sfo[e, :n]) == _rows(xt[e, :n], sft[e, :n]), f"expert {e}"
    torch.testing.assert_close(out_ours, out_theirs, rtol=0, atol=0)


def _rows(x: torch.Tensor, sf: torch.Tensor) -> list[bytes]:
    """x float8 [n, hidden], sf int32 [n, hidden // 512] -> the n rows' bytes, sorted."""
    both = torch.cat([x.view(torch.uint8), sf.contiguous().view(torch.uint8)], dim=1)
    return sorted(bytes(r) for r in both.cpu().numpy())
