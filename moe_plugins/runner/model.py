"""A DeepSeek/Qwen-style MoE layer's weights, the router, and how ranks shard them (the shape
is :class:`moe_plugins.config.MoEConfig`)."""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from moe_plugins.config import MoEConfig
from moe_plugins.placement import ExpertPlacement

__all__ = ["MoEWeights", "ExpertWeights", "SharedWeights", "route"]


@dataclass(frozen=True)
class ExpertWeights:
    """Routed experts held by one rank. w13: [num_local_experts, 2 * inter, hidden] (gate rows
    then up rows); w2: [num_local_experts, hidden, inter]; first_expert: physical id of local 0."""

    w13: torch.Tensor
    w2: torch.Tensor
    first_expert: int = 0

    @property
    def num_local_experts(self) -> int:
        return self.w13.shape[0]


@dataclass(frozen=True)
class SharedWeights:
    """w13: [2 * inter, hidden]; w2: [hidden, inter]; gate: [1, hidden] or None.
    ``partial``: the weights are a TP shard, so outputs are partial sums over TP."""

    w13: torch.Tensor
    w2: torch.Tensor
    gate: Optional[torch.Tensor]
    partial: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] -> gated shared-expert output [num_tokens, hidden], x.dtype.
        With TP-sharded weights the gate multiplies the partial (gate * sum(p) == sum(gate * p))."""
        xf = x.float()
        g, u = (xf @ self.w13.float().t()).chunk(2, dim=-1)
        y = (F.silu(g) * u) @ self.w2.float().t()
        if self.gate is not None:
            y = y * torch.sigmoid(xf @ self.gate.float().t())
        return y.to(x.dtype)


def _shard_inter(w13: torch.Tensor, w2: torch.Tensor, parts: int, index: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the intermediate dim of a SwiGLU (w13 [..., 2I, H], w2 [..., H, I]) in ``parts``."""
    inter = w2.shape[-1]
    if inter % parts:
        raise ValueError(f"intermediate size {inter} is not divisible by tp={parts}")
    s = slice(index * inter // parts, (index + 1) * inter // parts)
    gate, up = w13.chunk(2, dim=-2)
    return torch.cat([gate[..., s, :], up[..., s, :]], dim=-2).contiguous(), w2[..., s].contiguous()


@dataclass(frozen=True)
class MoEWeights:
    """Full (unsharded) weights of one layer. router: [num_experts, hidden]; w13: [num_experts,
    2 * intermediate, hidden]; w2: [num_experts, hidden, intermediate]; shared_*: see SharedWeights."""

    config: MoEConfig
    router: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    shared_w13: Optional[torch.Tensor]
    shared_w2: Optional[torch.Tensor]
    shared_gate: Optional[torch.Tensor]

    @classmethod
    def random(cls, cfg: MoEConfig, seed: int = 0) -> "MoEWeights":
        """Deterministic weights scaled so every output is O(1) and each expert differs."""
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape: int, fan_in: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) / fan_in ** 0.5).to(cfg.dtype)

        h, e, i, s = cfg.hidden, cfg.num_experts, cfg.intermediate, cfg.shared_intermediate
        has_shared = cfg.has_shared_expert
        return cls(
            config=cfg,
            router=rnd(e, h, fan_in=h) * 4,  # peaked router: a wrong expert shows in the output
            w13=rnd(e, 2 * i, h, fan_in=h) * 2,
            w2=rnd(e, h, i, fan_in=i) * 2,
            shared_w13=rnd(2 * s, h, fan_in=h) * 2 if has_shared else None,
            shared_w2=rnd(h, s, fan_in=s) * 2 if has_shared else None,
            shared_gate=rnd(1, h, fan_in=h) if has_shared and cfg.shared_gate else None,
        )

    def to(self, device: "torch.device | str") -> "MoEWeights":
        """The same weights with every tensor on ``device``."""
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)})

    def local_experts(self, ep_size: int, ep_rank: int,
                      placement: Optional[ExpertPlacement] = None) -> ExpertWeights:
        """The whole experts EP rank ``ep_rank`` holds: its physical slots' logical experts
        under ``placement`` (None: linear, a contiguous block of num_experts / ep_size)."""
        if placement is None:
            placement = ExpertPlacement.linear(self.config.num_experts, ep_size)
        if placement.num_ranks != ep_size or placement.num_logical != self.config.num_experts:
            raise ValueError(f"placement {placement.describe()} over {placement.num_ranks} ranks "
                             f"does not fit this layer ({self.config.num_experts} experts, EP size "
                             f"{ep_size})")
        held = torch.tensor(placement.local_logical(ep_rank), device=self.w13.device)
        return ExpertWeights(self.w13[held].contiguous(), self.w2[held].contiguous(),
                             ep_rank * placement.num_local)

    def tp_sharded_experts(self, tp: int, tp_rank: int) -> ExpertWeights:
        """Every expert, intermediate dim split over TP (EP off)."""
        w13, w2 = _shard_inter(self.w13, self.w2, tp, tp_rank)
        return ExpertWeights(w13, w2, 0)

    def shared(self, tp: int = 1, tp_rank: int = 0) -> Optional[SharedWeights]:
        """The shared expert: TP shard ``tp_rank`` of ``tp`` (tp == 1: replicated / whole)."""
        if self.shared_w13 is None or self.shared_w2 is None:
            return None
        w13, w2 = _shard_inter(self.shared_w13, self.shared_w2, tp, tp_rank)
        return SharedWeights(w13, w2, self.shared_gate, partial=tp > 1)


def route(x: torch.Tensor, router: torch.Tensor, num_topk: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k router. x [num_tokens, hidden] -> (topk_weights float32 [num_tokens, num_topk],
    topk_ids int64 [num_tokens, num_topk]). Computed on all tokens of the DP group, before any
    slicing, so every strategy routes identically."""
    probs = torch.softmax(x.float() @ router.float().t(), dim=-1)
    w, ids = probs.topk(num_topk, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids
