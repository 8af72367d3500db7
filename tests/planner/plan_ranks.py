"""Rank functions for tests/planner/test_plan.py: one MoE layer forward with everything the plan predicts
measured where it happens (importable by spawned ranks)."""
from __future__ import annotations

from dataclasses import asdict
from typing import Optional, Sequence

import torch

from moe_plugins.counters import tensor_bytes
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.groups import cached_dist_context
from moe_plugins.runner.layer import MoELayer
from moe_plugins.layout import ParallelLayout
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights
from moe_plugins.overlap import OverlapConfig
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import get_backend
from moe_plugins.strategy import ReductionStrategy
from tests.checks import count_dist_calls


def measure_layer(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                  strategy: Optional[ReductionStrategy], tokens_per_dp: Sequence[int],
                  quant: QuantSpec = QuantSpec(), seed: int = 0, backend: str = "torch",
                  backend_options: object = None) -> dict:
    """One forward on this rank's DP group (``tokens_per_dp[dp_rank]`` tokens). Returns the output,
    the backend's DispatchStats, the layer's TP collective log, every torch.distributed call with
    its bytes, the topk_ids the backend's prepare really received, and the weight bytes held."""
    ctx = cached_dist_context(layout)
    num_tokens = tokens_per_dp[ctx.dp_rank]
    layer = MoELayer(MoEWeights.random(cfg, seed), ctx, get_backend(backend), strategy, quant,
                     OverlapConfig(overlap=False), max_tokens_per_rank=max(num_tokens, 1),
                     backend_options=backend_options)
    prepared: list[torch.Tensor] = []
    if layer.pf is not None:
        pf = layer.pf
        prepare_async = pf.prepare_async

        def recording(hidden_states, topk_weights, topk_ids, q):  # type: ignore[no-untyped-def]
            prepared.append(topk_ids.clone())
            return prepare_async(hidden_states, topk_weights, topk_ids, q)

        pf.prepare_async = recording  # type: ignore[method-assign]
    x = demo_inputs(cfg, num_tokens, ctx.dp_rank, seed)
    with count_dist_calls() as calls:
        out = layer(x)
    shared = layer.shared
    layer.destroy()
    return dict(
        out=out, strategy=layer.strategy, stats=asdict(layer.dispatch_stats),
        recorded=[(c.kind, c.bytes) for c in layer.collectives.records], calls=calls,
        prepared_topk_ids=prepared[0] if prepared else None,
        shared_weight_bytes=0 if shared is None else sum(
            tensor_bytes(t) for t in (shared.w13, shared.w2, shared.gate)),
        expert_weight_bytes=tensor_bytes(layer.expert_weights.w13)
        + tensor_bytes(layer.expert_weights.w2))


def measure_ll_layer(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
                     strategy: Optional[ReductionStrategy], tokens_per_dp: Sequence[int],
                     quant: QuantSpec = QuantSpec(), seed: int = 0) -> dict:
    """:func:`measure_layer` through a low-latency backend (deepep_ll, nixl_ep) on the emulation
    of its vendor library (tests/emulation), installed for this call only."""
    from tests.emulation import installed
    from tests.backends.low_latency_ranks import make_options, vendor_module

    with installed(vendor_module(backend)):
        return measure_layer(rank, world, layout, cfg, strategy, tokens_per_dp, quant, seed,
                             backend, make_options(backend))
