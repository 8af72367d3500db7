"""The bound of one layer's calls (:class:`CallBound`, one per layer): which bound a call runs
under, and where none is set, the backstop. The watchdog that enforces it:
:mod:`moe_plugins.callbound.watchdog`.

Start-up. A layer's first calls include JIT builds, vLLM's profile run and peers that are still
compiling: until a call of the layer after its first has completed (then every peer has entered
that call, so every peer finished its first), its calls run under the start-up bound
(``first_call_timeout_s`` / ``$MOE_PLUGINS_FIRST_CALL_TIMEOUT_S``, default
``max(10 x bound, 600 s)``), stated in the layers' INFO line.

The backstop. With no bound set by the user, a layer whose library waits on a peer with a
timeout of its own is bounded anyway (:meth:`CallBound.backstop`): under that timeout where the
library traps (the process would lose its CUDA context, and on a shared GPU some ranks never
trap), past it where the library masks the peer or raises, so its own outcome comes first.
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_plugins.callbound.fault_notice import FaultNotice
from moe_plugins.callbound.settings import (CALL_TIMEOUT_ENV, UNSET, call_timeout_seconds,
                                             environment_seconds, first_call_timeout_seconds)
from moe_plugins.callbound.watchdog import WatchedCall, bound_on, bounds_changed, watch_call

__all__ = ["CallBound", "BACKSTOP_TRAP_FRACTION", "BACKSTOP_GRACE_S"]

#: The backstop of a layer whose library traps at its own timeout, as a fraction of that timeout
#: (:meth:`CallBound.backstop`): DeepEP's 100 s give 90 s, a DeepEP built with 300 s 270 s.
BACKSTOP_TRAP_FRACTION = 0.9
#: The backstop of a layer whose library masks a peer or raises at its own timeout: this many
#: seconds after that timeout (:meth:`CallBound.backstop`).
BACKSTOP_GRACE_S = 20.0


class CallBound:
    """The bound of one layer's calls (the layer holds one): :meth:`watch` starts a call.

    ``timeout_s`` and ``first_timeout_s`` as resolved by :func:`call_timeout_seconds` and
    :func:`first_call_timeout_seconds`; ``device``: the layer's (on CUDA, with the bound on, the
    progress buffer is made here, with a CUDA context current on this thread). A call runs
    under the start-up bound until one of the layer's calls after its first has completed
    (every peer entered that call, so every peer finished its first one); from then on under
    ``timeout_s``."""

    __slots__ = ("name", "timeout_s", "first_timeout_s", "notice", "why", "_note", "_set",
                 "_device", "_first_given", "_warm", "_proof", "_proof_seq", "__weakref__")

    def __init__(self, name: str, call_timeout_s: Optional[float] = None,
                 first_call_timeout_s: Optional[float] = None,
                 device: Optional[torch.device] = None) -> None:
        self.name = name
        # set by the user (a bound, or 0 for none), as the argument or in the environment: then
        # no backstop (see backstop)
        self._set = (call_timeout_s is not None
                     or environment_seconds(CALL_TIMEOUT_ENV) is not UNSET)
        self._device, self._first_given = device, first_call_timeout_s
        self.why = ""  # where the bound comes from when the user set none (the backstop)
        self._note = ""  # the same, for the INFO line
        self.timeout_s: Optional[float] = None
        self.first_timeout_s: Optional[float] = None
        self._warm = True
        self._proof: Optional[WatchedCall] = None  # the layer's first call after its first
        self._proof_seq = -1
        # the layer's EP group's notice of a peer's failure (moe_plugins.callbound.fault_notice):
        # the layer sets it once it has its group
        self.notice: Optional[FaultNotice] = None
        self._turn_on(call_timeout_seconds(call_timeout_s))

    def _turn_on(self, timeout_s: Optional[float], bound_why: str = "") -> None:
        self.timeout_s = timeout_s
        self.first_timeout_s = first_call_timeout_seconds(timeout_s, self._first_given,
                                                          bound_why)
        self._warm = timeout_s is None or self.first_timeout_s == timeout_s
        if timeout_s is not None:
            bound_on(self, self._device)

    def backstop(self, library: str, library_timeout_s: Optional[float], traps: bool,
                 start_up: bool = True) -> None:
        """With no bound set by the user (neither the argument nor the environment; 0 there is
        a choice too), bound the calls anyway where the library's own timeout does not end every
        rank: ``library`` waits ``library_timeout_s`` seconds for a peer, then ``traps`` (its
        kernels trap, the CUDA context is lost, and on a GPU shared by several ranks a rank may
        not trap at all) or masks the peer / raises. A library that traps gets the backstop
        :data:`BACKSTOP_TRAP_FRACTION` of its timeout, so the process ends with this package's
        error before the trap; one that masks or raises gets :data:`BACKSTOP_GRACE_S` after its
        timeout, so its own outcome comes first. None (no timeout known): nothing.
        ``start_up``: the layer's first calls keep the start-up bound (a caller whose watched
        calls include work that compiles on first use: vLLM's experts run inside the adapter's
        call); False: every call runs under the backstop from the first (a wait on a peer longer
        than that ends in the library's own timeout anyway)."""
        if self._set or self.timeout_s is not None or library_timeout_s is None:
            return
        if traps:
            seconds = BACKSTOP_TRAP_FRACTION * library_timeout_s
            self.why = (f"no call bound was set; this is moe-plugins' backstop under {library}'s "
                        f"own timeout (about {library_timeout_s:g} s), after which its kernels "
                        "trap and this process's CUDA context is lost")
            self._note = f"under {library}'s {library_timeout_s:g} s timeout"
        else:
            seconds = library_timeout_s + BACKSTOP_GRACE_S
            self.why = (f"no call bound was set; this is moe-plugins' backstop "
                        f"{BACKSTOP_GRACE_S:g} s past {library}'s own timeout (about "
                        f"{library_timeout_s:g} s), which did not end the call")
            self._note = f"past {library}'s {library_timeout_s:g} s timeout"
        # one rule with or without a start-up window: a start-up bound given below the
        # backstop is refused alike (the message says the bound is the backstop)
        bound_why = f": no call bound was set; this is moe-plugins' backstop {self._note}"
        first_call_timeout_seconds(seconds, self._first_given, bound_why)
        if not start_up:
            self._first_given = 0  # no separate start-up bound
        self._turn_on(seconds, bound_why)

    def current_timeout_s(self) -> Optional[float]:
        """The bound a call started now runs under (the start-up bound until the layer is warm;
        None: off)."""
        return self.timeout_s if self._warm else self.first_timeout_s

    @property
    def is_backstop(self) -> bool:
        """The bound is the backstop (no bound set by the user): it follows the library's own
        timeout, which ends a call first."""
        return bool(self.why)

    def describe(self) -> str:
        """For the layers' INFO line: ``off``, or the bound and the start-up bound."""
        if self.timeout_s is None:
            return "off"
        text = f"{self.timeout_s:g} s (first calls {self.first_timeout_s:g} s)"
        return f"{text}: no bound set, the backstop {self._note}" if self._note else text

    def watch(self, number: int) -> Optional[WatchedCall]:
        """Watch call ``number`` of the layer (None: not watched)."""
        if self._warm:
            return watch_call(self.name, number, self.timeout_s, "call", self.notice, self.why)
        return self._watch_starting(number)

    def _watch_starting(self, number: int) -> Optional[WatchedCall]:
        proof = self._proof
        if proof is not None and (proof.seq != self._proof_seq or proof.finished()):
            self._warm = True  # completed (or lapped by the ring: long since done)
            bounds_changed()
            return watch_call(self.name, number, self.timeout_s, "call", self.notice, self.why)
        call = watch_call(self.name, number, self.first_timeout_s, "start-up call", self.notice,
                          self.why)
        if proof is None and call is not None and number >= 2:
            self._proof, self._proof_seq = call, call.seq
        return call
