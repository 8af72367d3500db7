"""deepep_ll against the REAL DeepEP V1 ``deep_ep.Buffer`` on one GPU (EP world size 1).

Needs a CUDA GPU and DeepEP's V1 line (commit 567632d) built from source; skipped cleanly
otherwise. One process, a one-rank gloo group (DeepEP only all-gathers objects over it; the
kernels run over NVSHMEM, which on a node without an RDMA NIC logs that IBGDA failed to start
and goes on with the local GPU). The checks are tests/backends/low_latency_cases.py, shared with nixl_ep.

Run: ``python -m pytest -m gpu tests/gpu -q`` from the repository root.
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
deep_ep = pytest.importorskip("deep_ep", reason="needs DeepEP's V1 line built from source")

from tests.backends.low_latency_cases import *  # noqa: E402,F401,F403  (the shared tests and fixtures)
from tests.backends.low_latency_cases import (BF16, CFG, DEV, FP8, MAX_TOKENS, _close, backend_factory,  # noqa: E402
                          free_port, one_rank_context)
from moe_plugins.runner.demo import demo_inputs  # noqa: E402
from moe_plugins.runner.layer import MoELayer  # noqa: E402
from moe_plugins.overlap import OverlapConfig  # noqa: E402
from moe_plugins.runner.reference import reference_moe  # noqa: E402
from moe_plugins.prepare_finalize.deepep_ll import SPEC  # noqa: E402
from tests.gpu.cuda_graphs import capture  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ctx():
    with one_rank_context(init_method=f"tcp://127.0.0.1:{free_port()}") as c:
        yield c


@pytest.fixture(scope="module")
def build(ctx):
    return backend_factory(SPEC, ctx)


@pytest.mark.parametrize("num_tokens", [5, 64])
@pytest.mark.parametrize("quant", [BF16, FP8], ids=["bf16", "fp8"])
def test_whole_layer_replays_in_a_cuda_graph(ctx, weights, quant, num_tokens):
    """A whole MoELayer with deepep_ll (router, dispatch with its receive hook, the reference
    experts' BATCHED path, combine, the shared expert on the side stream) captured once and
    replayed on new inputs gives what the eager layer gives on those inputs. Before the BATCHED
    path masked by count, capture failed on a device-to-host read of the counts."""
    layer = MoELayer(weights.to(DEV), ctx, SPEC, quant=quant,
                     overlap=OverlapConfig(overlap=True), max_tokens_per_rank=MAX_TOKENS)
    try:
        static_x = demo_inputs(CFG, num_tokens, 0, 10).to(DEV)
        graph, static_out = capture(lambda: layer(static_x))
        for seed in (11, 12):
            x = demo_inputs(CFG, num_tokens, 0, seed)
            static_x.copy_(x.to(DEV))
            graph.replay()
            replayed = static_out.clone()
            eager = layer(x.to(DEV))
            torch.cuda.synchronize()
            _close(replayed, eager.float().cpu())
            _close(replayed, reference_moe(x, weights, quant))
    finally:
        torch.cuda.synchronize()
        layer.destroy()


def test_calls_go_to_the_runtime_of_567632d(build):
    """On DeepEP 567632d the manager recognises deep_ep.Buffer's low-latency signatures and calls
    its C++ runtime directly (all2all/deepep_ll.py); the tests above then check what those calls
    deliver against the reference and the raw ``Buffer`` methods."""
    from moe_plugins.all2all.deepep_ll import runtime_calls_known

    pf = build(BF16)
    assert runtime_calls_known(pf.manager.buffer)
    assert pf.manager.runtime_calls is not None and pf.runtime_calls is pf.manager.runtime_calls
