"""The CPU demo: a MoE layer on R gloo ranks under every applicable strategy, checked against the
single-process reference, with what each strategy really communicated."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from moe_plugins.groups import cached_dist_context
from moe_plugins.runner.launch import RankPool
from moe_plugins.runner.layer import MoELayer
from moe_plugins.layout import ParallelLayout
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights
from moe_plugins.overlap import OverlapConfig
from moe_plugins.quant import QuantSpec
from moe_plugins.runner.reference import reference_moe, within_tolerance
from moe_plugins.registry import get_backend, select_backend
from moe_plugins.strategy import ReductionStrategy, applicable_strategies, choose_strategy
from moe_plugins.callbound import call_timeout_seconds, first_call_timeout_seconds

__all__ = ["DemoRow", "demo_inputs", "demo_preflight", "run_demo", "strategies_for"]


@dataclass(frozen=True)
class DemoRow:
    strategy: str
    default: bool
    ok: bool
    max_abs_err: float
    tp_collectives: int
    tp_collective_bytes: int
    dispatched_pairs: list[int]
    dispatched_bytes: list[int]
    ms_per_layer: float
    # calls per transport mode on rank 0, all calls included (deepep_auto); empty otherwise
    modes: dict[str, int] = field(default_factory=dict)


def demo_inputs(cfg: MoEConfig, num_tokens: int, dp_rank: int, seed: int) -> torch.Tensor:
    """x [num_tokens, hidden] of DP group ``dp_rank`` (the same on all its TP ranks)."""
    g = torch.Generator().manual_seed(seed * 7919 + dp_rank + 1)
    return torch.randn(num_tokens, cfg.hidden, generator=g).to(cfg.dtype)


def strategies_for(layout: ParallelLayout, backend: str, cfg: MoEConfig) -> list[ReductionStrategy]:
    caps = get_backend(backend).capabilities
    return applicable_strategies(layout, supports_sp=caps.sp, supports_row_scatter=caps.row_scatter,
                                 has_shared_expert=cfg.has_shared_expert)


def demo_preflight(layout: ParallelLayout, cfg: MoEConfig, backend: str, quant: QuantSpec,
                   call_timeout_s: Optional[float] = None) -> Optional[float]:
    """Every configuration error a demo rank would hit, raised here before ranks start
    (ValueError / BackendSelectionError naming the value and the fix). Returns the call bound
    (``call_timeout_s``, else ``$MOE_PLUGINS_CALL_TIMEOUT_S``; None: off), its start-up bound
    checked too."""
    bound = call_timeout_seconds(call_timeout_s)
    first_call_timeout_seconds(bound)
    select_backend(layout, quant.scheme, backend, dtype=cfg.dtype)
    if layout.ep and cfg.num_experts % layout.ep_size:
        raise ValueError(f"--experts {cfg.num_experts} is not divisible by the EP size "
                         f"{layout.ep_size}; give a multiple of {layout.ep_size}")
    for flag, size in (("--intermediate", cfg.intermediate if not layout.ep else 0),
                       ("--shared-intermediate", cfg.shared_intermediate)):
        if size % layout.tp:
            raise ValueError(f"{flag} {size} is not divisible by --tp {layout.tp} (TP shards "
                             "it); give a multiple of the TP size")
    return bound


def _demo_rank(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, backend: str,
               strategy: ReductionStrategy, num_tokens: int, quant: QuantSpec, seed: int,
               iters: int, call_timeout_s: float = 0.0) -> dict:
    ctx = cached_dist_context(layout)
    weights = MoEWeights.random(cfg, seed)
    x = demo_inputs(cfg, num_tokens, ctx.dp_rank, seed)
    # CPU ranks: the shared expert runs inline; the CLI says so once instead of every rank
    # warning (the layer warns when overlap is requested without CUDA).
    layer = MoELayer(weights, ctx, get_backend(backend), strategy, quant,
                     OverlapConfig.from_env(overlap=False), max_tokens_per_rank=max(num_tokens, 1),
                     call_timeout_s=call_timeout_s)
    out = layer(x)  # the counted call
    stats = layer.dispatch_stats
    counted = dict(collectives=list(layer.collectives.records), pairs=stats.pairs,
                   bytes=stats.dispatch_bytes)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        layer(x)
    ms = (time.perf_counter() - t0) * 1e3 / max(iters, 1)
    modes = dict(layer.dispatch_stats.modes)
    layer.destroy()
    return dict(out=out, ms=ms, modes=modes, **counted)


def run_demo(pool: RankPool, layout: ParallelLayout, cfg: MoEConfig, backend: str, num_tokens: int,
             quant: QuantSpec = QuantSpec(), seed: int = 0, iters: int = 3,
             strategies: list[ReductionStrategy] | None = None,
             call_timeout_s: Optional[float] = None) -> list[DemoRow]:
    """Run every applicable strategy (or ``strategies``) and compare each rank with the
    reference. ``call_timeout_s``: the layers' call bound (:mod:`moe_plugins.callbound.watchdog`; None:
    off)."""
    caps = select_backend(layout, quant.scheme, backend, dtype=cfg.dtype).capabilities
    default = choose_strategy(layout, supports_sp=caps.sp, supports_row_scatter=caps.row_scatter,
                              has_shared_expert=cfg.has_shared_expert,
                              single_collective=OverlapConfig.from_env().single_collective).strategy
    weights = MoEWeights.random(cfg, seed)
    refs = [reference_moe(demo_inputs(cfg, num_tokens, d, seed), weights, quant)
            for d in range(layout.dp)]
    rows = []
    for strategy in strategies or strategies_for(layout, backend, cfg):
        per_rank = pool.run(_demo_rank, layout, cfg, backend, strategy, num_tokens, quant, seed,
                            iters, call_timeout_s or 0.0)
        checks = [within_tolerance(r["out"], refs[layout.dp_rank(i)]) for i, r in enumerate(per_rank)]
        colls = per_rank[0]["collectives"]
        rows.append(DemoRow(
            strategy=strategy.value, default=strategy is default,
            ok=all(ok for ok, _ in checks), max_abs_err=max(err for _, err in checks),
            tp_collectives=len(colls), tp_collective_bytes=sum(c.bytes for c in colls),
            dispatched_pairs=[r["pairs"] for r in per_rank],
            dispatched_bytes=[r["bytes"] for r in per_rank],
            ms_per_layer=max(r["ms"] for r in per_rank), modes=per_rank[0]["modes"]))
    return rows
