"""Rank functions of test_vllm_wire_format: vLLM's ``FusedMoEKernel`` over a low-latency backend on the emulated library,
with OUR adapter or with vLLM's IN-TREE prepare/finalize class for the same library on the same
buffer and inputs (gloo CPU ranks; imported only by tests that skip without vLLM).

The experts are :class:`ScaleRecordingExperts`: batched-format experts that, like DeepGEMM's on
Blackwell, ask for FP8 activations with packed UE8M0 scales; they record what the
prepare/finalize handed them and compute the SwiGLU experts on the dequantized rows, so the
layer output can be checked against the single-process reference as well.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig

from tests.emulation import installed
from tests.backends.low_latency_ranks import built
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.groups import cached_dist_context
from moe_plugins.layout import ParallelLayout
from moe_plugins.lowlat.limits import dequantize_batched
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights, route
from moe_plugins.overlap import OverlapConfig
from moe_plugins.quant import QuantScheme, QuantSpec
from moe_plugins.strategy import ReductionStrategy, StrategyChoice
from moe_plugins.vllm.prepare_finalize import MoEPluginsPrepareAndFinalize
from tests.vllm_glue.vllm_modular_kernel_ranks import TorchBatchedExpertsModular, _moe_config, contiguous_expert_map


class ScaleRecordingExperts(TorchBatchedExpertsModular):
    """Batched experts that take FP8 block-128 activations and ask for packed UE8M0 scales
    (``supports_packed_ue8m0_act_scales``), recording ``hidden_states`` and ``a1q_scale``."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]] = []

    def supports_packed_ue8m0_act_scales(self) -> bool:
        return True

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: MoEActivation, global_num_experts: int,
              expert_map: Optional[torch.Tensor], a1q_scale: Optional[torch.Tensor],
              a2_scale: Optional[torch.Tensor], workspace13: torch.Tensor,
              workspace2: torch.Tensor, expert_tokens_meta: Any,
              apply_router_weight_on_input: bool) -> None:
        counts = expert_tokens_meta.expert_num_tokens
        self.seen.append((hidden_states.clone(), None if a1q_scale is None else a1q_scale.clone(),
                          counts.clone()))
        x = dequantize_batched(hidden_states, a1q_scale)
        output.zero_()
        for e, n in enumerate(counts.tolist()):
            if n:
                g, u = (x[e, :n] @ w1[e].float().t()).chunk(2, dim=-1)
                output[e, :n] = ((F.silu(g) * u) @ w2[e].float().t()).to(output.dtype)


def _in_tree_prepare_finalize(buffer: Any, max_tokens: int, world: int
                              ) -> mk.FusedMoEPrepareAndFinalizeModular:
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import (
        DeepEPLLPrepareAndFinalize)

    # What vLLM's maybe_make_prepare_finalize builds for FP8 block-128 experts.
    return DeepEPLLPrepareAndFinalize(buffer, max_tokens_per_rank=max_tokens,
                                      num_dispatchers=world, use_fp8_dispatch=True)


@contextmanager
def blocking_finalize_patch(on: bool) -> Iterator[None]:
    """The plugin's patch of vLLM's FusedMoEKernelModularImpl (moe_plugins.vllm.patches: kernels
    over our prepare/finalize combine blocking when no shared expert runs between) installed
    (``on``) or not for the block, whatever an earlier test in this rank process left."""
    from moe_plugins.vllm import patches

    symbol = patches.BLOCKING_FINALIZE
    was = symbol in patches.applied_symbols()
    if on != was:
        (patches.apply_patch if on else patches.revert_patch)(symbol)
    try:
        yield
    finally:
        if on != was:
            (patches.revert_patch if on else patches.apply_patch)(symbol)


class LaunchRecordingSharedExpert:
    """Stands for vLLM's SharedExperts in the kernel's call (a shared expert with no output):
    records the library's launches and pending receives when vLLM runs it."""

    def __init__(self, runtime: Any):
        self.runtime, self.seen = runtime, []

    def __call__(self, x: torch.Tensor, order: Any) -> None:
        self.seen.append((self.runtime.launches, self.runtime.pending_receives))


def run_ue8m0_kernel(rank: int, world: int, cfg: MoEConfig, num_tokens: int, in_tree: bool,
                     seed: int = 0, overlap: bool = False, patched: bool = False,
                     shared: bool = False) -> dict:
    """vLLM's FusedMoEKernel with FP8 block-128, UE8M0-asking experts over deepep_ll on the
    emulated DeepEP (EP over ``world`` DP ranks). ``in_tree``: vLLM's DeepEPLLPrepareAndFinalize
    on our manager's buffer; else our adapter (``overlap``: its shared-expert overlap setting,
    which makes vLLM take the async path). ``patched``: with the plugin's blocking-finalize
    patch; ``shared``: a shared expert in the call (:class:`LaunchRecordingSharedExpert`).
    Returns what the experts received, the routed output, the library's kernel launches during
    the layer call and what the shared expert saw."""
    with blocking_finalize_patch(patched):
        return _ue8m0_kernel(rank, world, cfg, num_tokens, in_tree, seed, overlap, shared)


def _ue8m0_kernel(rank: int, world: int, cfg: MoEConfig, num_tokens: int, in_tree: bool,
                  seed: int, overlap: bool, shared: bool) -> dict:
    layout = ParallelLayout(world, 1, True)
    quant = QuantSpec(QuantScheme.FP8_BLOCK128)
    with installed("deep_ep"), built("deepep_ll", layout, cfg, num_tokens, quant) as backend:
        ctx = cached_dist_context(layout)
        if in_tree:
            pf: mk.FusedMoEPrepareAndFinalizeModular = _in_tree_prepare_finalize(
                backend.manager.buffer, backend.manager.max_tokens_per_rank, world)
        else:
            pf = MoEPluginsPrepareAndFinalize(backend, "deepep_ll", ctx,
                                              StrategyChoice(ReductionStrategy.LOCAL, "test"),
                                              OverlapConfig(overlap=overlap), cfg.num_experts,
                                              QuantScheme.FP8_BLOCK128)
        qc = FusedMoEQuantConfig.make(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128])
        experts = ScaleRecordingExperts(_moe_config(cfg, layout, rank), qc,
                                        max_num_tokens=pf.max_num_tokens_per_rank(),
                                        num_dispatchers=pf.num_dispatchers())
        kernel = mk.FusedMoEKernel(pf, experts)  # calls pf.post_init_setup(experts)
        weights = MoEWeights.random(cfg, seed)
        local = weights.local_experts(layout.ep_size, rank)
        x = demo_inputs(cfg, num_tokens, rank, seed)
        topk_weights, topk_ids = route(x, weights.router, cfg.num_topk, cfg.renormalize)
        runtime = backend.manager.buffer.runtime
        shared_expert = LaunchRecordingSharedExpert(runtime) if shared else None
        start = runtime.launches
        routed = kernel.apply(hidden_states=x, w1=local.w13, w2=local.w2,
                              shared_experts=shared_expert,
                              shared_experts_input=x if shared else None,
                              topk_weights=topk_weights,
                              # as vLLM's router hands them: the class's index dtype, else int32
                              topk_ids=topk_ids.to(pf.topk_indices_dtype() or torch.int32),
                              activation=MoEActivation.SILU, global_num_experts=cfg.num_experts,
                              expert_map=contiguous_expert_map(cfg.num_experts, world, rank),
                              apply_router_weight_on_input=False)
        (recv_x, recv_sf, counts), = experts.seen
        return dict(x=recv_x.view(torch.uint8), x_sf=recv_sf, counts=counts, routed=routed,
                    launches=runtime.launches - start, async_=pf.supports_async(),
                    ids_dtype=pf.topk_indices_dtype(),
                    shared_saw=None if shared_expert is None else
                    [(n - start, pending) for n, pending in shared_expert.seen])
