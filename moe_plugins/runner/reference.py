"""Single-process reference MoE: what every multi-rank run is compared with, element-wise.

Written independently of the layer runner and the experts (a per-token loop over full weights), so
a bug in the distributed path cannot be mirrored here.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from moe_plugins.runner.model import MoEWeights, route
from moe_plugins.quant import QuantSpec, quantize_dequantize

__all__ = ["reference_moe", "TOLERANCES", "tolerance_for", "within_tolerance"]


def reference_moe(x: torch.Tensor, weights: MoEWeights, quant: QuantSpec = QuantSpec(),
                  apply_router_weight_on_input: bool = False,
                  round_trip: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                  ) -> torch.Tensor:
    """x [num_tokens, hidden] -> MoE output [num_tokens, hidden] float32: shared expert (gated) on
    x, plus routed experts on x after the dispatch quantization's rounding (``round_trip``, when
    given, replaces ``quant``'s: x [num_tokens, hidden] -> the float32 values the experts
    compute on, e.g. an engine's own quantize + dequantize).

    apply_router_weight_on_input (top-1 models such as Llama-4): the routed expert runs on
    ``weight * x`` (rounded as dispatched) and its output is added unweighted."""
    cfg = weights.config
    topk_w, topk_ids = route(x, weights.router, cfg.num_topk, cfg.renormalize)
    if apply_router_weight_on_input and cfg.num_topk != 1:
        raise ValueError(f"apply_router_weight_on_input needs num_topk == 1, got {cfg.num_topk}")
    routed_in = (x * topk_w.to(x.dtype)) if apply_router_weight_on_input else x
    xr = quantize_dequantize(routed_in, quant) if round_trip is None else round_trip(routed_in)
    xf = x.float()
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(cfg.num_topk):
            e = int(topk_ids[t, k])
            g, u = (weights.w13[e].float() @ xr[t]).chunk(2)
            w = 1.0 if apply_router_weight_on_input else topk_w[t, k]
            out[t] += w * (weights.w2[e].float() @ (F.silu(g) * u))
        if weights.shared_w13 is not None and weights.shared_w2 is not None:
            g, u = (weights.shared_w13.float() @ xf[t]).chunk(2)
            s = weights.shared_w2.float() @ (F.silu(g) * u)
            if weights.shared_gate is not None:
                s = s * torch.sigmoid(weights.shared_gate.float()[0] @ xf[t])
            out[t] += s
    return out


# (atol, rtol) for a distributed output against reference_moe, with atol scaled by max|ref|
# (partials are rounded at the scale of the largest values, so small outputs carry the absolute
# error of large ones). float32: only summation order differs (batched GEMMs vs per-token
# mat-vecs, partials summed over ranks in another order): ~1e-6 relative per dot product.
# bfloat16: each rank's partial and the combine/all_reduce payloads are rounded to bf16 (8 mantissa
# bits, half-ulp 2^-9 relative); up to ~4 such roundings stay within 2e-2 of max|ref|.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
}


def tolerance_for(ref: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) to compare an output of ``dtype`` with ``ref``; atol scales with max|ref|."""
    atol, rtol = TOLERANCES[dtype]
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    return atol * scale, rtol


def within_tolerance(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """(all close under tolerance_for(ref, out.dtype), max abs error)."""
    atol, rtol = tolerance_for(ref, out.dtype)
    err = (out.float() - ref.float()).abs()
    ok = bool((err <= atol + rtol * ref.float().abs()).all())
    return ok, float(err.max()) if err.numel() else 0.0
