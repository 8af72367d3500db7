"""Rank functions: one decoder layer's TP reductions and MoE block as vLLM 0.32 runs them, with
our prepare/finalize, on gloo CPU ranks (imported only by tests that skip without vLLM).

Real vLLM throughout where it decides or reduces: vLLM's process groups over DP x TP ranks
(``vllm_parallel_state`` with ``data_parallel_size``; the EP group's communicator gets our
all2all manager from the patched hook), ``ParallelConfig.use_sequence_parallel_moe`` (our hook),
``FusedMoEParallelConfig.make`` with the resulting SP size, our prepare/finalize from
``make_prepare_finalize`` (as ``maybe_make_prepare_finalize`` builds it), vLLM's
``FusedMoEKernel``, the MoE runner's reduction methods (``MoERunner._maybe_reduce_shared_expert_
output`` and ``_maybe_reduce_final_output``, called in the order ``MoERunner.forward`` calls them,
on a stand-in holding the layer's FusedMoEConfig), and the model's SP steps with vLLM's own
functions (``tensor_model_parallel_reduce_scatter`` after attention as DeepSeek-V2 does, or the
attention's ``tensor_model_parallel_all_reduce`` then ``sequence_parallel_chunk_impl`` as
Qwen3-MoE does; ``tensor_model_parallel_all_gather`` after the MoE).

Not vLLM's: the attention itself (a stand-in output whose TP sum is the layer input), the
router (the reference's, so routing matches the reference), the experts (torch SwiGLU experts
that honour ``expert_map``, as vLLM's GPU experts do) and the shared expert (the reference's
weights: replicated under SP, TP-sharded otherwise, as DeepSeek-V2 builds it).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.nn.functional as F

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                         FusedMoEQuantConfig, RoutingMethodType)

from moe_plugins.runner.demo import demo_inputs
from moe_plugins.layout import ParallelLayout
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights, route
from tests.checks import count_dist_calls
from tests.vllm_glue.vllm_dist import tp_uses_cpu_shm, vllm_parallel_state
from tests.vllm_glue.vllm_modular_kernel_ranks import TorchExpertsModular, contiguous_expert_map

# torch.distributed call -> the plan's collective kind
KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter"}


def _runner_reduce(moe: FusedMoEConfig, shared: torch.Tensor, fused: torch.Tensor,
                   fused_output_is_reduced: bool) -> torch.Tensor:
    """What ``MoERunner.forward`` does with the two outputs, through its own methods."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runner = SimpleNamespace(moe_config=moe, _fused_output_is_reduced=fused_output_is_reduced)
    shared = MoERunner._maybe_reduce_shared_expert_output(runner, shared, fused_output_is_reduced)
    return MoERunner._maybe_reduce_final_output(runner, shared + fused, None,
                                                fused_output_is_reduced)


def run_decoder_layer(rank: int, world: int, dp: int, cfg: MoEConfig, num_tokens: int,
                      sp_attention: str, section: dict, seed: int = 0,
                      cpu_shm: Optional[bool] = None) -> dict:
    """One decoder layer's TP reductions and MoE block on this rank (see the module docstring),
    for the DP group's ``num_tokens`` tokens (``demo_inputs``). ``sp_attention``:
    ``reduce_scatter`` (DeepSeek-V2) or ``all_reduce`` (Qwen3-MoE), the model's reduction of the
    attention output under SP; ``section``: our ``--additional-config`` section; ``cpu_shm``:
    vLLM's CPU shared-memory communicator on the TP group as vLLM decides (None), on or off
    (``vllm_parallel_state``). Returns the layer output [num_tokens, hidden] (SP: after the
    all_gather), whether vLLM ran SP, what the layer reported, whether the TP collectives ran
    through the shared-memory communicator, and every collective call (torch.distributed, or
    the shared-memory communicator standing in for it) from the attention's reduction to the
    end, with whether it ran on vLLM's TP group."""
    from vllm.distributed import (get_tp_group, tensor_model_parallel_all_gather,
                                  tensor_model_parallel_all_reduce,
                                  tensor_model_parallel_reduce_scatter)
    from vllm.model_executor.models.utils import sequence_parallel_chunk_impl

    from moe_plugins.vllm.factory import make_prepare_finalize

    tp = world // dp
    layout = ParallelLayout(dp, tp, True)
    dp_rank, tp_rank = layout.dp_rank(rank), layout.tp_rank(rank)
    with vllm_parallel_state(tp_rank, tp, tp, "moe_plugins_torch", data_parallel_size=dp,
                             data_parallel_rank=dp_rank,
                             additional_config={"moe_plugins": section},
                             cpu_shm=cpu_shm) as config:
        sp = config.parallel_config.use_sequence_parallel_moe  # what the model reads
        parallel = FusedMoEParallelConfig.make(tp_size_=tp, pcp_size_=1, dp_size_=dp,
                                               sp_size_=tp if sp else 1,
                                               vllm_parallel_config=config.parallel_config)
        moe = FusedMoEConfig(
            num_experts=cfg.num_experts, experts_per_token=cfg.num_topk, hidden_dim=cfg.hidden,
            intermediate_size=cfg.intermediate,
            num_local_experts=cfg.num_experts // layout.world_size,
            num_logical_experts=cfg.num_experts, activation=MoEActivation.SILU, device="cpu",
            routing_method=RoutingMethodType.Renormalize, moe_parallel_config=parallel,
            in_dtype=cfg.dtype, max_num_tokens=64)
        pf = make_prepare_finalize(moe, FusedMoEQuantConfig.make())
        assert pf is not None
        kernel = mk.FusedMoEKernel(pf, TorchExpertsModular(moe, FusedMoEQuantConfig.make()))

        weights = MoEWeights.random(cfg, seed)
        local = weights.local_experts(layout.ep_size, rank)
        shared_weights = weights.shared(1, 0) if sp else weights.shared(tp, tp_rank)
        x = demo_inputs(cfg, num_tokens, dp_rank, seed)
        partial = x / tp  # the attention's TP-partial output (exact in float32, tp a power of 2)
        tp_group = get_tp_group().device_group
        shm = tp_uses_cpu_shm()
        groups: list[Any] = []
        # under vLLM's shared-memory communicator its all_reduce / all_gather go there, not to
        # torch.distributed (its reduce_scatter still does)
        with count_dist_calls(groups, also=[get_tp_group().device_communicator.dist_module]
                              if shm else []) as calls:
            if sp and sp_attention == "reduce_scatter":  # DeepseekV2DecoderLayer.forward
                pad = (-partial.shape[0]) % tp
                h = tensor_model_parallel_reduce_scatter(F.pad(partial, (0, 0, 0, pad)), 0)
            else:
                h = tensor_model_parallel_all_reduce(partial.clone())
                if sp:  # Qwen3MoeSparseMoeBlock.forward
                    h = sequence_parallel_chunk_impl(h)
            topk_weights, topk_ids = route(h, weights.router, cfg.num_topk, cfg.renormalize)
            fused = kernel.apply(hidden_states=h, w1=local.w13, w2=local.w2,
                                 topk_weights=topk_weights, topk_ids=topk_ids.to(torch.int32),
                                 activation=MoEActivation.SILU,
                                 global_num_experts=cfg.num_experts,
                                 expert_map=contiguous_expert_map(cfg.num_experts,
                                                                  layout.ep_size, rank),
                                 apply_router_weight_on_input=False)
            shared = shared_weights(h) if shared_weights is not None else torch.zeros_like(h)
            out = _runner_reduce(moe, shared, fused, kernel.output_is_reduced())
            if sp:  # after the MoE (Qwen3) or before the next attention (DeepSeek-V2)
                out = tensor_model_parallel_all_gather(out, 0)[:num_tokens]
        return dict(out=out, sp=sp, cpu_shm=shm, moe_input_rows=h.shape[0],
                    strategy=pf.strategy, output_is_reduced=kernel.output_is_reduced(),
                    rows_sent=pf.stats.rows, pairs=pf.stats.pairs,
                    calls=[(name, b, g is tp_group) for (name, b), g in zip(calls, groups)])
