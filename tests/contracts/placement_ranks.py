"""Rank functions of the expert-placement tests: a layer under a placement (linear, round-robin,
EPLB's with redundant copies), rebalanced between forward passes, on any backend (the vendor
libraries' emulations installed for the rank function's duration only)."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch

from moe_plugins.runner.demo import demo_inputs
from moe_plugins.groups import cached_dist_context
from moe_plugins.runner.layer import MoELayer
from moe_plugins.layout import ParallelLayout
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights, route
from moe_plugins.overlap import OverlapConfig
from moe_plugins.placement import ExpertPlacement
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import get_backend
from moe_plugins.strategy import ReductionStrategy


def random_placement(num_logical: int, num_ranks: int, num_redundant: int, seed: int
                     ) -> ExpertPlacement:
    """EPLB-like: every logical expert once plus ``num_redundant`` random extra copies, the
    physical slots shuffled (so no rank holds a contiguous block)."""
    g = torch.Generator().manual_seed(seed)
    extra = torch.randint(0, num_logical, (num_redundant,), generator=g)
    slots = torch.cat([torch.arange(num_logical), extra])
    return ExpertPlacement.eplb(slots[torch.randperm(slots.numel(), generator=g)], num_ranks,
                                num_logical)


@contextlib.contextmanager
def _vendor(backend: str) -> Iterator[Optional[object]]:
    """The emulations of the packages ``backend`` needs, for the block, and the backend_options
    the layer is built with: what an engine passes (``engine_options``), but deepep_auto gets a
    low-latency capacity below the tests' 9 tokens, so its calls take normal mode through its
    own managers (its low-latency mode is deepep_ll's, tested as such)."""
    from tests.backends.low_latency_ranks import default_store
    from tests.emulation import installed

    spec = get_backend(backend)
    if any(p.module == "flashinfer" for p in spec.required):  # both NVLink backends
        from tests.emulation import flashinfer_two_sided as emu

        with emu.installed("0.7.2.post1"):
            yield None
        return
    with installed(*(p.module for p in spec.required)):
        if backend == "deepep_auto":
            from moe_plugins.all2all.deepep_auto import DeepEPAutoOptions

            yield DeepEPAutoOptions(ll_max_tokens_per_rank=4)
        else:
            yield spec.manager.engine_options(default_store())


def run_placed_layer(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
                     strategy: Optional[ReductionStrategy], num_tokens: int,
                     placements: Sequence[ExpertPlacement], overlap: bool = False,
                     quant: QuantSpec = QuantSpec(), seed: int = 0) -> dict:
    """The same inputs through one layer under ``placements[0]``, then after each
    :meth:`MoELayer.rebalance` to the next placement. Returns the outputs, the physical ids this
    DP group dispatched under each placement and the logical experts this rank held."""
    ctx = cached_dist_context(layout)
    weights = MoEWeights.random(cfg, seed)
    x = demo_inputs(cfg, num_tokens, ctx.dp_rank, seed)
    outs, ids, held = [], [], []
    with _vendor(backend) as options:
        layer = MoELayer(weights, ctx, get_backend(backend), strategy, quant,
                         OverlapConfig(overlap=overlap), max_tokens_per_rank=max(num_tokens, 1),
                         backend_options=options, placement=placements[0])
        try:
            for i, placement in enumerate(placements):
                if i:
                    layer.rebalance(placement)
                outs.append(layer(x))
                _, logical = route(x, weights.router, cfg.num_topk, cfg.renormalize)
                ids.append(placement.to_physical(logical))
                held.append(placement.local_logical(ctx.rank))
            experts_w13 = layer.expert_weights.w13.clone()
        finally:
            layer.destroy()
    return dict(outs=outs, ids=ids, held=held, experts_w13=experts_w13, strategy=layer.strategy)
