"""Shared-expert overlap on a real CUDA device: side stream, join, CUDA graphs.

Run on a GPU machine: `python -m pytest -m gpu tests/gpu`. Skipped without CUDA.
"""
from __future__ import annotations

import pytest
import torch

from moe_plugins import overlap
from moe_plugins.groups import DistContext
from moe_plugins.interface import RowScatterTarget, row_scatter_add
from moe_plugins.runner.layer import MoELayer
from moe_plugins.layout import ParallelLayout, owned_rows
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights
from moe_plugins.overlap import OverlapConfig, launch_shared
from moe_plugins.registry import get_backend
from tests.gpu.cuda_graphs import capture

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CFG = MoEConfig(hidden=1024, num_experts=8, num_topk=2, intermediate=512,
                shared_intermediate=2048, dtype=torch.bfloat16)


@pytest.fixture
def side_streams():
    """A fresh side-stream cache for the test, cleared again afterwards."""
    overlap.clear_side_streams()
    yield overlap._SIDE_STREAMS
    torch.cuda.synchronize()
    overlap.clear_side_streams()


def _layer(on: bool, max_tokens: int = 1 << 20) -> MoELayer:
    ctx = DistContext(ParallelLayout(1, 1, False), 0, None, None, torch.device("cuda"))
    w = MoEWeights.random(CFG, seed=3).to("cuda")
    return MoELayer(w, ctx, get_backend("torch"), overlap=OverlapConfig(overlap=on,
                                                                        overlap_max_tokens=max_tokens))


def _x(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, CFG.hidden, device="cuda", generator=g).to(CFG.dtype)


@pytest.mark.parametrize("num_tokens", [1, 8, 128])
def test_overlapped_equals_sequential(side_streams, num_tokens):
    x = _x(num_tokens, 0)
    over, seq = _layer(True), _layer(False)
    out = over(x)
    assert len(side_streams) == 1  # the shared expert really went to the side stream
    assert torch.equal(out, seq(x))


def test_over_threshold_runs_inline(side_streams):
    _layer(True, max_tokens=4)(_x(8, 0))
    assert len(side_streams) == 0


@pytest.mark.parametrize("num_tokens,tp,rank", [(64, 2, 1), (1, 4, 3)], ids=["owns-rows", "owns-none"])
def test_row_scatter_waits_for_the_side_stream(side_streams, num_tokens, tp, rank):
    """A slow shared expert on the side stream; the finalize adds right away on the main stream.
    Without the join the add would race the shared expert's write."""
    x = _x(num_tokens, 1).float()
    w = torch.randn(x.shape[1], x.shape[1], device="cuda") / x.shape[1] ** 0.5

    def slow_shared(t: torch.Tensor) -> torch.Tensor:
        for _ in range(50):
            t = torch.tanh(t @ w)
        return t

    expected = slow_shared(x)
    rows = owned_rows(num_tokens, tp, rank)
    combined = torch.ones(rows.chunk, x.shape[1], device="cuda")
    expected[rows.as_slice] += 1
    handle = launch_shared(slow_shared, x, OverlapConfig(overlap=True))
    assert handle.overlapped
    out = row_scatter_add(RowScatterTarget(handle, rows), combined)
    # read on the main stream only: correct values prove the main stream waited
    torch.testing.assert_close(out, expected)


def _capture(layer: MoELayer, x: torch.Tensor, pool=None):
    return capture(lambda: layer(x), warmups=1, pool=pool)


def test_graph_capture_with_fork_join_replays_new_input(side_streams):
    layer, seq = _layer(True), _layer(False)
    static_x = _x(16, 0)
    graph, static_out = _capture(layer, static_x)
    for seed in (1, 2):
        new = _x(16, seed)
        static_x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, seq(new), atol=0, rtol=0)


def test_batch_sizes_captured_into_one_pool_share_one_side_stream(side_streams):
    layer, seq = _layer(True), _layer(False)
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for n in (1, 8, 32):
        static_x = _x(n, 0)
        graph, static_out = _capture(layer, static_x, pool)
        graphs[n] = (static_x, graph, static_out)
    assert len(side_streams) == 1
    # graphs sharing a pool may reuse each other's memory: check each output right after its replay
    for n, (static_x, graph, static_out) in graphs.items():
        new = _x(n, 10 + n)
        static_x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, seq(new), atol=0, rtol=0)
