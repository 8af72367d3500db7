"""What a step window (:func:`moe_plugins.callbound.watchdog.watch_step`) shares with the layer calls inside
it: the thread's open window, which a call's end reads to take the window's completion mark,
and the bounds of the process's layers, whose largest is the window's bound."""
from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

__all__ = ["StepLocal", "LayerBounds"]


class StepLocal(threading.local):
    """The open step window of this thread (watch_step): (its call, stream handle, seq, device
    index), or None. A class attribute for the default: getattr with a default on a plain
    threading.local costs half a microsecond (an AttributeError) on every layer call."""

    window: Optional[tuple] = None


class LayerBounds:
    """Every layer bound that is on (:class:`moe_plugins.callbound.layer_bound.CallBound`, held weakly: a
    layer may be dropped), and the largest bound a call started now runs under, the bound of a
    step window (cached: asked once per step)."""

    def __init__(self) -> None:
        self._bounds: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._largest: Optional[float] = None
        self._stale = False

    def add(self, bound: Any) -> None:
        self._bounds.add(bound)
        weakref.finalize(bound, self.changed)
        self.changed()

    def changed(self) -> None:
        self._stale = True

    def largest(self) -> Optional[float]:
        """The largest current bound of the layers (None: no layer has a bound)."""
        if self._stale:
            self._stale = False  # first: a change while this computes marks it stale again
            self._largest = max((t for b in list(self._bounds)
                                 if (t := b.current_timeout_s()) is not None), default=None)
        return self._largest
