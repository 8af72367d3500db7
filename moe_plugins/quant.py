"""Activation quantization for dispatch: schemes and their reference (torch) implementations.

One name for scale factors everywhere: ``x_sf``. ``x_sf is None`` exactly when activations travel
unquantized (no quant scheme, or ``defer_input_quant``).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "QuantScheme", "QuantSpec", "FP8_BLOCK", "NVFP4_BLOCK",
    "quantize_fp8_block128", "dequantize_fp8_block128",
    "quantize_nvfp4", "dequantize_nvfp4", "swizzle_nvfp4_sf", "unswizzle_nvfp4_sf",
    "quantize_for_dispatch", "dequantize", "quantize_dequantize", "wire_view", "from_wire",
]

FP8_BLOCK = 128
NVFP4_BLOCK = 16
_FP8_MAX = 448.0
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class QuantScheme(str, enum.Enum):
    """How activations are quantized for dispatch (``NONE``: they travel in the model dtype)."""

    NONE = "none"
    FP8_BLOCK128 = "fp8_block128"
    NVFP4 = "nvfp4"

    @classmethod
    def _missing_(cls, value: object) -> "QuantScheme":
        raise ValueError(f"{value!r} is not a QuantScheme; expected one of "
                         f"{', '.join(repr(s.value) for s in cls)}")


@dataclass(frozen=True)
class QuantSpec:
    """Dispatch quantization of one layer.

    ``defer_input_quant``: activations travel unquantized and the experts quantize them
    (``x_sf is None`` after prepare). ``nvfp4_global_scale`` plays the checkpoint's per-layer
    input global scale. ``nvfp4_swizzled_sf``: whether the experts read nvfp4 scales in the
    swizzled (128x4 tiled) layout; None leaves it to the backend's own option (an engine that
    knows its experts, e.g. vLLM's ``is_scale_swizzled``, says it here).
    """

    scheme: QuantScheme = QuantScheme.NONE
    defer_input_quant: bool = False
    nvfp4_global_scale: float = 1.0
    nvfp4_swizzled_sf: Optional[bool] = None

    def __post_init__(self) -> None:
        """Types and ranges of every field; a scheme given by its value (``"nvfp4"``) becomes the
        :class:`QuantScheme`."""
        if isinstance(self.scheme, str) and not isinstance(self.scheme, QuantScheme):
            try:
                object.__setattr__(self, "scheme", QuantScheme(self.scheme))
            except ValueError as e:
                raise ValueError(f"QuantSpec.scheme: {e}") from None
        if not isinstance(self.scheme, QuantScheme):
            raise TypeError(f"QuantSpec.scheme must be a QuantScheme, got {self.scheme!r} "
                            f"({type(self.scheme).__name__}); pass one of "
                            f"{', '.join(f'QuantScheme.{s.name}' for s in QuantScheme)}")
        if not isinstance(self.defer_input_quant, bool):
            raise TypeError(f"QuantSpec.defer_input_quant must be a bool, got "
                            f"{self.defer_input_quant!r} ({type(self.defer_input_quant).__name__})"
                            f"; pass True or False")
        gs = self.nvfp4_global_scale
        if isinstance(gs, bool) or not isinstance(gs, (int, float)):
            raise TypeError(f"QuantSpec.nvfp4_global_scale must be a number, got {gs!r} "
                            f"({type(gs).__name__}); pass a float (a tensor: float(t))")
        if not math.isfinite(gs) or gs <= 0:
            raise ValueError(f"QuantSpec.nvfp4_global_scale must be finite and > 0, got {gs!r}; "
                             "pass the layer's NVFP4 input global scale (1.0 without one)")
        if self.nvfp4_swizzled_sf is not None and not isinstance(self.nvfp4_swizzled_sf, bool):
            raise TypeError(f"QuantSpec.nvfp4_swizzled_sf must be True, False or None, got "
                            f"{self.nvfp4_swizzled_sf!r} ({type(self.nvfp4_swizzled_sf).__name__})")

    @property
    def quantized_on_wire(self) -> bool:
        """True when prepare sends quantized activations with ``x_sf`` (a scheme, not
        deferred to the experts)."""
        return self.scheme is not QuantScheme.NONE and not self.defer_input_quant

    def check_hidden(self, hidden: int) -> None:
        """ValueError unless ``hidden`` is a multiple of the scheme's scale block (fp8: 128,
        nvfp4: 16)."""
        block = {QuantScheme.FP8_BLOCK128: FP8_BLOCK, QuantScheme.NVFP4: NVFP4_BLOCK}.get(self.scheme)
        if block is not None and hidden % block:
            raise ValueError(
                f"quant scheme {self.scheme.value} needs hidden to be a multiple of {block}, "
                f"got hidden={hidden}; use an unquantized dispatch (QuantScheme.NONE) for this layer"
            )


def quantize_fp8_block128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [num_tokens, hidden] float -> (x_q float8_e4m3fn [num_tokens, hidden],
    x_sf float32 [num_tokens, hidden // 128]) with one scale per 128-wide block of a row."""
    m, h = x.shape
    blocks = x.float().reshape(m, h // FP8_BLOCK, FP8_BLOCK)
    x_sf = (blocks.abs().amax(dim=-1) / _FP8_MAX).clamp(min=1e-12)
    x_q = (blocks / x_sf.unsqueeze(-1)).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return x_q.reshape(m, h), x_sf


def dequantize_fp8_block128(x_q: torch.Tensor, x_sf: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_block128`; returns float32 [num_tokens, hidden]."""
    m, h = x_q.shape
    blocks = x_q.float().reshape(m, h // FP8_BLOCK, FP8_BLOCK) * x_sf.float().unsqueeze(-1)
    return blocks.reshape(m, h)


def _round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """v float32 [...] with |v| <= 6 -> uint8 [...] e2m1 magnitude codes (0..7), rounded to
    nearest with ties to the even code (0.25 -> 0, 0.75 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0,
    3.5 -> 4.0, 5.0 -> 4.0): what the hardware's cvt.rn and vLLM's NVFP4 emulation
    (``cast_to_fp4``) do. ``bucketize`` puts a midpoint in the lower bucket; a tie whose lower
    code is odd moves up one."""
    grid = torch.tensor(_E2M1_GRID, device=v.device)
    mids = (grid[1:] + grid[:-1]) / 2
    codes = torch.bucketize(v, mids)
    tie = (codes < mids.numel()) & (v == mids[codes.clamp(max=mids.numel() - 1)])
    return (codes + (tie & (codes % 2 == 1)).long()).to(torch.uint8)


def quantize_nvfp4(x: torch.Tensor, global_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference NVFP4: x [num_tokens, hidden] -> (x_q uint8 [num_tokens, hidden // 2] holding two
    e2m1 codes per byte, low nibble first (element 2j in bits 0-3, 2j + 1 in bits 4-7, the
    order vLLM's ``break_fp4_bytes`` and flashinfer read); x_sf float8_e4m3fn
    [num_tokens, hidden // 16], unswizzled).

    Block scales are ``global_scale * amax / 6`` saturated to e4m3's 448; values are scaled by
    ``1 / (x_sf / global_scale)`` (0 for an all-zero block), clamped to [-6, 6] and rounded to
    the nearest e2m1 value, ties to even: the arithmetic of vLLM's ``ref_nvfp4_quant``."""
    m, h = x.shape
    blocks = x.float().reshape(m, h // NVFP4_BLOCK, NVFP4_BLOCK)
    gs = torch.tensor(global_scale, dtype=torch.float32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    x_sf = (gs * (amax * (1.0 / 6.0))).clamp(max=_FP8_MAX).to(torch.float8_e4m3fn)
    per_value = x_sf.float() * (1.0 / gs)
    inv = torch.where(per_value == 0, torch.zeros_like(per_value), 1.0 / per_value)
    scaled = (blocks * inv).clamp(-6.0, 6.0)
    codes = _round_to_e2m1(scaled.abs()) | ((scaled < 0).to(torch.uint8) << 3)
    codes = codes.reshape(m, h // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4), x_sf.squeeze(-1)


def dequantize_nvfp4(x_q: torch.Tensor, x_sf: torch.Tensor, global_scale: float) -> torch.Tensor:
    """Inverse of :func:`quantize_nvfp4`; returns float32 [num_tokens, hidden]."""
    m, half = x_q.shape
    codes = torch.stack([x_q & 0xF, x_q >> 4], dim=-1).reshape(m, half * 2).long()
    grid = torch.tensor(_E2M1_GRID, device=x_q.device)
    vals = grid[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    blocks = vals.reshape(m, half * 2 // NVFP4_BLOCK, NVFP4_BLOCK)
    blocks = blocks * x_sf.float().unsqueeze(-1) / global_scale
    return blocks.reshape(m, half * 2)


def swizzle_nvfp4_sf(x_sf: torch.Tensor) -> torch.Tensor:
    """[num_tokens, hidden // 16] scales -> the 128x4 tiled layout NVFP4 GEMMs read, as a flat
    [padded_tokens * padded_cols] tensor (rows padded to 128, columns to 4). The padding is why
    scales cross an all-to-all unswizzled and are swizzled after it."""
    m, k = x_sf.shape
    pm, pk = -(-m // 128) * 128, -(-k // 4) * 4
    padded = torch.zeros(pm, pk, dtype=x_sf.dtype, device=x_sf.device)
    padded[:m, :k] = x_sf
    tiles = padded.view(pm // 128, 4, 32, pk // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().view(-1)


def unswizzle_nvfp4_sf(swizzled: torch.Tensor, num_tokens: int, num_cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_nvfp4_sf`: flat tiled scales -> [num_tokens, num_cols]."""
    pm, pk = -(-num_tokens // 128) * 128, -(-num_cols // 4) * 4
    tiles = swizzled.view(pm // 128, pk // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().view(pm, pk)[:num_tokens, :num_cols]


def quantize_for_dispatch(
    x: torch.Tensor, spec: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize x [num_tokens, hidden] for the wire; ``x_sf`` is None when nothing is quantized."""
    if not spec.quantized_on_wire:
        return x, None
    if spec.scheme is QuantScheme.FP8_BLOCK128:
        return quantize_fp8_block128(x)
    return quantize_nvfp4(x, spec.nvfp4_global_scale)


def dequantize(x: torch.Tensor, x_sf: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """Float32 activations back from what prepare returned; a no-op cast when ``x_sf is None``."""
    if x_sf is None:
        return x.float()
    if spec.scheme is QuantScheme.FP8_BLOCK128:
        return dequantize_fp8_block128(x, x_sf)
    if spec.scheme is QuantScheme.NVFP4:
        return dequantize_nvfp4(x, x_sf, spec.nvfp4_global_scale)
    raise ValueError(f"got scales (x_sf) for quant scheme {spec.scheme.value}, which has none")


def quantize_dequantize(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """What the experts compute on: x after the scheme's rounding (float32). Deferred quant rounds
    exactly like dispatch-side quant, only later, so both give the same numbers."""
    if spec.scheme is QuantScheme.NONE:
        return x.float()
    wire = QuantSpec(spec.scheme, False, spec.nvfp4_global_scale, spec.nvfp4_swizzled_sf)
    return dequantize(*quantize_for_dispatch(x, wire), wire)


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """A view that every transport can move: float8 travels as uint8 bytes (gloo has no fp8)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def from_wire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Undo :func:`wire_view`."""
    return t.view(dtype) if t.dtype != dtype else t
