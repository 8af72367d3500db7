"""Backends side by side under the time model: which is fastest for a layout and batch
(:func:`compare_backends`), how the dispatch + combine time grows with tokens per DP group
(:func:`sweep_tokens`), and where the normal mode overtakes the low-latency one
(:func:`crossover_tokens`). Times are the busiest rank's, per MoE layer, of the strategy each
backend's plan recommends."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from moe_plugins.planner.plan import plan_layer
from moe_plugins.registry import Transport, registered_backends

__all__ = ["BackendTime", "compare_backends", "sweep_tokens", "crossover_backends",
           "crossover_tokens"]


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
                     if specs[n].transport is t and specs[n].transport_for is None), None)

    return first(Transport.LOW_LATENCY), first(Transport.NORMAL)


def crossover_tokens(token_counts: Sequence[int], points: Sequence[Sequence[BackendTime]],
                     low_latency: str, normal: str) -> tuple[Optional[float], str]:
    """Tokens per DP group where ``normal`` becomes as fast as ``low_latency`` (linear between
    the swept counts), and a sentence saying so. None when the sweep does not bracket it (the
    sentence says which side wins throughout) or a backend cannot serve the layer."""
    diff = []
    for n, row in zip(token_counts, points):
        times = {b.backend: b for b in row}
        for name in (low_latency, normal):
            if name not in times or not times[name].usable:
                why = times[name].reason if name in times else "not registered"
                return None, f"no crossover: {name} cannot serve the layer at {n} tokens ({why})"
        diff.append(times[normal].total_us - times[low_latency].total_us)
    if diff[0] <= 0:
        return None, (f"{normal} is as fast as {low_latency} or faster from the first swept "
                      f"count ({token_counts[0]} tokens)")
    for i in range(1, len(diff)):
        if diff[i] <= 0:
            n0, n1 = token_counts[i - 1], token_counts[i]
            at = n0 + (n1 - n0) * diff[i - 1] / (diff[i - 1] - diff[i])
            return at, (f"{normal} overtakes {low_latency} at about {at:.0f} tokens per DP group "
                        f"(between {n0} and {n1})")
    return None, (f"{low_latency} stays faster than {normal} up to {token_counts[-1]} tokens per "
                  "DP group")
