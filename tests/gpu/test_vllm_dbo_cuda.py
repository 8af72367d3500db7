"""vLLM 0.33's dual-batch overlap (``--enable-dbo``) on the H200 with our plugin, side by side
with vLLM's in-tree DeepEP LL class: the harness of tests/gpu/test_vllm_cuda.py
(benchmarks/vllm_cuda_layer.py), built under a config with DBO on (our DBO config patch lets
``moe_plugins_deepep_ll`` through vLLM's check), and the two micro-batches run on vLLM's own
ubatch contexts (tests/vllm_glue/micro_batches.py: vLLM's threads, events and yields; a compute and a
communication CUDA stream, as vLLM's UBatchWrapper has).

Checked: under DBO ours EQUALS the in-tree class bit for bit (same DeepEP kernels on the same
buffer, both keep one handle per micro-batch); DBO on EQUALS the same two micro-batches run one
after the other without DBO (both sides); DBO on equals the whole batch in one call within bf16
tolerance (different batch composition); no receive is left pending.

Not run by this change's author (no GPU here): the lead runs it with ``scripts/gpu/h200.sh``.
"""
from __future__ import annotations

from typing import Iterator

import pytest
import torch

from tests.gpu import vllm_harness

H = vllm_harness.load()
from tests.vllm_glue.micro_batches import run_micro_batches  # noqa: E402

pytestmark = pytest.mark.gpu

TOKENS = (2, 9, 64, 128)


@pytest.fixture(scope="module", params=[False, True], ids=["bf16", "fp8"])
def layers(request) -> Iterator[H.VllmLayers]:
    yield from vllm_harness.layers(request.param, dbo=True)


def _halves(n: int) -> list[slice]:
    half = (n + 1) // 2
    return [slice(0, half), slice(half, n)]


def _dbo(layers: H.VllmLayers, side: H.Built, x, w, ids) -> torch.Tensor:
    """The two micro-batches on vLLM's ubatch contexts (compute stream = the current one)."""
    from vllm.utils.torch_utils import current_stream

    compute, comm = current_stream(), torch.cuda.Stream()
    fns = [lambda p=p: layers.forward(side, x[p], w[p], ids[p]) for p in _halves(x.shape[0])]
    outs = run_micro_batches(fns, compute_stream=compute, comm_stream=comm, device_index=0)
    torch.cuda.synchronize()
    return torch.cat(outs)


def _sequential(layers: H.VllmLayers, side: H.Built, x, w, ids) -> torch.Tensor:
    outs = [layers.forward(side, x[p], w[p], ids[p]) for p in _halves(x.shape[0])]
    torch.cuda.synchronize()
    return torch.cat(outs)


def test_ours_has_a_call_slot_per_micro_batch(layers):
    pf = layers.ours.kernel.prepare_finalize
    assert pf.supports_dbo() and len(pf._backends) == 2
    assert pf._backends[0].manager is pf._backends[1].manager


@pytest.mark.parametrize("num_tokens", TOKENS)
def test_dbo_on_equals_off_ours_and_in_tree(layers, num_tokens):
    x, w, ids = layers.inputs(num_tokens, seed=num_tokens)
    ours_on = _dbo(layers, layers.ours, x, w, ids)
    theirs_on = _dbo(layers, layers.in_tree, x, w, ids)
    torch.testing.assert_close(ours_on, theirs_on, rtol=0, atol=0)
    for side, on in ((layers.ours, ours_on), (layers.in_tree, theirs_on)):
        torch.testing.assert_close(on, _sequential(layers, side, x, w, ids), rtol=0, atol=0,
                                   msg=lambda m: f"{side.name}: {m}")
    whole = layers.forward(layers.ours, x, w, ids)
    scale = whole.float().abs().max().item()
    torch.testing.assert_close(ours_on.float(), whole.float(), rtol=0.02, atol=0.02 * scale)
    ref = layers.reference(x, w, ids)
    torch.testing.assert_close(ours_on.float(), ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
