"""A layer that continues after an EP peer's loss (``MoELayer(on_peer_loss=PeerLossOptions())``).

Per call: the call counts itself in and out of the group's :class:`PeerWatch` (two integer
updates) and compares the watch's decision count with its own (an attribute read). A decision
taken before the call began is adopted first (recover, re-home) and the call is exact; one
taken while it was in flight ends it with :class:`PeerLostError` (retryable) after the same
adoption, so the next call is exact. Adopting: the survivors' recovery
(:meth:`PeerWatch.recover`, once per decision for all layers of the group), the layer's faults
on the survivors' host group, and :meth:`MoELayer.rebalance` to the survivors' placement
(:func:`moe_plugins.survival.rehoming.rehome`). A logical expert without a surviving replica
stops the layer (:class:`ExpertsLostError`) unless ``degraded`` is on: then one WARNING per
layer names it and the router leaves its terms out.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar

from moe_plugins.faults import LayerBrokenError, group_faults, in_step
from moe_plugins.backend_manager import RankMasking
from moe_plugins.survival.errors import ExpertsLostError, PeerLostError
from moe_plugins.survival.peer_watch import PeerWatch, peer_watch_for
from moe_plugins.survival.rehoming import rehome

__all__ = ["PeerLossOptions", "LayerContinuation"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class PeerLossOptions:
    """Continue after an EP peer's loss (docs/faults.md, "Continuing after a peer's loss").

    detect_s: a peer whose heartbeat did not change for this long while this rank has a call
        in flight is lost (seconds; above the longest time a rank's Python threads may be held
        up, e.g. by a long call that keeps the interpreter lock).
    beat_s: the heartbeat period (seconds, below ``detect_s / 4``).
    degraded: continue when a logical expert has no surviving replica (its terms are left out
        of the output); off: the layer stops with :class:`ExpertsLostError`.
    group_timeout_s: the survivors' host group's collective timeout (seconds).
    """

    detect_s: float = 3.0
    beat_s: float = 0.25
    degraded: bool = False
    group_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("detect_s", "beat_s", "group_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v <= 0:
                raise ValueError(f"PeerLossOptions.{name} must be a finite number of seconds "
                                 f"> 0, got {v!r}")
        if self.beat_s * 4 > self.detect_s:
            raise ValueError(f"PeerLossOptions: beat_s={self.beat_s:g} must be at most "
                             f"detect_s / 4 = {self.detect_s / 4:g} (a live peer beats several "
                             "times within the detection time); lower beat_s or raise detect_s")
        if not isinstance(self.degraded, bool):
            raise TypeError(f"PeerLossOptions.degraded must be a bool, got {self.degraded!r}")


def refusal(backend: Any, manager: Any, layout: Any, dispatches: bool) -> Optional[str]:
    """Why a layer cannot continue after a peer's loss (None: it can)."""
    if not backend.capabilities.rank_masking:
        return (f"backend {backend.name!r} cannot mask EP ranks (capability rank_masking); "
                "use deepep_ll with DeepEPLLOptions(enable_shrink=True) or nixl_ep")
    if not dispatches or manager is None:
        return f"layout {layout.describe()} does not dispatch through the backend (EP off)"
    if layout.tp != 1:
        return (f"layout {layout.describe()} has tp={layout.tp}: a lost rank's TP peers would "
                "wait in its TP collectives; continuing needs tp=1")
    if not isinstance(manager, RankMasking) or not manager.can_mask():
        return (f"backend {backend.name!r} was built without a rank mask; for deepep_ll build "
                "the layer with backend_options=DeepEPLLOptions(enable_shrink=True)")
    return None


class LayerContinuation:
    """The peer-loss state of one layer (built by ``MoELayer`` when ``on_peer_loss`` is
    given, after its backend; raises ValueError naming what is missing)."""

    def __init__(self, layer: Any, options: PeerLossOptions) -> None:
        if not isinstance(options, PeerLossOptions):
            raise TypeError(f"on_peer_loss must be a PeerLossOptions, got "
                            f"{type(options).__name__}; pass on_peer_loss=PeerLossOptions()")
        why = refusal(layer.backend_spec, layer.manager, layer.ctx.layout, layer.pf is not None)
        if why:
            raise ValueError(f"{layer.name}: cannot continue after a peer's loss: {why}")
        # a bound set by the user must outlive a faulted call's detection and recovery; the
        # backstop lies past the library's own timeout, which masks the lost peer (a detection
        # too: PeerWatch.declare) and so ends the faulted call first
        bound = None if layer._bound.is_backstop else layer._bound.timeout_s
        if bound is not None and bound < options.detect_s + options.group_timeout_s:
            raise ValueError(
                f"{layer.name}: the call bound ({bound:g} s) is shorter than a faulted call "
                f"may take under on_peer_loss: detection ({options.detect_s:g} s) plus the "
                f"survivors' recovery (group_timeout_s={options.group_timeout_s:g} s); raise "
                "the bound or lower PeerLossOptions.group_timeout_s / detect_s")
        self.options = options
        self.watch: PeerWatch = peer_watch_for(layer.ctx.ep_group, options.detect_s,
                                               options.beat_s, options.group_timeout_s)
        self.watch.register(layer.manager)
        self.epoch = self.watch.epoch
        self.stopped: Optional[str] = None  # why this layer can never run again
        self.warned = False
        #: per adoption: the lost ranks and experts, and time.time() when it was done
        self.adopted: list[dict] = []

    def call(self, layer: Any, fn: Callable[[Any], T], x: Any) -> T:
        """``fn(x)``, one call of ``layer``, under the peer-loss rules (module doc)."""
        watch = self.watch
        watch.check_lease()
        if self.stopped is not None:
            raise LayerBrokenError(f"{layer.name}: stopped after a peer's loss: {self.stopped}")
        if watch.epoch != self.epoch or watch.evicted:
            self._adopt(layer)  # a decision between calls: this call runs exact
        started = self.epoch
        watch.calls_in_flight += 1
        try:
            out = fn(x)
        except BaseException as e:
            if watch.epoch == started:
                raise
            raise self._faulted(layer) from e
        finally:
            watch.calls_in_flight -= 1
        watch.check_lease()  # stopped during the call: the group may have decided meanwhile
        if watch.epoch != started:
            raise self._faulted(layer)
        return out

    def library_masked(self, ranks: Sequence[int]) -> bool:
        """The library masked EP ``ranks`` on its own during the call in flight: they are
        declared to the group. True when a decision this layer has not adopted yet stands
        (this declaration's, or one the watch's thread took meanwhile), so the call ends in
        PeerLostError, not PeerMaskedError."""
        self.watch.declare(ranks)
        return self.watch.epoch != self.epoch

    def _faulted(self, layer: Any) -> BaseException:
        """The error of a call in flight during a decision, after adopting it."""
        lost = self._adopt(layer)
        return in_step(PeerLostError(
            f"{layer.name}: EP ranks {list(lost['ranks'])} were lost during this call (no "
            f"heartbeat for {self.options.detect_s:g} s); its result is not returned. Every "
            "survivor masked them, re-homed their experts to replicas on surviving ranks and "
            "continues on a host group of the survivors: the layer continues, call again"
            + (f" (degraded: logical experts {list(lost['experts'])} have no surviving replica "
               "and are left out)" if lost["experts"] else ""),
            tuple(lost["ranks"]), tuple(lost["experts"])))

    def _adopt(self, layer: Any) -> dict:
        """Recover with the survivors, move the layer onto their group, re-home its experts."""
        watch = self.watch
        epoch = watch.epoch
        watch.recover(layer.name)  # RankEvictedError on an evicted rank
        plan = rehome(layer.placement, watch.lost)
        self.epoch = epoch
        layer.faults = group_faults(watch.host_group)
        layer._bound.notice = layer.faults.notice if layer._bound.notice is not None else None
        lost = dict(ranks=plan.lost_ranks, experts=plan.lost_experts, at=time.time())
        self.adopted.append(lost)
        if plan.lost_experts and not self.options.degraded:
            self.stopped = (f"logical experts {list(plan.lost_experts)} had every replica on "
                            f"lost EP ranks {list(plan.lost_ranks)}")
            raise ExpertsLostError(
                f"{layer.name}: cannot continue: {self.stopped}, so no later call could be "
                "exact. Place each logical expert on at least two ranks (EPLB's redundant "
                "experts), or opt into PeerLossOptions(degraded=True) to serve without them",
                plan.lost_ranks, plan.lost_experts)
        if plan.lost_experts and not self.warned:
            self.warned = True
            logger.warning("%s: degraded: logical experts %s have no replica on a surviving "
                           "rank (lost EP ranks %s); their terms are left out of the output",
                           layer.name, list(plan.lost_experts), list(plan.lost_ranks))
        layer.rebalance(plan.placement)
        return lost

    def close(self, manager: Any) -> None:
        """The layer is destroyed: a buffer whose teardown waits for every rank is left as is
        once the group lost a rank (on survivors and an evicted rank alike: each knows the
        decision, so none waits for the others' teardown)."""
        if self.watch.lost:
            manager.peers_lost(self.watch.lost)
        self.watch.unregister(manager)
