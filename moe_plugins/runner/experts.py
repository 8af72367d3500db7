"""Reference routed experts (SwiGLU, float32 math) for both activation formats."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_plugins.interface import PrepareResult
from moe_plugins.runner.model import ExpertWeights
from moe_plugins.quant import (NVFP4_BLOCK, QuantScheme, QuantSpec, dequantize,
                               quantize_dequantize, unswizzle_nvfp4_sf)

__all__ = ["TorchExperts"]


class TorchExperts:
    """Runs the local experts on what a prepare returned.

    Quantized input (``x_sf is not None``) is dequantized; unquantized input under a quant scheme
    (deferred quant, or no dispatch) is rounded here exactly as dispatch would have, so every path
    computes on the same numbers. Swizzled nvfp4 scales (``PrepareResult.x_sf_swizzled``) are
    unswizzled here, the only consumer that reads them.
    """

    def __init__(self, weights: ExpertWeights, quant: QuantSpec, out_dtype: torch.dtype):
        self.weights = weights
        self.quant = quant
        self.out_dtype = out_dtype
        self._w13 = weights.w13.float()
        self._w2 = weights.w2.float()

    def _input(self, x: torch.Tensor, x_sf: torch.Tensor | None,
               x_sf_swizzled: bool = False) -> torch.Tensor:
        if x_sf is not None:
            if x_sf_swizzled:
                # The one place swizzled scales are read back: the tiled layout is padded, so the
                # row count comes from x (nvfp4 packs two values per byte).
                if self.quant.scheme is not QuantScheme.NVFP4:
                    raise ValueError(f"swizzled scales are an nvfp4 layout, got them for quant "
                                     f"scheme {self.quant.scheme.value}")
                x_sf = unswizzle_nvfp4_sf(x_sf, x.shape[0], x.shape[1] * 2 // NVFP4_BLOCK)
            return dequantize(x, x_sf, self.quant)
        return quantize_dequantize(x, self.quant)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        g, u = (x @ self._w13[e].t()).chunk(2, dim=-1)
        return (F.silu(g) * u) @ self._w2[e].t()

    def apply(self, prep: PrepareResult) -> torch.Tensor:
        """STANDARD: x [num_recv_tokens, hidden] -> router-weighted sum over the local experts,
        [num_recv_tokens, hidden] out_dtype. BATCHED: x [num_local_experts, max_recv_tokens,
        hidden] -> unweighted per-expert outputs of the same shape (rows past each expert's count
        are zero)."""
        if prep.topk_ids is None:
            return self._apply_batched(prep)
        assert prep.topk_weights is not None
        x = self._input(prep.x, prep.x_sf, prep.x_sf_swizzled)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        # Every local expert runs on every received row and is weighted by the row's router
        # weight for it (0 where not routed): no data-dependent shapes, so no host sync and the
        # path can be captured in a CUDA graph. This is a reference, not a fast kernel.
        for e in range(self.weights.num_local_experts):
            w = (prep.topk_weights.float() * (prep.topk_ids == e)).sum(dim=1)
            out += self._expert(e, x) * w[:, None]
        return out.to(self.out_dtype)

    def _apply_batched(self, prep: PrepareResult) -> torch.Tensor:
        assert prep.expert_tokens_meta is not None
        if prep.x_sf_swizzled:
            raise ValueError("BATCHED activations with swizzled scales are not supported; "
                             "return row-aligned x_sf [num_local_experts, max_recv_tokens, ...]")
        counts = prep.expert_tokens_meta.expert_num_tokens
        e_l, t = prep.x.shape[0], prep.x.shape[1]
        x_sf = prep.x_sf
        flat = self._input(prep.x.reshape(e_l * t, -1),
                           None if x_sf is None else x_sf.reshape(e_l * t, -1)).reshape(e_l, t, -1)
        # Every expert runs on all of its slots and the rows past its count are masked out (as
        # the STANDARD path weights instead of gathering): reading the counts back to the host
        # would be a sync per call and cannot happen inside a CUDA-graph capture. `where`, not
        # a multiply: unfilled slots hold whatever the library left there (NaN included).
        valid = torch.arange(t, device=counts.device)[None, :] < counts[:, None].long()
        out = torch.stack([self._expert(e, flat[e]) for e in range(e_l)])
        return torch.where(valid[..., None].to(out.device), out, 0.0).to(self.out_dtype)
