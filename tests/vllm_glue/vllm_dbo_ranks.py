"""Rank functions for vLLM's dual-batch overlap (DBO) through our prepare/finalize, and for the
fault-tolerance polls of our all2all manager (gloo CPU ranks, emulated vendor libraries).

DBO: vLLM's ``FusedMoEKernel`` over our adapter with a low-latency backend (one backend object
per micro-batch on one manager), the layer's tokens split in two micro-batches as vLLM's
ubatch slicing splits them, run either on vLLM's own ubatch contexts (two threads handing over
at vLLM's ``dbo_yield``, :mod:`micro_batches`) or one after the other without DBO.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig

from tests.emulation import installed
from tests.backends.low_latency_ranks import make_options, vendor_module
from tests.vllm_glue.micro_batches import run_micro_batches
from moe_plugins.config import DispatchConfig
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.groups import cached_dist_context
from moe_plugins.layout import ParallelLayout
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights, route
from moe_plugins.overlap import OverlapConfig
from moe_plugins.quant import QuantScheme
from moe_plugins.registry import get_backend
from moe_plugins.strategy import ReductionStrategy, StrategyChoice
from moe_plugins.vllm.prepare_finalize import MoEPluginsPrepareAndFinalize
from tests.vllm_glue.vllm_modular_kernel_ranks import (TorchBatchedExpertsModular, _moe_config, _runner_reduce,
                            contiguous_expert_map)


def _split(num_tokens: int) -> list[slice]:
    """vLLM's two micro-batches of a batch: the first half (rounded up), then the rest."""
    half = (num_tokens + 1) // 2
    return [slice(0, half), slice(half, num_tokens)]


def run_dbo_kernel(rank: int, world: int, backend_name: str, layout: ParallelLayout,
                   cfg: MoEConfig, strategy: ReductionStrategy, num_tokens: int, dbo: bool,
                   overlap: bool = True, in_tree: bool = False, seed: int = 0) -> dict:
    """One MoE layer call of ``num_tokens`` tokens per DP rank as two micro-batches through
    vLLM's FusedMoEKernel. ``dbo``: on vLLM's ubatch contexts (interleaved); else one after the
    other on this thread. ``in_tree``: vLLM's own DeepEPLLPrepareAndFinalize on our manager's
    buffer instead of our adapter (deepep_ll, LOCAL only). Returns the layer output (both
    micro-batches, in token order, after the runner's TP reduction) and what ran."""
    with installed(vendor_module(backend_name)):
        ctx = cached_dist_context(layout)
        spec = get_backend(backend_name)
        dispatch = DispatchConfig(cfg.num_experts, cfg.hidden, cfg.num_topk,
                                  max(num_tokens, 1), cfg.dtype,
                                  backend_options=make_options(backend_name))
        backend = spec.build(ctx, dispatch)
        # micro-batch 1's object, on the same manager and library buffer
        second = spec.prepare_finalize(backend.manager, dispatch)  # type: ignore[attr-defined]
        runtime = backend.manager.buffer.runtime  # type: ignore[attr-defined]
        try:
            if in_tree:
                from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import (
                    DeepEPLLPrepareAndFinalize)

                pf: mk.FusedMoEPrepareAndFinalizeModular = DeepEPLLPrepareAndFinalize(
                    backend.manager.buffer, max_tokens_per_rank=backend.max_num_tokens_per_rank(),
                    num_dispatchers=world, use_fp8_dispatch=False)
            else:
                pf = MoEPluginsPrepareAndFinalize(
                    backend, backend_name, ctx, StrategyChoice(strategy, "test"),
                    OverlapConfig(overlap=overlap), cfg.num_experts, QuantScheme.NONE,
                    micro_batch_backends=[second])
            moe = _moe_config(cfg, layout, rank)
            experts = TorchBatchedExpertsModular(
                moe, FusedMoEQuantConfig.make(), max_num_tokens=pf.max_num_tokens_per_rank(),
                num_dispatchers=pf.num_dispatchers())
            kernel = mk.FusedMoEKernel(pf, experts)
            weights = MoEWeights.random(cfg, seed)
            local = weights.local_experts(layout.ep_size, rank)
            x = demo_inputs(cfg, num_tokens, ctx.dp_rank, seed)
            topk_weights, topk_ids = route(x, weights.router, cfg.num_topk, cfg.renormalize)
            expert_map = contiguous_expert_map(cfg.num_experts, layout.ep_size, rank)
            peak = [0]

            def micro_batch(part: slice) -> Callable[[], torch.Tensor]:
                def run() -> torch.Tensor:
                    out = kernel.apply(
                        hidden_states=x[part], w1=local.w13, w2=local.w2,
                        topk_weights=topk_weights[part],
                        # as vLLM's router hands them: the class's index dtype, else int32
                        topk_ids=topk_ids[part].to(pf.topk_indices_dtype() or torch.int32),
                        activation=MoEActivation.SILU,
                        global_num_experts=cfg.num_experts, expert_map=expert_map,
                        apply_router_weight_on_input=False)
                    peak[0] = max(peak[0], runtime.pending_receives)
                    return out
                return run

            fns = [micro_batch(p) for p in _split(num_tokens)]
            routed = run_micro_batches(fns) if dbo else [fn() for fn in fns]
            outs = [_runner_reduce(kernel, r, x[p], weights, layout)
                    for p, r in zip(_split(num_tokens), routed)]
            return dict(out=torch.cat(outs), calls=getattr(pf, "calls", None),
                        dispatches=None if in_tree else pf.stats.calls,  # type: ignore[attr-defined]
                        pending_after=runtime.pending_receives,
                        async_=pf.supports_async())
        finally:
            for b in (backend, second):
                b.reset_call_state()
            backend.manager.destroy()  # type: ignore[attr-defined]


def interleaved_prepares_on_one_slot(rank: int, world: int, backend_name: str,
                                     cfg: MoEConfig) -> None:
    """Two micro-batches on an adapter built with ONE call slot: the second micro-batch's
    prepare must be refused with the adapter's error (never run on micro-batch 0's state)."""
    layout = ParallelLayout(world, 1, True)
    with installed(vendor_module(backend_name)):
        ctx = cached_dist_context(layout)
        dispatch = DispatchConfig(cfg.num_experts, cfg.hidden, cfg.num_topk, 4, cfg.dtype,
                                  backend_options=make_options(backend_name))
        backend = get_backend(backend_name).build(ctx, dispatch)
        try:
            pf = MoEPluginsPrepareAndFinalize(
                backend, backend_name, ctx, StrategyChoice(ReductionStrategy.LOCAL, "test"),
                OverlapConfig(), cfg.num_experts, QuantScheme.NONE)
            assert not pf.supports_dbo()
            x = demo_inputs(cfg, 2, rank, 0)
            w, ids = route(x, MoEWeights.random(cfg, 0).router, cfg.num_topk, cfg.renormalize)
            expert_map = contiguous_expert_map(cfg.num_experts, world, rank)

            def prepare() -> None:
                pf.prepare_async(x, w, ids, cfg.num_experts, expert_map, False, None, False)

            run_micro_batches([lambda: None, prepare])
        finally:
            backend.reset_call_state()
            backend.manager.destroy()  # type: ignore[attr-defined]


# -- fault tolerance ----------------------------------------------------------------------------
def run_fault_tolerance(rank: int, world: int, backend_name: str, cfg: MoEConfig,
                        num_tokens: int, dead: int, enable_fault_tolerance: bool = True) -> dict:
    """Our all2all manager of vLLM's EP group (``--enable-fault-tolerance`` as given; EP over
    ``world`` ranks, TP-shaped: vLLM's DP needs one engine per DP rank), a layer's backend built
    through it exactly as the glue builds it (no backend options: the manager's engine options),
    three forwards: all ranks live; after the library masked rank ``dead`` on every other rank
    (what its timeout does; here through the library's own mask call); after vLLM's recovery
    (``clean_buffers`` on every rank); then vLLM 0.34's sentinel masks rank ``dead`` again
    through the manager (``update_mask`` on every other rank) and takes it back. Returns the
    outputs and the manager's answers to vLLM's polls."""
    from moe_plugins.runner.experts import TorchExperts
    from moe_plugins.quant import QuantSpec
    from moe_plugins.vllm.manager import ep_manager
    from tests.vllm_glue.vllm_dist import vllm_parallel_state

    layout = ParallelLayout(world, 1, True)
    with installed(vendor_module(backend_name)), vllm_parallel_state(
            rank, world, world, "moe_plugins_" + backend_name,
            enable_fault_tolerance=enable_fault_tolerance):
        manager = ep_manager()
        backend = manager.build(get_backend(backend_name), cached_dist_context(layout),
                                DispatchConfig(cfg.num_experts, cfg.hidden, cfg.num_topk,
                                               num_tokens, cfg.dtype))
        try:
            weights = MoEWeights.random(cfg, 0)
            experts = TorchExperts(weights.local_experts(world, rank), QuantSpec(), cfg.dtype)
            x = demo_inputs(cfg, num_tokens, rank, 0)
            w, ids = route(x, weights.router, cfg.num_topk, cfg.renormalize)

            def forward() -> torch.Tensor:
                prep = backend.prepare(x, w, ids, QuantSpec())
                return backend.finalize(experts.apply(prep), w, ids, torch.empty_like(x))

            lib_manager = backend.manager  # type: ignore[attr-defined]
            polls: dict[str, Any] = dict(
                supports=manager.support_fault_tolerance,
                enable_shrink=getattr(lib_manager.options, "enable_shrink", None),
                can_mask=lib_manager.can_mask())
            if not polls["can_mask"]:
                return polls
            full = forward()
            polls["fault_before"] = bool(manager.query_fault())
            if rank != dead:
                getattr(lib_manager.buffer, lib_manager.update_mask_method)(dead, True)
            polls["fault_after_mask"] = bool(manager.query_fault())
            polls["mask"] = manager.query_active_mask().tolist()
            masked = forward()
            manager.clean_buffers()
            rdma = lib_rdma(backend)
            polls["rdma_zeroed"] = rdma is not None and bool((rdma == 0).all())
            polls["fault_after_clean"] = bool(manager.query_fault())
            polls["mask_after_clean"] = manager.query_active_mask().tolist()
            restored = forward()
            # vLLM 0.34's sentinel on a retry: after clean_buffers, every surviving rank masks
            # the dead one again (update_mask); then takes it back (masked=False)
            if rank != dead:
                manager.update_mask(dead, masked=True)
            polls["fault_after_update_mask"] = bool(manager.query_fault())
            polls["mask_after_update_mask"] = manager.query_active_mask().tolist()
            remasked = forward()
            if rank != dead:
                manager.update_mask(dead, masked=False)
            polls["fault_after_unmask"] = bool(manager.query_fault())
            unmasked = forward()
            return dict(full=full, masked=masked, restored=restored, remasked=remasked,
                        unmasked=unmasked, **polls)
        finally:
            backend.reset_call_state()
            manager.destroy()


def bad_update_masks_then_forward(rank: int, world: int, backend_name: str, cfg: MoEConfig,
                                  num_tokens: int) -> dict:
    """Our manager of vLLM's EP group under ``--enable-fault-tolerance`` with one layer's
    backend built through it; every bad mask request through ``update_mask``
    (low_latency_ranks.refused_masks: after each, the library's mask, the masks the manager
    replays to later layers and vLLM's poll), then a forward."""
    from moe_plugins.quant import QuantSpec
    from moe_plugins.runner.experts import TorchExperts
    from moe_plugins.vllm.manager import ep_manager
    from tests.backends.low_latency_ranks import refused_masks
    from tests.vllm_glue.vllm_dist import vllm_parallel_state

    layout = ParallelLayout(world, 1, True)
    with installed(vendor_module(backend_name)), vllm_parallel_state(
            rank, world, world, "moe_plugins_" + backend_name, enable_fault_tolerance=True):
        manager = ep_manager()
        backend = manager.build(get_backend(backend_name), cached_dist_context(layout),
                                DispatchConfig(cfg.num_experts, cfg.hidden, cfg.num_topk,
                                               num_tokens, cfg.dtype))
        try:
            def state() -> tuple:
                return (manager.query_active_mask().tolist(), dict(manager._masks),
                        bool(manager.query_fault()))

            before = state()
            refused = refused_masks(manager.update_mask, state)
            weights = MoEWeights.random(cfg, 0)
            experts = TorchExperts(weights.local_experts(world, rank), QuantSpec(), cfg.dtype)
            x = demo_inputs(cfg, num_tokens, rank, 0)
            w, ids = route(x, weights.router, cfg.num_topk, cfg.renormalize)
            prep = backend.prepare(x, w, ids, QuantSpec())
            out = backend.finalize(experts.apply(prep), w, ids, torch.empty_like(x))
            return dict(before=before, refused=refused, out=out)
        finally:
            backend.reset_call_state()
            manager.destroy()


def mask_before_the_layer(rank: int, world: int, backend_name: str, cfg: MoEConfig,
                          num_tokens: int, dead: int) -> dict:
    """vLLM 0.34's sentinel masks EP rank ``dead`` (``update_mask`` on every other rank) before
    any layer exists; then a layer's backend is built through our manager: its library mask,
    vLLM's poll and a forward (which must leave ``dead``'s experts out); then ``update_mask``
    takes the rank back and a second forward."""
    from moe_plugins.quant import QuantSpec
    from moe_plugins.runner.experts import TorchExperts
    from moe_plugins.vllm.manager import ep_manager
    from tests.vllm_glue.vllm_dist import vllm_parallel_state

    layout = ParallelLayout(world, 1, True)
    with installed(vendor_module(backend_name)), vllm_parallel_state(
            rank, world, world, "moe_plugins_" + backend_name, enable_fault_tolerance=True):
        manager = ep_manager()
        if rank != dead:
            manager.update_mask(dead, masked=True)
        mask_before = manager.query_active_mask().tolist()  # no layer: nothing to ask
        backend = manager.build(get_backend(backend_name), cached_dist_context(layout),
                                DispatchConfig(cfg.num_experts, cfg.hidden, cfg.num_topk,
                                               num_tokens, cfg.dtype))
        try:
            weights = MoEWeights.random(cfg, 0)
            experts = TorchExperts(weights.local_experts(world, rank), QuantSpec(), cfg.dtype)
            x = demo_inputs(cfg, num_tokens, rank, 0)
            w, ids = route(x, weights.router, cfg.num_topk, cfg.renormalize)

            def forward() -> torch.Tensor:
                prep = backend.prepare(x, w, ids, QuantSpec())
                return backend.finalize(experts.apply(prep), w, ids, torch.empty_like(x))

            lib_mask = backend.manager.masked_ranks()  # type: ignore[attr-defined]
            fault = bool(manager.query_fault())
            masked = forward()
            if rank != dead:
                manager.update_mask(dead, masked=False)
            unmasked = forward()
            return dict(mask_before=mask_before, lib_mask=lib_mask, fault=fault, masked=masked,
                        unmasked=unmasked)
        finally:
            backend.reset_call_state()
            manager.destroy()


def lib_rdma(backend: Any) -> Optional[torch.Tensor]:
    """The emulated library's RDMA bytes (what ``clean_buffers`` zeroes), if allocated."""
    return backend.manager.buffer.runtime.rdma_bytes
