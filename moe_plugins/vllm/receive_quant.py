"""How vLLM's activation quant config maps onto our transports: the wire quant scheme a backend
can carry (:func:`quant_scheme_of`), the one NVFP4 input scale the wire uses
(:func:`nvfp4_global_scale`), and, for every other activation format, the quantization vLLM's
experts get after an unquantized receive (:func:`receive_quantization`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from moe_plugins.quant import QuantScheme

__all__ = ["quant_scheme_of", "ReceiveQuant", "receive_quantization", "nvfp4_global_scale"]


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
