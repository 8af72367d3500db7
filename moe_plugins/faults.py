"""Faults of a layer call across ranks: never a wrong answer, never an unbounded wait.

The rules, by name as in docs/design.md, "Faults" (code, tests and docs cite them by name). A
check that raises on one rank only makes that rank skip the collectives its peers make; their
next collectives then pair with the wrong ones and return results that belong to another batch,
with no error. So:

- **Validated everywhere.** What can be validated before the first collective is validated
  **identically on every rank**: configuration at construction (the same on all ranks), and,
  where a backend has a host exchange at the start of a call (the ``torch`` backend's
  split-size all-to-all), the per-rank input checks travel *in* that exchange as a status
  word, so every rank learns that some rank rejected its inputs and all of them raise at the
  same point (:func:`check_peers`).
- **Refused inputs.** A check that refuses this rank's inputs **before this rank sent
  anything** (a refusal) leaves the layer usable, and the peers never pair this rank's next
  call with the refused one:

  - on a backend with a host exchange (``torch``) the refusal travels in it (rule "validated
    everywhere"): every rank raises at that point, the refusing rank its own error, the others
    :class:`PeerInputError`; a caller's own refusal goes the same way
    (``PrepareFinalize.refuse``);
  - on a backend without one (the DeepEP, NIXL EP and flashinfer kernels) the peers are in
    this call's dispatch already and cannot be told. The refusing rank *owes* the call
    (:meth:`GroupFaults.refuse`): its next call on the group must be that call with no tokens
    of its own, so that its experts still serve the peers' tokens and their results are
    right; then it raises its error. :class:`moe_plugins.runner.layer.MoELayer` and the vLLM
    adapter make that call themselves where the layout allows it (one TP rank, or a refusal
    of the layer input, which every TP rank of a DP group shares); any other next call breaks
    the group (:meth:`GroupFaults.settle`) instead of pairing with the peers' pending one;
  - with one rank in the group there is no peer to be out of step with.
- **Out of step.** The same exchange carries a per-group **call sequence number** and the
  **layer-config digest**: a peer that skipped a call, or is in another layer's call, is
  detected at once on every rank (:class:`OutOfStepError`) instead of pairing the wrong buffers.
- **Mid-way failures.** A call that fails **mid-way** (after its first collective, or on a
  backend without a host exchange) leaves this rank's collectives out of step with its peers'.
  The EP group's :class:`GroupFaults` is then broken: every later call on it raises
  :class:`LayerBrokenError` naming the first failure, until the layer is rebuilt on new process
  groups (:func:`moe_plugins.groups.make_dist_context`); reusing the group could pair this
  rank's next collective with a peer's pending one.
- **Bounded waits.** Every collective a backend waits on runs under a bounded process-group
  timeout (:func:`moe_plugins.groups.default_timeout`); :func:`collective_error` turns the
  transport's error (timeout, peer gone) into :class:`CollectiveError` naming the layer, the
  collective and the peers, and breaks the group.
- **Peers the library masks.** A result without the experts of a peer the library masked on
  its own is not returned: :class:`PeerMaskedError` (raised by ``MoELayer``).
- **One mask contract.** Our masked flag means one thing on every backend; each library's
  word is translated in :mod:`moe_plugins.masking`.
- **Continuing after a peer's loss.** Opt-in (:mod:`moe_plugins.survival`): the faulted call
  raises a retryable error, the survivors mask, re-home and regroup from values they all hold.
- **The call bound.** A call not complete within the optional bound ends the process
  (:mod:`moe_plugins.callbound`).

State is per EP process group (all layers on a group share its collective sequence), held by
:func:`group_faults`; nothing here runs per token, and the per-call cost is an attribute read.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch

from moe_plugins.callbound import FaultNotice, notice_for

T = TypeVar("T")

__all__ = ["LayerBrokenError", "OutOfStepError", "PeerInputError", "CollectiveError",
           "PeerMaskedError", "library_timeout_error", "call_fault_error", "peer_gone",
           "transport_error",
           "GroupFaults", "group_faults", "config_digest", "collective_error", "told_error",
           "HEADER_WORDS",
           "clear_group_faults", "STATUS_OK", "STATUS_BAD_INPUT", "check_peers", "in_step",
           "is_in_step", "owes_call", "is_owed_call", "layer_name"]

#: Words a rank sends each peer in a host exchange: (count, sequence number, digest, status).
HEADER_WORDS = 4
#: Status words: OK, inputs rejected by the host checks; a positive status is the number of
#: tokens whose expert ids lie outside [-1, num_experts) (a count the device computes on the way,
#: so flagging them costs no kernel of its own).
STATUS_OK, STATUS_BAD_INPUT = 0, -1


def _status_text(status: int) -> str:
    if status == STATUS_BAD_INPUT:
        return "rejected its inputs"
    if status > 0:
        return f"got expert ids outside [-1, num_experts) in {status} token(s)"
    return f"reported status {status}"


class LayerBrokenError(RuntimeError):
    """A call on this EP group failed mid-way earlier; the group's collectives are out of step."""


class OutOfStepError(RuntimeError):
    """A peer is in another call (sequence number) or another layer (config digest)."""


class PeerInputError(ValueError):
    """Some rank rejected its inputs for this call (its own error says why); no rank ran it."""


class CollectiveError(RuntimeError):
    """A collective did not complete: timed out, or a peer went away."""


class PeerMaskedError(RuntimeError):
    """The library masked a peer on its own during a call (its kernels timed out waiting for
    it): the call's result lacks that peer's experts and is not returned; the EP group is broken
    (later calls raise :class:`LayerBrokenError`). ``masked_ranks``: the EP ranks it masked,
    where known."""

    def __init__(self, message: str, masked_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.masked_ranks = masked_ranks


#: Our own fault errors: never wrapped again.
_OURS = (LayerBrokenError, OutOfStepError, CollectiveError, PeerInputError, PeerMaskedError)


def config_digest(*parts: object) -> int:
    """A digest of a layer's configuration, equal on every rank (unlike ``hash``, which is
    salted per process); 62 bits, so it travels in an int64."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2


@dataclass
class GroupFaults:
    """Fault state of one EP process group on this rank.

    seq: calls that went through a host exchange on this group (equal on every rank while in
    step); broken: the first mid-way failure, or None; layers: see :meth:`next_layer_index`."""

    ranks: Sequence[int]
    rank: int = 0  # this process's global rank
    seq: int = 0
    broken: Optional[str] = None
    layers: int = 0  # backends built on this group so far (every rank builds them in one order)
    #: The backend object (and its layer's name) whose call this rank refused while its peers
    #: are in it (see :meth:`refuse`); None when nothing is owed.
    owed_by: Optional[object] = None
    _owed_layer: str = ""
    _first: Optional[BaseException] = field(default=None, repr=False)
    #: tells the peers of this rank's first mid-way failure (moe_plugins.callbound.fault_notice; None
    #: without torch.distributed)
    notice: Optional[FaultNotice] = field(default=None, repr=False)

    def check(self, layer: str) -> None:
        """Raise :class:`LayerBrokenError` when an earlier call broke this group."""
        if self.broken is not None:
            raise LayerBrokenError(
                f"{layer}: this rank's EP group is out of step with its peers since an earlier "
                f"call failed mid-way: {self.broken}. Every call on this group raises. If a "
                "peer died or hangs (a CollectiveError, CallTimeoutError or PeerMaskedError "
                "came first), restart every rank of the EP group (under vLLM, the engine: its "
                "executor shuts down when a worker dies); if every rank lives, rebuild the "
                "layer on new process groups on every rank (moe_plugins.groups."
                "make_dist_context(..., fresh_ep_group=True))") from self._first

    def next_layer_index(self) -> int:
        """The creation index of a new layer's backend on this group: part of its digest, so
        that ranks in different layers of equal config are told apart."""
        self.layers += 1
        return self.layers

    def mark_broken(self, what: str, exc: Optional[BaseException] = None) -> None:
        """Record the first mid-way failure (later ones are consequences of it) and tell the
        peers (:mod:`moe_plugins.callbound.fault_notice`: with the call bound on, their calls on the group
        end at once with this cause). A transport that saw a peer's process go is not told:
        this rank did not fail, and each peer's own transport sees the loss (a notice would
        name this rank as the one that failed)."""
        if self.broken is None:
            self.broken = what if exc is None else f"{what}: {type(exc).__name__}: {exc}"
            self._first = exc
            if self.notice is not None and not (exc is not None and peer_gone(exc)):
                self.notice.post(self.broken)

    def start(self, backend: object, layer: str, hidden_states: object, in_flight: bool,
              check: Callable[..., T], *args: object) -> T:
        """The start of a prepare on a backend without a host exchange, before it sends
        anything: :meth:`begin` where the group is broken or a call is owed; the in-flight
        check (:meth:`call_in_flight`); then ``check(*args)``, the backend's input checks, whose
        ValueError/TypeError is a refusal (:meth:`refuse`). Returns what ``check`` returns."""
        if self.broken is not None or self.owed_by is not None:
            self.begin(backend, layer, hidden_states)
        if in_flight:
            raise self.call_in_flight(layer)
        try:
            return check(*args)
        except (ValueError, TypeError) as e:  # nothing sent (rule "refused inputs")
            raise self.refuse(backend, layer, e)

    def call_in_flight(self, layer: str, what: str = "prepare") -> RuntimeError:
        """``what`` was called while this rank's last call of ``layer`` is in flight (its
        prepare ran, its finalize did not): its peers wait in that call's combine, so the group
        breaks; returns the error to raise, which says what was called in which order."""
        msg = (f"{layer}: {what} called while the previous call is in flight (its prepare ran, "
               "its finalize did not; its peers wait in that call's combine): call finalize, or "
               "reset_call_state after an error, before the next prepare")
        self.mark_broken(msg)
        return RuntimeError(msg)

    def refuse(self, backend: object, layer: str, error: BaseException) -> BaseException:
        """The error to raise when ``backend`` (a backend without a host exchange) refuses this
        rank's inputs before sending anything: with peers, they are in this call, so the call is
        owed (:meth:`settle`) and the error tagged :func:`owes_call`; alone, it is in step."""
        if len(self.ranks) == 1:
            return in_step(error)
        if self.owed_by is None:
            self.owed_by, self._owed_layer = backend, layer
        return owes_call(error)

    def begin(self, backend: object, layer: str, hidden_states: object) -> None:
        """The start of a prepare of ``backend`` (``layer`` names it) on a backend without a host
        exchange: raise :class:`LayerBrokenError` when the group is broken; while a refused call
        is owed, a call of the same backend with no tokens of its own IS that call (it completes
        the peers' call); any other call would pair with the peers' pending one, so the group
        breaks and this raises naming both calls. (Callers test ``broken`` and ``owed_by``
        first: the common case costs two attribute reads.)"""
        self.check(layer)
        if self.owed_by is None:
            return
        owed, owed_layer = self.owed_by, self._owed_layer
        self.owed_by, self._owed_layer = None, ""
        num_tokens = (hidden_states.shape[0] if isinstance(hidden_states, torch.Tensor)
                      and hidden_states.dim() >= 1 else -1)
        if owed is backend and num_tokens == 0:
            return
        what = (f"this rank refused its inputs to a call of {owed_layer} while its peers were in "
                f"that call, and its next call on the group was a call of {layer} with "
                f"{num_tokens} token(s), not that call with no tokens of its own (its peers would "
                "have paired the two)")
        self.mark_broken(what)
        self.check(layer)


_GROUPS: dict[object, GroupFaults] = {}


def layer_name(backend: str, cfg: object, rank: object) -> str:
    """How errors name a backend's layer: ``<backend> layer (experts=E hidden=H topk=K, EP rank
    R)`` for ``cfg`` (a DispatchConfig) on EP rank ``rank``."""
    c: Any = cfg
    return (f"{backend} layer (experts={c.num_experts} hidden={c.hidden} topk={c.num_topk}, "
            f"EP rank {rank})")


def group_faults(group: object) -> GroupFaults:
    """The one :class:`GroupFaults` of a process group (``None``: the default group)."""
    import torch.distributed as dist

    key = group if group is not None else dist.group.WORLD
    state = _GROUPS.get(key)
    if state is None:
        ranks = dist.get_process_group_ranks(key) if dist.is_initialized() else [0]
        rank = dist.get_rank() if dist.is_initialized() else 0
        state = _GROUPS[key] = GroupFaults(list(ranks), rank, notice=notice_for(key, rank))
    return state


def clear_group_faults(group: object = None) -> None:
    """Forget a group's fault state and sequence number, on this rank, in the one
    :class:`GroupFaults` every layer on the group holds (the layers' creation count stays: it
    is part of their digests). Sound only when every rank of the group abandoned or refused
    exactly the same calls and all of them call this at the same point (tests that probe a
    prepare alone on every rank do); otherwise rebuild on new groups."""
    import torch.distributed as dist

    state = _GROUPS.get(group if group is not None else dist.group.WORLD)
    if state is not None:
        state.seq, state.broken, state._first = 0, None, None
        state.owed_by, state._owed_layer = None, ""
        if state.notice is not None:
            state.notice.clear()


_PEER_RE = re.compile(r"\d+\.\d+\.\d+\.\d+:\d+|\[[0-9a-fA-F:.]+\]:\d+")
#: What torch.distributed's transports say when a peer's process went away in a collective
#: (gloo: "Connection closed by peer", "Read error ...: Connection reset by peer").
_PEER_GONE_SIGNS = ("reset by peer", "closed by peer", "Connection closed", "Broken pipe", "EOF",
                    "Connection refused")
#: how long a failed collective waits for the store to say whether a peer failed first (s)
NOTICE_READ_S = 2.0


_IN_STEP = "_moe_plugins_in_step"


def in_step(exc: BaseException) -> BaseException:
    """Tag ``exc`` as raised at the same point on every rank (after a host exchange told every
    rank about it): the group's collectives are still in step, the group is not broken."""
    setattr(exc, _IN_STEP, True)
    return exc


def is_in_step(exc: BaseException) -> bool:
    return isinstance(exc, PeerInputError) or getattr(exc, _IN_STEP, False)


_OWES = "_moe_plugins_owes_call"


def owes_call(exc: BaseException) -> BaseException:
    """Tag ``exc`` as a refusal of this rank's inputs on a backend without a host exchange while
    its peers are in the call (:meth:`GroupFaults.refuse`): nothing was sent, and the caller
    must complete the call with no tokens of its own, or the group breaks at its next call."""
    setattr(exc, _OWES, True)
    return exc


def is_owed_call(exc: BaseException) -> bool:
    return getattr(exc, _OWES, False)


#: What a vendor library's own timeout on a peer looks like when it reaches the host: a CUDA
#: kernel that trapped (the error of the next CUDA call: "unspecified launch failure"), or
#: DeepEP's host waits ("DeepEP error: CPU recv timeout", "DeepEP error: timeout (dispatch
#: CPU)", csrc/deep_ep.cpp at 567632d).
_LIBRARY_TIMEOUT_SIGNS = ("unspecified launch failure", "DeepEP error: CPU recv timeout",
                          "DeepEP error: timeout")


def _says_peer_gone(exc: BaseException) -> bool:
    return any(s in str(exc) for s in _PEER_GONE_SIGNS)


def transport_error(exc: BaseException) -> bool:
    """``exc`` is torch.distributed's own failure of a collective (a peer gone, the group's
    timeout): a ``DistError`` (NCCL, the store), or a RuntimeError from gloo's transport (its
    text names gloo's source). Text alone from elsewhere (an expert's error) is not enough."""
    if isinstance(exc, _OURS):
        return False
    dist_error = getattr(torch.distributed, "DistError", None)
    return (dist_error is not None and isinstance(exc, dist_error)) or (
        isinstance(exc, RuntimeError) and "gloo/transport" in str(exc))


def peer_gone(exc: BaseException) -> bool:
    """``exc`` is a transport's error (:func:`transport_error`) saying a peer's process went
    away."""
    return transport_error(exc) and _says_peer_gone(exc)


def library_timeout_error(layer: str, library: str, timeout_s: Optional[float],
                          exc: BaseException) -> Optional[CollectiveError]:
    """The error to raise where a library's call (or the next CUDA call after one of its
    kernels trapped) failed with ``exc`` at the library's own timeout on a peer (``timeout_s``
    seconds; None: the library has none, and nothing is wrapped): :class:`CollectiveError`
    saying that a peer died or hangs and every rank of the EP group must restart, to be raised
    ``from exc``; None when ``exc`` is something else."""
    if timeout_s is None or not isinstance(exc, RuntimeError) or isinstance(exc, _OURS):
        return None
    text = str(exc)
    if not any(sign in text for sign in _LIBRARY_TIMEOUT_SIGNS):
        return None
    lines = text.strip().splitlines()
    trapped = "launch failure" in text
    return CollectiveError(
        f"{layer}: {library}'s wait for a peer ended at the library's own timeout (about "
        f"{timeout_s:g} s; {type(exc).__name__}: {lines[0] if lines else ''}): a peer rank died "
        "or hangs in the middle of the call. "
        + ("Its kernel trapped, so this process's CUDA context is lost. " if trapped else "")
        + "Restart every rank of the EP group (under vLLM, the engine); "
        "$MOE_PLUGINS_CALL_TIMEOUT_S ends such a call earlier, with this package's error")


def call_fault_error(faults: GroupFaults, layer: str, library: str,
                     library_timeout_s: Optional[float], timeout_s: Optional[float], call: int,
                     exc: BaseException) -> Optional[BaseException]:
    """What a backend's call that failed with ``exc`` means, where the error reaches a layer's
    call site (``MoELayer``, the vLLM adapter): the library's own timeout on a peer
    (:func:`library_timeout_error`), or a collective inside the call whose transport failed
    (a peer's process gone, the group's ``timeout_s``: :func:`collective_error`, naming
    ``call``). None for anything else, which is raised as it is. Raise the result ``from
    exc``."""
    wrapped = library_timeout_error(layer, library, library_timeout_s, exc)
    if wrapped is None and transport_error(exc):
        return collective_error(faults, layer, f"a collective inside {library}'s call",
                                timeout_s, exc, call)
    return wrapped


def collective_error(faults: GroupFaults, layer: str, what: str, timeout_s: Optional[float],
                     exc: BaseException, call: Optional[int] = None) -> BaseException:
    """The error to raise for a collective of ``layer`` that failed with ``exc`` (issue or
    wait): a transport error (timeout, peer gone) becomes :class:`CollectiveError` naming the
    layer, the collective, the call (``call``, else the group's host-exchange count) and the
    peers, and the group is marked broken (its collectives are out of step now). Our own fault
    errors pass through unchanged."""
    if isinstance(exc, (LayerBrokenError, OutOfStepError, CollectiveError, PeerInputError)):
        return exc
    call = faults.seq if call is None else call
    lines = str(exc).strip().splitlines()
    text = lines[-1] if lines else type(exc).__name__
    gone = _says_peer_gone(exc)  # (a collective's own error: its words suffice)
    timed_out = "imed out" in str(exc) or "imeout" in str(exc)
    peer = _PEER_RE.search(str(exc))
    limit = f" of {timeout_s:g} s" if timeout_s is not None else ""
    cause = ("a peer went away (its process died or left the group)" if gone else
             f"no answer within the process-group timeout{limit}" if timed_out
             else "the transport failed")
    others = [r for r in faults.ranks if r != faults.rank]
    who = (f"peer {peer.group(0)} (as the transport names it)" if peer else
           f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others}")
    # a peer that failed mid-way posted its error (moe_plugins.callbound.fault_notice): the true cause
    told = faults.notice.read_within(NOTICE_READ_S) if faults.notice is not None else None
    faults.mark_broken(f"{what} of call {call} did not complete", exc)
    first = (f"; first, a peer's call on this group failed mid-way and told its peers: {told}"
             if told else "")
    return CollectiveError(
        f"{layer}: {what} (call {call}) did not complete on the EP group of ranks "
        f"{list(faults.ranks)}: {cause}; the peer that did not answer: {who} "
        f"({type(exc).__name__}: {text}){first}. A rank that raised before this collective, "
        "or died, reports its own error")


def told_error(faults: GroupFaults, layer: str, what: str, told: str) -> CollectiveError:
    """The error to raise when this rank's ``what`` of ``layer`` stops waiting because a peer's
    call on the group failed mid-way and said so (``told``: its notice,
    :mod:`moe_plugins.callbound.fault_notice`); the group is marked broken (the collective stays
    pending on this rank)."""
    faults.mark_broken(f"{what} of call {faults.seq} did not complete: a peer failed mid-way")
    return CollectiveError(
        f"{layer}: {what} (call {faults.seq}) cannot complete on the EP group of ranks "
        f"{list(faults.ranks)}: a peer's call on this group failed mid-way and told its peers: "
        f"{told}. That peer raised its own error and lives; the group is out of step: rebuild "
        "the layer on new process groups on every rank (moe_plugins.groups.make_dist_context("
        "..., fresh_ep_group=True))")


def check_peers(faults: GroupFaults, layer: str, rank_in_group: int, seq: int, digest: int,
                headers: torch.Tensor | list[list[int]]) -> None:
    """After a host exchange: ``headers`` [num_ranks, HEADER_WORDS] as received from each peer
    (count, seq, digest, status). Raises on every rank alike when any peer is out of step or
    flagged its inputs; the rank whose own input was bad raises its own error instead (the
    caller does that after this returns)."""
    rows = headers.tolist() if isinstance(headers, torch.Tensor) else headers
    for h in rows:  # the common case in one pass: every peer in step, every status OK
        if h[1] != seq or h[2] != digest or h[3] != STATUS_OK:
            break
    else:
        return
    ranks = list(faults.ranks)
    off_seq = [(ranks[r], h[1]) for r, h in enumerate(rows) if h[1] != seq]
    off_layer = [ranks[r] for r, h in enumerate(rows) if h[2] != digest]
    if off_seq or off_layer:
        faults.mark_broken(f"peers out of step at call {seq}")
        parts = []
        if off_seq:
            parts.append("in other calls: " + ", ".join(f"rank {r} at call {s}" for r, s in off_seq))
        if off_layer:
            parts.append(f"ranks {off_layer} in another layer (layer digest differs)")
        raise OutOfStepError(
            f"{layer}: call {seq} of this rank met peers {'; '.join(parts)}. A rank skipped a "
            "call (an error on that rank before its first collective) or runs layers in another "
            "order; no result of this call is used. Rebuild the layer on new process groups")
    flagged = [(ranks[r], h[3]) for r, h in enumerate(rows) if h[3] != STATUS_OK and r != rank_in_group]
    if flagged and rows[rank_in_group][3] == STATUS_OK:
        raise PeerInputError(
            f"{layer}: call {seq} was not run on any rank because "
            + "; ".join(f"rank {r} {_status_text(s)}" for r, s in flagged)
            + " (that rank's error says why); fix the inputs there and call again")
