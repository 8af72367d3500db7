"""Reference backend ``torch``: dispatch/combine with ``all_to_all_single`` over the EP group.

Runs anywhere torch.distributed runs (gloo on CPU, NCCL on GPU); the embedded default. A token is
sent to each destination rank once, however many of its experts live there; the receiving rank
sums its local experts' weighted outputs and sends one row back.

Faults (:mod:`moe_plugins.faults`): the split-size all-to-all that starts every call is the host
exchange. Each rank's input checks run before it but raise only after it, their outcome (and
whether any expert id is outside [-1, num_experts)) travelling in the exchanged header with the
call's sequence number and layer digest; so a bad input on one rank makes every rank raise at
the same point, and a peer that skipped a call or is in another layer is caught at once. Expert
id -1 means "no expert" (the token is not sent for that slot).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from moe_plugins.all2all.torch import TorchAll2AllManager
from moe_plugins.config import DispatchConfig
from moe_plugins.counters import DispatchStats, tensor_bytes
from moe_plugins.callbound import wait_or_told
from moe_plugins.faults import (layer_name, HEADER_WORDS, STATUS_BAD_INPUT, STATUS_OK, check_peers,
                                collective_error, config_digest, group_faults, in_step,
                                told_error)
from moe_plugins.interface import (ActivationFormat, AsyncResult, LazyExpertTokensMeta,
                                   PrepareFinalize, PrepareResult, RowScatterTarget,
                                   check_finalize_result, check_finalize_routing, check_output,
                                   check_prepare_inputs, write_output)
from moe_plugins.layout import DestinationMap, LocalIdMap
from moe_plugins.quant import QuantScheme, QuantSpec, quantize_for_dispatch, wire_view
from moe_plugins.registry import BackendSpec, Capabilities

__all__ = ["TorchPrepareFinalize", "SPEC"]


@dataclass
class _DispatchHandle:
    """What combine needs from dispatch. token_index: int64 [num_sent_rows], the owned row each
    sent row came from, grouped by destination rank; num_recv: sum(recv_splits)."""

    num_tokens: int
    token_index: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    num_recv: int
    topk_ids: torch.Tensor  # as given to prepare (finalize must get the same, and the
    topk_weights: torch.Tensor  # same weights: they travelled with the tokens)


class _HeaderBuffer:
    """One layer's host-exchange buffer on one device, kept across calls: int64
    [2 * num_ranks + 2, HEADER_WORDS], so one ``tolist`` reads it all (the call's one host
    sync). Rows [0, r): ``send`` (row i: what this rank sends rank i: count, seq, digest,
    status); rows r, r + 1: scratch; rows [r + 2, 2r + 2): ``recv`` (what each peer sent).
    Reusing it is safe: that read waits for the exchange before the call goes on.

    ``send`` is written in two kernels, with no separate write of the sequence number:
    :meth:`write_counts` sums the destination map's rows into column 0 of rows [0, r + 2): the
    rows to each rank, then the -1 row (into the scratch row r) and the count of tokens with bad
    ids (into row r + 1: the status); :meth:`write_words` then writes columns 1-3 of every send
    row as ``base + seq * (1, 0, 0)``, where ``base`` is a stride-0 view of the three words
    (0, digest, status) that end scratch row r and start row r + 1."""

    def __init__(self, num_ranks: int, digest: int, device: torch.device):
        r = num_ranks
        self.buffer = torch.zeros(2 * r + 2, HEADER_WORDS, dtype=torch.int64, device=device)
        self.send, self.recv = self.buffer[:r], self.buffer[r + 2:]
        self.buffer[r, 3] = digest
        self.counts = self.buffer[:r + 2, 0]  # strided: column 0
        self.status = self.buffer[r + 1, 0]
        self._words = self.send[:, 1:]  # strided: columns 1-3
        self._base = self.buffer.view(-1).as_strided((r, 3), (0, 1), HEADER_WORDS * r + 2)
        self._seq_unit = torch.tensor([1, 0, 0], dtype=torch.int64, device=device).expand(r, 3)

    def write_counts(self, hit: torch.Tensor) -> None:
        """hit: the destination map's int64 0/1 [r + 2, num_tokens]."""
        torch.sum(hit, dim=1, out=self.counts)

    def write_words(self, seq: int) -> None:
        torch.add(self._base, self._seq_unit, alpha=seq, out=self._words)


class TorchPrepareFinalize(PrepareFinalize):
    """STANDARD layout: prepare returns [num_recv_tokens, hidden] rows with LOCAL topk ids."""

    activation_format = ActivationFormat.STANDARD

    def __init__(self, manager: TorchAll2AllManager, cfg: DispatchConfig):
        self.manager = manager
        self.cfg = cfg
        self.stats = DispatchStats()
        self._handle: Optional[_DispatchHandle] = None
        self.faults = group_faults(getattr(manager, "group", None))
        self.name = layer_name("torch backend", cfg, getattr(manager, "rank", "?"))
        # The layer's config (placement included) and its creation index on the group: ranks
        # in different layers (even of equal config) disagree on it.
        placement = getattr(manager, "placement", None)
        self._digest = config_digest("torch", cfg.num_experts, cfg.hidden, cfg.num_topk,
                                     str(cfg.dtype), cfg.quant,
                                     placement.describe() if placement is not None else None,
                                     self.faults.next_layer_index())
        ctx = getattr(manager, "ctx", None)
        self._timeout_s = getattr(ctx, "timeout_s", None)
        # On CPU (gloo) a wait for the peers can be cut into slices on the host: between them
        # it hears the group's fault notice, so a peer that fails mid-way makes this rank raise
        # in seconds, bound on or off. NCCL's wait only orders streams: left to the watchdog.
        device = getattr(ctx, "device", None)
        self.hears_peer_failures = (self.faults.notice is not None and device is not None
                                    and device.type == "cpu")
        self._local_ids: Optional[LocalIdMap] = None  # made on the first receive
        self._destinations: Optional[DestinationMap] = None  # made on the first prepare
        self._headers: dict[torch.device, _HeaderBuffer] = {}
        # Per device, a 1-element int32 one: expanded, the source of the per-expert count scatter.
        self._ones: dict[torch.device, torch.Tensor] = {}
        self._layouts: dict[tuple, _RowLayout] = {}  # row layouts by (k, dtypes, widths)

    def num_dispatchers(self) -> int:
        return self.manager.num_ranks

    def supports_async(self) -> bool:
        return True

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        """The ids travel as int64 (int32 ones are widened per call)."""
        return torch.int64

    def reset_call_state(self) -> None:
        if self._handle is not None:  # dispatched, never combined: peers wait in the combine
            self.faults.mark_broken(f"call {self.faults.seq} was abandoned between its "
                                    "dispatch and its combine")
        self._handle = None

    def _wait(self, work: "object | None", what: str) -> None:
        if work is not None:
            try:
                self._wait_for_peers(work, what)
            except RuntimeError as e:
                raise collective_error(self.faults, self.name, what, self._timeout_s, e) from e

    def _wait_for_peers(self, work: "dist.Work", what: str) -> None:
        """``work.wait()``; on gloo hearing the group's fault notice (CollectiveError naming
        the peer's failure, in seconds)."""
        if not self.hears_peer_failures:
            work.wait()
            return
        told = wait_or_told(work, self.faults.notice)  # type: ignore[arg-type]
        if told is not None:
            raise told_error(self.faults, self.name, what, told)

    def _counts(self, local_ids: torch.Tensor) -> torch.Tensor:
        """LOCAL ids int64 [num_recv, num_topk] (-1: held elsewhere), as prepare returned them
        -> int32 [num_local_experts], pairs per local expert, in three small kernels, no host
        sync."""
        one = self._ones.get(local_ids.device)
        if one is None:
            one = self._ones[local_ids.device] = torch.ones(1, dtype=torch.int32,
                                                            device=local_ids.device)
        shifted = local_ids.view(-1) + 1  # 0: held elsewhere
        # a token's experts are distinct, so pairs per local expert == tokens per expert; slot 0
        # of the scatter collects the entries held elsewhere
        counts = torch.zeros(self.manager.placement.num_local + 1, dtype=torch.int32,
                             device=shifted.device)
        counts.scatter_add_(0, shifted, one.expand(shifted.numel()))
        return counts[1:]

    def prepare_async(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, quant: QuantSpec) -> AsyncResult:
        """hidden_states [num_tokens, hidden], topk_weights float [num_tokens, num_topk],
        topk_ids int [num_tokens, num_topk] (PHYSICAL ids, -1: none). The header exchange runs
        here; the payload all-to-all is issued here and waited for in the hook."""
        sent, work, row = self._dispatch(hidden_states, topk_weights, topk_ids, quant, False)

        def hook() -> None:
            self._wait(work, "dispatch all-to-all")

        return AsyncResult(hook, lambda: self._received(sent, row))

    def prepare(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, quant: QuantSpec) -> PrepareResult:
        """:meth:`prepare_async` with a blocking payload all-to-all (no pending work object to
        keep and wait for, no hook or receiver to build)."""
        sent, _, row = self._dispatch(hidden_states, topk_weights, topk_ids, quant, True)
        return self._received(sent, row)

    def _dispatch(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, quant: QuantSpec, blocking: bool
                  ) -> tuple[torch.Tensor, "object | None", "_RowLayout"]:
        """The header exchange and the payload all-to-all (issued) -> (the receive buffer uint8
        [num_recv, row bytes], its pending work or None, the row layout)."""
        f = self.faults
        f.check(self.name)
        self._check_no_call_in_flight("prepare")
        m = self.manager
        try:  # raised after the exchange, so that every rank raises alike
            check_prepare_inputs(hidden_states, topk_weights, topk_ids, self.cfg)
            input_error: Optional[Exception] = None
        except (ValueError, TypeError) as e:
            input_error = e
        r = m.num_ranks
        if input_error is not None:
            self._refused_exchange(input_error)
        hb = self._header_buffer(hidden_states.device)
        f.seq += 1
        if self._destinations is None:
            self._destinations = DestinationMap(m.placement)
        ids = topk_ids if topk_ids.dtype is torch.int64 else topk_ids.long()
        # [r + 2, n]: the destination ranks, a -1 row, a bad-id row (faults' status word: the
        # count of tokens with ids outside [-1, num_physical))
        hit = self._destinations(ids)
        hb.write_counts(hit)
        sent_header, peers = self._exchange(hb)
        send_splits = [row[0] for row in sent_header]
        if sent_header[0][3] != STATUS_OK:  # a count of tokens with out-of-range ids
            num_physical = m.placement.num_physical
            raise in_step(ValueError(
                f"{self.name}: topk_ids hold expert ids outside [-1, {num_physical}) "
                f"(-1: no expert) in {sent_header[0][3]} token(s); route over the layer's "
                f"{num_physical} (physical) experts"))
        recv_splits = [peer[0] for peer in peers]
        num_recv = sum(recv_splits)
        num_sent = sum(send_splits)
        # Rows sent, grouped by destination rank, each token once per rank; their number is
        # known from the header, so the nonzeros are found without a second host sync.
        token_index = torch.nonzero_static(hit[:r], size=num_sent)[:, 1]

        x, x_sf = quantize_for_dispatch(hidden_states, quant)
        weights = topk_weights if topk_weights.dtype is torch.float32 else topk_weights.float()
        # One message per row (ids, weights, activations, scales as bytes): one all-to-all
        # instead of one per tensor (each is a collective's host cost, on NCCL and on gloo).
        packed, row = self._pack_rows(ids, weights, x, x_sf)
        try:
            sent, work = self._all_to_all(torch.index_select(packed, 0, token_index),
                                          send_splits, recv_splits, num_recv, blocking,
                                          "dispatch all-to-all")
        except RuntimeError as e:  # a blocking transfer that timed out, or a peer gone
            raise collective_error(f, self.name, "dispatch all-to-all", self._timeout_s, e) from e

        s = self.stats
        s.calls += 1
        s.pairs += topk_ids.numel()
        s.rows += num_sent
        s.act_bytes += num_sent * row.x_bytes
        s.sf_bytes += num_sent * row.sf_bytes
        s.meta_bytes += num_sent * row.meta_bytes
        self._handle = _DispatchHandle(hidden_states.shape[0], token_index, send_splits,
                                       recv_splits, num_recv, topk_ids, topk_weights)
        return sent, work, row

    # -- the process group's calls (the manager holds the group and the options) ---------------
    # The all-to-alls call the process group's own ``alltoall_base``, as ``dist.all_to_all_single``
    # does after its argument checks. Those checks cannot fail here (this rank is in the group,
    # the tensors are plain, same-dtype, never complex), and on a busy host they cost about as
    # much as a kernel launch, three times a round trip. Under ``torch.compile`` tracing the
    # public function is called instead (Dynamo maps it to a functional collective).
    def _all_to_all_single(self, recv: torch.Tensor, send: torch.Tensor,
                           recv_splits: Optional[list[int]], send_splits: Optional[list[int]],
                           blocking: bool, what: str) -> Optional["dist.Work"]:
        """``dist.all_to_all_single(recv, send, recv_splits, send_splits, group, not blocking)``
        (None splits: equal ones; ``what`` names it in an error)."""
        m = self.manager
        if torch.compiler.is_compiling():
            return dist.all_to_all_single(recv, send, recv_splits, send_splits, group=m.group,
                                          async_op=not blocking)
        work = m.pg.alltoall_base(recv, send, recv_splits or [], send_splits or [],
                                      m.blocking_opts if blocking else m.async_opts)
        if blocking:
            # NCCL returns no work for a blocking call (it ran on the current stream), as
            # dist.all_to_all_single expects of backends that sync in C++
            if work is not None:
                self._wait_for_peers(work, what)
            return None
        return work

    def _exchange_header(self, send: torch.Tensor, recv: Optional[torch.Tensor] = None
                        ) -> torch.Tensor:
        """The call's host exchange: send int64 [num_ranks, HEADER_WORDS] (row r: rows we send
        rank r, then this call's sequence number, layer digest and input status; see
        :mod:`moe_plugins.faults`) -> what each peer sent us, same shape (into ``recv`` when
        given: a caller that keeps one buffer for both saves an allocation per call)."""
        if recv is None:
            recv = torch.empty_like(send)
        self._all_to_all_single(recv, send, None, None, True, "split-size exchange")
        return recv

    def _all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                    num_recv: Optional[int] = None, blocking: bool = False,
                    what: str = "all-to-all") -> tuple[torch.Tensor, Optional["dist.Work"]]:
        """Rows of ``send`` [sum(send_splits), ...] go to each rank in order; returns the receive
        tensor [sum(recv_splits), ...] (same dtype) and the pending work to wait on (None when
        ``blocking``: the call returns once the transfer is done, on NCCL once it is queued on
        the stream, with no work object or event to keep). ``num_recv``: sum(recv_splits)
        when the caller has it already."""
        wire = wire_view(send.contiguous())
        rows = sum(recv_splits) if num_recv is None else num_recv
        recv = torch.empty((rows, *wire.shape[1:]), dtype=wire.dtype, device=wire.device)
        work = self._all_to_all_single(recv, wire, recv_splits, send_splits, blocking, what)
        return recv.view(send.dtype) if recv.dtype != send.dtype else recv, work

    # -- the host exchange (moe_plugins.faults, rules "validated everywhere", "out of step" and
    # "refused inputs") -----------------------------------------------------------------------
    host_exchange = True

    def refuse(self, error: BaseException) -> None:
        """A caller refused this call's inputs: the header exchange goes out with this rank's
        input status set (no rows), every rank raises after it, this one ``error``."""
        self.faults.check(self.name)
        self._check_no_call_in_flight("refuse")
        self._refused_exchange(error)

    def _refused_exchange(self, error: BaseException) -> None:
        """The header exchange of a call whose inputs this rank refused; raises ``error`` (in
        step: its peers raise PeerInputError at the same point, or their own refusals)."""
        hb = self._header_buffer(self.manager.ctx.device)
        self.faults.seq += 1
        hb.counts.zero_()
        hb.status.fill_(STATUS_BAD_INPUT)
        self._exchange(hb)
        raise in_step(error)

    def _header_buffer(self, device: torch.device) -> _HeaderBuffer:
        hb = self._headers.get(device)
        if hb is None:
            hb = self._headers[device] = _HeaderBuffer(self.manager.num_ranks, self._digest,
                                                       device)
        return hb

    def _exchange(self, hb: _HeaderBuffer) -> tuple[list[list[int]], list[list[int]]]:
        """Send this call's header (counts and status already written), receive the peers',
        check them (:func:`check_peers`) -> (what this rank sent each peer, what each peer
        sent it), rows of (count, seq, digest, status)."""
        f, r = self.faults, self.manager.num_ranks
        hb.write_words(f.seq)
        try:
            self._exchange_header(hb.send, hb.recv)
        except RuntimeError as e:
            raise collective_error(f, self.name, "split-size exchange", self._timeout_s, e) from e
        header = hb.buffer.tolist()  # the one host sync of the call
        peers = header[r + 2:]
        check_peers(f, self.name, self.manager.rank, f.seq, self._digest, peers)
        return header[:r], peers

    def _check_no_call_in_flight(self, what: str) -> None:
        """``what`` (prepare, refuse) while a dispatched call was never combined: its peers wait
        in that call's combine, so the group breaks."""
        if self._handle is not None:
            raise self.faults.call_in_flight(self.name, what)

    def _received(self, sent: torch.Tensor, row: "_RowLayout") -> PrepareResult:
        """The received rows -> the experts' input: LOCAL ids (-1 elsewhere) in one gather; the
        per-expert counts are made when first read (STANDARD experts rarely read them)."""
        recv_ids, recv_weights, recv_x, recv_sf = row.unpack(sent)
        if self._local_ids is None:
            m = self.manager
            self._local_ids = LocalIdMap(m.placement, m.rank)
        local = self._local_ids.checked(recv_ids)
        # counted from the local ids (which the result holds anyway), not the received rows:
        # the receive buffer is freed here, not kept for a read that may never come
        return PrepareResult(x=recv_x, x_sf=recv_sf,
                             expert_tokens_meta=LazyExpertTokensMeta(self._counts, local),
                             topk_ids=local, topk_weights=recv_weights)

    def _pack_rows(self, ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor,
                   x_sf: Optional[torch.Tensor]) -> tuple[torch.Tensor, "_RowLayout"]:
        """ids int64, weights float32 [num_tokens, k], x [num_tokens, cols], x_sf [num_tokens,
        sf_cols] or None -> (uint8 [num_tokens, row bytes], the layout): one concatenation.
        The layout is made once per (k, dtypes, widths) and kept."""
        parts = [ids.contiguous().view(torch.uint8), weights.contiguous().view(torch.uint8),
                 x.contiguous().view(torch.uint8)]
        if x_sf is not None:
            parts.append(x_sf.contiguous().view(torch.uint8))
        key = (ids.shape[1], x.dtype, parts[2].shape[1],
               None if x_sf is None else x_sf.dtype, 0 if x_sf is None else parts[3].shape[1])
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _RowLayout.of(*key)
        if layout.pad:
            parts.append(x.new_zeros((x.shape[0], layout.pad), dtype=torch.uint8))
        return torch.cat(parts, dim=1), layout

    def finalize_async(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget) -> AsyncResult:
        """fused_expert_output [num_recv_tokens, hidden]: the weighted sum over this rank's
        experts of each received row; it goes back to the row's owner, which sums its rows
        into ``output``."""
        recv, work, h = self._combine(fused_expert_output, topk_weights, topk_ids, output,
                                      False)

        def hook() -> None:
            self._wait(work, "combine all-to-all")

        return AsyncResult(hook, lambda: self._combined(recv, h, fused_expert_output.dtype,
                                                        output))

    def finalize(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget) -> torch.Tensor:
        """:meth:`finalize_async` with a blocking all-to-all."""
        recv, _, h = self._combine(fused_expert_output, topk_weights, topk_ids, output, True)
        return check_finalize_result(self, output, self._combined(
            recv, h, fused_expert_output.dtype, output))

    def _combine(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget, blocking: bool
                 ) -> tuple[torch.Tensor, "object | None", _DispatchHandle]:
        """The reverse all-to-all (issued): what we received goes back where it came from ->
        (the returned rows [num_sent_rows, hidden], the pending work or None, the handle)."""
        h = self._handle
        if h is None:
            raise RuntimeError("finalize called without a matching prepare on this backend")
        if topk_ids is not h.topk_ids or topk_weights is not h.topk_weights:
            check_finalize_routing(h.topk_ids, h.topk_weights, topk_ids, topk_weights)
        if not isinstance(fused_expert_output, torch.Tensor):
            raise TypeError(f"fused_expert_output must be a torch.Tensor, got "
                            f"{type(fused_expert_output).__name__}")
        if fused_expert_output.shape != (h.num_recv, self.cfg.hidden):
            raise ValueError(f"fused_expert_output has shape {tuple(fused_expert_output.shape)}, "
                             f"expected [{h.num_recv}, {self.cfg.hidden}] (the rows prepare "
                             "received, the layer's hidden)")
        check_output(output, h.num_tokens, self.cfg.hidden)
        try:
            recv, work = self._all_to_all(fused_expert_output, h.recv_splits, h.send_splits,
                                          h.token_index.numel(), blocking,
                                          "combine all-to-all")
        except RuntimeError as e:
            raise collective_error(self.faults, self.name, "combine all-to-all", self._timeout_s,
                                   e) from e
        self.stats.combine_bytes += tensor_bytes(fused_expert_output)
        return recv, work, h

    def _combined(self, recv: torch.Tensor, h: _DispatchHandle, dtype: torch.dtype,
                  output: torch.Tensor | RowScatterTarget) -> torch.Tensor:
        """The returned rows summed per token (float32) into ``output``."""
        acc = torch.zeros(h.num_tokens, recv.shape[1], dtype=torch.float32, device=recv.device)
        acc.index_add_(0, h.token_index, recv if recv.dtype is torch.float32 else recv.float())
        self._handle = None
        if isinstance(output, RowScatterTarget) or output.dtype is not dtype:
            return write_output(output, acc.to(dtype))
        # copy_ rounds to the output dtype on the way, as .to() would, without a temporary
        return write_output(output, acc)


@dataclass(frozen=True)
class _RowLayout:
    """Byte layout of one dispatched row: ids int64 [k], weights float32 [k], the activation
    row (``x_dtype``), its scales (``sf_dtype``, None: none), zero or more pad bytes (rows are
    whole int64 words, so every part can be viewed in its own dtype). Widths in bytes."""

    k: int
    x_dtype: torch.dtype
    x_bytes: int
    sf_dtype: Optional[torch.dtype]
    sf_bytes: int
    pad: int
    splits: tuple[int, ...]  # the parts' widths: ids, weights, x[, x_sf][, pad]

    @classmethod
    def of(cls, k: int, x_dtype: torch.dtype, x_bytes: int, sf_dtype: Optional[torch.dtype],
           sf_bytes: int) -> "_RowLayout":
        pad = -(12 * k + x_bytes + sf_bytes) % 8
        splits = (8 * k, 4 * k, x_bytes) + ((sf_bytes,) if sf_dtype is not None else ()) \
            + ((pad,) if pad else ())
        return cls(k, x_dtype, x_bytes, sf_dtype, sf_bytes, pad, splits)

    @property
    def meta_bytes(self) -> int:
        """int64 ids + float32 weights + pad, per row."""
        return self.k * (8 + 4) + self.pad

    def unpack(self, rows: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """uint8 [num_rows, row bytes] -> (ids int64 [num_rows, k] (a view, strided by the
        row: only the local-id lookup reads it), weights float32 [num_rows, k], x, x_sf or None
        (row-major copies, as experts read them))."""
        parts = rows.split_with_sizes(self.splits, dim=1)  # the column views, in one call
        x_sf = None if self.sf_dtype is None else _dense(parts[3].view(self.sf_dtype))
        return (parts[0].view(torch.int64), _dense(parts[1].view(torch.float32)),
                _dense(parts[2].view(self.x_dtype)), x_sf)


def _dense(view: torch.Tensor) -> torch.Tensor:
    """A copy with row-major strides. Not ``.contiguous()``: a view of one row counts as
    contiguous whatever its row stride and would be returned as is, and kernels that read the
    row stride (vLLM's CPU experts check stride(0) == hidden) would get the packed row's."""
    return view.clone(memory_format=torch.contiguous_format)


SPEC = BackendSpec(
    name="torch",
    prepare_finalize=TorchPrepareFinalize,
    manager=TorchAll2AllManager,
    capabilities=Capabilities(ep_dp=True, dp=True, tp=True, sp=True, row_scatter=True,
                              recv_hook=False, placements=True),
    quants=frozenset({QuantScheme.NONE, QuantScheme.FP8_BLOCK128, QuantScheme.NVFP4}),
    description="reference all_to_all_single over torch.distributed (gloo on CPU, NCCL on GPU)",
    use_for="CPU runs, tests and a reference to check the others against; any torch.distributed "
            "backend",
)
