"""Rank functions of test_vllm_faults: vLLM's own modular kernel with our prepare/finalize, one
rank refusing its inputs at the adapter's checks (gloo CPU ranks; imported only by tests that
skip without vLLM)."""
from __future__ import annotations

import contextlib
from typing import Any, Optional

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


class _AdaptedKernel:
    """vLLM's FusedMoEKernel over our adapter on a new EP group with a short timeout (the
    emulated library for the DeepEP and NIXL EP backends: the caller installs it), then vLLM's
    runner reduction; one rank's experts, routing and inputs of ``tokens`` demo tokens."""

    def __init__(self, rank: int, backend_name: str, layout: ParallelLayout, cfg: MoEConfig,
                 strategy: ReductionStrategy, tokens: int, timeout_s: float) -> None:
        from tests.backends.low_latency_ranks import make_options

        options = make_options(backend_name) if backend_name in ("deepep_ll", "nixl_ep") else None
        self.ctx = ctx = make_dist_context(layout, timeout_s=timeout_s, fresh_ep_group=True)
        dispatch = DispatchConfig(cfg.num_experts, cfg.hidden, cfg.num_topk, 64, cfg.dtype,
                                  backend_options=options)
        self.backend = get_backend(backend_name).build(ctx, dispatch)
        self.pf = MoEPluginsPrepareAndFinalize(self.backend, backend_name, ctx,
                                               StrategyChoice(strategy, "test"),
                                               OverlapConfig(overlap=False), cfg.num_experts,
                                               QuantScheme.NONE)
        self.kernel = _kernel(self.pf, _moe_config(cfg, layout, rank))
        self.cfg, self.layout = cfg, layout
        self.weights = MoEWeights.random(cfg, 0)
        self.local = self.weights.local_experts(layout.ep_size, rank)
        self.x = demo_inputs(cfg, tokens, ctx.dp_rank, 0)
        self.topk_weights, self.topk_ids = route(self.x, self.weights.router, cfg.num_topk,
                                                 cfg.renormalize)
        self.expert_map = contiguous_expert_map(cfg.num_experts, layout.ep_size, rank)

    def __call__(self, tw: Optional[torch.Tensor] = None, ti: Optional[torch.Tensor] = None,
                 emap: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One call (the rank's own routing and expert_map unless given); the reduced output."""
        ti = self.topk_ids if ti is None else ti
        routed = self.kernel.apply(
            hidden_states=self.x, w1=self.local.w13, w2=self.local.w2,
            topk_weights=self.topk_weights if tw is None else tw,
            topk_ids=ti.to(self.pf.topk_indices_dtype() or torch.int32),
            activation=MoEActivation.SILU, global_num_experts=self.cfg.num_experts,
            expert_map=self.expert_map if emap is None else emap,
            apply_router_weight_on_input=False)
        return _runner_reduce(self.kernel, routed, self.x, self.weights, self.layout)

    def close(self) -> None:
        self.backend.reset_call_state()
        destroy: Any = getattr(self.backend.manager, "destroy", None)
        if destroy is not None:
            destroy()


def _no_bound_set() -> None:
    """Clear the call bound's variables (a pool's process may have set them for an earlier
    test): the adapter runs under the backstop."""
    import os

    from moe_plugins.callbound import reread_environment

    for name in ("MOE_PLUGINS_CALL_TIMEOUT_S", "MOE_PLUGINS_FIRST_CALL_TIMEOUT_S"):
        os.environ.pop(name, None)
    reread_environment()


def refused_kernel_call(rank: int, world: int, backend_name: str, layout: ParallelLayout,
                        cfg: MoEConfig, strategy: ReductionStrategy, bad_rank: int, kind: str,
                        tokens: int, timeout_s: float) -> dict:
    """:class:`_AdaptedKernel` (the emulated library for the low-latency backends).
    ``bad_rank`` calls it with inputs the adapter refuses: ``tokens`` (routing for one token
    fewer than the activations: the token-ownership check) or ``expert_map`` (a map of the
    wrong size: the placement check). Then every rank calls it with good inputs. Returns each
    call's (error type, message, seconds) and outputs, and the adapter's call bound as its INFO
    line says it (no bound set)."""
    from tests.backends.low_latency_ranks import vendor_module
    from tests.emulation import installed

    _no_bound_set()
    low_latency = backend_name in ("deepep_ll", "nixl_ep")
    with installed(vendor_module(backend_name)) if low_latency else contextlib.nullcontext():
        kernel = _AdaptedKernel(rank, backend_name, layout, cfg, strategy, tokens, timeout_s)
        outs: list[torch.Tensor] = []
        tw, ti, emap = kernel.topk_weights, kernel.topk_ids, kernel.expert_map
        if rank == bad_rank and kind == "tokens":
            tw, ti = tw[:-1], ti[:-1]
        elif rank == bad_rank and kind == "expert_map":
            emap = emap[:-1]
        try:
            first = _error(lambda: outs.append(kernel(tw, ti, emap)))
            second = _error(lambda: outs.append(kernel()))
        finally:
            kernel.close()
        pf = kernel.pf
        return dict(first=first, second=second, outs=outs, broken=pf.faults.broken,
                    out=outs[-1] if second[0] is None else None, bound=pf._guard.describe())


def peer_lost_kernel_call(rank: int, world: int, backend_name: str, fault: str, victim: int,
                          library_timeout_s: float) -> dict:
    """:class:`_AdaptedKernel` at dp ``world`` on the emulated DeepEP built with its own
    timeout ``library_timeout_s`` (its host waits raise there; the build record of
    scripts/deepep/build.sh), no call bound set (the backstop, past that timeout). Call 1 on
    every rank; then in call 2 the victim ``fault``s: "sit_out" (alive, asleep past the
    library's timeout instead of its call 2: its peers wait in the library) or "kill" (its
    process SIGKILLed between its dispatch and its combine: its peers wait in the combine).
    Reported by each survivor (``result`` of tests.gpu.ep_harness): call 1's output, call 2's
    error (type, text, its cause's type, seconds from the start of the call)."""
    import os
    import signal
    import time

    import tests.emulation._ht_kernels as ht_kernels
    from tests.emulation import installed
    from tests.gpu.ep_harness import result, step
    from tests.runner.watchdog_ranks import deepep_build

    _no_bound_set()
    ht_kernels.NUM_CPU_TIMEOUT_SECS = library_timeout_s  # (this process's alone)
    layout = ParallelLayout(world, 1, True)
    cfg = MoEConfig(hidden=128, num_experts=8, num_topk=2, intermediate=32,
                    shared_intermediate=64, dtype=torch.bfloat16)
    with installed("deep_ep", deep_ep_build=deepep_build(library_timeout_s)):
        kernel = _AdaptedKernel(rank, backend_name, layout, cfg, ReductionStrategy.LOCAL, 6,
                                60.0)
        step("call 1")
        out = kernel()
        if rank != victim:  # (a tensor is fetched from its process: a killed one has none)
            result({"call": 1, "out": out})
        step("call 2")
        if rank == victim and fault == "sit_out":
            time.sleep(library_timeout_s + 3.0)
            return {"sat out": 2}
        if rank == victim:
            def die(*args: Any, **kwargs: Any) -> Any:
                os.kill(os.getpid(), signal.SIGKILL)
            kernel.pf.finalize = die  # type: ignore[method-assign]
        t0 = time.monotonic()
        try:
            kernel()
            result({"call": 2, "type": None})
        except Exception as e:
            result({"call": 2, "type": type(e).__name__, "error": str(e),
                    "cause": type(e.__cause__).__name__, "seconds": time.monotonic() - t0})
        return {"returned": True}


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
