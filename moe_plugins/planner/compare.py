"""Backends side by side under the time model: which is fastest for a layout and batch
(:func:`compare_backends`), how the dispatch + combine time grows with tokens per DP group
(:func:`sweep_tokens`), and which two backends the low-latency / normal-mode crossover is read
between (:func:`crossover_backends`; the crossover itself:
:func:`moe_plugins.planner.crossover.mode_crossover`). Times are the busiest rank's, per MoE
layer, of the strategy each backend's plan recommends."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from moe_plugins.planner.plan import plan_layer
from moe_plugins.registry import Transport, registered_backends

__all__ = ["BackendTime", "compare_backends", "sweep_tokens", "crossover_backends"]


@dataclass(frozen=True)
class BackendTime:
    """One backend at one batch: its transport and dispatch / combine time (us), or why it
    cannot serve the layer (``reason``; the times are then None)."""

    backend: str
    transport: Optional[Transport]
    dispatch_us: Optional[float]
    combine_us: Optional[float]
    reason: str = ""

    @property
    def usable(self) -> bool:
        return not self.reason

    @property
    def total_us(self) -> float:
        """dispatch + combine (us); infinite for a backend that cannot serve the layer."""
        if self.dispatch_us is None or self.combine_us is None:
            return float("inf")
        return self.dispatch_us + self.combine_us


def compare_backends(model: Any, layout: Any, num_tokens: int | Sequence[int], quant: Any,
                     backends: Optional[Sequence[str]] = None, **plan_kw: Any
                     ) -> list[BackendTime]:
    """Plan ``model`` on ``layout`` with every registered backend (or ``backends``) and return
    their times, fastest first, the ones that cannot serve the layer last (with the reason the
    plan gave). ``plan_kw`` go to :func:`plan_layer` (``link``, ``placement``, ...)."""
    specs = registered_backends()
    names = sorted(specs) if backends is None else list(backends)
    out = []
    for name in names:
        try:
            plan = plan_layer(model, layout, num_tokens, specs[name], quant, **plan_kw)
        except ValueError as e:
            out.append(BackendTime(name, None, None, None, str(e)))
            continue
        t = plan.recommended.time
        out.append(BackendTime(name, plan.transport, t.dispatch_us, t.combine_us))
    return sorted(out, key=lambda b: (not b.usable, b.total_us, b.backend))


def sweep_tokens(model: Any, layout: Any, token_counts: Sequence[int], quant: Any,
                 backends: Optional[Sequence[str]] = None, **plan_kw: Any
                 ) -> list[list[BackendTime]]:
    """:func:`compare_backends` at each count of tokens per DP group, in the order given."""
    if not token_counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                               for n in token_counts):
        raise ValueError(f"token counts must be integers >= 1, got {list(token_counts)!r}; "
                         "pass e.g. 1,8,64,512,4096")
    return [compare_backends(model, layout, n, quant, backends, **plan_kw) for n in token_counts]


def crossover_backends() -> tuple[Optional[str], Optional[str]]:
    """(low-latency backend, normal-mode backend) the crossover is read between: the first
    registered, by name, whose transport is fixed to that family."""
    specs = registered_backends()

    def first(t: Transport) -> Optional[str]:
        return next((n for n in sorted(specs)
                     if specs[n].transport is t and specs[n].call_modes is None), None)

    return first(Transport.LOW_LATENCY), first(Transport.NORMAL)
