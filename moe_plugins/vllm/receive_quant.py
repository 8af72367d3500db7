"""How vLLM's activation quant config maps onto our transports: the wire quant scheme a backend
can carry (:func:`quant_scheme_of`), the one NVFP4 input scale the wire uses
(:func:`nvfp4_global_scale`), and, for every other activation format, the quantization vLLM's
experts get after an unquantized receive (:func:`receive_quantization`); per layer, what its
experts want (:func:`experts_quantization`) and the quantization after the receive
(:func:`quantize_received`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from moe_plugins.interface import PrepareResult
from moe_plugins.quant import QuantScheme, QuantSpec

__all__ = ["quant_scheme_of", "ReceiveQuant", "receive_quantization", "nvfp4_global_scale",
           "ExpertsQuant", "experts_quantization", "quantize_received", "valid_rows"]


def quant_scheme_of(quant_config: Any) -> Optional[QuantScheme]:
    """Our WIRE quant scheme for vLLM's FusedMoEQuantConfig (what a backend can put on the wire
    quantized: FP8 block-128, NVFP4), NONE for unquantized activations, or None for every other
    activation format (those travel in the model dtype and are quantized after the receive,
    see :func:`receive_quantization`)."""
    if quant_config is None or quant_config.quant_dtype is None:
        return QuantScheme.NONE
    if (quant_config.quant_dtype == torch.float8_e4m3fn and not quant_config.per_act_token_quant
            and list(quant_config.block_shape or []) == [128, 128]):
        return QuantScheme.FP8_BLOCK128
    if quant_config.quant_dtype == "nvfp4":
        return QuantScheme.NVFP4
    return None


# Activation formats vLLM's moe_kernel_quantize_input produces natively for experts (the others,
# mxfp4 and mxfp6, it only emulates, or refuses outside XPU).
_RECEIVE_QUANT_DTYPES = (torch.float8_e4m3fn, torch.int8, "mxfp8", "nvfp4")


@dataclass(frozen=True)
class ReceiveQuant:
    """The arguments of vLLM's ``moe_kernel_quantize_input`` for activations that crossed the
    wire unquantized and are quantized after the receive, before the experts (as vLLM's in-tree
    DeepEP LL ``_do_quant`` does). ``spans_rows``: the scale is computed over many rows (dynamic
    per-tensor), so rows that carry no token are zeroed first (their contents are unspecified
    and would otherwise set the scale)."""

    quant_dtype: Any
    per_act_token_quant: bool
    block_shape: Optional[tuple[int, ...]]
    is_scale_swizzled: bool
    mx_alignment: int

    @property
    def spans_rows(self) -> bool:
        return not self.per_act_token_quant and self.block_shape is None and \
            self.quant_dtype in (torch.float8_e4m3fn, torch.int8)

    def input_scale(self, quant_config: Any) -> Optional[torch.Tensor]:
        """The scale argument for this call's quant config: NVFP4 takes the input global scale
        (``a1_gscale``, as vLLM's DeepEP HT backend quantizes NVFP4 after its dispatch), the
        others the static input scale (``a1_scale``; None: dynamic)."""
        return quant_config.a1_gscale if self.quant_dtype == "nvfp4" else quant_config.a1_scale


def receive_quantization(quant_config: Any) -> Optional[ReceiveQuant]:
    """How vLLM's experts with ``quant_config`` get their activations quantized after a
    model-dtype dispatch; None when vLLM has no native quantization for that format."""
    if quant_config.quant_dtype not in _RECEIVE_QUANT_DTYPES:
        return None
    block = quant_config.block_shape
    return ReceiveQuant(quant_config.quant_dtype, bool(quant_config.per_act_token_quant),
                        None if block is None else tuple(block),
                        bool(getattr(quant_config, "is_scale_swizzled", True)),
                        int(getattr(quant_config, "mx_alignment", 0)))


def nvfp4_global_scale(quant_config: Any) -> float:
    """The one input global scale an NVFP4 wire uses (vLLM's ``a1_gscale``)."""
    gs = quant_config.a1_gscale
    if gs is None:
        raise ValueError("NVFP4 experts without an input global scale (quant_config.a1_gscale "
                         "is None); moe-plugins quantizes NVFP4 activations before the "
                         "all-to-all with it, as vLLM's two-sided flashinfer backend does")
    flat = gs.detach().float().flatten().cpu()
    if flat.numel() == 0 or not bool((flat == flat[0]).all()):
        raise ValueError(f"NVFP4 input global scales differ per expert ({flat.tolist()}); the "
                         "activations cross the wire before the expert is known, so they need "
                         "one scale for the layer")
    return float(flat[0])


@dataclass(frozen=True)
class ExpertsQuant:
    """How one layer's activations reach its experts: ``wire`` (what our transport carries:
    a quantized wire format, or NONE for the model dtype), ``after_receive`` (vLLM's
    quantization to run right after an unquantized receive; None: none) and ``nvfp4_swizzle``
    (interleave NVFP4 scales after the receive, as the experts read them)."""

    wire: QuantSpec = QuantSpec()
    after_receive: Optional[ReceiveQuant] = None
    nvfp4_swizzle: bool = False


def experts_quantization(fused_experts: Any, backend_name: str, batched: bool,
                         quants: frozenset[QuantScheme], wire_scheme: Optional[QuantScheme]
                         ) -> ExpertsQuant:
    """What vLLM's experts ``fused_experts`` want, on a backend that can put ``quants`` on the
    wire (``wire_scheme``: the one planned for the layer): the format the transport can carry
    goes quantized; NVFP4 experts on a batched bf16 dispatch quantize their input themselves
    (as vLLM's in-tree DeepEP LL hands them bf16 rows); every other format goes in the model
    dtype and is quantized after the receive. ValueError where vLLM has no quantization to run
    after a receive for the experts' format."""
    if fused_experts.expects_unquantized_inputs:
        return ExpertsQuant()
    qc = fused_experts.quant_config
    if qc is None or qc.quant_dtype is None:
        return ExpertsQuant()
    scheme = quant_scheme_of(qc)
    if scheme is not None and scheme in quants and scheme is wire_scheme:
        if scheme is QuantScheme.NVFP4:
            # As vLLM's two-sided flashinfer backend: quantized before the all-to-all with the
            # layer's global scale, scales unswizzled on the wire and interleaved after it when
            # the experts read them swizzled.
            swizzle = bool(getattr(qc, "is_scale_swizzled", True))
            return ExpertsQuant(QuantSpec(scheme, nvfp4_global_scale=nvfp4_global_scale(qc),
                                          nvfp4_swizzled_sf=swizzle), None, swizzle)
        return ExpertsQuant(QuantSpec(scheme))
    if batched and qc.quant_dtype == "nvfp4":
        return ExpertsQuant()
    recv = receive_quantization(qc)
    if recv is None:
        raise ValueError(
            f"{type(fused_experts).__name__} wants activations quantized as "
            f"quant_dtype={qc.quant_dtype!r} (block_shape={qc.block_shape}, per-token="
            f"{qc.per_act_token_quant}); backend {backend_name!r} puts "
            f"{sorted(q.value for q in quants)} on the wire and vLLM's "
            "moe_kernel_quantize_input has no native quantization for that format to run "
            "after the receive. Use experts that take bf16 or one of fp8 (block-128, "
            "per-token, per-tensor), int8, mxfp8, nvfp4, or an in-tree --all2all-backend")
    return ExpertsQuant(after_receive=recv)


def quantize_received(recv: ReceiveQuant, x: torch.Tensor, valid: torch.Tensor,
                      quant_config: Any, batched: bool
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x [num_recv_tokens, hidden] or batched [num_local_experts, max_recv_tokens, hidden] in
    the model dtype -> vLLM's quantized activations and scales for the experts, by vLLM's own
    ``moe_kernel_quantize_input`` with the layer's quant config (the call's ``quant_config``:
    static scales live there). ``valid`` bool [rows]: rows that carry a token; the others
    (stale or uninitialised memory) are zeroed first where the scale spans rows, so they never
    feed a per-tensor amax. Batched: quantized as [-1, hidden] and reshaped, scales by vLLM's
    ``normalize_batched_scales_shape`` (as vLLM's DeepEP LL ``_do_quant``)."""
    from vllm.model_executor.layers.fused_moe.utils import (moe_kernel_quantize_input,
                                                             normalize_batched_scales_shape)

    rows = x.reshape(-1, x.shape[-1])
    if recv.spans_rows:
        rows = torch.where(valid.reshape(-1, 1), rows, torch.zeros_like(rows))
    q, q_sf = moe_kernel_quantize_input(
        rows, recv.input_scale(quant_config), recv.quant_dtype, recv.per_act_token_quant,
        None if recv.block_shape is None else list(recv.block_shape),
        is_scale_swizzled=recv.is_scale_swizzled, mx_alignment=recv.mx_alignment)
    if not batched:
        return q, q_sf
    num_experts = x.shape[0]
    q = q.view(num_experts, -1, q.shape[-1])
    if q_sf is not None and recv.quant_dtype != "nvfp4":
        q_sf = normalize_batched_scales_shape(q_sf, num_experts)
    return q, q_sf


def valid_rows(prep: PrepareResult) -> torch.Tensor:
    """bool, one per received row of ``prep``: the row carries a token (STANDARD: some local
    expert id; BATCHED: within its expert's count)."""
    if prep.topk_ids is not None:
        return (prep.topk_ids >= 0).any(dim=1)
    assert prep.expert_tokens_meta is not None
    counts = prep.expert_tokens_meta.expert_num_tokens.to(prep.x.device)
    slots = torch.arange(prep.x.shape[1], device=prep.x.device)
    return slots[None, :] < counts[:, None]
