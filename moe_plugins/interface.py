"""The prepare/finalize interface every backend implements (vLLM's modular-kernel split).

A prepare/finalize moves the owned tokens of a rank to the ranks that hold their experts
(``prepare``) and brings the expert outputs back (``finalize``). The experts in between are a
separate object (:mod:`moe_plugins.runner.experts`).
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, runtime_checkable

import torch

from moe_plugins.config import DispatchConfig
from moe_plugins.counters import DispatchStats
from moe_plugins.layout import OwnedRows
from moe_plugins.overlap import SharedExpertHandle, join
from moe_plugins.quant import QuantSpec

__all__ = [
    "ActivationFormat", "ExpertTokensMeta", "LazyExpertTokensMeta", "PrepareResult",
    "RowScatterTarget", "Hook", "AsyncResult", "PrepareFinalize", "capturing",
    "check_prepare_inputs", "check_finalize_routing", "check_finalize_result", "check_output",
    "row_scatter_add", "write_output", "BatchHint", "SplitPhases",
]

Hook = Callable[[], None]


class ActivationFormat(enum.Enum):
    """STANDARD: [num_recv_tokens, hidden] rows with per-row topk ids/weights.
    BATCHED: [num_local_experts, max_recv_tokens, hidden] with a token count per expert."""

    STANDARD = "standard"
    BATCHED = "batched"


# The per-call results (ExpertTokensMeta, PrepareResult, AsyncResult, BatchHint) are plain
# dataclasses with slots, read only by convention: each prepare/finalize builds them, and a
# frozen dataclass's __init__ (one object.__setattr__ per field) costs about 0.8 us more per
# object on this hot path; slots save another ~0.1 us each.
@dataclass(slots=True)
class ExpertTokensMeta:
    """expert_num_tokens: int32 [num_local_experts], received tokens per local expert."""

    expert_num_tokens: torch.Tensor


class LazyExpertTokensMeta(ExpertTokensMeta):
    """:class:`ExpertTokensMeta` whose counts are made on first read, by ``make(source)``:
    for STANDARD backends whose counts cost kernels that the experts may never read (vLLM's
    and our STANDARD experts route by the ids). Read once, the counts are kept."""

    __slots__ = ("_make", "_source", "_counts")

    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor], source: torch.Tensor):
        self._make, self._source = make, source
        self._counts: Optional[torch.Tensor] = None

    @property  # type: ignore[override]
    def expert_num_tokens(self) -> torch.Tensor:
        """int32 [num_local_experts], made by ``make(source)`` on the first read."""
        if self._counts is None:
            self._counts = self._make(self._source)
            self._source = None  # type: ignore[assignment]
        return self._counts


@dataclass(slots=True)
class PrepareResult:
    """What a prepare hands the experts.

    x: STANDARD [num_recv_tokens, hidden] or BATCHED [num_local_experts, max_recv_tokens, hidden];
        model dtype, float8_e4m3fn (fp8 block-128) or uint8 with hidden // 2 columns (nvfp4).
    x_sf: None exactly when x is unquantized; fp8: float32 [..., hidden // 128];
        nvfp4: float8_e4m3fn [..., hidden // 16] (or swizzled, flat).
    expert_tokens_meta: per-local-expert counts (BATCHED always; STANDARD may give it).
    topk_ids: STANDARD only: int64 [num_recv_tokens, k], LOCAL expert ids, -1 where the
        expert lives on another rank; k is num_topk, or 1 where each row carries one (token,
        expert) pair (a batched layout presented as rows, :mod:`moe_plugins.formats`). None for
        BATCHED.
    topk_weights: STANDARD only: float32 [num_recv_tokens, k]. None for BATCHED (the
        combine applies the weights).
    x_sf_swizzled: True when x_sf holds nvfp4 scales in the 128x4 tiled layout NVFP4 GEMMs read
        (flat, see :func:`moe_plugins.quant.swizzle_nvfp4_sf`); the experts unswizzle them with
        ``num_recv_tokens`` rows. False: x_sf is row-aligned with x.
    """

    x: torch.Tensor
    x_sf: Optional[torch.Tensor]
    expert_tokens_meta: Optional[ExpertTokensMeta]
    topk_ids: Optional[torch.Tensor]
    topk_weights: Optional[torch.Tensor]
    x_sf_swizzled: bool = False

    def __post_init__(self) -> None:
        if self.x_sf_swizzled and self.x_sf is None:
            raise ValueError("PrepareResult says x_sf is swizzled but x_sf is None; swizzle only "
                             "scales that exist (guard with `x_sf is not None`)")


@dataclass(frozen=True)
class RowScatterTarget:
    """Where a row-scatter finalize adds its output: the shared expert's gated partial and its
    ready event travel together in ``shared`` (so having the buffer means having the event).

    shared.output: [num_tokens, hidden], this rank's gated shared-expert partial for ALL rows.
    rows: the rows this rank owns; the finalize adds the combined routed output there and touches
        no other row.
    """

    shared: SharedExpertHandle
    rows: OwnedRows

    def __post_init__(self) -> None:
        buf = self.shared.output
        if buf is None:
            raise ValueError("a row-scatter target needs the shared expert's output buffer, got None")
        if buf.dim() != 2 or buf.shape[0] != self.rows.num_tokens:
            raise ValueError(
                f"row-scatter buffer has shape {tuple(buf.shape)}, expected "
                f"[{self.rows.num_tokens}, hidden] (all tokens of the DP group)"
            )

    @property
    def buffer(self) -> torch.Tensor:
        """The shared expert's partial [num_tokens, hidden] the finalize adds into."""
        out = self.shared.output
        assert out is not None
        return out


def row_scatter_add(target: RowScatterTarget, combined: torch.Tensor) -> torch.Tensor:
    """The one join-and-add every row-scatter finalize calls.

    Waits for the shared expert (even when this rank owns no rows: the all_reduce that follows
    reads the whole buffer), then adds ``combined`` [>= num_owned, hidden] into the owned rows of
    the buffer and returns the buffer object itself.
    """
    buf = join(target.shared)
    assert buf is not None
    n = target.rows.num_owned
    if combined.dim() != 2 or combined.shape[0] < n or combined.shape[1] != buf.shape[1]:
        raise ValueError(
            f"combined output has shape {tuple(combined.shape)}, expected [>= {n}, {buf.shape[1]}] "
            "to add into the owned rows of the row-scatter buffer"
        )
    if combined.dtype != buf.dtype or combined.device != buf.device:
        raise ValueError(
            f"row-scatter buffer is {buf.dtype} on {buf.device} but the combined output is "
            f"{combined.dtype} on {combined.device}; allocate the shared-expert output with the "
            "activation dtype on the activation device"
        )
    if n:
        buf[target.rows.as_slice].add_(combined[:n])
    return buf


def write_output(output: "torch.Tensor | RowScatterTarget", combined: torch.Tensor) -> torch.Tensor:
    """The last step of every finalize: ``combined`` [num_tokens, hidden] (the owned tokens'
    routed output) is added into a row-scatter target through :func:`row_scatter_add`, or copied
    into a plain output tensor of the same shape. Returns the tensor written."""
    if isinstance(output, RowScatterTarget):
        return row_scatter_add(output, combined)
    if output.shape != combined.shape:
        raise ValueError(f"finalize output has shape {tuple(output.shape)}, expected "
                         f"{tuple(combined.shape)} (the tokens given to prepare)")
    output.copy_(combined)
    return output


def check_output(output: "torch.Tensor | RowScatterTarget", num_tokens: int, hidden: int) -> None:
    """A finalize's ``output`` checked before anything is sent: a plain tensor
    [num_tokens, hidden] (the tokens given to prepare), or a row-scatter target owning
    ``num_tokens`` rows of ``hidden`` columns. ValueError/TypeError naming what was given."""
    if isinstance(output, RowScatterTarget):
        if output.rows.num_owned != num_tokens or output.buffer.shape[1] != hidden:
            raise ValueError(f"row-scatter target owns {output.rows.num_owned} rows of "
                             f"{output.buffer.shape[1]} columns, prepare was given {num_tokens} "
                             f"tokens of hidden={hidden}")
        return
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"finalize output must be a torch.Tensor or a RowScatterTarget, got "
                        f"{type(output).__name__}")
    if output.shape != (num_tokens, hidden):
        raise ValueError(f"finalize output has shape {tuple(output.shape)}, expected "
                         f"[{num_tokens}, {hidden}] (the tokens given to prepare)")


def check_prepare_inputs(
    hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    cfg: Optional[DispatchConfig] = None,
) -> None:
    """hidden_states float [num_tokens, hidden], topk_weights float [num_tokens, num_topk],
    topk_ids int32/int64 [num_tokens, num_topk]; all from the same token slice. With ``cfg``
    (the layer's): ``hidden`` and ``num_topk`` must be the layer's. Shape and dtype checks only
    (no host sync); a backend calls it where every rank can learn the outcome (see
    :mod:`moe_plugins.faults`). (Called per prepare: each shape is read once.)"""
    if not (type(hidden_states) is torch.Tensor and type(topk_weights) is torch.Tensor
            and type(topk_ids) is torch.Tensor):
        _check_tensors(hidden_states=hidden_states, topk_weights=topk_weights, topk_ids=topk_ids)
    h_shape, w_shape, ids_shape = hidden_states.shape, topk_weights.shape, topk_ids.shape
    if len(h_shape) != 2:
        raise ValueError(f"hidden_states must be [num_tokens, hidden], got {tuple(h_shape)}")
    # dtype attributes and identity compares: about half the host time of the tensor methods
    if not hidden_states.dtype.is_floating_point:
        raise TypeError(f"hidden_states must be a float tensor (the model dtype), got "
                        f"{hidden_states.dtype}; integer activations would be truncated, cast "
                        "them with .to(torch.bfloat16)")
    ids_dtype = topk_ids.dtype
    if ids_dtype is not torch.int64 and ids_dtype is not torch.int32:
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}; "
                        "cast the router's indices with .to(torch.int64)")
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"topk_weights must be a float tensor, got {topk_weights.dtype}")
    if w_shape != ids_shape or len(ids_shape) != 2 or ids_shape[0] != h_shape[0]:
        raise ValueError(
            f"hidden_states {tuple(h_shape)}, topk_ids {tuple(ids_shape)} and "
            f"topk_weights {tuple(w_shape)} must cover the same tokens: slice all three "
            "together with moe_plugins.layout.slice_owned"
        )
    device = hidden_states.device
    if topk_ids.device != device or topk_weights.device != device or device.type == "meta":
        raise ValueError(f"hidden_states ({device}), topk_ids ({topk_ids.device}) and "
                         f"topk_weights ({topk_weights.device}) must be on the layer's device "
                         "(one cuda or cpu device, not meta); move them with .to(device)")
    if cfg is not None:
        if h_shape[1] != cfg.hidden:
            raise ValueError(f"hidden_states has hidden={h_shape[1]}, the layer was "
                             f"built for hidden={cfg.hidden}")
        if ids_shape[1] != cfg.num_topk:
            raise ValueError(f"topk_ids has {ids_shape[1]} experts per token, the layer was "
                             f"built for num_topk={cfg.num_topk}; route with the layer's top-k")


def _check_tensors(**tensors: object) -> None:
    """TypeError naming the first argument that is not a torch.Tensor (a numpy array, a list)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__module__}."
                            f"{type(t).__qualname__}; convert it with torch.as_tensor(...) on "
                            "the layer's device")


def capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_finalize_routing(prepared_ids: torch.Tensor, prepared_weights: torch.Tensor,
                           topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """The one rule for every backend: a finalize must get the topk_ids AND topk_weights its
    prepare was given (a combine reduces by the dispatch's routing, and a backend applies the
    weights either before the experts, from what travelled with the tokens, or in its combine:
    other weights would silently mean different things on different backends). The same tensor
    (what vLLM passes) is recognised by identity or storage, with no host sync. Another tensor of
    that shape and dtype (a second ``.to(device)`` copy, say) is compared by value, one host sync
    off the common path; during a CUDA-graph capture, where a sync is not allowed, it is
    refused. ValueError naming which of the two differs."""
    for name, got, given in (("topk_ids", topk_ids, prepared_ids),
                             ("topk_weights", topk_weights, prepared_weights)):
        if got is given:
            continue
        if not isinstance(got, torch.Tensor):
            raise TypeError(f"finalize got {name} of type {type(got).__name__}; pass the tensor "
                            "given to prepare")
        if (got.shape != given.shape or got.dtype != given.dtype
                or (got.data_ptr() != given.data_ptr()
                    and (capturing() or not torch.equal(got, given)))):
            raise ValueError(
                f"finalize got {name} {tuple(got.shape)} {got.dtype} that are not the ones given "
                f"to prepare ({tuple(given.shape)} {given.dtype}"
                f"{'; compared by storage during a CUDA-graph capture' if capturing() else ''}); "
                "pass the same tensors to prepare and finalize")


@dataclass
class BatchHint:
    """What an engine knows about the current forward pass, the SAME on every EP rank (a
    backend that picks its transport per call must pick the same one on every rank).

    max_tokens_per_rank: the most rows any EP rank hands prepare in this pass (after TP slicing;
        flashinfer two-sided sizes its receive rows by it, ``num_ranks * max_tokens_per_rank``).
    prefill: True when the pass prefills on some rank, False when every rank decodes, None
        when the engine cannot tell.
    """

    max_tokens_per_rank: int
    prefill: Optional[bool] = None


@dataclass(slots=True)
class AsyncResult:
    """``hook`` (None when nothing is left to wait for) completes the receive; ``receiver``
    returns the result once the hook has run."""

    hook: Optional[Hook]
    receiver: Callable[[], object]


class PrepareFinalize(ABC):
    """Dispatch (prepare) and combine (finalize) of one backend over one EP group.

    Subclasses implement ``prepare_async`` and ``finalize_async``; the synchronous ``prepare`` and
    ``finalize`` run the hook at once, so the async path and the sync path are the same code.
    Subclasses keep a :class:`moe_plugins.counters.DispatchStats` in ``self.stats`` and add to it
    what they send (the layer runner and the plan tests read it), or make ``stats`` a property
    that builds it from cheaper per-call totals when read (the low-latency backends do).
    """

    stats: DispatchStats
    #: The layer config it was built for (``BackendSpec.prepare_finalize(manager, cfg)`` sets it):
    #: engines read the layer's shape from it (hidden, num_topk, dtype).
    cfg: DispatchConfig

    activation_format: ActivationFormat = ActivationFormat.STANDARD
    #: True when :meth:`set_batch_hint` changes what the next call does (an engine then builds
    #: the hint before each prepare; for other backends it skips that work).
    uses_batch_hint: bool = False

    def supports_row_scatter_finalize(self) -> bool:
        """True when ``finalize`` accepts a :class:`RowScatterTarget`."""
        return True

    def supports_async(self) -> bool:
        """True when the hooks really defer work (so the shared expert can run between)."""
        return False

    def max_num_tokens_per_rank(self) -> Optional[int]:
        """The most tokens one rank may hand prepare per call, where the buffers are sized
        for a fixed capacity (the low-latency backends); None: no fixed limit."""
        return None

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        """The topk-id dtype the transport takes (None: any int32/int64). An engine whose router
        emits it (vLLM's asks the prepare/finalize) saves the cast, a kernel per call."""
        return None

    def post_init_setup(self, experts: object) -> None:
        """Adapt the wire format to the experts that will read it, once, before the first call
        (e.g. packed UE8M0 scales for experts whose ``supports_packed_ue8m0_act_scales()`` is
        true). An engine calls it when it pairs this prepare/finalize with its experts."""

    @abstractmethod
    def num_dispatchers(self) -> int:
        """Ranks that send tokens to this one."""

    @abstractmethod
    def prepare_async(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        quant: QuantSpec,
    ) -> AsyncResult:
        """Send this rank's owned tokens to the ranks that hold their experts.

        Arguments:
            hidden_states: ``torch.Tensor`` of the model dtype (bf16 on the GPU backends),
                shape ``[num_tokens, hidden]``: the owned tokens (``num_tokens`` may be 0).
            topk_weights: ``torch.float32``, shape ``[num_tokens, num_topk]``: router weights.
            topk_ids: ``torch.int32`` or ``torch.int64``, shape ``[num_tokens, num_topk]``:
                PHYSICAL expert ids (:mod:`moe_plugins.placement`: physical expert p lives on
                EP rank p // num_local_experts; with linear placement and no redundant experts
                they are the model's expert ids), -1 for none where the backend allows it.
            quant: how the activations travel (:class:`moe_plugins.quant.QuantSpec`).

        Returns:
            :class:`AsyncResult`: ``hook`` (None, or the receive to run later, e.g. after the
            shared expert was launched) and ``receiver``, which returns the
            :class:`PrepareResult` (its tensors stay valid until this call's finalize).
        """

    @abstractmethod
    def finalize_async(
        self,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        output: torch.Tensor | RowScatterTarget,
    ) -> AsyncResult:
        """Send the expert outputs back to their tokens' owners and reduce them there.

        Arguments:
            fused_expert_output: ``torch.Tensor`` of the model dtype, the experts' outputs in
                the layout prepare handed them: STANDARD ``[num_recv_tokens, hidden]`` (already
                weighted by the experts' reduction), BATCHED
                ``[num_local_experts, max_recv_tokens, hidden]`` (unweighted: the combine
                applies ``topk_weights``).
            topk_weights: ``torch.float32``, shape ``[num_tokens, num_topk]``: the ones given
                to this call's prepare.
            topk_ids: ``torch.int32`` or ``torch.int64``, shape ``[num_tokens, num_topk]``: the
                ones given to this call's prepare.
            output: a ``[num_tokens, hidden]`` tensor of the model dtype to fill, or a
                :class:`RowScatterTarget` whose rows this rank owns get the routed output
                added (:func:`row_scatter_add`; other rows untouched).

        Returns:
            :class:`AsyncResult`: ``hook`` (None, or the receive to run later) and
            ``receiver``, which returns the tensor it wrote: ``output`` itself, or the
            target's buffer.
        """

    def reset_call_state(self) -> None:
        """Drop per-call state (dispatch handles). Called in ``finally`` after every layer call,
        so an error in one call never shows up as a stale-handle error in the next."""

    #: True when every call starts with a host exchange that can carry a refusal to the peers
    #: (:meth:`refuse`); False: the peers cannot be told, and a caller that refuses a call's
    #: inputs completes it with no tokens of its own instead (:mod:`moe_plugins.faults`, rule "refused inputs").
    host_exchange: bool = False
    #: True when a call may wait on the host inside the library while holding the interpreter
    #: lock (DeepEP's normal-mode dispatch): the call bound's watchdog thread cannot run there,
    #: so the layers name their watched call for the thread (moe_plugins.callbound.host_timer.
    #: bound_host_waits) and the backend wraps the library call that waits in ``host_wait``
    waits_on_host: bool = False
    #: True when the backend's waits for its peers hear the group's fault notice themselves
    #: (moe_plugins.callbound.fault_notice.wait_or_told: a peer that failed mid-way makes this rank raise
    #: in seconds, bound on or off); the layers then leave the notice out of their watched calls,
    #: so the watchdog does not end the process for what the backend raises
    hears_peer_failures: bool = False
    #: The library's own bound on a wait for a peer, in seconds (None: none; the backend's waits
    #: are bounded by the process group's timeout), and whether at it the library's kernels trap
    #: (the process's CUDA context is lost before any error reaches the host) rather than mask
    #: the peer or raise. With no call bound set, the layers bound their calls by a backstop
    #: derived from these (moe_plugins.callbound.CallBound.backstop), so that no rank waits
    #: forever where the library's own timeout does not end it.
    library_timeout_s: Optional[float] = None
    library_traps: bool = False

    def refuse(self, error: BaseException) -> None:
        """A caller refused this call's inputs before calling prepare: take this rank's part in
        the call's host exchange without them, so every rank raises at the same point (this
        one ``error``, its peers :class:`moe_plugins.faults.PeerInputError`). Always raises.
        Only where :attr:`host_exchange` is True."""
        raise TypeError(f"{type(self).__name__} has no host exchange to refuse a call through; "
                        "complete the call with no tokens of its own instead") from error

    def set_batch_hint(self, hint: Optional[BatchHint]) -> None:
        """What the engine knows about the next call's forward pass (the vLLM glue reads it from
        vLLM's forward context). Backends that pick their transport per call use it; others
        ignore it."""

    def prepare(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, quant: QuantSpec) -> PrepareResult:
        """:meth:`prepare_async` with its receive completed.

        Arguments:
            hidden_states: model dtype, ``[num_tokens, hidden]``.
            topk_weights: ``torch.float32``, ``[num_tokens, num_topk]``.
            topk_ids: ``torch.int32``/``torch.int64``, ``[num_tokens, num_topk]``, physical ids.
            quant: how the activations travel.

        Returns:
            :class:`PrepareResult`: ``x``, ``x_sf`` (None exactly when ``x`` is unquantized),
            the per-expert counts and, STANDARD only, local ``topk_ids``/``topk_weights``.
        """
        res = self.prepare_async(hidden_states, topk_weights, topk_ids, quant)
        if res.hook is not None:
            res.hook()
        out = res.receiver()
        assert isinstance(out, PrepareResult)
        return out

    def finalize(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget) -> torch.Tensor:
        """:meth:`finalize_async` with its receive completed.

        Arguments:
            fused_expert_output: model dtype, STANDARD ``[num_recv_tokens, hidden]`` or
                BATCHED ``[num_local_experts, max_recv_tokens, hidden]``.
            topk_weights: ``torch.float32``, ``[num_tokens, num_topk]`` (as given to prepare).
            topk_ids: ``torch.int32``/``torch.int64``, ``[num_tokens, num_topk]`` (as given).
            output: a ``[num_tokens, hidden]`` tensor, or a :class:`RowScatterTarget`.

        Returns:
            ``torch.Tensor``: the tensor written (``output``, or the target's buffer).
            TypeError when the backend returned another, or when ``output`` is a
            :class:`RowScatterTarget` and the backend has no row-scatter finalize.
        """
        if isinstance(output, RowScatterTarget) and not self.supports_row_scatter_finalize():
            raise TypeError(f"{type(self).__name__} has no row-scatter finalize; pass a plain "
                            "output tensor or pick a backend whose capabilities list row_scatter")
        res = self.finalize_async(fused_expert_output, topk_weights, topk_ids, output)
        if res.hook is not None:
            res.hook()
        return check_finalize_result(self, output, res.receiver())


def check_finalize_result(backend: object, output: torch.Tensor | RowScatterTarget,
                          result: object) -> torch.Tensor:
    """A finalize must hand back the very tensor it was given to write."""
    expected = output.buffer if isinstance(output, RowScatterTarget) else output
    if result is not expected:
        raise TypeError(
            f"{type(backend).__name__}.finalize returned "
            f"{type(result).__name__ if not isinstance(result, torch.Tensor) else 'another tensor'} "
            "instead of the output buffer it was given; a finalize must write (row-scatter: add) "
            "into that buffer in place and return it"
        )
    return expected




# --------------------------------------------------------------------------------------------
# Optional protocols a backend (or its manager) may implement; any class with these methods
# qualifies, a third-party one too (isinstance checks the methods, not the base class).
# --------------------------------------------------------------------------------------------
@runtime_checkable
class SplitPhases(Protocol):
    """A prepare/finalize whose dispatch and combine split into a send and a receive that the
    caller runs itself, without the result objects in between (the vLLM adapter takes this path
    for every backend that has it: one Python frame less per half). The low-latency family
    (DeepEP LL, NIXL EP) implements it."""

    def dispatch_send(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, quant: QuantSpec, recv_hook: bool
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor,
                                 Optional[Hook]]:
        """Check the call and issue the dispatch. Returns the receive buffers x and x_sf
        (BATCHED layout; filled once the hook ran, or at once when not ``recv_hook``),
        recv_count int32 [num_local_experts] and the hook (None when not ``recv_hook``)."""
        ...

    def expert_shape(self) -> Optional[torch.Size]:
        """The shape the call in flight wants its expert outputs in; None without one."""
        ...

    def combine_send(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget,
                     recv_hook: bool) -> tuple[Optional[Hook], torch.Tensor]:
        """Check the call and issue the combine. Returns (hook or None, dest: the tensor the
        library writes, ``output`` itself where it can)."""
        ...

    def combine_received(self, dest: torch.Tensor, output: torch.Tensor | RowScatterTarget
                         ) -> torch.Tensor:
        """After the combine's receive: ``dest`` into ``output``; returns ``output`` (a
        row-scatter target: its buffer)."""
        ...
