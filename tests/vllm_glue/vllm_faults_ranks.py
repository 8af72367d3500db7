"""Rank functions of test_vllm_faults: vLLM's own modular kernel with our prepare/finalize, one
rank refusing its inputs at the adapter's checks (gloo CPU ranks; imported only by tests that
skip without vLLM)."""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.activation import MoEActivation

from moe_plugins.config import DispatchConfig
from moe_plugins.groups import make_dist_context
from moe_plugins.layout import ParallelLayout
from moe_plugins.overlap import OverlapConfig
from moe_plugins.quant import QuantScheme
from moe_plugins.registry import get_backend
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights, route
from moe_plugins.strategy import ReductionStrategy, StrategyChoice
from moe_plugins.vllm.prepare_finalize import MoEPluginsPrepareAndFinalize
from tests.runner.faults_ranks import _error
from tests.vllm_glue.vllm_modular_kernel_ranks import (_kernel, _moe_config, _runner_reduce,
                                                       contiguous_expert_map)


def refused_kernel_call(rank: int, world: int, backend_name: str, layout: ParallelLayout,
                        cfg: MoEConfig, strategy: ReductionStrategy, bad_rank: int, kind: str,
                        tokens: int, timeout_s: float) -> dict:
    """vLLM's FusedMoEKernel over our adapter (new EP group with a short timeout; the emulated
    library for the low-latency backends), then vLLM's runner reduction. ``bad_rank`` calls it
    with inputs the adapter refuses: ``tokens`` (routing for one token fewer than the
    activations: the token-ownership check) or ``expert_map`` (a map of the wrong size: the
    placement check). Then every rank calls it with good inputs. Returns each call's (error
    type, message, seconds) and outputs, and the adapter's call bound as its INFO line says it
    (no bound set here: the environment's bound variables are cleared for the build)."""
    import os

    from moe_plugins.callbound import reread_environment
    from tests.backends.low_latency_ranks import make_options, vendor_module
    from tests.emulation import installed

    for name in ("MOE_PLUGINS_CALL_TIMEOUT_S", "MOE_PLUGINS_FIRST_CALL_TIMEOUT_S"):
        os.environ.pop(name, None)  # (a pool's process may have set them for an earlier test)
    reread_environment()

    low_latency = backend_name in ("deepep_ll", "nixl_ep")
    with installed(vendor_module(backend_name)) if low_latency else contextlib.nullcontext():
        ctx = make_dist_context(layout, timeout_s=timeout_s, fresh_ep_group=True)
        dispatch = DispatchConfig(cfg.num_experts, cfg.hidden, cfg.num_topk, 64, cfg.dtype,
                                  backend_options=make_options(backend_name) if low_latency
                                  else None)
        backend = get_backend(backend_name).build(ctx, dispatch)
        pf = MoEPluginsPrepareAndFinalize(backend, backend_name, ctx,
                                          StrategyChoice(strategy, "test"),
                                          OverlapConfig(overlap=False), cfg.num_experts,
                                          QuantScheme.NONE)
        kernel = _kernel(pf, _moe_config(cfg, layout, rank))
        weights = MoEWeights.random(cfg, 0)
        local = weights.local_experts(layout.ep_size, rank)
        x = demo_inputs(cfg, tokens, ctx.dp_rank, 0)
        topk_weights, topk_ids = route(x, weights.router, cfg.num_topk, cfg.renormalize)
        expert_map = contiguous_expert_map(cfg.num_experts, layout.ep_size, rank)
        outs: list[torch.Tensor] = []

        def call(tw: torch.Tensor, ti: torch.Tensor, emap: torch.Tensor) -> None:
            routed = kernel.apply(hidden_states=x, w1=local.w13, w2=local.w2, topk_weights=tw,
                                  topk_ids=ti.to(pf.topk_indices_dtype() or torch.int32),
                                  activation=MoEActivation.SILU,
                                  global_num_experts=cfg.num_experts, expert_map=emap,
                                  apply_router_weight_on_input=False)
            outs.append(_runner_reduce(kernel, routed, x, weights, layout))

        tw, ti, emap = topk_weights, topk_ids, expert_map
        if rank == bad_rank and kind == "tokens":
            tw, ti = topk_weights[:-1], topk_ids[:-1]
        elif rank == bad_rank and kind == "expert_map":
            emap = expert_map[:-1]
        try:
            first = _error(lambda: call(tw, ti, emap))
            second = _error(lambda: call(topk_weights, topk_ids, expert_map))
        finally:
            backend.reset_call_state()
            destroy: Any = getattr(backend.manager, "destroy", None)
            if destroy is not None:
                destroy()
        return dict(first=first, second=second, outs=outs, broken=pf.faults.broken,
                    out=outs[-1] if second[0] is None else None, bound=pf._guard.describe())


def hung_peer_kernel_call(rank: int, world: int, call_timeout_s: float, hang_s: float) -> dict:
    """vLLM's FusedMoEKernel over our adapter (torch backend, dp 2), rank 0 under the call
    watchdog (``$MOE_PLUGINS_CALL_TIMEOUT_S``, read when the adapter is built): call 1 on both
    ranks, then rank 1 hangs for ``hang_s`` instead of its call 2, so rank 0's call 2 waits in
    the backend's exchange. Rank 0's watchdog ends its process; each rank reports its steps."""
    import os
    import time

    from moe_plugins.callbound import reread_environment
    from tests.gpu.ep_harness import result, step

    if rank == 0:
        os.environ["MOE_PLUGINS_CALL_TIMEOUT_S"] = f"{call_timeout_s:g}"
        # call 2 would run under the start-up bound (a peer may still be in its first call):
        # here the first calls run under the call bound itself
        os.environ["MOE_PLUGINS_FIRST_CALL_TIMEOUT_S"] = "0"
    # read once per process: this pool's rank may have read them for an earlier test
    reread_environment()
    layout, cfg = ParallelLayout(world, 1, True), MoEConfig(
        hidden=128, num_experts=8, num_topk=2, intermediate=64, shared_intermediate=64)
    ctx = make_dist_context(layout, timeout_s=60.0, fresh_ep_group=True)
    backend = get_backend("torch").build(ctx, DispatchConfig(cfg.num_experts, cfg.hidden,
                                                              cfg.num_topk, 64, cfg.dtype))
    pf = MoEPluginsPrepareAndFinalize(backend, "torch", ctx,
                                      StrategyChoice(ReductionStrategy.LOCAL, "test"),
                                      OverlapConfig(overlap=False), cfg.num_experts,
                                      QuantScheme.NONE)
    kernel = _kernel(pf, _moe_config(cfg, layout, rank))
    weights = MoEWeights.random(cfg, 0)
    local = weights.local_experts(layout.ep_size, rank)
    x = demo_inputs(cfg, 5, ctx.dp_rank, 0)
    topk_weights, topk_ids = route(x, weights.router, cfg.num_topk, cfg.renormalize)

    def call() -> torch.Tensor:
        routed = kernel.apply(hidden_states=x, w1=local.w13, w2=local.w2,
                              topk_weights=topk_weights,
                              topk_ids=topk_ids.to(pf.topk_indices_dtype() or torch.int32),
                              activation=MoEActivation.SILU, global_num_experts=cfg.num_experts,
                              expert_map=contiguous_expert_map(cfg.num_experts, world, rank),
                              apply_router_weight_on_input=False)
        return _runner_reduce(kernel, routed, x, weights, layout)

    step("call 1")
    result({"call": 1, "out": call()})
    step("call 2")
    if rank == 1:
        time.sleep(hang_s)
        return {"hung": hang_s}
    from moe_plugins.callbound import on_call_timeout

    t0 = time.monotonic()  # this rank's own clock: when the watchdog ends it, how long call 2 ran
    on_call_timeout(lambda e: result({"call": 2, "seconds": time.monotonic() - t0}))
    call()
    return {"returned": True}
