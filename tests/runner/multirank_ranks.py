"""Rank functions of test_multirank and test_overlap: what they run on every rank of a RankPool
(importable by spawned ranks)."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from moe_plugins.runner.demo import demo_inputs
from moe_plugins.faults import clear_group_faults
from moe_plugins.groups import cached_dist_context
from moe_plugins.runner.layer import MoELayer
from moe_plugins.layout import ParallelLayout, owned_rows
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights
from moe_plugins.overlap import OverlapConfig
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import get_backend
from moe_plugins.strategy import ReductionStrategy
from tests.checks import count_dist_calls


def run_compiling_and_eager(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                            num_tokens: int) -> dict:
    """One forward of a torch-backend layer eager, one with ``torch.compiler.is_compiling``
    reporting a trace (the manager then calls the public ``dist.all_to_all_single``, which
    Dynamo maps): the outputs, and which entry point each all-to-all went through."""
    ctx = cached_dist_context(layout)
    layer = MoELayer(MoEWeights.random(cfg, 0), ctx, get_backend("torch"), None, QuantSpec(),
                     OverlapConfig(), max_tokens_per_rank=max(num_tokens, 1))
    x = demo_inputs(cfg, num_tokens, ctx.dp_rank, 0)
    public = dist.all_to_all_single
    entries: list[str] = []

    def via_public(*args: Any, **kwargs: Any) -> Any:
        entries.append("dist.all_to_all_single")
        return public(*args, **kwargs)

    result = {}
    for mode in ("eager", "compiling"):
        entries.clear()
        saved_flag = torch.compiler.is_compiling
        dist.all_to_all_single = via_public
        if mode == "compiling":
            torch.compiler.is_compiling = lambda: True
        try:
            with count_dist_calls() as calls:
                out = layer(x)
        finally:
            dist.all_to_all_single = public
            torch.compiler.is_compiling = saved_flag
        result[mode] = dict(out=out, public=len(entries),
                            a2a=sum(1 for n, _ in calls if n == "all_to_all_single"))
    return result


def run_layer(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
              strategy: Optional[ReductionStrategy], num_tokens: int,
              quant: QuantSpec = QuantSpec(), seed: int = 0, backend: str = "torch",
              overlap: bool = False, single_collective: bool = True) -> dict:
    """One forward of a MoE layer on this rank, with every torch.distributed call counted."""
    ctx = cached_dist_context(layout)
    layer = MoELayer(MoEWeights.random(cfg, seed), ctx, get_backend(backend), strategy, quant,
                     OverlapConfig(single_collective, overlap), max_tokens_per_rank=max(num_tokens, 1))
    x = demo_inputs(cfg, num_tokens, ctx.dp_rank, seed)
    with count_dist_calls() as calls:
        out = layer(x)
    stats = layer.dispatch_stats
    rows = owned_rows(num_tokens, layout.tp, ctx.tp_rank)
    return dict(out=out, strategy=layer.strategy, calls=calls, pairs=stats.pairs,
                rows_sent=stats.rows, owned=rows.num_owned, sf_bytes=stats.sf_bytes,
                recorded=[(c.kind, c.bytes) for c in layer.collectives.records])


def run_prepare(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, num_tokens: int,
                quant: QuantSpec, seed: int = 0) -> dict:
    """prepare + finalize alone on the owned slice; reports what prepare returned and sent."""
    from moe_plugins.config import DispatchConfig
    from moe_plugins.layout import slice_owned
    from moe_plugins.runner.model import route

    ctx = cached_dist_context(layout)
    w = MoEWeights.random(cfg, seed)
    pf = get_backend("torch").build(ctx, DispatchConfig(cfg.num_experts, cfg.hidden, cfg.num_topk,
                                                        max(num_tokens, 1), cfg.dtype, quant))
    x = demo_inputs(cfg, num_tokens, ctx.dp_rank, seed)
    tw, ti = route(x, w.router, cfg.num_topk, cfg.renormalize)
    owned = slice_owned(owned_rows(num_tokens, layout.tp, ctx.tp_rank), x, ti, tw)
    with count_dist_calls() as calls:
        prep = pf.prepare(owned.hidden_states, owned.topk_weights, owned.topk_ids, quant)
    out = torch.empty_like(owned.hidden_states)
    pf.finalize(torch.zeros(prep.x.shape[0], cfg.hidden, dtype=cfg.dtype), owned.topk_weights,
                owned.topk_ids, out)
    return dict(x_dtype=prep.x.dtype, x_shape=tuple(prep.x.shape), x_stride=prep.x.stride(),
                x_sf=None if prep.x_sf is None else (prep.x_sf.dtype, tuple(prep.x_sf.shape)),
                x_sf_stride=None if prep.x_sf is None else prep.x_sf.stride(),
                weights_stride=prep.topk_weights.stride(),
                a2a_calls=sum(1 for n, _ in calls if n == "all_to_all_single"),
                sf_bytes=pf.stats.sf_bytes)


def prepare_mismatched(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig) -> None:
    """prepare with hidden_states of 4 tokens and topk of 8: must raise before any collective."""
    from moe_plugins.config import DispatchConfig

    ctx = cached_dist_context(layout)
    pf = get_backend("torch").build(ctx, DispatchConfig(cfg.num_experts, cfg.hidden, cfg.num_topk))
    pf.prepare(torch.zeros(4, cfg.hidden), torch.ones(8, cfg.num_topk),
               torch.zeros(8, cfg.num_topk, dtype=torch.int64), QuantSpec())


class _FailOnce:
    """Experts that raise on their first call, then delegate (a routed-path failure)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.failed = inner, False

    def apply(self, prep: Any) -> torch.Tensor:
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected expert failure")
        return self.inner.apply(prep)


def run_layer_after_failure(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                            strategy: ReductionStrategy, num_tokens: int) -> dict:
    """First call fails inside the routed path (after dispatch); the second call on the same
    groups must raise naming that first failure; a layer rebuilt on new groups must work."""
    from moe_plugins.faults import LayerBrokenError
    from moe_plugins.groups import make_dist_context

    def build() -> MoELayer:
        ctx = make_dist_context(layout, fresh_ep_group=True)
        return MoELayer(MoEWeights.random(cfg, 0), ctx, get_backend("torch"), strategy,
                        QuantSpec(), OverlapConfig(overlap=True), max_tokens_per_rank=num_tokens)

    layer = build()
    layer.experts = _FailOnce(layer.experts)  # type: ignore[assignment]
    x = demo_inputs(cfg, num_tokens, layout.dp_rank(rank), 0)
    try:
        layer(x)
        first_error = None
    except RuntimeError as e:
        first_error = str(e)
    try:
        layer(x)  # the experts would work now; the group is out of step
        second_error = None
    except LayerBrokenError as e:
        second_error = str(e)
    handle_after = layer.pf._handle  # type: ignore[union-attr]
    return dict(first_error=first_error, second_error=second_error, out=build()(x),
                handle_after=handle_after)


def expert_counts(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                  num_tokens: int) -> dict:
    """prepare's per-local-expert counts next to the received local topk ids."""
    from moe_plugins.config import DispatchConfig
    from moe_plugins.runner.model import route

    ctx = cached_dist_context(layout)
    pf = get_backend("torch").build(ctx, DispatchConfig(cfg.num_experts, cfg.hidden, cfg.num_topk))
    x = demo_inputs(cfg, num_tokens, ctx.dp_rank, 0)
    tw, ti = route(x, MoEWeights.random(cfg, 0).router, cfg.num_topk, cfg.renormalize)
    prep = pf.prepare(x, tw, ti, QuantSpec())
    pf.reset_call_state()  # abandoned on every rank alike: still in step
    clear_group_faults(ctx.ep_group)
    assert prep.expert_tokens_meta is not None and prep.topk_ids is not None
    return dict(counts=prep.expert_tokens_meta.expert_num_tokens, local_ids=prep.topk_ids)
