"""Batched receive layouts presented in the STANDARD format, and back (no host sync).

A low-latency prepare hands the experts ``x [num_local_experts, num_recv_slots, hidden]`` with a
count per expert; a backend that must present one format for both its modes (``deepep_auto``)
shows that layout as ``num_local_experts * num_recv_slots`` STANDARD rows: row ``e * slots + i``
is slot ``i`` of local expert ``e``, with ONE routing column: LOCAL id ``e`` and weight 1.0 for
the first ``expert_num_tokens[e]`` slots (the low-latency combine applies the router weights, so
the experts must return unweighted rows), id -1 and weight 0.0 for the empty slots. The shapes
depend only on the buffer, so the conversion can be captured in a CUDA graph; x is a view when
the batched x is contiguous, and block-128 scales (column-major in the kernels' layout) are
copied row-major. The experts' STANDARD output ``[num_local_experts * num_recv_slots, hidden]``
is viewed back as the batched layout for the combine.
"""
from __future__ import annotations

import torch

from moe_plugins.interface import PrepareResult

__all__ = ["batched_as_standard", "standard_as_batched"]


def batched_as_standard(prep: PrepareResult) -> PrepareResult:
    """A BATCHED :class:`PrepareResult` as STANDARD rows (see the module doc). x_sf must be
    row-aligned block scales ([num_local_experts, num_recv_slots, hidden // 128]) or None."""
    if prep.topk_ids is not None or prep.expert_tokens_meta is None:
        raise ValueError("batched_as_standard needs a BATCHED prepare result (per-expert counts, "
                         "no topk ids)")
    if prep.x_sf_swizzled:
        raise ValueError("swizzled scales have no per-row layout to present as STANDARD rows")
    e_l, slots = prep.x.shape[0], prep.x.shape[1]
    counts = prep.expert_tokens_meta.expert_num_tokens
    valid = (torch.arange(slots, device=counts.device).unsqueeze(0)
             < counts.to(torch.int64).unsqueeze(1))  # [num_local_experts, num_recv_slots]
    experts = torch.arange(e_l, device=counts.device).unsqueeze(1).expand(e_l, slots)
    ids = torch.where(valid, experts, torch.full_like(experts, -1)).reshape(e_l * slots, 1)
    weights = valid.to(torch.float32).reshape(e_l * slots, 1)
    x_sf = prep.x_sf
    if x_sf is not None:
        x_sf = x_sf.reshape(e_l * slots, x_sf.shape[-1])
    return PrepareResult(x=prep.x.reshape(e_l * slots, prep.x.shape[-1]), x_sf=x_sf,
                         expert_tokens_meta=prep.expert_tokens_meta, topk_ids=ids,
                         topk_weights=weights)


def standard_as_batched(out: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """The experts' STANDARD output [num_local_experts * num_recv_slots, hidden] as
    [num_local_experts, num_recv_slots, hidden] (a view when contiguous)."""
    if out.dim() != 2 or out.shape[0] % num_local_experts:
        raise ValueError(f"expert output has shape {tuple(out.shape)}, expected "
                         f"[{num_local_experts} * num_recv_slots, hidden] (the rows prepare "
                         "presented)")
    return out.reshape(num_local_experts, out.shape[0] // num_local_experts, out.shape[1])
