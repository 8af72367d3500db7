"""Reference routed experts (SwiGLU, float32 math) for both activation formats."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_plugins.interface import PrepareResult
from moe_plugins.model import ExpertWeights
from moe_plugins.quant import QuantSpec, dequantize, quantize_dequantize

__all__ = ["TorchExperts"]


class TorchExperts:
    """Runs the local experts on what a prepare returned.

    Quantized input (``x_sf is not None``) is dequantized; unquantized input under a quant scheme
    (deferred quant, or no dispatch) is rounded here exactly as dispatch would have, so every path
    computes on the same numbers.
    """

    def __init__(self, weights: ExpertWeights, quant: QuantSpec, out_dtype: torch.dtype):
        self.weights = weights
        self.quant = quant
        self.out_dtype = out_dtype
        self._w13 = weights.w13.float()
        self._w2 = weights.w2.float()

    def _input(self, x: torch.Tensor, x_sf: torch.Tensor | None) -> torch.Tensor:
        if x_sf is not None:
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
        x = self._input(prep.x, prep.x_sf)
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
        counts = prep.expert_tokens_meta.expert_num_tokens.tolist()
        e_l, t = prep.x.shape[0], prep.x.shape[1]
        x_sf = prep.x_sf
        flat = self._input(prep.x.reshape(e_l * t, -1),
                           None if x_sf is None else x_sf.reshape(e_l * t, -1)).reshape(e_l, t, -1)
        out = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
        for e, n in enumerate(counts):
            if n:
                out[e, :n] = self._expert(e, flat[e, :n])
        return out.to(self.out_dtype)

