"""Rank functions: every activation format vLLM's experts ask for, through vLLM's own
``FusedMoEKernel`` with our adapter over a real backend (torch; flashinfer two-sided and
deepep_ll on their emulations), on gloo CPU ranks. Imported only by tests that skip without vLLM.

The experts record what reached them (activations, ``a1q_scale``, the receive rows) and compute
the SwiGLU experts on the values those encode, decoded here from each format's definition
(scale per tensor / per token / per 128-block, UE8M0 exponents for MXFP8, NVFP4 codes), so the
layer output can be compared with the single-process reference under the same quantization
round trip. Optionally the call runs inside a vLLM forward context whose DP metadata gives the
tokens of every DP rank, as vLLM's model runner sets it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig

from moe_plugins.config import DispatchConfig
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.groups import cached_dist_context
from moe_plugins.layout import ParallelLayout
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights, route
from moe_plugins.overlap import OverlapConfig
from moe_plugins.quant import (QuantScheme, QuantSpec, dequantize_nvfp4, unswizzle_nvfp4_sf)
from moe_plugins.registry import get_backend
from moe_plugins.strategy import ReductionStrategy, StrategyChoice
from moe_plugins.vllm.prepare_finalize import MoEPluginsPrepareAndFinalize
from moe_plugins.vllm.receive_quant import quant_scheme_of
from tests.vllm_glue.vllm_modular_kernel_ranks import (TorchBatchedExpertsModular, TorchExpertsModular, _moe_config,
                           contiguous_expert_map)

NVFP4_GLOBAL_SCALE = 200.0
INT8_STATIC_SCALE = 0.04

# name -> FusedMoEQuantConfig.make arguments (those vLLM's CPU build can quantize)
FORMATS: dict[str, dict[str, Any]] = {
    "bf16": dict(),
    "fp8_block128": dict(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128]),
    "int8_per_tensor_static": dict(quant_dtype=torch.int8,
                                   a1_scale=torch.tensor([INT8_STATIC_SCALE])),
    "int8_per_tensor_dynamic": dict(quant_dtype=torch.int8),
    "mxfp8": dict(quant_dtype="mxfp8", is_scale_swizzled=False),
    "nvfp4": dict(quant_dtype="nvfp4", a1_gscale=torch.tensor(NVFP4_GLOBAL_SCALE)),
    "nvfp4_swizzled": dict(quant_dtype="nvfp4", a1_gscale=torch.tensor(NVFP4_GLOBAL_SCALE),
                           is_scale_swizzled=True),
}


def quant_config(fmt: str) -> FusedMoEQuantConfig:
    kw = dict(FORMATS[fmt])
    if fmt == "nvfp4":
        kw["is_scale_swizzled"] = False
    return FusedMoEQuantConfig.make(**kw)


def decode(x: torch.Tensor, x_sf: Optional[torch.Tensor], qc: FusedMoEQuantConfig,
           swizzled: bool = False) -> torch.Tensor:
    """x [rows, hidden or hidden // 2], x_sf as the experts got it -> float32 [rows, hidden]."""
    if x_sf is None:
        return x.float()
    if qc.quant_dtype == "nvfp4":
        cols = x.shape[1] * 2 // 16
        sf = unswizzle_nvfp4_sf(x_sf, x.shape[0], cols) if swizzled else x_sf
        return dequantize_nvfp4(x, sf, float(qc.a1_gscale))
    if qc.quant_dtype == "mxfp8":  # one UE8M0 exponent (bias 127) per 32 values
        scale = torch.exp2(x_sf.float() - 127.0).reshape(x.shape[0], -1)
        return x.float() * scale.repeat_interleave(32, dim=1)[:, : x.shape[1]]
    sf = x_sf.float()
    if sf.numel() == 1:  # per tensor
        return x.float() * sf.reshape(())
    sf = sf.reshape(x.shape[0], -1)  # per token ([rows, 1]) or per block ([rows, hidden / b])
    return x.float() * sf.repeat_interleave(x.shape[1] // sf.shape[1], dim=1)


class FormatExperts(TorchExpertsModular):
    """Standard-format experts for any quant config: decode, then the unquantized math."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.seen: list[dict] = []

    def workspace_shapes(self, M: int, N: int, K: int, *args: Any) -> tuple[tuple[int, ...], ...]:
        # K comes from the activations vLLM got (NVFP4: two values a byte); the output is hidden
        return (0,), (0,), (M, self.moe_config.hidden_dim)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input) -> None:
        qc = self.quant_config
        swizzled = qc.quant_dtype == "nvfp4" and qc.is_scale_swizzled
        self.seen.append(dict(x_dtype=hidden_states.dtype, rows=hidden_states.shape[0],
                              x_sf=None if a1q_scale is None else a1q_scale.clone()))
        x = decode(hidden_states, a1q_scale, qc, swizzled)
        super().apply(output, x, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                      expert_map, None, a2_scale, workspace13, workspace2, expert_tokens_meta,
                      apply_router_weight_on_input)


class FormatBatchedExperts(TorchBatchedExpertsModular):
    """Batched-format experts for any quant config: decode each expert's rows."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.seen: list[dict] = []

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input) -> None:
        qc = self.quant_config
        self.seen.append(dict(x_dtype=hidden_states.dtype, rows=hidden_states.shape[1],
                              x_sf=None if a1q_scale is None else a1q_scale.clone()))
        num_experts, slots = hidden_states.shape[:2]
        if a1q_scale is None:
            x = hidden_states.float()
        else:
            sf = a1q_scale.reshape(num_experts, -1, a1q_scale.shape[-1]) \
                if a1q_scale.numel() > num_experts else a1q_scale.reshape(num_experts, 1)
            x = torch.stack([decode(hidden_states[e], sf[e], qc) for e in range(num_experts)])
        super().apply(output, x.to(torch.float32), w1, w2, topk_weights, topk_ids, activation,
                      global_num_experts, expert_map, None, a2_scale, workspace13, workspace2,
                      expert_tokens_meta, apply_router_weight_on_input)


@contextlib.contextmanager
def _vendor(backend: str, flavor: str) -> Iterator[None]:
    if backend == "flashinfer_nvlink_two_sided":
        from tests.emulation import flashinfer_two_sided

        with flashinfer_two_sided.installed(flavor):
            yield
    elif backend in ("deepep_ll", "nixl_ep", "deepep_ht", "deepep_auto"):
        from tests.emulation import installed
        from tests.backends.low_latency_ranks import vendor_module

        # DeepEP's normal mode lives in the same package as its low-latency kernels
        with installed("deep_ep" if backend in ("deepep_ht", "deepep_auto")
                       else vendor_module(backend)):
            yield
    else:
        yield


@contextlib.contextmanager
def _forward_context(dp_tokens: Optional[list[int]]) -> Iterator[None]:
    """vLLM's forward context with DP metadata for ``dp_tokens`` (tokens per DP rank), the
    chunk sizes set as vLLM's MoE runner sets them around the layer (sequence parallel off)."""
    if dp_tokens is None:
        yield
        return
    from vllm.forward_context import DPMetadata, ForwardContext, override_forward_context

    dp = DPMetadata(torch.tensor(dp_tokens, dtype=torch.int32))
    ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}, dp_metadata=dp)
    with override_forward_context(ctx), dp.sp_local_sizes(1):
        yield


@dataclass
class _Built:
    pf: MoEPluginsPrepareAndFinalize
    experts: Any


def run_format(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
               fmt: str, tokens: list[int], layer_max: int = 16,
               dp_tokens_in_context: bool = False, flavor: str = "0.7.2.post1",
               options: Optional[dict] = None) -> dict:
    """vLLM's FusedMoEKernel with our adapter over ``backend`` (built through the registry,
    the wire quant chosen as the vLLM glue does, ``options`` overriding its backend options'
    defaults) and experts asking for ``fmt``; DP rank d holds ``tokens[d]`` tokens. Routed
    output only (no shared expert), LOCAL or ROW_SCATTER by tp."""
    qc = quant_config(fmt)
    wire = quant_scheme_of(qc)
    # "batched_test": tests/vllm_glue/batched_backend.py (the torch transport, batched format)
    batched_test = backend == "batched_test"
    backend = "torch" if batched_test else backend
    spec = get_backend(backend)
    ctx = cached_dist_context(layout)
    n = tokens[ctx.dp_rank]
    with _vendor(backend, flavor):
        from tests.backends.low_latency_ranks import make_options

        if backend == "deepep_auto":  # its manager holds the options type on its LL side
            from moe_plugins.all2all.deepep_auto import DeepEPAutoOptions

            backend_options: Any = DeepEPAutoOptions(**(options or {}))
        elif getattr(spec.manager, "options_type", None) is not None:
            backend_options = make_options(backend, **(options or {}))
        else:
            assert options is None, f"{backend} takes no options here"
            backend_options = None
        dispatch = DispatchConfig(
            cfg.num_experts, cfg.hidden, cfg.num_topk, layer_max, cfg.dtype,
            QuantSpec(wire if wire in spec.quants else QuantScheme.NONE),
            backend_options=backend_options)
        if batched_test:  # the torch transport, received rows packed per expert
            from moe_plugins.all2all.torch import TorchAll2AllManager
            from tests.vllm_glue.batched_backend import BatchedTorchPrepareFinalize

            pf_backend: Any = BatchedTorchPrepareFinalize(TorchAll2AllManager(ctx, dispatch),
                                                          dispatch)
        else:
            pf_backend = spec.build(ctx, dispatch)
        strategy = ReductionStrategy.LOCAL if layout.tp == 1 else \
            ReductionStrategy.GATHER_PLUS_ALLREDUCE
        pf = MoEPluginsPrepareAndFinalize(pf_backend, backend, ctx,
                                          StrategyChoice(strategy, "test"),
                                          OverlapConfig(overlap=False), cfg.num_experts, wire,
                                          spec.quants)
        moe = _moe_config(cfg, layout, rank)
        if pf.batched:
            experts: Any = FormatBatchedExperts(moe, qc, max_num_tokens=pf.max_num_tokens_per_rank(),
                                                num_dispatchers=pf.num_dispatchers())
        else:
            experts = FormatExperts(moe, qc)
        kernel = mk.FusedMoEKernel(pf, experts)  # calls pf.post_init_setup(experts)
        weights = MoEWeights.random(cfg, 0)
        local = weights.local_experts(layout.ep_size, rank)
        x = demo_inputs(cfg, n, ctx.dp_rank, 0)
        topk_weights, topk_ids = route(x, weights.router, cfg.num_topk, cfg.renormalize)
        try:
            with _forward_context(tokens if dp_tokens_in_context else None):
                out = kernel.apply(hidden_states=x, w1=local.w13, w2=local.w2,
                                   topk_weights=topk_weights,
                                   topk_ids=topk_ids.to(pf.topk_indices_dtype() or torch.int32),
                                   activation=MoEActivation.SILU,
                                   global_num_experts=cfg.num_experts,
                                   expert_map=contiguous_expert_map(cfg.num_experts,
                                                                    layout.ep_size, rank),
                                   apply_router_weight_on_input=False)
        finally:
            pf_backend.reset_call_state()
            destroy = getattr(pf_backend.manager, "destroy", None)  # type: ignore[attr-defined]
            if destroy is not None:
                destroy()
        seen, = experts.seen
        modes = getattr(pf_backend.stats, "modes", None)
        return dict(out=out, seen=seen, wire=pf._quant.scheme.value,
                    after_receive=pf._recv_quant is not None,
                    modes=None if modes is None else dict(modes))
