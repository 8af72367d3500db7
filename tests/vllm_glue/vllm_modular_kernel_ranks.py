"""Rank functions for vLLM's own modular kernel with our prepare/finalize (gloo CPU ranks).

Imported only by tests that skip without vLLM. Each rank builds vLLM's ``FusedMoEKernel`` from
our :class:`MoEPluginsPrepareAndFinalize` and :class:`TorchExpertsModular` (a small torch experts
implementation that honours ``expert_map`` like vLLM's GPU experts), runs it, and then reduces
exactly as vLLM's MoE runner does for the reported ``output_is_reduced()``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                         FusedMoEQuantConfig, RoutingMethodType)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceDelegate, TopKWeightAndReduceNoOP)

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


class TorchExpertsModular(mk.FusedMoEExpertsModular):
    """Unquantized SwiGLU experts in float32 torch, on the tokens' device. Takes GLOBAL topk ids
    and maps them with ``expert_map`` (vLLM's convention); writes the router-weighted sum over
    this rank's experts (so finalize's weight-and-reduce is a no-op)."""

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return True

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key: Any, activation_key: Any) -> bool:
        return (weight_key, activation_key) == (None, None)

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        return True

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, global_num_experts: int,
                         local_num_experts: int, expert_tokens_meta: Any,
                         activation: MoEActivation) -> tuple[tuple[int, ...], ...]:
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: MoEActivation, global_num_experts: int,
              expert_map: Optional[torch.Tensor], a1q_scale: Optional[torch.Tensor],
              a2_scale: Optional[torch.Tensor], workspace13: torch.Tensor,
              workspace2: torch.Tensor, expert_tokens_meta: Any,
              apply_router_weight_on_input: bool) -> None:
        assert a1q_scale is None
        ids = topk_ids.long()
        if expert_map is not None:  # -1 (no expert) stays -1
            ids = torch.where(ids >= 0, expert_map[ids.clamp(min=0)].long(), -1)
        x = hidden_states.float()
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        # every local expert on every row, weighted by the row's router weight for it (0 where
        # not routed): no data-dependent shapes, so no host sync (a CUDA graph can capture it)
        for e in range(w1.shape[0]):
            w = (topk_weights.float() * (ids == e)).sum(dim=1)
            g, u = (x @ w1[e].float().t()).chunk(2, dim=-1)
            acc += ((F.silu(g) * u) @ w2[e].float().t()) * w[:, None]
        output.copy_(acc.to(output.dtype))


class TorchBatchedExpertsModular(TorchExpertsModular):
    """Batched-format experts: x [num_local_experts, max_recv_tokens, hidden] with a count per
    expert; writes UNWEIGHTED outputs in the same layout and leaves weighting to the
    prepare/finalize (TopKWeightAndReduceDelegate), as vLLM's BatchedTritonExperts do."""

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.BatchedExperts

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, global_num_experts: int,
                         local_num_experts: int, expert_tokens_meta: Any,
                         activation: MoEActivation) -> tuple[tuple[int, ...], ...]:
        assert self.max_num_tokens is not None and self.num_dispatchers is not None
        return (0,), (0,), (local_num_experts, self.max_num_tokens * self.num_dispatchers, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceDelegate()

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: MoEActivation, global_num_experts: int,
              expert_map: Optional[torch.Tensor], a1q_scale: Optional[torch.Tensor],
              a2_scale: Optional[torch.Tensor], workspace13: torch.Tensor,
              workspace2: torch.Tensor, expert_tokens_meta: Any,
              apply_router_weight_on_input: bool) -> None:
        assert a1q_scale is None and expert_tokens_meta is not None
        output.zero_()
        for e, n in enumerate(expert_tokens_meta.expert_num_tokens.tolist()):
            if n:
                g, u = (hidden_states[e, :n].float() @ w1[e].float().t()).chunk(2, dim=-1)
                output[e, :n] = ((F.silu(g) * u) @ w2[e].float().t()).to(output.dtype)


def _moe_config(cfg: MoEConfig, layout: ParallelLayout, rank: int,
                num_physical: Optional[int] = None) -> FusedMoEConfig:
    parallel = FusedMoEParallelConfig(
        tp_size=1, tp_rank=0, pcp_size=1, pcp_rank=0, dp_size=layout.dp,
        dp_rank=layout.dp_rank(rank), ep_size=layout.world_size, ep_rank=rank,
        sp_size=1, use_ep=True, all2all_backend="moe_plugins_torch", enable_eplb=False)
    e = num_physical or cfg.num_experts
    return FusedMoEConfig(
        num_experts=e, experts_per_token=cfg.num_topk, hidden_dim=cfg.hidden,
        intermediate_size=cfg.intermediate, num_local_experts=e // layout.world_size,
        num_logical_experts=cfg.num_experts, activation=MoEActivation.SILU, device="cpu",
        routing_method=RoutingMethodType.Renormalize, moe_parallel_config=parallel,
        in_dtype=cfg.dtype, max_num_tokens=64)


def contiguous_expert_map(num_experts: int, ep_size: int, rank: int) -> torch.Tensor:
    """vLLM's 'linear' placement: int32 [num_experts], local index or -1."""
    per = num_experts // ep_size
    m = torch.full((num_experts,), -1, dtype=torch.int32)
    m[rank * per:(rank + 1) * per] = torch.arange(per, dtype=torch.int32)
    return m


def run_vllm_kernel(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                    strategy: ReductionStrategy, num_tokens: int, overlap: bool,
                    seed: int = 0, expert_map: Optional[torch.Tensor] = None,
                    batched: bool = False, weight_on_input: bool = False,
                    backend_name: str = "torch", backend_options: Any = None,
                    in_tree_pf: Any = None) -> dict:
    """vLLM's FusedMoEKernel with our prepare/finalize on this rank, then the runner's reduction:
    ``output_is_reduced()`` False -> all_reduce(shared partial + routed) over TP; True -> routed +
    all_reduce(shared partial). Returns the layer output and what ran. ``batched``: the batched
    torch test backend; ``weight_on_input``: vLLM's ``apply_router_weight_on_input``;
    ``backend_name``: the registered backend under the adapter; ``in_tree_pf(ctx, moe)``: build a
    vLLM in-tree prepare/finalize instead of ours."""
    ctx = cached_dist_context(layout)
    backend = None
    if strategy.dispatches:
        from moe_plugins.config import DispatchConfig

        dispatch = DispatchConfig(cfg.num_experts, cfg.hidden, cfg.num_topk, max(num_tokens, 1),
                                  cfg.dtype, backend_options=backend_options)
        if batched:
            from moe_plugins.all2all.torch import TorchAll2AllManager
            from tests.vllm_glue.batched_backend import BatchedTorchPrepareFinalize

            backend = BatchedTorchPrepareFinalize(TorchAll2AllManager(ctx, dispatch), dispatch)
        else:
            backend = get_backend(backend_name).build(ctx, dispatch)
    try:
        return _run_kernel(rank, layout, cfg, strategy, num_tokens, overlap, seed, expert_map,
                           backend, weight_on_input, backend_name, in_tree_pf)
    finally:
        destroy = getattr(getattr(backend, "manager", None), "destroy", None)
        if destroy is not None:
            destroy()


def run_vllm_kernel_ll(rank: int, world: int, backend_name: str, layout: ParallelLayout,
                       cfg: MoEConfig, strategy: ReductionStrategy, num_tokens: int,
                       weight_on_input: bool = False) -> dict:
    """:func:`run_vllm_kernel` with a low-latency backend (deepep_ll, nixl_ep) built through
    the registry on the emulation of its vendor library (tests/emulation)."""
    from tests.emulation import installed
    from tests.backends.low_latency_ranks import make_options, vendor_module
    from moe_plugins.config import DispatchConfig

    with installed(vendor_module(backend_name)):
        ctx = cached_dist_context(layout)
        backend = get_backend(backend_name).build(ctx, DispatchConfig(
            cfg.num_experts, cfg.hidden, cfg.num_topk, max(num_tokens, 1), cfg.dtype,
            backend_options=make_options(backend_name)))
        try:
            return _run_kernel(rank, layout, cfg, strategy, num_tokens, True, 0, None, backend,
                               weight_on_input)
        finally:
            backend.reset_call_state()
            backend.manager.destroy()  # type: ignore[attr-defined]


def _run_kernel(rank: int, layout: ParallelLayout, cfg: MoEConfig, strategy: ReductionStrategy,
                num_tokens: int, overlap: bool, seed: int, expert_map: Optional[torch.Tensor],
                backend: Any, weight_on_input: bool, backend_name: str = "torch",
                in_tree_pf: Any = None) -> dict:
    ctx = cached_dist_context(layout)
    weights = MoEWeights.random(cfg, seed)
    local = weights.local_experts(layout.ep_size, rank)
    moe = _moe_config(cfg, layout, rank)
    pf = MoEPluginsPrepareAndFinalize(backend, backend_name, ctx, StrategyChoice(strategy, "test"),
                                      OverlapConfig(overlap=overlap), cfg.num_experts,
                                      QuantScheme.NONE)
    if in_tree_pf is not None:
        pf = in_tree_pf(ctx, moe)
    kernel = _kernel(pf, moe)

    x = demo_inputs(cfg, num_tokens, ctx.dp_rank, seed)
    topk_weights, topk_ids = route(x, weights.router, cfg.num_topk, cfg.renormalize)
    if expert_map is None:
        expert_map = contiguous_expert_map(cfg.num_experts, layout.ep_size, rank)
    routed = kernel.apply(hidden_states=x, w1=local.w13, w2=local.w2,
                          topk_weights=topk_weights,
                          topk_ids=topk_ids.to(pf.topk_indices_dtype() or torch.int32),
                          activation=MoEActivation.SILU, global_num_experts=cfg.num_experts,
                          expert_map=expert_map, apply_router_weight_on_input=weight_on_input)
    out = _runner_reduce(kernel, routed, x, weights, layout)
    stats = getattr(pf, "stats", None)
    # an in-tree prepare/finalize (in_tree_pf) has no calls, stats or batched flag
    return dict(out=out, output_is_reduced=kernel.output_is_reduced(),
                calls=getattr(pf, "calls", None), rows_sent=getattr(stats, "rows", None),
                modes=dict(getattr(stats, "modes", {}) or {}), async_=pf.supports_async(),
                batched=getattr(pf, "batched", False))


def _kernel(pf: MoEPluginsPrepareAndFinalize, moe: FusedMoEConfig) -> mk.FusedMoEKernel:
    """vLLM's FusedMoEKernel of ``pf`` and the torch experts of its activation format."""
    if getattr(pf, "batched", False):
        experts: TorchExpertsModular = TorchBatchedExpertsModular(
            moe, FusedMoEQuantConfig.make(), max_num_tokens=pf.max_num_tokens_per_rank(),
            num_dispatchers=pf.num_dispatchers())
    else:
        experts = TorchExpertsModular(moe, FusedMoEQuantConfig.make())
    return mk.FusedMoEKernel(pf, experts)


def _runner_reduce(kernel: mk.FusedMoEKernel, routed: torch.Tensor, x: torch.Tensor,
                   weights: MoEWeights, layout: ParallelLayout) -> torch.Tensor:
    """What vLLM's MoE runner does after the kernel: ``output_is_reduced()`` False ->
    all_reduce(shared partial + routed) over TP; True -> routed + all_reduce(shared partial)."""
    ctx = cached_dist_context(layout)
    shared_weights = weights.shared(layout.tp, ctx.tp_rank)
    shared = shared_weights(x) if shared_weights is not None else torch.zeros_like(x)
    if kernel.output_is_reduced():
        if layout.tp > 1:
            dist.all_reduce(shared, group=ctx.tp_group)
        return shared + routed
    out = shared + routed
    if layout.tp > 1:
        dist.all_reduce(out, group=ctx.tp_group)
    return out


def vllm_expert_map(num_experts: int, ep_size: int, rank: int, strategy: str) -> torch.Tensor:
    """vLLM's own expert_map for ``strategy`` ('linear' / 'round_robin'), from its
    determine_expert_map."""
    try:
        from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
    except ImportError:
        from vllm.model_executor.layers.fused_moe.layer import determine_expert_map
    _, expert_map, _ = determine_expert_map(ep_size, rank, num_experts, strategy)
    return expert_map


def vllm_round_robin_table(num_experts: int, ep_size: int) -> torch.Tensor:
    """vLLM's round-robin global_to_physical (ExpertMapManager's routing table, even split):
    logical g on rank g % ep_size, slot g // ep_size."""
    g = torch.arange(num_experts)
    return (g % ep_size) * (num_experts // ep_size) + g // ep_size


def run_vllm_kernel_placed(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                           strategy: ReductionStrategy, num_tokens: int, mode: str,
                           physical_to_logical: Optional[list[int]] = None,
                           backend_name: str = "torch", batched: bool = False) -> dict:
    """vLLM's FusedMoEKernel with our prepare/finalize under a non-linear placement, set up
    as vLLM sets it up. mode 'eplb': ``physical_to_logical`` (redundant copies), vLLM's linear
    expert_map over the physical ids, router ids mapped logical -> a physical replica here
    (replica (token * num_topk + k) % copies). 'round_robin' / 'round_robin_table': vLLM's
    round-robin expert_map over logical ids, with or without vLLM's routing table."""
    from moe_plugins.config import DispatchConfig

    ctx = cached_dist_context(layout)
    weights = MoEWeights.random(cfg, 0)
    x = demo_inputs(cfg, num_tokens, ctx.dp_rank, 0)
    topk_weights, topk_ids = route(x, weights.router, cfg.num_topk, cfg.renormalize)
    g2p = None
    if mode == "eplb":
        assert physical_to_logical is not None
        num_ids = len(physical_to_logical)
        expert_map = vllm_expert_map(num_ids, layout.ep_size, rank, "linear")
        per = num_ids // layout.ep_size
        held = physical_to_logical[rank * per:(rank + 1) * per]
        copies = [[p for p, e in enumerate(physical_to_logical) if e == le]
                  for le in range(cfg.num_experts)]
        ids = torch.tensor([[copies[int(e)][(t * cfg.num_topk + k) % len(copies[int(e)])]
                             for k, e in enumerate(row)] for t, row in enumerate(topk_ids)],
                           dtype=torch.int64).reshape(topk_ids.shape)
    else:
        num_ids = cfg.num_experts
        expert_map = vllm_expert_map(num_ids, layout.ep_size, rank, "round_robin")
        held = list(range(rank, num_ids, layout.ep_size))
        ids = topk_ids
        if mode == "round_robin_table":
            g2p = vllm_round_robin_table(num_ids, layout.ep_size)
    moe = _moe_config(cfg, layout, rank, num_ids)
    dispatch = DispatchConfig(num_ids, cfg.hidden, cfg.num_topk, max(num_tokens, 1), cfg.dtype)
    ctxm = contextlib.nullcontext()
    if backend_name != "torch":
        from tests.emulation import installed
        from tests.backends.low_latency_ranks import make_options, vendor_module

        ctxm = installed(vendor_module(backend_name))
        dispatch = DispatchConfig(num_ids, cfg.hidden, cfg.num_topk, max(num_tokens, 1),
                                  cfg.dtype, backend_options=make_options(backend_name))
    with ctxm:
        if batched and backend_name == "torch":
            from moe_plugins.all2all.torch import TorchAll2AllManager
            from tests.vllm_glue.batched_backend import BatchedTorchPrepareFinalize

            backend: Any = BatchedTorchPrepareFinalize(TorchAll2AllManager(ctx, dispatch), dispatch)
        else:
            backend = get_backend(backend_name).build(ctx, dispatch)
        try:
            pf = MoEPluginsPrepareAndFinalize(backend, backend_name, ctx,
                                              StrategyChoice(strategy, "test"),
                                              OverlapConfig(overlap=True), num_ids,
                                              QuantScheme.NONE, global_to_physical=g2p)
            kernel = _kernel(pf, moe)
            held_t = torch.tensor(held)
            routed = kernel.apply(hidden_states=x, w1=weights.w13[held_t], w2=weights.w2[held_t],
                                  topk_weights=topk_weights, topk_ids=ids.to(torch.int32),
                                  activation=MoEActivation.SILU, global_num_experts=num_ids,
                                  expert_map=expert_map, apply_router_weight_on_input=False)
            out = _runner_reduce(kernel, routed, x, weights, layout)
        finally:
            backend.reset_call_state()
            destroy = getattr(getattr(backend, "manager", None), "destroy", None)
            if destroy is not None and backend_name != "torch":
                destroy()
    return dict(out=out, expert_map=expert_map.tolist(), calls=pf.calls, batched=pf.batched)
