"""Where DeepEP's normal mode overtakes its low-latency mode under the time model: the smallest
batch at which the normal-mode dispatch + combine takes less time than the low-latency one
(:func:`mode_crossover`), and the threshold a per-call backend switches modes at
(:func:`low_latency_threshold`). ``moe-plugins plan --sweep-tokens`` prints the first, a
``deepep_auto`` layer built with a link (and the plan of one) uses the second, so the two
agree.

Under uniform routing every count of rows grows in proportion to the batch, so each mode's time
is a fixed part plus a part proportional to the batch (transport_time's families are sums and
maxima of such terms): the difference of the two is monotone in the batch, and a bisection over
integers finds the exact first batch where normal mode is faster."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from moe_plugins.config import MoEConfig
from moe_plugins.layout import ParallelLayout, owned_rows
from moe_plugins.placement import ExpertPlacement
from moe_plugins.planner.all_to_all import plan_all_to_all
from moe_plugins.planner.link_model import LinkModel
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import BackendSpec, CallModes

__all__ = ["SEARCH_LIMIT", "Crossover", "ModeThreshold", "mode_crossover",
           "low_latency_threshold"]

#: The largest batch (tokens per DP group) the crossover is searched up to.
SEARCH_LIMIT = 1 << 20


@dataclass(frozen=True)
class Crossover:
    """``tokens``: the smallest count of tokens per DP group at which ``normal``'s dispatch +
    combine (busiest rank) is below ``low_latency``'s; None when there is none up to ``limit``,
    or when a backend cannot serve the layer (``reason`` says why). ``tp``: the layout's TP
    size (a rank owns ceil(tokens / tp) of them). ``bound``: why the search stopped at
    ``limit`` below :data:`SEARCH_LIMIT` (the low-latency backend's token limit), or ""."""

    low_latency: str
    normal: str
    tokens: Optional[int]
    limit: int
    tp: int = 1
    reason: str = ""
    bound: str = ""

    @property
    def rows_per_rank(self) -> Optional[int]:
        """The busiest rank's rows at :attr:`tokens`."""
        return None if self.tokens is None else owned_rows(self.tokens, self.tp, 0).chunk

    @property
    def text(self) -> str:
        if self.reason:
            return f"no crossover: {self.reason}"
        if self.tokens is None:
            return (f"{self.low_latency} stays faster than {self.normal} up to {self.limit} "
                    "tokens per DP group" + (f", {self.bound}" if self.bound else ""))
        if self.tokens == 1:
            return f"{self.normal} is faster than {self.low_latency} from 1 token per DP group"
        per_rank = "" if self.tp == 1 else f" ({self.rows_per_rank} rows per rank)"
        return (f"{self.normal} overtakes {self.low_latency} at {self.tokens} tokens per DP "
                f"group{per_rank}")


def _total_us(cfg: MoEConfig, layout: ParallelLayout, tokens: int, backend: BackendSpec,
              quant: QuantSpec, link: LinkModel, placement: Optional[ExpertPlacement]) -> float:
    """Dispatch + combine (us, busiest rank) of ``tokens`` per DP group on ``backend``."""
    owned = [owned_rows(tokens, layout.tp, layout.tp_rank(r)).num_owned
             for r in range(layout.world_size)]
    return sum(plan_all_to_all(cfg, layout, owned, backend, quant, link, max_tokens=max(owned),
                               placement=placement).times())


def mode_crossover(cfg: MoEConfig, layout: ParallelLayout, quant: QuantSpec,
                   low_latency: BackendSpec, normal: BackendSpec, link: LinkModel,
                   placement: Optional[ExpertPlacement] = None,
                   limit: int = SEARCH_LIMIT) -> Crossover:
    """The batch (tokens per DP group, EP on) at which ``normal`` becomes faster than
    ``low_latency`` for this layer shape, quant and link (see the module doc), searched up to
    ``limit`` and no further than the low-latency backend takes (its ``token_limit``, e.g.
    DeepEP's QP depth); each backend's own checks run as the plan runs them, and one that
    refuses the layer gives a crossover of None with its error as ``reason``."""
    bound = ""
    taken = (low_latency.token_limit(layout.ep_size) if low_latency.token_limit is not None
             else None)
    if taken is not None and taken.tokens * layout.tp < limit:
        limit = taken.tokens * layout.tp
        bound = f"the most {low_latency.name} takes per rank ({taken.reason})"
    return _crossover(cfg, layout, quant, low_latency, normal, link, placement, limit, bound)


@functools.lru_cache(maxsize=256)
def _crossover(cfg: MoEConfig, layout: ParallelLayout, quant: QuantSpec,
               low_latency: BackendSpec, normal: BackendSpec, link: LinkModel,
               placement: Optional[ExpertPlacement], limit: int, bound: str) -> Crossover:
    result = functools.partial(Crossover, low_latency.name, normal.name, limit=limit,
                               tp=layout.tp, bound=bound)
    if limit < 1:
        return result(None, reason=f"{low_latency.name} takes no tokens: {bound}")

    def faster(n: int) -> bool:  # normal mode strictly faster at n tokens per DP group
        return (_total_us(cfg, layout, n, normal, quant, link, placement)
                < _total_us(cfg, layout, n, low_latency, quant, link, placement))

    try:
        if faster(1):
            return result(1)
        if not faster(limit):
            return result(None)
    except ValueError as e:
        return result(None, reason=str(e))
    lo, hi = 1, limit  # not faster at lo, faster at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if faster(mid) else (mid, hi)
    return result(hi)


@dataclass(frozen=True)
class ModeThreshold:
    """Where a per-call backend switches: a call takes the low-latency mode when its busiest
    rank has at most ``rows`` rows, normal mode above. ``rows`` is the crossover's batch less
    one, at most ``capacity`` (the low-latency buffers' rows per rank)."""

    rows: int
    capacity: int
    crossover: Crossover
    link: LinkModel

    @property
    def reason(self) -> str:
        c, link = self.crossover, self.link.name or "(link flags)"
        if c.tokens is None:
            return (f"the time model (link {link}) keeps {c.low_latency} faster than "
                    f"{c.normal} up to {c.limit} rows per rank: the low-latency capacity")
        if c.tokens > self.capacity:
            return (f"the time model (link {link}) puts {c.normal} below {c.low_latency} from "
                    f"{c.tokens} rows per rank, above the low-latency capacity: the capacity")
        return (f"the time model (link {link}) puts {c.normal} below {c.low_latency} from "
                f"{c.tokens} rows per rank")


def low_latency_threshold(cfg: MoEConfig, ep_size: int, quant: QuantSpec, link: LinkModel,
                          modes: CallModes, capacity: int) -> ModeThreshold:
    """The threshold of a per-call layer of shape ``cfg`` over ``ep_size`` EP ranks with
    low-latency buffers of ``capacity`` rows per rank: the rows below :func:`mode_crossover`
    (on dp = ep_size, tp = 1, where tokens per DP group are rows per rank), at most the
    capacity. Depends only on its arguments (the low-latency backend's token limit, which
    bounds the search, is at least any capacity its manager builds), so ranks that agree on
    them agree on the threshold. ValueError when a mode's backend or the link cannot serve the
    layer."""
    c = mode_crossover(cfg, ParallelLayout(ep_size, 1, True), quant, modes.low_latency,
                       modes.normal, link, None, max(SEARCH_LIMIT, capacity + 1))
    if c.reason:
        raise ValueError(f"the time model cannot price this layer's modes: {c.reason}")
    rows = capacity if c.tokens is None else min(c.tokens - 1, capacity)
    return ModeThreshold(rows, capacity, c, link)
