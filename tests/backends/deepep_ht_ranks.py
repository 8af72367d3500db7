"""Rank functions of the DeepEP normal-mode tests (deepep_ht, deepep_auto).

Each injects the deep_ep emulation (tests/emulation) for its own duration only, builds the
backend through the registry as a layer does, and returns plain tensors/values.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from tests.emulation import installed
from moe_plugins.config import DispatchConfig
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.groups import cached_dist_context
from moe_plugins.interface import BatchHint
from moe_plugins.runner.layer import MoELayer
from moe_plugins.layout import ParallelLayout, owned_rows, slice_owned
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights, route
from moe_plugins.overlap import OverlapConfig
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import get_backend
from moe_plugins.strategy import ReductionStrategy
from tests.checks import count_dist_calls, logged


def _layer(backend: str, layout: ParallelLayout, cfg: MoEConfig,
           strategy: Optional[ReductionStrategy], quant: QuantSpec, seed: int,
           max_tokens: int, options: Any) -> MoELayer:
    return MoELayer(MoEWeights.random(cfg, seed), cached_dist_context(layout), get_backend(backend),
                    strategy, quant, OverlapConfig(overlap=False), max_tokens_per_rank=max_tokens,
                    backend_options=options)


def run_ht_layer(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
                 strategy: Optional[ReductionStrategy], num_tokens: int,
                 quant: QuantSpec = QuantSpec(), seed: int = 0, max_tokens: int = 256,
                 options: Any = None) -> dict:
    """One forward of a MoE layer through ``backend`` on the emulated deep_ep."""
    with installed("deep_ep"):
        layer = _layer(backend, layout, cfg, strategy, quant, seed, max_tokens, options)
        try:
            x = demo_inputs(cfg, num_tokens, layout.dp_rank(rank), seed)
            with count_dist_calls() as calls:
                out = layer(x)
            stats = dict(dataclasses.asdict(layer.dispatch_stats),
                         modes=dict(layer.dispatch_stats.modes))
        finally:
            layer.destroy()
    rows = owned_rows(num_tokens, layout.tp, layout.tp_rank(rank))
    return dict(out=out, strategy=layer.strategy, stats=stats, owned=rows.num_owned,
                tp_collectives=[n for n, _ in calls if n != "all_to_all_single"],
                calls=[n for n, _ in calls])


def run_auto_calls(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                   tokens_per_dp: list[list[int]], capacity: int, quant: QuantSpec = QuantSpec(),
                   hints: Optional[list[Optional[BatchHint]]] = None, seed: int = 0,
                   link: Any = None) -> dict:
    """Several forwards of ONE deepep_auto layer (built with ``link``, a LinkModel or None):
    call i runs the first tokens_per_dp[i][dp] rows of one input per DP group (so every call's
    rows are a prefix of the same tokens), with ``hints[i]`` given to the backend first. Returns
    the outputs, the mode counts after each call and the layer's threshold."""
    from moe_plugins.all2all.deepep_auto import DeepEPAutoOptions

    with installed("deep_ep"), logged("moe_plugins.prepare_finalize.deepep_auto") as logs:
        layer = _layer("deepep_auto", layout, cfg, None, quant, seed, 4096,
                       DeepEPAutoOptions(ll_max_tokens_per_rank=capacity, link=link))
        try:
            assert layer.pf is not None
            dp = layout.dp_rank(rank)
            x = demo_inputs(cfg, max(t[dp] for t in tokens_per_dp), dp, seed)
            runtime = layer.pf.manager.buffer.runtime  # type: ignore[attr-defined]
            outs, modes, launches = [], [], []
            for i, per_dp in enumerate(tokens_per_dp):
                if hints is not None:
                    layer.pf.set_batch_hint(hints[i])
                start = runtime.launches
                outs.append(layer(x[: per_dp[dp]]))
                modes.append(dict(layer.dispatch_stats.modes))
                launches.append(runtime.launches - start)  # low-latency kernel launches
            return dict(outs=outs, x=x, modes=modes, ll_launches=launches,
                        threshold=layer.pf.threshold, logs=logs,  # type: ignore[attr-defined]
                        capacity=layer.pf.low_latency_capacity,  # type: ignore[attr-defined]
                        ll_dirty=layer.pf.manager.buffer.low_latency_dirty)  # type: ignore[attr-defined]
        finally:
            layer.destroy()


def auto_scales_after_packed_experts(rank: int, world: int, layout: ParallelLayout,
                                     cfg: MoEConfig, capacity: int) -> dict:
    """deepep_auto (FP8) paired with experts that ask for packed UE8M0 scales: the scale dtype
    and shape each mode's prepare hands them (one call of ``capacity`` tokens: low-latency
    mode; one of ``capacity + 1``: normal mode), and the INFO lines logged."""
    from moe_plugins.all2all.deepep_auto import DeepEPAutoOptions
    from moe_plugins.faults import clear_group_faults
    from moe_plugins.quant import QuantScheme

    class PackedScaleExperts:
        def supports_packed_ue8m0_act_scales(self) -> bool:
            return True

    quant = QuantSpec(QuantScheme.FP8_BLOCK128)
    with logged("moe_plugins.prepare_finalize.deepep_auto") as records:
        with installed("deep_ep"):
            ctx = cached_dist_context(layout)
            pf = get_backend("deepep_auto").build(ctx, DispatchConfig(
                cfg.num_experts, cfg.hidden, cfg.num_topk, 4 * capacity, cfg.dtype, quant,
                backend_options=DeepEPAutoOptions(ll_max_tokens_per_rank=capacity)))
            try:
                pf.post_init_setup(PackedScaleExperts())
                w = MoEWeights.random(cfg, 0)
                scales = {}
                for n in (capacity, capacity + 1):
                    x = demo_inputs(cfg, n, ctx.dp_rank, 0)
                    tw, ti = route(x, w.router, cfg.num_topk, cfg.renormalize)
                    prep = pf.prepare(x, tw, ti, quant)
                    pf.reset_call_state()  # abandoned alike on every rank
                    clear_group_faults(ctx.ep_group)
                    assert prep.x_sf is not None
                    scales[n] = (str(prep.x_sf.dtype), prep.x_sf.shape[-1])
                return dict(scales=scales, modes=dict(pf.stats.modes), logs=records)
            finally:
                pf.manager.destroy()


def refused_capture_then_eager(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                               num_tokens: int, seed: int = 0) -> dict:
    """deepep_ht asked to run while (as every rank sees it) a CUDA graph captures, then the
    same layer eagerly. The CPU has no capture: the backend's ``capturing`` is forced True for
    the first call only, so what is tested is the refusal's fault semantics, not capture
    detection (tests/gpu's EP matrix captures for real)."""
    import moe_plugins.prepare_finalize.deepep_ht as ht

    with installed("deep_ep"):
        layer = _layer("deepep_ht", layout, cfg, None, QuantSpec(), seed, 64, None)
        try:
            x = demo_inputs(cfg, num_tokens, layout.dp_rank(rank), seed)
            real, ht.capturing = ht.capturing, lambda: True
            try:
                layer(x)
            except RuntimeError as e:
                refusal = f"{type(e).__name__}: {e}"
            else:
                refusal = ""
            finally:
                ht.capturing = real
            out = layer(x)
        finally:
            layer.destroy()
    return dict(refusal=refusal, out=out)


def forget_faults(rank: int, world: int, layout: ParallelLayout) -> None:
    """After a call that every rank refused alike: forget the cached EP group's fault state."""
    from moe_plugins.faults import clear_group_faults

    clear_group_faults(cached_dist_context(layout).ep_group)


def run_ht_prepare(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
                   num_tokens: int, quant: QuantSpec, seed: int = 0) -> dict:
    """prepare (and a zero finalize) on the owned slice through ``backend`` ('deepep_ht' on the
    emulation, or 'torch'); what prepare handed the experts."""
    with installed("deep_ep"):
        ctx = cached_dist_context(layout)
        w = MoEWeights.random(cfg, seed)
        pf = get_backend(backend).build(ctx, DispatchConfig(cfg.num_experts, cfg.hidden,
                                                            cfg.num_topk, max(num_tokens, 1),
                                                            cfg.dtype, quant))
        try:
            x = demo_inputs(cfg, num_tokens, ctx.dp_rank, seed)
            tw, ti = route(x, w.router, cfg.num_topk, cfg.renormalize)
            owned = slice_owned(owned_rows(num_tokens, layout.tp, ctx.tp_rank), x, ti, tw)
            prep = pf.prepare(owned.hidden_states, owned.topk_weights, owned.topk_ids, quant)
            out = torch.empty_like(owned.hidden_states)
            pf.finalize(torch.zeros(prep.x.shape[0], cfg.hidden, dtype=cfg.dtype),
                        owned.topk_weights, owned.topk_ids, out)
            assert prep.expert_tokens_meta is not None
            return dict(x=prep.x, x_sf=prep.x_sf, ids=prep.topk_ids, weights=prep.topk_weights,
                        counts=prep.expert_tokens_meta.expert_num_tokens, finalized=out,
                        stats=dataclasses.asdict(pf.stats))
        finally:
            pf.reset_call_state()
            destroy = getattr(pf.manager, "destroy", None)
            if destroy is not None:
                destroy()


def build_ht(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
             options: Any = None) -> dict:
    """Build the backend on the emulation and report the buffer it made."""
    with installed("deep_ep"):
        pf = get_backend(backend).build(cached_dist_context(layout), DispatchConfig(
            cfg.num_experts, cfg.hidden, cfg.num_topk, 64, cfg.dtype, QuantSpec(),
            backend_options=options))
        try:
            b = pf.manager.buffer
            return dict(num_nvl_bytes=b.num_nvl_bytes, num_rdma_bytes=b.num_rdma_bytes,
                        low_latency_mode=b.low_latency_mode,
                        num_qps_per_rank=b.num_qps_per_rank, use_fabric=b.use_fabric)
        finally:
            pf.manager.destroy()


def measure_deepep_layer(rank: int, world: int, *args: Any, **kwargs: Any) -> dict:
    """:func:`plan_rank_fns.measure_layer` on the emulated deep_ep."""
    from tests.planner.plan_ranks import measure_layer

    with installed("deep_ep"):
        return measure_layer(rank, world, *args, **kwargs)


def demo_rank(rank: int, world: int, *args: Any) -> dict:
    """The CPU demo's rank function (:func:`moe_plugins.runner.demo._demo_rank`) on the emulation."""
    from moe_plugins.runner.demo import _demo_rank

    with installed("deep_ep"):
        return _demo_rank(rank, world, *args)


def raw_normal_mode(rank: int, world: int, num_tokens: int, num_experts: int, hidden: int,
                    num_topk: int) -> dict:
    """DeepEP's own intranode test pattern (tests/test_intranode.py), on the emulated Buffer:
    rows of value `rank`, layout, dispatch (async, cached, num_worst_tokens), combine."""
    import torch.distributed as dist

    with installed("deep_ep"):
        import deep_ep

        g = torch.Generator().manual_seed(rank)
        scores = torch.rand(num_tokens, num_experts, generator=g) + 1
        topk_idx = torch.topk(scores, num_topk, dim=-1, sorted=False)[1].to(deep_ep.topk_idx_t)
        topk_idx[0, 0] = -1 if num_tokens else 0  # -1 selects nothing
        x = torch.full((num_tokens, hidden), float(rank), dtype=torch.bfloat16)
        topk_weights = torch.full((num_tokens, num_topk), float(rank))
        bytes_ = max(c.get_nvl_buffer_size_hint(hidden * 2, world)
                     for c in (deep_ep.Buffer.get_dispatch_config(world),
                               deep_ep.Buffer.get_combine_config(world)))
        buffer = deep_ep.Buffer(dist.group.WORLD, bytes_, 0, explicitly_destroy=True)
        try:
            per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx,
                                                                                    num_experts)
            args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                        topk_weights=topk_weights)
            recv_x, recv_ids, recv_w, counts, handle, event = buffer.dispatch(
                x, async_finish=True, **args)
            poisoned = bool(torch.isnan(recv_x.float()).all()) if recv_x.numel() else True
            event.current_stream_wait()
            worst = buffer.dispatch(x, num_worst_tokens=num_tokens * world, **args)
            cached = buffer.dispatch(x, handle=handle)[0]
            combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
            aligned = buffer.dispatch(x, expert_alignment=4, **args)[3]
            try:
                buffer.dispatch(x.float(), **args)  # fp32 rows of 8 values: allowed by dispatch
                buffer.combine(recv_x.float(), handle)  # the combine is bf16 only
                combine_error = None
            except RuntimeError as e:
                combine_error = str(e)
            return dict(topk_idx=topk_idx, per_rank=per_rank, per_rdma=per_rdma,
                        per_expert=per_expert, in_rank=in_rank, recv_x=recv_x, recv_ids=recv_ids,
                        recv_w=recv_w, counts=counts, rank_prefix=handle[0], poisoned=poisoned,
                        worst=worst[:4], cached=cached, combined=combined, combined_w=combined_w,
                        aligned=aligned, combine_error=combine_error)
        finally:
            buffer.destroy()


def auto_choice_without_a_peer(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                               absent_rank: int, timeout_s: float) -> dict:
    """deepep_auto without a hint: every rank but ``absent_rank`` calls the layer, whose mode
    choice all-reduces the token counts over the EP group (a group of ``timeout_s``); the absent
    rank returns at once. Returns (error type, message, seconds) of the call."""
    from moe_plugins.all2all.deepep_auto import DeepEPAutoOptions
    from moe_plugins.groups import make_dist_context
    from tests.runner.faults_ranks import _error

    with installed("deep_ep"):
        ctx = make_dist_context(layout, timeout_s=timeout_s, fresh_ep_group=True)
        layer = MoELayer(MoEWeights.random(cfg, 0), ctx, get_backend("deepep_auto"), None,
                         QuantSpec(), OverlapConfig(overlap=False), max_tokens_per_rank=64,
                         backend_options=DeepEPAutoOptions(ll_max_tokens_per_rank=8))
        if rank == absent_rank:
            return dict(error=(None, None, 0.0))
        return dict(error=_error(lambda: layer(demo_inputs(cfg, 4, layout.dp_rank(rank), 0))))


def deterministic_layer_call(rank: int, world: int, *args: Any) -> tuple[str, str]:
    """:func:`run_ht_layer` under torch.use_deterministic_algorithms(True) (restored after);
    returns the error it raised (type, message). Every rank refused the same call: the group's
    fault state is forgotten after."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        run_ht_layer(rank, world, *args)
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)
    finally:
        torch.use_deterministic_algorithms(before)
        forget_faults(rank, world, args[1])
    raise AssertionError("the call ran")


def build_auto_per_rank(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                        options: list[dict]) -> dict:
    """Build a deepep_auto layer with ``options[rank]`` (DeepEPAutoOptions fields; each rank its
    own) on the emulated deep_ep: its threshold, or the error its construction raised."""
    from moe_plugins.all2all.deepep_auto import DeepEPAutoOptions

    with installed("deep_ep"):
        try:
            layer = _layer("deepep_auto", layout, cfg, None, QuantSpec(), 0, 64,
                           DeepEPAutoOptions(**options[rank]))
        except ValueError as e:
            return dict(error=str(e))
        try:
            return dict(threshold=layer.pf.threshold)  # type: ignore[union-attr]
        finally:
            layer.destroy()
