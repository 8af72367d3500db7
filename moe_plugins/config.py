"""Per-layer dispatch configuration handed to a backend's manager and prepare/finalize."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from moe_plugins.placement import ExpertPlacement
from moe_plugins.quant import QuantSpec

__all__ = ["DispatchConfig"]


@dataclass(frozen=True)
class DispatchConfig:
    """num_experts: experts of the layer (global); hidden: model width; num_topk: experts per
    token; max_tokens_per_rank: the most tokens one rank dispatches in a call (buffer sizing);
    dtype: activation dtype; quant: dispatch quantization; backend_options: the backend's own
    typed options dataclass (e.g. NixlEP's store group), None for its defaults; each backend
    checks the type it expects and raises TypeError naming it. placement: where the experts are
    (:class:`moe_plugins.placement.ExpertPlacement`, ``num_experts`` logical experts); None is
    linear. Backends dispatch PHYSICAL ids and read only the slot geometry (``num_ranks``,
    ``num_local``), which an EPLB rebalance keeps."""

    num_experts: int
    hidden: int
    num_topk: int
    max_tokens_per_rank: int = 256
    dtype: torch.dtype = torch.bfloat16
    quant: QuantSpec = field(default_factory=QuantSpec)
    backend_options: Any = None
    placement: Optional[ExpertPlacement] = None

    def __post_init__(self) -> None:
        for name in ("num_experts", "hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DispatchConfig.{name} must be a positive int, got {value!r}; "
                                 "give the layer's size")
        if self.num_topk < 1 or self.num_topk > self.num_experts:
            raise ValueError(f"num_topk must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_topk}")
        if self.max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank must be >= 1, got {self.max_tokens_per_rank}")
        self.quant.check_hidden(self.hidden)
        if self.placement is not None and self.placement.num_logical != self.num_experts:
            raise ValueError(f"the placement holds {self.placement.num_logical} logical experts, "
                             f"the layer has num_experts={self.num_experts}; build the placement "
                             "for this layer's experts")

    def placement_for(self, num_ranks: int) -> ExpertPlacement:
        """The placement over an EP group of ``num_ranks`` (linear when none was given)."""
        if self.placement is None:
            return ExpertPlacement.linear(self.num_experts, num_ranks)
        if self.placement.num_ranks != num_ranks:
            raise ValueError(f"the placement spreads experts over {self.placement.num_ranks} EP "
                             f"ranks, the EP group has {num_ranks}; build it for this group")
        return self.placement
