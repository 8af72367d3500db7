"""Rank functions of the low-latency backend tests (deepep_ll, nixl_ep).

Each injects the emulation of the backend's vendor package (tests/emulation) for its own
duration only, builds the backend through the registry exactly as a layer does, and returns
plain tensors/values to the test process.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist

from emulation import installed
from moe_plugins.config import DispatchConfig
from moe_plugins.demo import demo_inputs
from moe_plugins.groups import DistContext, cached_dist_context
from moe_plugins.layer import MoELayer
from moe_plugins.layout import ParallelLayout, owned_rows, slice_owned
from moe_plugins.model import MoEConfig, MoEWeights, route
from moe_plugins.overlap import OverlapConfig
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import BackendSpec, get_backend
from moe_plugins.strategy import ReductionStrategy
from rank_fns import count_dist_calls


def vendor_module(backend: str) -> str:
    """The package the backend imports (what the emulation stands in for)."""
    return get_backend(backend).manager.required.module


def default_store() -> "dist.Store":
    """A prefix store on the store the process group was initialized with (the RankPool's
    TCPStore), for nixl_ep's metadata exchange."""
    return dist.PrefixStore("nixl_ep", dist.distributed_c10d._get_default_store())


def make_options(backend: str, **overrides: Any) -> Any:
    """The backend's options dataclass; a store is added where the options take one."""
    options_type = get_backend(backend).manager.options_type
    names = {f.name for f in dataclasses.fields(options_type)}
    if "tcp_store_group" in names and "tcp_store_group" not in overrides:
        overrides["tcp_store_group"] = default_store()
    return options_type(**overrides)


def run_ll_layer(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
                 strategy: Optional[ReductionStrategy], num_tokens: int,
                 quant: QuantSpec = QuantSpec(), seed: int = 0,
                 options: Optional[dict] = None, masked_rank: Optional[int] = None) -> dict:
    """One forward of a MoE layer through the backend on the emulated library. With
    ``masked_rank``, every other rank masks that rank before the forward."""
    with installed(vendor_module(backend)):
        ctx = cached_dist_context(layout)
        layer = MoELayer(MoEWeights.random(cfg, seed), ctx, get_backend(backend), strategy, quant,
                         OverlapConfig(overlap=False), max_tokens_per_rank=max(num_tokens, 1),
                         backend_options=make_options(backend, **(options or {})))
        try:
            assert layer.pf is not None
            if masked_rank is not None and rank != masked_rank:
                layer.pf.manager.set_rank_masked(masked_rank)
            masked = layer.pf.manager.masked_ranks() if masked_rank is not None else []
            x = demo_inputs(cfg, num_tokens, ctx.dp_rank, seed)
            with count_dist_calls() as calls:
                out = layer(x)
            stats = layer.dispatch_stats
        finally:
            layer.destroy()
    rows = owned_rows(num_tokens, layout.tp, ctx.tp_rank)
    return dict(out=out, strategy=layer.strategy, pairs=stats.pairs, owned=rows.num_owned,
                sf_bytes=stats.sf_bytes, masked=masked,
                tp_collectives=[n for n, _ in calls if n != "all_to_all_single"])


def _build(backend: str, layout: ParallelLayout, cfg: MoEConfig, num_tokens: int,
           quant: QuantSpec, options: Optional[dict]) -> Any:
    ctx = cached_dist_context(layout)
    return get_backend(backend).build(ctx, DispatchConfig(
        cfg.num_experts, cfg.hidden, cfg.num_topk, max(num_tokens, 1), cfg.dtype, quant,
        backend_options=make_options(backend, **(options or {}))))


def run_ll_prepare(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
                   num_tokens: int, quant: QuantSpec, seed: int = 0,
                   options: Optional[dict] = None, ue8m0_experts: bool = False) -> dict:
    """prepare alone on the owned slice; returns what it gave the experts, plus this rank's
    owned tokens and routing (the test checks them against the other ranks' receive)."""
    with installed(vendor_module(backend)):
        pf = _build(backend, layout, cfg, num_tokens, quant, options)
        try:
            if ue8m0_experts:
                pf.post_init_setup(_PackedUE8M0Experts())
            w = MoEWeights.random(cfg, seed)
            x = demo_inputs(cfg, num_tokens, layout.dp_rank(rank), seed)
            tw, ti = route(x, w.router, cfg.num_topk, cfg.renormalize)
            owned = slice_owned(owned_rows(num_tokens, layout.tp, layout.tp_rank(rank)), x, ti, tw)
            sent = pf.prepare_async(owned.hidden_states, owned.topk_weights, owned.topk_ids, quant)
            assert sent.hook is not None
            pending = pf.manager.buffer.runtime.pending_receives
            sent.hook()
            prep = sent.receiver()
            result = dict(
                x=prep.x.clone(), x_sf=None if prep.x_sf is None else prep.x_sf.clone(),
                counts=prep.expert_tokens_meta.expert_num_tokens.clone(),
                topk_ids=prep.topk_ids, topk_weights=prep.topk_weights,
                pending_before_hook=pending,
                pending_after_hook=pf.manager.buffer.runtime.pending_receives,
                tokens=owned.hidden_states, ids=owned.topk_ids,
                num_local_experts=pf.manager.num_local_experts,
                max_tokens=pf.max_num_tokens_per_rank(), stats=dataclasses.asdict(pf.stats))
        finally:
            pf.reset_call_state()
            pf.manager.destroy()
    return result


class _PackedUE8M0Experts:
    """An experts object that asks for packed UE8M0 activation scales (as DeepGEMM does)."""

    def supports_packed_ue8m0_act_scales(self) -> bool:
        return True


def run_ll_call(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
                action: str, options: Optional[dict] = None) -> Any:
    """Build the backend and do one thing that is expected to fail or report; see the tests."""
    with installed(vendor_module(backend)):
        pf = _build(backend, layout, cfg, 4, QuantSpec(), options)
        h = cfg.hidden
        try:
            if action == "float_topk_ids":
                pf.prepare(torch.zeros(2, h, dtype=torch.bfloat16), torch.ones(2, cfg.num_topk),
                           torch.zeros(2, cfg.num_topk), QuantSpec())
            elif action == "int32_topk_ids":
                ids = torch.arange(2 * cfg.num_topk, dtype=torch.int32).view(2, -1) % cfg.num_experts
                prep = pf.prepare(torch.ones(2, h, dtype=torch.bfloat16),
                                  torch.full((2, cfg.num_topk), 0.5), ids, QuantSpec())
                return prep.expert_tokens_meta.expert_num_tokens.tolist()
            elif action == "too_many_tokens":
                n = pf.max_num_tokens_per_rank() + 1
                pf.prepare(torch.zeros(n, h, dtype=torch.bfloat16), torch.ones(n, cfg.num_topk),
                           torch.zeros(n, cfg.num_topk, dtype=torch.int64), QuantSpec())
            elif action == "wrong_expert_output_shape":
                prep = pf.prepare(torch.zeros(2, h, dtype=torch.bfloat16),
                                  torch.ones(2, cfg.num_topk),
                                  torch.zeros(2, cfg.num_topk, dtype=torch.int64), QuantSpec())
                e_l, slots, _ = prep.x.shape
                pf.finalize(torch.zeros(e_l, slots - 1, h, dtype=torch.bfloat16),
                            torch.ones(2, cfg.num_topk),
                            torch.zeros(2, cfg.num_topk, dtype=torch.int64),
                            torch.empty(2, h, dtype=torch.bfloat16))
            elif action == "state_after_failed_finalize":
                # A finalize that raises still drops the handle: the next prepare works.
                ids = torch.zeros(2, cfg.num_topk, dtype=torch.int64)
                x = torch.ones(2, h, dtype=torch.bfloat16)
                pf.prepare(x, torch.ones(2, cfg.num_topk), ids, QuantSpec())
                try:
                    pf.finalize(torch.zeros(1, 1, h, dtype=torch.bfloat16),
                                torch.ones(2, cfg.num_topk), ids,
                                torch.empty(2, h, dtype=torch.bfloat16))
                except ValueError:
                    pass
                prep = pf.prepare(x, torch.ones(2, cfg.num_topk), ids, QuantSpec())
                return prep.expert_tokens_meta.expert_num_tokens.tolist()
            elif action == "mask_without_support":
                pf.manager.set_rank_masked((rank + 1) % world)
            elif action == "mask_self":
                pf.manager.set_rank_masked(rank)
            elif action == "buffer_sharing":
                other = _build(backend, layout, cfg, 4, QuantSpec(), options)
                shared = other.manager.buffer is pf.manager.buffer
                runtime = pf.manager.buffer.runtime
                other.manager.destroy()
                alive_after_one = pf.manager.buffer.runtime is runtime and not runtime.destroyed
                return dict(shared=shared, alive_after_one=alive_after_one, runtime=runtime)
            elif action == "buffer_args":
                b = pf.manager.buffer
                return {k: v for k, v in vars(b).items()
                        if isinstance(v, (int, bool, str, type(None)))} | dict(
                    expected_rdma=type(b).get_low_latency_rdma_size_hint(
                        pf.manager.max_tokens_per_rank, pf.manager.kernel_hidden,
                        pf.manager.num_ranks, pf.manager.num_experts)
                    if hasattr(type(b), "get_low_latency_rdma_size_hint") else None)
            else:
                raise ValueError(f"unknown action {action!r}")
        finally:
            pf.reset_call_state()
            pf.manager.destroy()
    if action == "buffer_sharing":
        pass
    return None
