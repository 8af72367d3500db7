"""Rank functions for the flashinfer_nvlink_one_sided tests: each installs the emulated flashinfer
(tests/emulation/flashinfer_one_sided.py through flashinfer_two_sided.installed) in sys.modules
for its own duration only, runs on every rank of a RankPool, and destroys what it built."""
from __future__ import annotations

from typing import Any, Optional, Union

import torch

from moe_plugins.all2all.flashinfer_nvlink_one_sided import FlashInferOneSidedOptions
from moe_plugins.config import DispatchConfig, MoEConfig
from moe_plugins.faults import clear_group_faults
from moe_plugins.groups import cached_dist_context
from moe_plugins.layout import ParallelLayout
from moe_plugins.overlap import OverlapConfig
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import get_backend
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.runner.experts import TorchExperts
from moe_plugins.runner.layer import MoELayer
from moe_plugins.runner.model import MoEWeights, route
from moe_plugins.strategy import ReductionStrategy
from tests.emulation import flashinfer_one_sided as one_sided
from tests.emulation import flashinfer_two_sided as emu

BACKEND = "flashinfer_nvlink_one_sided"


def _traffic(op: str) -> list[dict]:
    return [dict(t) for t in emu.TRAFFIC if t["op"] == op]


def run_layer(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
              num_tokens: Union[int, list[int]], quant: QuantSpec, flavor: str,
              strategy: Optional[ReductionStrategy] = None, options: Any = None,
              platform: Optional[dict] = None, seed: int = 0) -> dict:
    """One forward of a MoE layer (shared expert included) on the emulated flashinfer ``flavor``
    (``num_tokens``: one count, or one per DP group); reports the output, the strategy, what
    the dispatches carried and on which transport, the TP collectives and the stats."""
    with emu.installed(flavor):
        one_sided.PLATFORM.update(platform or {})
        ctx = cached_dist_context(layout)
        counts = [num_tokens] * layout.dp if isinstance(num_tokens, int) else num_tokens
        layer = MoELayer(MoEWeights.random(cfg, seed), ctx, get_backend(BACKEND), strategy,
                         quant, OverlapConfig(overlap=False), backend_options=options,
                         max_tokens_per_rank=max(max(counts), 1))
        try:
            out = layer(demo_inputs(cfg, counts[ctx.dp_rank], ctx.dp_rank, seed))
            stats = layer.dispatch_stats
        finally:
            layer.destroy()
        return dict(out=out, strategy=layer.strategy, dispatch=_traffic("moe_a2a_dispatch"),
                    combine=_traffic("moe_a2a_combine"), pairs=stats.pairs, rows=stats.rows,
                    sf_bytes=stats.sf_bytes, meta_bytes=stats.meta_bytes,
                    combine_bytes=stats.combine_bytes,
                    tp_collectives=[c.kind for c in layer.collectives.records],
                    live_after_destroy=emu.live_allocations())


def run_routed(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, num_tokens: int,
               quant: QuantSpec, flavor: str, options: Any = None,
               masked_rank: Optional[int] = None, seed: int = 0) -> dict:
    """prepare -> TorchExperts -> finalize on this rank's tokens; with ``masked_rank`` every
    other rank masks it first (``set_rank_masked``). Reports what prepare returned, the mask
    and the routed output."""
    with emu.installed(flavor):
        ctx = cached_dist_context(layout)
        pf = get_backend(BACKEND).build(ctx, DispatchConfig(
            cfg.num_experts, cfg.hidden, cfg.num_topk, max(num_tokens, 1), cfg.dtype, quant,
            options))
        try:
            if masked_rank is not None and rank != masked_rank:
                pf.manager.set_rank_masked(masked_rank)  # type: ignore[attr-defined]
            w = MoEWeights.random(cfg, seed)
            x = demo_inputs(cfg, num_tokens, ctx.dp_rank, seed)
            tw, ti = route(x, w.router, cfg.num_topk, cfg.renormalize)
            experts = TorchExperts(w.local_experts(layout.ep_size, ctx.rank), quant, cfg.dtype)
            prep = pf.prepare(x, tw, ti, quant)
            out = pf.finalize(experts.apply(prep), tw, ti, torch.empty_like(x))
            return dict(out=out, x_dtype=prep.x.dtype, x_shape=tuple(prep.x.shape),
                        x_sf=None if prep.x_sf is None else (prep.x_sf.dtype,
                                                             tuple(prep.x_sf.shape)),
                        x_sf_swizzled=prep.x_sf_swizzled, topk_ids=prep.topk_ids,
                        dispatch=_traffic("moe_a2a_dispatch"),
                        masked=pf.manager.masked_ranks())  # type: ignore[attr-defined]
        finally:
            pf.reset_call_state()
            clear_group_faults(pf.manager.group)  # type: ignore[attr-defined]
            pf.manager.destroy()  # type: ignore[attr-defined]


def checkpoint(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
               flavor: str) -> dict:
    """A call, the manager's checkpoint prepare and restore, the same call again."""
    with emu.installed(flavor):
        ctx = cached_dist_context(layout)
        layer = MoELayer(MoEWeights.random(cfg, 0), ctx, get_backend(BACKEND), None, QuantSpec(),
                         OverlapConfig(overlap=False), max_tokens_per_rank=6)
        try:
            x = demo_inputs(cfg, 6, ctx.dp_rank, 0)
            first = layer(x)
            manager = layer.pf.manager  # type: ignore[union-attr]
            manager.checkpoint_prepare()
            manager.checkpoint_prepare()  # again: nothing to do
            manager.checkpoint_restore()
            second = layer(x)
        finally:
            layer.destroy()
        return dict(first=first, second=second)


def bad_mask(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, flavor: str,
             options: FlashInferOneSidedOptions, peer_offset: int, masked: Any) -> str:
    """The error ``set_rank_masked(rank + peer_offset, masked)`` raises (before any change)."""
    with emu.installed(flavor):
        pf = get_backend(BACKEND).build(cached_dist_context(layout), DispatchConfig(
            cfg.num_experts, cfg.hidden, cfg.num_topk, 4, cfg.dtype, QuantSpec(), options))
        try:
            pf.manager.set_rank_masked((rank + peer_offset) % world, masked)  # type: ignore
        except (TypeError, ValueError) as e:
            assert pf.manager.masked_ranks() == []  # type: ignore[attr-defined]
            return f"{type(e).__name__}: {e}"
        finally:
            pf.manager.destroy()  # type: ignore[attr-defined]
        return "accepted"
