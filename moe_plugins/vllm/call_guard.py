"""What happens around each call of vLLM's prepare/finalize over our backends when it goes wrong
(docs/design.md, "Faults"): the call state of each micro-batch between prepare and finalize,
the call bound watching it, a rank's refusal of its inputs, and the library's own timeout turned
into what it means. :class:`moe_plugins.vllm.prepare_finalize.MoEPluginsPrepareAndFinalize`
moves the tokens; this guards its calls.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from moe_plugins.callbound import CallBound, WatchedCall, bound_host_waits
from moe_plugins.faults import (GroupFaults, call_fault_error, in_step, is_in_step,
                                is_owed_call)
from moe_plugins.groups import DistContext
from moe_plugins.interface import PrepareFinalize
from moe_plugins.layout import OwnedRows

__all__ = ["Call", "CallGuard"]

# Per-call state between prepare and finalize (one per micro-batch), a plain tuple (made on
# every call): (rows: the owned rows, None where the adapter is ``whole``; topk_ids and
# topk_weights: the routing handed to the backend's prepare, which its finalize must get;
# owns_all: this TP rank owns every row, nothing to slice out of, or zero around, the output;
# refusal: None, or the error of inputs this rank refused, raised by finalize once the call
# went through without this rank's tokens; watched: the call under the call bound, or None).
Call = tuple


class CallGuard:
    """The calls in flight of one adapted layer, one per micro-batch id, and the rules of a call
    that fails (moe_plugins.faults).

    ``backends``: the backend object of each micro-batch id (empty: no dispatch);
    ``faults``: the EP group's fault state, shared with the backends; ``calls``: micro-batch id
    -> its :data:`Call` in flight. The bound on each call (``$MOE_PLUGINS_CALL_TIMEOUT_S``, else
    the backstop under the library's own timeout) is set up here."""

    def __init__(self, name: str, backend_name: str, ctx: DistContext,
                 backends: Sequence[PrepareFinalize], faults: GroupFaults) -> None:
        self.name, self.backend_name, self.ctx = name, backend_name, ctx
        self.backends = tuple(backends)
        self.faults = faults
        self.calls: dict[int, Call] = {}
        self.bound = CallBound(name, device=ctx.device)
        # the watchdog hears the group's notice unless the backends' waits do (they raise)
        if not (self.backends and all(b.hears_peer_failures for b in self.backends)):
            self.bound.notice = faults.notice
        if self.backends:  # no bound set: where the library's timeout does not end a rank
            # (the first calls keep the start-up bound: vLLM's experts, inside the watched
            # call, compile on first use)
            self.bound.backstop(backend_name, self.backends[0].library_timeout_s,
                                self.backends[0].library_traps)

    def no_slot(self, ubatch: int) -> None:
        """Micro-batch ``ubatch`` called a layer with no backend object for it."""
        raise RuntimeError(
            f"micro-batch {ubatch} called layer backend {self.backend_name!r}, which was "
            f"built with {len(self.backends)} call slot(s); build it under the vLLM config "
            "that enables dual-batch overlap (--enable-dbo), with a backend whose "
            "capabilities list micro_batch")

    def open(self, slot: int, backend: PrepareFinalize, call_number: int, rows: Optional[OwnedRows],
             ids: torch.Tensor, weights: torch.Tensor, owns_all: bool,
             refusal: Optional[BaseException]) -> Optional[WatchedCall]:
        """Register micro-batch ``slot``'s call before its dispatch is issued (a receive that
        raises leaves it for the next prepare to reset); returns its watch, if bounded."""
        watched = self.bound.watch(call_number)
        if watched is not None and backend.waits_on_host:
            bound_host_waits(watched)  # the library may wait on the host holding the interpreter
        self.calls[slot] = (rows, ids, weights, owns_all, refusal, watched)
        return watched

    def send_failed(self, slot: int, backend: PrepareFinalize, watched: Optional[WatchedCall],
                    call: int, error: BaseException) -> None:
        """The dispatch of ``slot`` raised ``error``: forget a call with nothing in flight, end
        its watch (the error reached the caller), and raise a library timeout as what it
        means. Returns where the caller re-raises ``error``."""
        if is_in_step(error) or is_owed_call(error):  # nothing in flight: nothing to reset later
            del self.calls[slot]
        self.end_watch(watched, backend)
        self.raise_library_timeout(backend, call, error)

    def raise_library_timeout(self, backend: PrepareFinalize, call: int,
                              error: BaseException) -> None:
        """Where ``error`` is the library's own timeout on a peer (a trapped kernel, DeepEP's
        host wait) or a collective inside the call whose transport failed (a peer's process
        gone), raise what it means instead, from ``error`` (the group is broken)."""
        wrapped = call_fault_error(self.faults, self.name, self.backend_name,
                                   backend.library_timeout_s, self.ctx.timeout_s, call, error)
        if wrapped is not None:
            self.faults.mark_broken(f"{self.name}: call {call} ended on a peer's loss or hang",
                                    error)
            raise wrapped from error

    def end_watch(self, watched: Optional[WatchedCall], backend: PrepareFinalize) -> None:
        """The end of a watched call's host part (and of its lock-free timer, where armed)."""
        if watched is not None:
            if backend.waits_on_host:
                bound_host_waits(None)
            watched.end(self.ctx.device)

    def refuse(self, error: BaseException) -> BaseException:
        """This rank refuses the call's inputs before sending anything (:mod:`moe_plugins.
        faults`, rule "refused inputs"). Through the backend's host exchange every rank raises
        here. Without one, with one TP rank (nothing follows the combine), the call goes on
        with no tokens of this rank's own and finalize raises ``error`` (returned); with more,
        the TP peers may not have refused alike, so the group breaks and this raises."""
        if self.backends and self.backends[0].host_exchange:
            self.backends[0].refuse(error)
        if self.ctx.layout.tp == 1:
            return in_step(error)
        self.faults.mark_broken(f"{self.backend_name} layer: EP rank {self.ctx.rank} refused its "
                                "inputs while its peers were in the call, and with TP inside "
                                "the EP group it cannot complete the call without them", error)
        raise error

    def left_in_flight(self, slot: int) -> None:
        """A prepare of micro-batch ``slot`` while its last call was never finalized. After an
        error that already broke the group (and surfaced), the call is dropped; otherwise
        prepare was called twice: its peers wait in the first call's combine, so the group
        breaks."""
        watched = self.calls.pop(slot)[5]
        backend = self.backends[slot]
        self.end_watch(watched, backend)  # this call's error surfaces here, not by the watchdog
        if self.faults.broken is None:
            msg = (f"{self.backend_name} layer: prepare called twice on micro-batch {slot} "
                   "without finalize in between (the first call's dispatch was never combined; "
                   "its peers wait in that combine)")
            self.faults.mark_broken(msg)
            backend.reset_call_state()
            raise RuntimeError(msg)
        backend.reset_call_state()

    def take(self, slot: int) -> Call:
        """The call of micro-batch ``slot`` that its finalize completes."""
        call = self.calls.pop(slot, None)
        if call is None:
            raise RuntimeError("finalize called without a matching prepare on this layer")
        return call

    def describe(self) -> Any:
        """The call bound in words (the first call's INFO line)."""
        return self.bound.describe()
