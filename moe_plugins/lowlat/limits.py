"""What the low-latency kernels of DeepEP V1 and NIXL EP accept, and the helpers that follow
from it.

The kernels are compiled for :data:`KERNEL_HIDDEN_SIZES` only and dispatch at most :data:`MAX_TOPK`
experts per token. A layer whose hidden size is a kernel size runs as is; a smaller one runs
**padded to the next kernel size** when ``pad_hidden`` is on (the default): prepare copies the
tokens into zero-padded rows before the dispatch and hands the experts views of the first
``hidden`` columns; finalize pads the expert outputs the same way and copies the first ``hidden``
columns of the combined rows out. Zero columns change no real column (combine is a per-column
weighted sum); the cost is one copy each way and ``kernel_hidden - hidden`` more columns on the
wire, logged once at INFO. Build the layer with :func:`round_up_hidden_size` (as vLLM rounds its
layer up) to avoid it. With ``pad_hidden=False`` an unsupported size is a ValueError; above 8192
it always is.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from moe_plugins.config import DispatchConfig
from moe_plugins.quant import FP8_BLOCK, QuantScheme

__all__ = ["KERNEL_HIDDEN_SIZES", "MAX_TOPK", "MSG_HEADER_BYTES", "UE8M0_PACK", "LL_QUANTS",
    "check_kernel_layer", "round_up_hidden_size", "kernel_hidden_size", "token_capacity",
    "unpack_ue8m0_scales", "dequantize_batched", "expert_id_error", "assert_expert_ids"]


#: Hidden sizes the low-latency kernels are compiled for (DeepEP V1 and nixl_ep SWITCH_HIDDEN).
KERNEL_HIDDEN_SIZES: tuple[int, ...] = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)


#: Largest top-k of the dispatch kernel (``kNumMaxTopK`` in both libraries).
MAX_TOPK = 11


#: Each dispatched pair carries a 16-byte header (the source token index) in front of its row.
MSG_HEADER_BYTES = 16


UE8M0_PACK = 4  # UE8M0 scales are packed four to an int32: one int32 per 512 columns


LL_QUANTS = frozenset({QuantScheme.NONE, QuantScheme.FP8_BLOCK128})


def check_kernel_layer(cfg: DispatchConfig, backend: str, bf16_why: str, max_topk: int,
                       quants: frozenset[QuantScheme]) -> None:
    """The layer checks DeepEP-style kernels share (ValueError with the fix): bfloat16
    activations (``bf16_why`` says which kernel needs them), top-k within the dispatch kernel's
    limit, a quant scheme the kernels move."""
    if cfg.dtype != torch.bfloat16:
        raise ValueError(f"{backend}: {bf16_why}, the layer is {cfg.dtype}; build the layer in "
                         "torch.bfloat16 or use another backend (e.g. 'torch')")
    if cfg.num_topk > max_topk:
        raise ValueError(f"{backend}: num_topk={cfg.num_topk} exceeds the dispatch kernel's limit "
                         f"of {max_topk} experts per token; use another backend (e.g. 'torch')")
    if cfg.quant.scheme not in quants:
        raise ValueError(f"{backend}: quant scheme {cfg.quant.scheme.value} is not supported; "
                         f"supported: {sorted(q.value for q in quants)}")


def round_up_hidden_size(hidden: int) -> int:
    """The smallest kernel hidden size >= ``hidden`` (build a layer with it to avoid padding)."""
    for size in KERNEL_HIDDEN_SIZES:
        if size >= hidden:
            return size
    raise ValueError(
        f"hidden={hidden} is larger than the largest hidden size the low-latency kernels support "
        f"({KERNEL_HIDDEN_SIZES[-1]}); supported: {list(KERNEL_HIDDEN_SIZES)}; use another "
        "backend (e.g. 'torch') for this layer"
    )


def kernel_hidden_size(hidden: int, pad_hidden: bool, backend: str) -> int:
    """The hidden size the kernels run for a layer of ``hidden`` (the module doc's rule)."""
    if hidden in KERNEL_HIDDEN_SIZES:
        return hidden
    padded = round_up_hidden_size(hidden)
    if not pad_hidden:
        raise ValueError(
            f"{backend}: hidden={hidden} is not a size the kernels are compiled for "
            f"({list(KERNEL_HIDDEN_SIZES)}); build the layer with hidden={padded} "
            f"(moe_plugins.lowlat.limits.round_up_hidden_size), or set pad_hidden=True in the "
            "backend options to pad the activations inside prepare/finalize"
        )
    return padded


def token_capacity(max_tokens_per_rank: int, num_ranks: int) -> int:
    """Smallest capacity >= ``max_tokens_per_rank`` with ``num_ranks * capacity`` a multiple of 4
    (the kernels' TMA needs the packed token dimension, ranks x capacity, to be a multiple of 4).
    Pass ``num_ranks=1`` when the number of ranks in the layout can change (NIXL EP's active rank
    bound): the capacity itself is then a multiple of 4."""
    step = 4 // math.gcd(num_ranks, 4)
    return -(-max_tokens_per_rank // step) * step


def pad_hidden(t: torch.Tensor, hidden: int, kernel_hidden: int) -> torch.Tensor:
    """t [..., hidden] -> a new zero-padded [..., kernel_hidden] copy (the kernels' hidden size;
    :func:`kernel_hidden_size`)."""
    out = t.new_zeros(*t.shape[:-1], kernel_hidden)
    out[..., :hidden] = t
    return out


def unpad_received(recv_x: torch.Tensor, recv_sf: Optional[torch.Tensor], hidden: int
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Views of received rows ``recv_x`` [..., kernel_hidden] and their scales ``recv_sf``
    (float32 [..., kernel_hidden / 128], or packed UE8M0 int32 [..., kernel_hidden / 512]) that
    hold the layer's ``hidden`` columns only (what the experts get)."""
    recv_x = recv_x[..., :hidden]
    if recv_sf is not None:
        per = FP8_BLOCK * (UE8M0_PACK if recv_sf.dtype is torch.int32 else 1)
        recv_sf = recv_sf[..., : -(-hidden // per)]
    return recv_x, recv_sf


def unpack_ue8m0_scales(packed: torch.Tensor) -> torch.Tensor:
    """Packed UE8M0 scales -> float32 scales.

    packed: int32 [..., hidden // 512], four biased 8-bit exponents per int32, lowest byte first
    (the layout DeepEP/NIXL EP return with ``use_ue8m0=True``). Returns float32
    [..., hidden // 128] holding ``2 ** (e - 127)``.
    """
    if packed.dtype != torch.int32:
        raise TypeError(f"packed UE8M0 scales must be int32, got {packed.dtype}")
    shifts = torch.arange(0, 32, 8, device=packed.device, dtype=torch.int32)
    exps = (packed.unsqueeze(-1) >> shifts) & 0xFF  # [..., hidden // 512, 4]
    return torch.exp2(exps.flatten(-2).float() - 127.0)


def dequantize_batched(x: torch.Tensor, x_sf: Optional[torch.Tensor]) -> torch.Tensor:
    """The values a low-latency dispatch delivered, for experts (and tests) that compute in
    float: x float8_e4m3fn/bf16 [num_local_experts, slots, hidden]; x_sf None, float32
    block-128 scales [..., hidden // 128] or packed UE8M0 int32 [..., hidden // 512] ->
    float32 [num_local_experts, slots, hidden]."""
    if x_sf is None:
        return x.float()
    scales = unpack_ue8m0_scales(x_sf) if x_sf.dtype == torch.int32 else x_sf.float()
    return x.float() * scales.repeat_interleave(FP8_BLOCK, dim=-1)[..., : x.shape[-1]]


def expert_id_error(num_experts: int, backend: str) -> str:
    """The message of :func:`assert_expert_ids` (built once per layer, not per call)."""
    return (f"{backend}: topk_ids hold expert ids outside [-1, {num_experts}) (-1: no expert); "
            f"route over the layer's {num_experts} experts")


def assert_expert_ids(ids: torch.Tensor, num_experts: int, msg: str) -> None:
    """ids int [num_tokens, num_topk] must lie in [-1, num_experts); see
    ``LowLatencyOptions.check_expert_ids`` (no host sync). CPU: one min/max reduction read on
    the host. CUDA: clamped to the range, the ids are unchanged exactly when all lie in it, so
    four small kernels (clamp, in-place compare, all, the device-side assert) instead of the
    five of a min/max reduction compared twice."""
    if ids.is_cpu:  # the values are on the host already
        if ids.numel():
            lo, hi = torch.aminmax(ids)
            if int(lo) < -1 or int(hi) >= num_experts:
                raise ValueError(msg)
        return
    torch._assert_async(ids.clamp(-1, num_experts - 1).eq_(ids).all(), msg)
