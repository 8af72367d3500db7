"""A MoE layer's configuration: its shape (:class:`MoEConfig`, what the planner, the runner and
the vLLM glue describe a layer by) and the dispatch configuration handed to a backend's manager
and prepare/finalize (:class:`DispatchConfig`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from moe_plugins.placement import ExpertPlacement
from moe_plugins.quant import QuantSpec

__all__ = ["MoEConfig", "DispatchConfig"]


@dataclass(frozen=True)
class MoEConfig:
    """hidden: model width; num_experts routed experts of ``intermediate`` each; num_topk experts
    per token (softmax top-k, renormalized when ``renormalize``); one shared expert of
    ``shared_intermediate`` (0: none), with a sigmoid gate when ``shared_gate``; dtype: the
    activations' and weights' dtype (the layer's input and output are [num_tokens, hidden] of
    it). ValueError for a top-k outside [1, num_experts] or a non-positive size."""

    hidden: int = 256
    num_experts: int = 8
    num_topk: int = 2
    intermediate: int = 64
    shared_intermediate: int = 128
    shared_gate: bool = True
    renormalize: bool = True
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not 1 <= self.num_topk <= self.num_experts:
            raise ValueError(f"num_topk must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_topk}")
        if min(self.hidden, self.num_experts, self.intermediate) < 1 or self.shared_intermediate < 0:
            raise ValueError(f"MoE sizes must be positive: {self}")

    @property
    def has_shared_expert(self) -> bool:
        """True when the layer has a shared expert (``shared_intermediate > 0``)."""
        return self.shared_intermediate > 0


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
        """Every field's type and range (bool is not an int); the backend checks
        ``backend_options`` itself."""
        _positive_int("num_experts", self.num_experts, "give the layer's number of (logical) "
                      "experts")
        _positive_int("hidden", self.hidden, "give the layer's size")
        _positive_int("num_topk", self.num_topk, "give the number of experts each token is "
                      "routed to")
        if self.num_topk > self.num_experts:
            raise ValueError(f"DispatchConfig.num_topk must be in [1, num_experts="
                             f"{self.num_experts}], got {self.num_topk}; a token is routed to "
                             "at most every expert once")
        _positive_int("max_tokens_per_rank", self.max_tokens_per_rank,
                      "give the most tokens one rank dispatches in a call (buffers are sized "
                      "for it)")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"DispatchConfig.dtype must be a torch.dtype, got {self.dtype!r} "
                            f"({type(self.dtype).__name__}); pass e.g. torch.bfloat16")
        if not self.dtype.is_floating_point:
            raise ValueError(f"DispatchConfig.dtype must be a floating-point activation dtype, "
                             f"got {self.dtype}; pass the model's activation dtype, e.g. "
                             "torch.bfloat16")
        if not isinstance(self.quant, QuantSpec):
            raise TypeError(f"DispatchConfig.quant must be a QuantSpec, got {self.quant!r} "
                            f"({type(self.quant).__name__}); pass e.g. "
                            "QuantSpec(QuantScheme.FP8_BLOCK128), or QuantSpec() for none")
        self.quant.check_hidden(self.hidden)
        if self.placement is not None and not isinstance(self.placement, ExpertPlacement):
            raise TypeError(f"DispatchConfig.placement must be an ExpertPlacement or None, got "
                            f"{type(self.placement).__name__}; build one with "
                            "ExpertPlacement.linear / round_robin / eplb")
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


def _positive_int(name: str, value: Any, fix: str) -> None:
    """TypeError unless ``value`` is an int (not a bool), ValueError unless it is >= 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"DispatchConfig.{name} must be a positive int, got {value!r} "
                        f"({type(value).__name__}); {fix}")
    if value < 1:
        raise ValueError(f"DispatchConfig.{name} must be a positive int, got {value!r}; {fix}")
