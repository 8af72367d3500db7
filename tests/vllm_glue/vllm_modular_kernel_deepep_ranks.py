"""vLLM's modular kernel over DeepEP normal mode on gloo ranks: our deepep_ht / deepep_auto
through the adapter, and vLLM's in-tree ``DeepEPHTPrepareAndFinalize`` on the same emulated
``deep_ep`` (tests/emulation), for side-by-side comparison. Imported only by tests that skip
without vLLM."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from tests.emulation import installed
from moe_plugins.layout import ParallelLayout
from moe_plugins.config import MoEConfig
from moe_plugins.strategy import ReductionStrategy
from tests.vllm_glue.vllm_modular_kernel_ranks import run_vllm_kernel


def _in_tree_deepep_ht(ctx: Any, moe: Any) -> Any:
    """vLLM's own DeepEPHTPrepareAndFinalize over a normal-mode buffer of the same sizes ours
    makes (vLLM's manager would take VLLM_DEEPEP_BUFFER_SIZE_MB instead)."""
    from moe_plugins.all2all.deepep_ht import DeepEPHTManager
    from moe_plugins.config import DispatchConfig
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht import (
        DeepEPHTPrepareAndFinalize)

    cfg = DispatchConfig(moe.num_experts, moe.hidden_dim, moe.experts_per_token, 64, moe.in_dtype)
    manager = DeepEPHTManager(ctx, cfg)
    per = moe.num_experts // ctx.layout.ep_size
    pf = DeepEPHTPrepareAndFinalize(manager.buffer, num_dispatchers=ctx.layout.ep_size,
                                    dp_size=ctx.layout.dp, rank_expert_offset=ctx.rank * per)
    pf._moe_plugins_manager = manager  # kept alive for the call
    return pf


@contextlib.contextmanager
def _forward(num_tokens_across_dp: Optional[list[int]], runtime_mode: Optional[str]
             ) -> Iterator[None]:
    """A vLLM forward context with these DP token counts and CUDA-graph runtime mode, under a
    config whose mode separates decode (FULL) from mixed batches (FULL_AND_PIECEWISE)."""
    if num_tokens_across_dp is None:
        yield
        return
    from vllm.config import CompilationConfig, CUDAGraphMode, VllmConfig, set_current_vllm_config
    from vllm.forward_context import DPMetadata, create_forward_context, override_forward_context

    config = VllmConfig(compilation_config=CompilationConfig())
    # set after construction: the CPU platform turns CUDA graphs off while building the config
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    dp = DPMetadata(torch.tensor(num_tokens_across_dp, dtype=torch.int32))
    context = create_forward_context(None, config, dp_metadata=dp,
                                     cudagraph_runtime_mode=CUDAGraphMode[runtime_mode or "NONE"])
    with set_current_vllm_config(config), override_forward_context(context):
        yield


def run_vllm_deepep(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                    strategy: ReductionStrategy, num_tokens: int, backend: str,
                    options: Any = None, in_tree: bool = False,
                    num_tokens_across_dp: Optional[list[int]] = None,
                    runtime_mode: Optional[str] = None) -> dict:
    """:func:`vllm_rank_fns.run_vllm_kernel` on the emulated deep_ep, with ``backend`` under our
    adapter, or (``in_tree``) vLLM's DeepEPHTPrepareAndFinalize; optionally inside a vLLM
    forward context (DP token counts, CUDA-graph runtime mode)."""
    with installed("deep_ep"), _forward(num_tokens_across_dp, runtime_mode):
        return run_vllm_kernel(rank, world, layout, cfg, strategy, num_tokens, True, 0, None,
                               backend_name=backend, backend_options=options,
                               in_tree_pf=_in_tree_deepep_ht if in_tree else None)
