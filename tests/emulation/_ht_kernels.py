"""Emulated DeepEP V1 normal-mode (high-throughput) intranode kernels over torch.distributed.

Follows what a caller can observe of DeepEP at commit 567632d (the last before the V2 rewrite):
``csrc/config.hpp`` (``Config`` and its buffer size hints), ``csrc/deep_ep.cpp``
(``Buffer::get_dispatch_layout``, ``Buffer::intranode_dispatch``, ``Buffer::intranode_combine``:
their ``EP_HOST_ASSERT`` checks, return tuples and handle contents) and
``csrc/kernels/intranode.cu`` / ``layout.cu`` (the data movement):

- ``get_dispatch_layout``: int32 ``num_tokens_per_rank`` [num_ranks] (tokens with at least one
  expert on a rank), ``None`` per RDMA rank (intranode), int32 ``num_tokens_per_expert``
  [num_experts], bool ``is_token_in_rank`` [num_tokens, num_ranks]; ids -1 select nothing;
- dispatch sends each token ONCE to every rank in ``is_token_in_rank`` (one row per (token,
  destination rank)): the row as is (bf16, or fp8 with its float/int scales), its source index,
  and with top-k: the ids mapped to the destination's LOCAL ids (``id - rank * E/R``, -1 for
  experts elsewhere) and the weights (0.0 where the id became -1). Received rows are ordered by
  source rank, then source token order; ``rank_prefix_matrix[s][r]`` is the end of source s's
  rows on rank r. ``num_recv_tokens_per_expert_list`` counts received tokens per local expert,
  each aligned up to ``expert_alignment``; with ``num_worst_tokens`` the outputs have that many
  rows, the list is empty and the top-k ids of the rows past the real ones are -1;
- combine sends each received row back to its source token and sums per token in float32,
  WITHOUT weights (plus optional biases), cast to bf16 (the only dtype the combine kernel has);
  with ``topk_weights`` the weights are summed the same way;
- ``async_finish``: the returned tensors hold poison (NaN, -1) until ``event.current_stream_wait()``
  (the CUDA event the real call returns) runs, so a caller that reads them before waiting gets
  wrong results, as it would on a GPU; without it the data are there when the call returns.
  The host still blocks inside a non-cached dispatch for the receive counts, as the real
  dispatch does (its "CPU recv timeout" wait): past :data:`NUM_CPU_TIMEOUT_SECS` it raises
  ``RuntimeError("DeepEP error: CPU recv timeout")`` as ``Buffer::intranode_dispatch`` throws
  it (the pending exchange is left behind, as the real kernel is).

Transport: the shared low-latency emulation's message all-to-all (counts, then uint8 rows).
Not emulated: internode (RDMA) kernels (more than 8 ranks), streams (``allocate_on_comm_stream``
is only checked), the channel-level layout of the handle's prefix matrices (kept as per-rank
inclusive prefix sums of the same shape and dtype).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from tests.emulation._ll_kernels import EmulatedLowLatencyRuntime, _bytes, host_assert

NUM_MAX_NVL_PEERS = 8
NUM_MAX_LOCAL_EXPERTS = 1024
_NOTIFY_THREADS = 128  # kNumThreads of notify_dispatch: local experts and ranks per block
_MAX_TOPK_LANES = 32  # EP_DEVICE_ASSERT(num_topk <= 32) in the dispatch kernel
_SOURCE_META_BYTES = 8  # sizeof(SourceMeta): counted in the NVL hint of NVSHMEM builds
_HINT_MAX_TOPK = 128
_HINT_MAX_SCALES = 128
_SUPPORTED_RANKS = (2, 4, 8)  # SWITCH_RANKS of the intranode kernels
#: DeepEP's NUM_CPU_TIMEOUT_SECS (csrc/kernels/configs.cuh at 567632d): how long a non-cached
#: dispatch's host waits for the peers' counts (a test process may lower it for itself).
NUM_CPU_TIMEOUT_SECS = 100.0


def _host_wait(work: Any) -> None:
    """The host's wait of ``Buffer::intranode_dispatch`` for the counts the notify kernel
    writes: a poll, and past :data:`NUM_CPU_TIMEOUT_SECS` the library's own error."""
    deadline = time.monotonic() + NUM_CPU_TIMEOUT_SECS
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise RuntimeError("DeepEP error: CPU recv timeout")
        time.sleep(0.0005)
    work.wait()


class Config:
    """deep_ep.Config (csrc/config.hpp): SMs and chunk sizes of the normal-mode kernels."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        host_assert(num_sms >= 0, "num_sms >= 0")
        host_assert(num_max_nvl_chunked_send_tokens > 0 and num_max_nvl_chunked_recv_tokens > 0,
                    "num_max_nvl_chunked_send_tokens > 0 and num_max_nvl_chunked_recv_tokens > 0")
        host_assert(num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens,
                    "num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens")
        host_assert(num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0,
                    "num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0")
        step = num_max_rdma_chunked_send_tokens
        num_max_rdma_chunked_recv_tokens = -(-num_max_rdma_chunked_recv_tokens // step) * step
        host_assert(step < num_max_rdma_chunked_recv_tokens,
                    "num_max_rdma_chunked_send_tokens < num_max_rdma_chunked_recv_tokens")
        host_assert(step <= num_max_rdma_chunked_recv_tokens // 2,
                    "num_max_rdma_chunked_send_tokens <= num_max_rdma_chunked_recv_tokens / 2")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        host_assert(num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0,
                    "num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0")
        host_assert(num_ranks <= NUM_MAX_NVL_PEERS or self.num_sms % 2 == 0,
                    "num_ranks <= NUM_MAX_NVL_PEERS or num_sms % 2 == 0")
        rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = self.num_sms // 2 * nvl_ranks
        recv = slots * self.num_max_nvl_chunked_recv_tokens
        num_bytes = (slots * (2 * rdma_ranks + 3) * 4 + recv * hidden_bytes
                     + recv * _SOURCE_META_BYTES + recv * _HINT_MAX_TOPK * 8
                     + recv * _HINT_MAX_TOPK * 4 + recv * _HINT_MAX_SCALES * 4)
        return (num_bytes + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0  # intranode: no RDMA buffer
        host_assert(num_ranks % NUM_MAX_NVL_PEERS == 0, "num_ranks % NUM_MAX_NVL_PEERS == 0")
        host_assert(self.num_sms % 2 == 0, "num_sms % 2 == 0")
        chans = self.num_sms // 2 * (num_ranks // NUM_MAX_NVL_PEERS)
        recv = chans * self.num_max_rdma_chunked_recv_tokens
        num_bytes = (chans * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4 + recv * hidden_bytes * 2
                     + recv * _SOURCE_META_BYTES * 2 + recv * _HINT_MAX_TOPK * 8 * 2
                     + recv * _HINT_MAX_TOPK * 4 * 2 + recv * _HINT_MAX_SCALES * 4 * 2
                     + recv * 16 * 2)
        return (num_bytes + 127) // 128 * 128


class EventHandle:
    """deep_ep_cpp.EventHandle: a CUDA event on the communication stream. Here it carries the
    receives still pending behind it; ``current_stream_wait`` completes them (once)."""

    def __init__(self, pending: Optional[Callable[[], None]] = None) -> None:
        self._pending = pending

    def current_stream_wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending()


_HEADER_INTS = 4  # int4 header: source token index, 3 reserved


def _field(msgs: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes [start, stop) of each message row as ``dtype`` [num_msgs, n]."""
    width = (stop - start) // torch.empty((), dtype=dtype).element_size()
    if msgs.shape[0] == 0:
        return torch.empty(0, width, dtype=dtype)
    return msgs[:, start:stop].clone(memory_format=torch.contiguous_format).view(dtype)


class EmulatedNormalRuntime:
    """The intranode normal-mode part of the C++ runtime, on the message transport of the
    low-latency emulation (``transport._send``)."""

    def __init__(self, transport: EmulatedLowLatencyRuntime, rank: int, num_ranks: int,
                 num_nvl_bytes: int) -> None:
        self.transport, self.rank, self.num_ranks = transport, rank, num_ranks
        self.num_nvl_bytes = num_nvl_bytes

    def _check_ranks(self) -> None:
        host_assert(self.num_nvl_bytes > 0, "emulation: normal mode needs num_nvl_bytes > 0")
        host_assert(self.num_ranks <= NUM_MAX_NVL_PEERS,
                    "emulation: internode (RDMA) normal mode is not emulated")
        host_assert(self.num_ranks in _SUPPORTED_RANKS, "false and \"Unsupported ranks\"")

    def _finish(self, recv: Callable[[], None], async_finish: bool) -> Optional[EventHandle]:
        if async_finish:
            return EventHandle(recv)
        recv()
        return None

    # -- layout -------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool):
        host_assert(topk_idx.dim() == 2, "topk_idx.dim() == 2")
        host_assert(topk_idx.is_contiguous(), "topk_idx.is_contiguous()")
        host_assert(num_experts > 0, "num_experts > 0")
        host_assert(topk_idx.dtype == torch.int64, "topk_idx.scalar_type() == topk_idx_t")
        if allocate_on_comm_stream:
            host_assert(previous_event is not None and async_finish,
                        "previous_event.has_value() and async")
        n, r = topk_idx.size(0), self.num_ranks
        per = num_experts // r
        valid = topk_idx >= 0
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        in_rank = torch.zeros(n, r, dtype=torch.bool)
        rows, cols = valid.nonzero(as_tuple=True)
        in_rank[rows, topk_idx[rows, cols] // per] = True
        per_rank = in_rank.sum(dim=0).to(torch.int32)
        return per_rank, None, per_expert, in_rank, EventHandle() if async_finish else None

    # -- dispatch -----------------------------------------------------------------------------
    def intranode_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor],
                           topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
                           num_tokens_per_rank: Optional[torch.Tensor],
                           is_token_in_rank: torch.Tensor,
                           num_tokens_per_expert: Optional[torch.Tensor],
                           cached_num_recv_tokens: int,
                           cached_rank_prefix_matrix: Optional[torch.Tensor],
                           expert_alignment: int, num_worst_tokens: int, config: Config,
                           async_finish: bool, allocate_on_comm_stream: bool,
                           previous_event: Any):
        self._check_ranks()
        cached = cached_rank_prefix_matrix is not None
        r, rank = self.num_ranks, self.rank
        host_assert(config.num_sms % 2 == 0, "config.num_sms % 2 == 0")
        channels = config.num_sms // 2
        if allocate_on_comm_stream:
            host_assert(previous_event is not None and async_finish,
                        "previous_event.has_value() and async")
        if not cached:
            host_assert(num_tokens_per_rank is not None and num_tokens_per_expert is not None,
                        "num_tokens_per_rank.has_value() and num_tokens_per_expert.has_value()")
        host_assert(is_token_in_rank.dtype == torch.bool,
                    "is_token_in_rank.scalar_type() == torch::kBool")
        if not cached:
            assert num_tokens_per_rank is not None and num_tokens_per_expert is not None
            host_assert(num_tokens_per_expert.dtype == torch.int32,
                        "num_tokens_per_expert->scalar_type() == torch::kInt32")
            host_assert(num_tokens_per_rank.dtype == torch.int32,
                        "num_tokens_per_rank->scalar_type() == torch::kInt32")
        host_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        host_assert(x.size(1) * x.element_size() % 16 == 0,
                    "(x.size(1) * x.element_size()) % sizeof(int4) == 0")
        host_assert(is_token_in_rank.dim() == 2 and is_token_in_rank.is_contiguous(),
                    "is_token_in_rank.dim() == 2 and is_token_in_rank.is_contiguous()")
        host_assert(is_token_in_rank.size(0) == x.size(0) and is_token_in_rank.size(1) == r,
                    "is_token_in_rank.size(0) == x.size(0) and is_token_in_rank.size(1) == num_ranks")
        num_experts = 0
        if not cached:
            assert num_tokens_per_rank is not None and num_tokens_per_expert is not None
            host_assert(num_tokens_per_expert.dim() == 1 and num_tokens_per_expert.is_contiguous(),
                        "num_tokens_per_expert->dim() == 1 and num_tokens_per_expert->is_contiguous()")
            host_assert(num_tokens_per_expert.size(0) % r == 0,
                        "num_tokens_per_expert->size(0) % num_ranks == 0")
            host_assert(num_tokens_per_expert.size(0) // r <= NUM_MAX_LOCAL_EXPERTS,
                        "num_tokens_per_expert->size(0) / num_ranks <= NUM_MAX_LOCAL_EXPERTS")
            host_assert(num_tokens_per_rank.dim() == 1 and num_tokens_per_rank.is_contiguous()
                        and num_tokens_per_rank.size(0) == r, "num_tokens_per_rank->size(0) == num_ranks")
            num_experts = num_tokens_per_expert.size(0)
        n, hidden = x.shape
        num_local = num_experts // r
        host_assert((topk_idx is None) == (topk_weights is None),
                    "topk_idx.has_value() == topk_weights.has_value()")
        num_topk = 0
        if topk_idx is not None:
            assert topk_weights is not None
            num_topk = topk_idx.size(1)
            host_assert(num_experts > 0, "num_experts > 0")
            host_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(),
                        "topk_idx->dim() == 2 and topk_idx->is_contiguous()")
            host_assert(topk_weights.dim() == 2 and topk_weights.is_contiguous(),
                        "topk_weights->dim() == 2 and topk_weights->is_contiguous()")
            host_assert(topk_idx.size(0) == n and topk_weights.size(0) == n,
                        "num_tokens == topk_idx->size(0) and num_tokens == topk_weights->size(0)")
            host_assert(topk_weights.size(1) == num_topk, "num_topk == topk_weights->size(1)")
            host_assert(topk_weights.dtype == torch.float32,
                        "topk_weights->scalar_type() == torch::kFloat32")
            host_assert(topk_idx.dtype == torch.int64, "topk_idx->scalar_type() == topk_idx_t")
            host_assert(num_topk <= _MAX_TOPK_LANES, "num_topk <= 32 (device assert)")
        num_scales = 0
        if x_scales is not None:
            host_assert(x.element_size() == 1, "x.element_size() == 1")
            host_assert(x_scales.dtype in (torch.float32, torch.int32),
                        "x_scales->scalar_type() == torch::kFloat32 or x_scales->scalar_type() == torch::kInt")
            host_assert(x_scales.dim() == 2, "x_scales->dim() == 2")
            host_assert(x_scales.size(0) == n, "x_scales->size(0) == num_tokens")
            num_scales = x_scales.size(1)
        if not cached:
            host_assert(r * (r + num_local) * 4 <= self.num_nvl_bytes,
                        "num_ranks * (num_ranks + num_local_experts) * sizeof(int) <= num_nvl_bytes")
            host_assert(num_local <= _NOTIFY_THREADS and r <= _NOTIFY_THREADS,
                        "num_experts / num_ranks <= kNumThreads and num_ranks <= kNumThreads")
        if num_worst_tokens > 0 and not cached:
            host_assert(topk_idx is not None and topk_weights is not None,
                        "topk_idx.has_value() and topk_weights.has_value()")
        recv_tokens = config.num_max_nvl_chunked_recv_tokens * channels * r
        host_assert(r * r * 4 + channels * r * 4 * 4 + recv_tokens * hidden * x.element_size()
                    + recv_tokens * 4 + recv_tokens * num_topk * 8 + recv_tokens * num_topk * 4
                    + recv_tokens * 4 * num_scales <= self.num_nvl_bytes,
                    "dispatch buffer bytes <= num_nvl_bytes")

        # The notify kernel exchanges the counts first; the host waits for them.
        sent = is_token_in_rank.sum(dim=0).to(torch.int32)
        gathered = [torch.empty(r, dtype=torch.int32) for _ in range(r)]
        work = dist.all_gather(gathered, sent, group=self.transport.group, async_op=True)
        if cached:  # no host wait in a cached dispatch
            work.wait()
        else:
            _host_wait(work)
        counts = torch.stack(gathered)  # counts[s][d]: rows source s sends to d
        rank_prefix_matrix = counts.cumsum(dim=0).to(torch.int32)
        num_real = int(rank_prefix_matrix[-1, rank])
        if cached:
            host_assert(cached_num_recv_tokens == num_real, "emulation: cached layout mismatch")
        num_recv = num_worst_tokens if num_worst_tokens > 0 else num_real
        host_assert(num_real <= num_recv, "emulation: more tokens received than num_worst_tokens")
        per_expert_list: list[int] = []
        if not cached and num_worst_tokens == 0:
            assert num_tokens_per_expert is not None
            # every sender's counts for this rank's experts, summed
            blocks = [torch.empty(num_experts, dtype=torch.int32) for _ in range(r)]
            dist.all_gather(blocks, num_tokens_per_expert.contiguous(), group=self.transport.group)
            mine = torch.stack(blocks).view(r, r, num_local)[:, rank].sum(dim=0)
            a = max(expert_alignment, 1)
            per_expert_list = [-(-int(c) // a) * a for c in mine.tolist()]

        # One message per (token, destination rank), in token order for each destination.
        tok, dest = is_token_in_rank.nonzero(as_tuple=True)
        order = torch.argsort(dest, stable=True)
        tok, dest = tok[order], dest[order]
        header = torch.zeros(tok.numel(), _HEADER_INTS, dtype=torch.int32)
        header[:, 0] = tok.to(torch.int32)
        parts = [_bytes(header), _bytes(x[tok])]
        if x_scales is not None:
            parts.append(_bytes(x_scales[tok].contiguous()))
        if topk_idx is not None:
            assert topk_weights is not None
            ids = topk_idx[tok]
            begin = (dest * num_local).unsqueeze(1)
            mine = (ids >= begin) & (ids < begin + num_local)
            parts.append(_bytes(torch.where(mine, ids - begin, torch.full_like(ids, -1))))
            parts.append(_bytes(torch.where(mine, topk_weights[tok],
                                            torch.zeros_like(topk_weights[tok]))))
        wait, _ = self.transport._send(torch.cat(parts, dim=1), dest)

        recv_x = torch.empty(num_recv, hidden, dtype=x.dtype)
        recv_x.view(torch.uint8).fill_(0xFF)  # poison (NaN for bf16 and e4m3)
        recv_scales = None
        if x_scales is not None:
            recv_scales = torch.full((num_recv, num_scales), -1, dtype=x_scales.dtype)
            if x_scales.dtype == torch.float32:
                recv_scales.fill_(float("nan"))
        recv_src_idx = torch.full((num_recv,), -1, dtype=torch.int32)
        recv_ids = recv_weights = None
        if topk_idx is not None and not cached:
            assert topk_weights is not None
            recv_ids = torch.full((num_recv, num_topk), -1, dtype=torch.int64)
            recv_weights = torch.full((num_recv, num_topk), float("nan"), dtype=torch.float32)

        def recv() -> None:
            msgs, _src = wait()
            host_assert(msgs.shape[0] == num_real, "emulation: received rows != counts")
            off = 4 * _HEADER_INTS
            recv_src_idx[:num_real] = _field(msgs, 0, off, torch.int32)[:, 0]
            row = hidden * x.element_size()
            recv_x[:num_real] = _field(msgs, off, off + row, x.dtype)
            off += row
            if recv_scales is not None:
                nb = num_scales * 4
                recv_scales[:num_real] = _field(msgs, off, off + nb, recv_scales.dtype)
                off += nb
            if recv_ids is not None and recv_weights is not None:
                recv_ids[:num_real] = _field(msgs, off, off + num_topk * 8, torch.int64)
                off += num_topk * 8
                recv_weights[:num_real] = _field(msgs, off, off + num_topk * 4, torch.float32)
                if num_worst_tokens > 0:
                    recv_weights[num_real:] = 0.0

        event = self._finish(recv, async_finish)
        # Per-channel prefix sums of the real kernels, kept as inclusive per-rank sums.
        channel_prefix = sent.view(r, 1).expand(r, channels).contiguous().to(torch.int32)
        recv_channel_prefix = counts[:, rank].view(r, 1).expand(r, channels).contiguous()
        send_head = torch.full((n, r), -1, dtype=torch.int32)
        for d in range(r):
            sel = is_token_in_rank[:, d].nonzero(as_tuple=True)[0]
            send_head[sel, d] = torch.arange(sel.numel(), dtype=torch.int32)
        return (recv_x, recv_scales, recv_ids, recv_weights, per_expert_list, rank_prefix_matrix,
                channel_prefix, recv_channel_prefix, recv_src_idx, send_head, event)

    # -- combine ------------------------------------------------------------------------------
    def intranode_combine(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor],
                          bias_0: Optional[torch.Tensor], bias_1: Optional[torch.Tensor],
                          src_idx: torch.Tensor, rank_prefix_matrix: torch.Tensor,
                          channel_prefix_matrix: torch.Tensor, send_head: torch.Tensor,
                          config: Config, previous_event: Any, async_finish: bool,
                          allocate_on_comm_stream: bool):
        self._check_ranks()
        r, rank = self.num_ranks, self.rank
        host_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        host_assert(src_idx.dim() == 1 and src_idx.is_contiguous() and src_idx.dtype == torch.int32,
                    "src_idx.dim() == 1 and src_idx.is_contiguous() and src_idx.scalar_type() == torch::kInt32")
        host_assert(send_head.dim() == 2 and send_head.is_contiguous()
                    and send_head.dtype == torch.int32, "send_head.scalar_type() == torch::kInt32")
        host_assert(rank_prefix_matrix.dim() == 2 and rank_prefix_matrix.dtype == torch.int32,
                    "rank_prefix_matrix.scalar_type() == torch::kInt32")
        host_assert(channel_prefix_matrix.dim() == 2 and channel_prefix_matrix.dtype == torch.int32,
                    "channel_prefix_matrix.scalar_type() == torch::kInt32")
        host_assert(config.num_sms % 2 == 0, "config.num_sms % 2 == 0")
        channels = config.num_sms // 2
        num_tokens, hidden = x.shape
        n = send_head.size(0)
        host_assert(src_idx.size(0) == num_tokens, "src_idx.size(0) == num_tokens")
        host_assert(send_head.size(1) == r, "send_head.size(1) == num_ranks")
        host_assert(tuple(rank_prefix_matrix.shape) == (r, r),
                    "rank_prefix_matrix.size(0) == num_ranks and rank_prefix_matrix.size(1) == num_ranks")
        host_assert(tuple(channel_prefix_matrix.shape) == (r, channels),
                    "channel_prefix_matrix.size(0) == num_ranks and channel_prefix_matrix.size(1) == num_channels")
        host_assert(hidden * x.element_size() % 16 == 0,
                    "(hidden * x.element_size()) % sizeof(int4) == 0")
        if allocate_on_comm_stream:
            host_assert(previous_event is not None and async_finish,
                        "previous_event.has_value() and async")
        num_topk = 0
        if topk_weights is not None:
            host_assert(topk_weights.dim() == 2 and topk_weights.is_contiguous(),
                        "topk_weights->dim() == 2 and topk_weights->is_contiguous()")
            host_assert(topk_weights.size(0) == num_tokens, "topk_weights->size(0) == num_tokens")
            host_assert(topk_weights.dtype == torch.float32,
                        "topk_weights->scalar_type() == torch::kFloat32")
            num_topk = topk_weights.size(1)
        for bias in (bias_0, bias_1):
            if bias is not None:
                host_assert(bias.dim() == 2 and bias.is_contiguous(), "bias.dim() == 2 and bias.is_contiguous()")
                host_assert(bias.dtype == x.dtype, "bias.scalar_type() == x.scalar_type()")
                host_assert(tuple(bias.shape) == (n, hidden),
                            "bias.size(0) == num_recv_tokens and bias.size(1) == hidden")
        recv_tokens = config.num_max_nvl_chunked_recv_tokens * channels * r
        host_assert(channels * r * 4 * 2 + recv_tokens * hidden * x.element_size()
                    + recv_tokens * 4 + recv_tokens * num_topk * 4 <= self.num_nvl_bytes,
                    "combine buffer bytes <= num_nvl_bytes")
        host_assert(x.dtype == torch.bfloat16, "false and \"Unsupported type\"")

        # Rows [prefix[s - 1][rank], prefix[s][rank]) came from source rank s.
        ends = rank_prefix_matrix[:, rank].tolist()
        starts = [0] + ends[:-1]
        num_real = ends[-1]
        dest = torch.repeat_interleave(torch.arange(r), torch.tensor(ends) - torch.tensor(starts))
        header = torch.zeros(num_real, _HEADER_INTS, dtype=torch.int32)
        header[:, 0] = src_idx[:num_real]
        parts = [_bytes(header), _bytes(x[:num_real])]
        if topk_weights is not None:
            parts.append(_bytes(topk_weights[:num_real].contiguous()))
        wait, _ = self.transport._send(torch.cat(parts, dim=1), dest)

        combined = torch.full((n, hidden), float("nan"), dtype=x.dtype)
        combined_weights = None
        if topk_weights is not None:
            combined_weights = torch.full((n, num_topk), float("nan"), dtype=torch.float32)

        def recv() -> None:
            msgs, _src = wait()
            off = 4 * _HEADER_INTS
            tok = _field(msgs, 0, off, torch.int32)[:, 0].long()
            vals = _field(msgs, off, off + hidden * 2, torch.bfloat16).float()
            acc = torch.zeros(n, hidden, dtype=torch.float32)
            acc.index_add_(0, tok, vals.view(-1, hidden))
            for bias in (bias_0, bias_1):
                if bias is not None:
                    acc += bias.float()
            combined.copy_(acc.to(x.dtype))
            if combined_weights is not None:
                w = _field(msgs, off + hidden * 2, off + hidden * 2 + num_topk * 4, torch.float32)
                wacc = torch.zeros(n, num_topk, dtype=torch.float32)
                wacc.index_add_(0, tok, w)
                combined_weights.copy_(wacc)

        return combined, combined_weights, self._finish(recv, async_finish)
