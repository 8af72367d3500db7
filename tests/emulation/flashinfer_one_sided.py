"""Emulation of flashinfer's NVLink one-sided MoE all-to-all (``flashinfer.moe_ep``'s
``NVLinkOneSidedAlltoAll`` / ``NVLinkOneSidedConfig``) on torch.distributed (gloo).

Follows the published wheels of flashinfer-python 0.7.2.post1 and 0.7.4, read from
moe_ep/backends/split/comm/nvlink_one_sided/{config,communication}.py, comm/trtllm_moe_alltoall.py
(0.7.2.post1, which the class wraps there) and the kernels behind them
(csrc/nvlink_one_sided_alltoall.cu, csrc/nv_internal/tensorrt_llm/kernels/moe/communication/
moeAlltoAllKernels.cu); names, parameters, defaults and dataclass fields are checked against the
wheels' source by tests/emulation/test_flashinfer_upstream.py. What it shares with the two-sided
emulation (MNNVL memory, Mapping, moe_ep's base classes) is tests/emulation/flashinfer_mnnvl.py.

The kernels' contract, reproduced:

- dispatch: each token goes at most once to each rank that owns one of its experts (expert ``e``
  lives on rank ``e // (num_experts / ep_size)``, the kernels' contiguous partition); the first
  top-k slot naming a rank sends, ids outside ``[0, num_experts)`` send nothing, and with a rank
  mask nothing goes to a masked-off rank. A token's send slot on a rank is taken by an
  ``atomicAdd``: arbitrary order across tokens (a seeded shuffle here). All payloads (activations,
  scales, int32 ids, weights) travel together; the receiver's buffers are ``[ep_size,
  tokens_per_rank, *]`` (flattened to rank-major rows), rows past a source's count hold what the
  workspace held (0xFF bytes: NaN) and their expert ids are set to ``invalid_expert_id``
  (``moe_a2a_sanitize_expert_ids``). The received ids are the token's full GLOBAL top-k.
  On the Lamport transport a token of source ``s`` lands in row ``s * tokens_per_rank + t``.
- combine: each rank returns one row per received row; the source reads, for each of its tokens,
  the rows of the ranks it sent to, in top-k slot order, and sums them in float32 in the kernels'
  tree order (``vectorized_combine_impl``), cast to the payload dtype (bf16 or fp16 only: the
  kernels' ``SWITCH_DTYPE``). ``use_low_precision_combine`` sends the rows as e4m3.
- host checks as the kernels' wrappers make them: int32 routing of ``top_k`` columns, at most
  four payloads of ``local_num_tokens`` rows, ``local_num_tokens <= tokens_per_rank <=
  max_tokens_per_rank``, the dispatch and combine regions' capacities, the rank mask's width and
  that it marks the local rank, one round (dispatch, then combine) at a time per workspace.

Transports (0.7.4): the fence path always; CFT counted writes and the Lamport transport only where
:data:`PLATFORM` says this "GPU" has them (default: neither, as on an H100/H200, so the library's
own probes and ``_log_unavailable`` lines decide as upstream). Differences: rows move with
``all_to_all_single`` over the default process group (the ranks that created the workspace), a
masked-off source's rows are dropped by the receiver (upstream it does not wait for them), the
workspace is a small placeholder allocation, the Lamport limit defaults to
``min(256, max_tokens_per_rank)`` (upstream derives it from the SM count), and the 0.7.2.post1
``MoeAlltoAll`` underneath is presented only through ``NVLinkOneSidedAlltoAll.alltoall``. Every
dispatch and combine is logged in :data:`TRAFFIC` (shared with the two-sided emulation), a
dispatch with the ranks its rank mask marks active as the kernels read it (``active``).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from tests.emulation.flashinfer_mnnvl import (TRAFFIC, MnnvlMemory, MoEEpCommParams,
                                              MoEEpCommunication, MoEEpDispatchResult, _check,
                                              _mnnvl_mapping_and_config, _uninitialized)

__all__ = ["NVLinkOneSidedConfig", "NVLinkOneSidedConfig072", "NVLinkOneSidedAlltoAll",
           "NVLinkOneSidedAlltoAll072", "moe_a2a_active_rank_mask", "PLATFORM", "reset_state"]

logger = logging.getLogger("flashinfer.moe_ep.backends.split.comm.nvlink_one_sided.communication")

#: What the emulated GPU supports (tests may switch them on): CFT counted writes, Lamport kernels.
PLATFORM = {"cft": False, "lamport": False}
_SUPPORTED_TOP_K = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 18, 22)
_MAX_RANKS = {"0.7.2.post1": 64, "0.7.4": 256}  # kMaxRanks of each release's kernels
_MASK_WORDS = {"0.7.2.post1": 1, "0.7.4": 4}  # MOE_A2A_RANK_MASK_WORDS / kRankMaskWords
_ALIGN = 128  # kCachelineAlignment: each payload's receive buffer starts on it
_MAX_PAYLOADS = 4
_LAMPORT_MAX_RANKS, _LAMPORT_MAX_TOP_K, _LAMPORT_DEFAULT_MAX_TOKENS = 64, 22, 256
_LAMPORT_FORMATS = {None: "BF16", "BF16": "BF16", "MXFP8": "MXFP8", "DeepSeekFp8": "FP8_BLOCK128",
                    "NVFP4": "NVFP4"}
_ORDER_SEED = itertools.count(4321)


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# --- flashinfer.comm (0.7.2.post1) --------------------------------------------------------------
def moe_a2a_active_rank_mask(active_ranks: Sequence[int], ep_size: int) -> torch.Tensor:
    """CPU ``uint64`` bitmask (one word in 0.7.2.post1) with bit ``i`` set per active rank."""
    return _mask_words(active_ranks, ep_size, _MASK_WORDS["0.7.2.post1"])


def _mask_words(active_ranks: Sequence[int], ep_size: int, words: int) -> torch.Tensor:
    mask = 0
    for rank in active_ranks:
        rank = int(rank)
        if not 0 <= rank < ep_size:
            raise ValueError(f"rank {rank} out of range [0, {ep_size})")
        mask |= 1 << rank
    return torch.tensor([(mask >> (64 * w)) & 0xFFFFFFFFFFFFFFFF for w in range(words)],
                        dtype=torch.uint64)


def _active_ranks(enabled: bool, mask: Optional[torch.Tensor], ep_size: int, ep_rank: int,
                  words: int) -> Optional[set[int]]:
    """The kernels' reading of ``active_rank_mask`` (csrc resolveRankMask): required with rank
    masking compiled in, refused without; None: every rank active."""
    if not enabled:
        _check(mask is None, "active_rank_mask requires enable_rank_mask=True")
        return None
    _check(mask is not None, "active_rank_mask must be defined")
    assert mask is not None
    _check(mask.dim() == 1, "active_rank_mask must be a 1D tensor")
    _check(mask.shape[0] == words, f"active_rank_mask must have {words} uint64 words")
    _check(mask.dtype == torch.uint64 and mask.device.type == "cpu",
           "active_rank_mask must be a CPU uint64 tensor")
    value = sum(int(w) << (64 * i) for i, w in enumerate(mask.tolist()))
    active = {r for r in range(ep_size) if (value >> r) & 1}
    _check(ep_rank in active, f"active_rank_mask must mark the local ep_rank ({ep_rank}) as active")
    return active


# --- the kernels ------------------------------------------------------------------------------
@dataclass
class _Round:
    """One dispatch awaiting its combine: where each (token, slot) went (rank, position in the
    rows sent there; -1: nowhere), and per source the receive rows it filled."""

    tokens_per_rank: int
    local_num_tokens: int
    target_ranks: torch.Tensor  # int64 [n, top_k]
    target_pos: torch.Tensor  # int64 [n, top_k]
    recv_slots: list[torch.Tensor]  # per source rank: receive rows (within its block) filled
    sent_counts: list[int]  # rows sent to each rank
    active: Optional[set[int]]
    lamport: bool


def _target_ranks(topk_ids: torch.Tensor, num_experts: int, ep_size: int) -> torch.Tensor:
    """compute_target_rank_id: contiguous ceil/floor partition; -1 for an invalid id."""
    base, rem = divmod(num_experts, ep_size)
    ids = topk_ids.long()
    split = rem * (base + 1)
    ranks = torch.where(ids < split, ids // (base + 1), rem + (ids - split) // max(base, 1))
    return torch.where((ids >= 0) & (ids < num_experts), ranks, torch.full_like(ids, -1))


def _exchange(rows: torch.Tensor, send_counts: list[int], group: Any) -> tuple[torch.Tensor,
                                                                                 list[int]]:
    """uint8 rows grouped by destination -> rows grouped by source, and the counts received."""
    counts = torch.tensor(send_counts, dtype=torch.int64)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    rc = recv_counts.tolist()
    out = torch.empty(sum(rc), rows.shape[1], dtype=torch.uint8)
    dist.all_to_all_single(out, rows.contiguous(), rc, send_counts, group=group)
    return out, rc


def _dispatch_kernel(topk_ids: torch.Tensor, payloads: list[torch.Tensor], tpr: int,
                     ep_rank: int, ep_size: int, top_k: int, num_experts: int,
                     expert_id_index: int, invalid_id: int, active: Optional[set[int]],
                     lamport: bool, group: Any) -> tuple[list[torch.Tensor], _Round]:
    n = topk_ids.shape[0]
    ranks = _target_ranks(topk_ids, num_experts, ep_size)
    first = torch.zeros_like(ranks, dtype=torch.bool)
    for k in range(top_k):  # the first lane naming a rank sends (__match_any_sync)
        first[:, k] = (ranks[:, k] >= 0) & ~(ranks[:, :k] == ranks[:, k:k + 1]).any(dim=1)
    if active is not None:
        first &= torch.tensor([[r in active for r in row] for row in ranks.tolist()],
                              dtype=torch.bool).reshape(ranks.shape)
    row_bytes = [p.shape[1] * p.element_size() for p in payloads]
    data = torch.cat([p.contiguous().view(torch.uint8).reshape(n, b)
                      for p, b in zip(payloads, row_bytes)], dim=1)
    gen = torch.Generator().manual_seed(next(_ORDER_SEED))
    target_pos = torch.full_like(ranks, -1)
    send_rows, send_counts = [], []
    for d in range(ep_size):
        tok, k = (first & (ranks == d)).nonzero(as_tuple=True)
        pos = torch.empty_like(tok)
        perm = (torch.arange(tok.numel()) if lamport
                else torch.randperm(tok.numel(), generator=gen))
        pos[perm] = torch.arange(tok.numel())
        target_pos[tok, k] = pos
        sent = tok[perm]
        slot = sent.to(torch.int32) if lamport else torch.arange(sent.numel(), dtype=torch.int32)
        send_rows.append(torch.cat([slot.reshape(-1, 1).view(torch.uint8), data[sent]], dim=1))
        send_counts.append(int(sent.numel()))
    recv, recv_counts = _exchange(torch.cat(send_rows), send_counts, group)
    outs = [_uninitialized((ep_size, tpr, p.shape[1]), p.dtype, p.device) for p in payloads]
    outs[expert_id_index].fill_(invalid_id)  # what the sanitize kernel leaves in unfilled rows
    recv_slots, begin = [], 0
    for s, count in enumerate(recv_counts):
        chunk, begin = recv[begin:begin + count], begin + count
        if active is not None and s not in active:
            recv_slots.append(torch.zeros(0, dtype=torch.int64))
            continue
        slots = chunk[:, :4].contiguous().view(torch.int32).reshape(count).long()
        col = 4
        for out, nbytes in zip(outs, row_bytes):
            out[s].view(torch.uint8).reshape(tpr, -1)[slots] = chunk[:, col:col + nbytes]
            col += nbytes
        recv_slots.append(slots)
    target_ranks = torch.where(target_pos >= 0, ranks, torch.full_like(ranks, -1))
    return outs, _Round(tpr, n, target_ranks, target_pos, recv_slots, send_counts, active,
                        lamport)


def _tree_sum(sources: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """vectorized_combine_impl's float32 order: pairs for <= 2 sources; else per lane of eight
    ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)), lanes then added pairwise (shuffle-down tree)."""
    zero = torch.zeros_like(like, dtype=torch.float32)
    f = [s.float() for s in sources]
    if len(f) <= 2:
        return (f[0] if f else zero) + (f[1] if len(f) > 1 else zero)
    lanes = []
    for base in range(0, 8 * (1 << ((len(f) > 8) + (len(f) > 16))), 8):
        p = [f[base + j] if base + j < len(f) else zero for j in range(8)]
        lanes.append(((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7])))
    while len(lanes) > 1:
        lanes = [lanes[i] + lanes[i + 1] for i in range(0, len(lanes), 2)]
    return lanes[0]


def _combine_kernel(payload: torch.Tensor, rnd: _Round, output: torch.Tensor, ep_size: int,
                    low_precision: bool, group: Any) -> None:
    _check(payload.dtype in (torch.bfloat16, torch.float16),
           "Unsupported dtype for moe_a2a_combine")
    hidden = payload.shape[2]
    wire = torch.float8_e4m3fn if low_precision else payload.dtype
    rows, counts = [], []
    for s in range(ep_size):  # each received row goes back to its source, in receive order
        r = payload[s][rnd.recv_slots[s]].to(wire)
        rows.append(r.contiguous().view(torch.uint8).reshape(r.shape[0], hidden * r.element_size()))
        counts.append(r.shape[0])
    back, back_counts = _exchange(torch.cat(rows), counts, group)
    per_rank, begin = [], 0
    for count, sent in zip(back_counts, rnd.sent_counts):
        rows_back = back[begin:begin + count].view(wire).reshape(count, hidden)
        if count < sent:  # a peer that masks this rank dropped its rows: reads find garbage
            rows_back = _uninitialized((sent, hidden), wire, payload.device)
        per_rank.append(rows_back)
        begin += count
    for t in range(rnd.local_num_tokens):
        sources = [per_rank[int(d)][int(p)] for d, p in
                   zip(rnd.target_ranks[t].tolist(), rnd.target_pos[t].tolist()) if p >= 0]
        output[t] = _tree_sum(sources, payload[0, 0]).to(payload.dtype)


def _region_bytes(params: MoEEpCommParams, extra: int, ep_size: int) -> tuple[int, int]:
    """Bytes of the dispatch receive region (every payload of ``ep * max_tokens`` rows, each
    payload aligned) and of the combine input region (unquantized rows, >= 16 bits)."""
    tokens = ep_size * params.max_tokens_per_rank
    dispatch = tokens * (params.dispatch_bytes_per_token + 2 * params.top_k * 4 + extra) \
        + _MAX_PAYLOADS * _ALIGN
    return dispatch, tokens * params.hidden_size * max(params.token_dtype.itemsize, 2)


def _check_dispatch(comm: Any, topk_ids: torch.Tensor, payloads: list[torch.Tensor],
                    tpr: int, expert_id_index: int) -> None:
    """The dispatch op's host checks (csrc moeA2ADispatchOp)."""
    p, n = comm.params, topk_ids.shape[0]
    _check(topk_ids.dtype == torch.int32, "tokenSelectedExperts must be int32")
    _check(topk_ids.dim() == 2 and topk_ids.shape[1] == p.top_k,
           "tokenSelectedExperts must be a 2D tensor of top_k columns")
    _check(0 < len(payloads) <= _MAX_PAYLOADS, "inputPayloads must hold 1 to 4 payloads")
    _check(p.num_experts >= comm.ep_size, "numExperts must be greater than or equal to epSize")
    for payload in payloads:
        _check(payload.dim() == 2 and payload.shape[0] == n,
               "payload must have the same first dimension as tokenSelectedExperts")
    ids = payloads[expert_id_index]
    _check(ids.dtype == torch.int32 and ids.shape[1] == p.top_k,
           "expert-id payload must be int32 with topK columns")
    _check(n <= tpr, "Local token count exceeds the runtime capacity")
    need = sum(_align(comm.ep_size * tpr * q.shape[1] * q.element_size()) for q in payloads)
    capacity = comm._dispatch_bytes
    _check(need <= capacity, f"Dispatch payload exceeds its workspace capacity: need {need} "
                             f"bytes, capacity {capacity}")


def _check_combine(comm: Any, payload: torch.Tensor, output: torch.Tensor, rnd: _Round) -> None:
    _check(payload.dim() == 3 and payload.shape[0] == comm.ep_size
           and payload.shape[1] == rnd.tokens_per_rank,
           "payload must be [ep_size, runtime_max_tokens_per_rank, elements]")
    need = payload[0].numel() * comm.ep_size * payload.element_size()
    _check(need <= comm._combine_bytes,
           f"Combine payload exceeds its fixed workspace region: need {need}")
    _check(output.dtype == payload.dtype, "output dtype must match the payload dtype")
    _check(tuple(output.shape) == (rnd.local_num_tokens, payload.shape[2]),
           "output must be a [local_num_tokens, elements_per_token] tensor")


def _payloads(hidden_states: torch.Tensor, hidden_states_scale: Optional[torch.Tensor],
              topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor]
              ) -> tuple[list[torch.Tensor], int]:
    payloads = [hidden_states]
    if hidden_states_scale is not None:
        payloads.append(hidden_states_scale)
    expert_id_index = len(payloads)
    payloads.append(topk_ids)
    if topk_weights is not None:
        payloads.append(topk_weights)
    return payloads, expert_id_index


def _result(recv: list[torch.Tensor], scaled: bool, weighted: bool, expert_id_index: int,
            tpr: int, stats: Optional[torch.Tensor]) -> MoEEpDispatchResult:
    rows = [t.flatten(0, 1) for t in recv]
    return MoEEpDispatchResult(
        hidden_states=rows[0], hidden_states_scale=rows[1] if scaled else None,
        topk_ids=rows[expert_id_index],
        topk_weights=rows[expert_id_index + 1] if weighted else None,
        tokens_per_rank=tpr, eplb_gathered_stats=stats)


def _gather_stats(stats: Optional[torch.Tensor], ep_size: int) -> Optional[torch.Tensor]:
    if stats is None:
        return None
    _check(stats.dtype == torch.int32 and stats.dim() == 1, "eplb_local_stats must be 1D int32")
    out = [torch.empty_like(stats) for _ in range(ep_size)]
    dist.all_gather(out, stats.contiguous())
    return torch.stack(out)


def _combine_payload(expert_output: torch.Tensor, ep_size: int, tpr: int) -> torch.Tensor:
    if expert_output.dim() == 2:
        return expert_output.view(ep_size, tpr, -1)
    if expert_output.dim() == 3:
        return expert_output
    raise ValueError(f"expert_output must be 2D or 3D, got shape {tuple(expert_output.shape)}")


class _Workspace:
    """One MNNVL workspace shared by the instances of one layout (refcounted); ``owner``: the
    instance whose dispatch awaits its combine on it; ``mapped``: False between a checkpoint's
    prepare and restore."""

    def __init__(self, key: tuple, mapping: Any, size: int):
        self.key, self.memory = key, MnnvlMemory(mapping, size)
        self.refcount, self.owner, self.mapped, self.cft = 0, None, True, False


# --- flashinfer.moe_ep (0.7.4) ------------------------------------------------------------------
@dataclass
class NVLinkOneSidedConfig072:
    """0.7.2.post1's NVLinkOneSidedConfig."""

    backend_name: str = "nvlink_one_sided"
    extra_payload_bytes_per_token: int = 0
    eplb_stats_num_experts: int = 0
    enable_rank_mask: bool = False
    use_low_precision_combine: bool = False
    comm_backend: Any = None


@dataclass
class NVLinkOneSidedConfig(NVLinkOneSidedConfig072):
    """0.7.4's NVLinkOneSidedConfig: 0.7.2.post1's fields, then the transports and timeouts."""

    cft: Optional[bool] = None
    cft_max_tokens_for_dispatch: int = 128
    cft_max_tokens_for_combine: int = 128
    lamport: Optional[bool] = None
    lamport_max_tokens: Optional[int] = None
    timeout_sec: int = 300
    enable_pdl: Optional[bool] = None


def _log_unavailable(transport: str, requested: Optional[bool], available: bool,
                     reason: Optional[str]) -> None:
    if requested is not False and not available:
        (logger.warning if requested else logger.info)(
            "NVLink one-sided %s disabled: %s", transport,
            reason or "another EP rank does not support it or turned it off")


def _check_config_074(config: NVLinkOneSidedConfig, params: MoEEpCommParams) -> None:
    if config.extra_payload_bytes_per_token < 0:
        raise ValueError("extra_payload_bytes_per_token must be non-negative")
    if not 0 <= config.eplb_stats_num_experts <= params.num_experts:
        raise ValueError("eplb_stats_num_experts must be in [0, num_experts]")
    if isinstance(config.timeout_sec, bool) or not isinstance(config.timeout_sec, int):
        raise TypeError("timeout_sec must be an integer number of seconds")
    if not 0 < config.timeout_sec <= 24 * 60 * 60:
        raise ValueError(f"timeout_sec must be in 1..{24 * 60 * 60}")
    if config.cft_max_tokens_for_dispatch < 0 or config.cft_max_tokens_for_combine < 0:
        raise ValueError("CFT token-count limits must be non-negative")
    if config.lamport_max_tokens is not None and (
            isinstance(config.lamport_max_tokens, bool)
            or not isinstance(config.lamport_max_tokens, int) or config.lamport_max_tokens <= 0):
        raise ValueError("lamport_max_tokens must be a positive integer or None")
    if params.top_k not in _SUPPORTED_TOP_K:
        raise ValueError(f"NVLinkOneSidedAlltoAll supports top_k in {_SUPPORTED_TOP_K}, "
                         f"got {params.top_k}")


def _lamport_reason(params: MoEEpCommParams, config: NVLinkOneSidedConfig,
                    ep_size: int) -> Optional[str]:
    """_probe_lamport_support on the emulated GPU."""
    if not PLATFORM["lamport"]:
        return "the kernel module has no Lamport kernels for this GPU"
    if ep_size > _LAMPORT_MAX_RANKS:
        return f"it supports at most {_LAMPORT_MAX_RANKS} EP ranks"
    if params.top_k > _LAMPORT_MAX_TOP_K:
        return f"it supports top_k <= {_LAMPORT_MAX_TOP_K}"
    if params.token_dtype != torch.bfloat16:
        return "it combines BF16 expert outputs only"
    if config.use_low_precision_combine:
        return "it has no FP8 combine"
    name = getattr(params.dispatch_format, "name", None)
    if name not in _LAMPORT_FORMATS:
        return f"it does not carry the dispatch format {name}"
    return None


class NVLinkOneSidedAlltoAll(MoEEpCommunication):
    """0.7.4's NVLinkOneSidedAlltoAll: its own workspace per (rank, size, layout), shared by
    instances of one layout, one round at a time on it; transports agreed by every rank at
    construction (fence; CFT counted writes and Lamport where :data:`PLATFORM` has them)."""

    backend_name = "nvlink_one_sided"
    _WORKSPACES: dict[tuple, _Workspace] = {}
    _CFT_WORKSPACE_KEY: Optional[tuple] = None

    def __init__(self, bootstrap: Any, params: MoEEpCommParams,
                 config: Optional[NVLinkOneSidedConfig] = None):
        self.config = config = NVLinkOneSidedConfig() if config is None else config
        if config.lamport is True and config.cft is True:
            raise ValueError("lamport=True and cft=True both ask for every eligible step; "
                             "set one of them to None or False")
        mapping, mnnvl_config = _mnnvl_mapping_and_config(bootstrap, config.comm_backend)
        MoEEpCommunication.__init__(self, bootstrap, params)
        _check_config_074(config, params)
        if self.ep_size > _MAX_RANKS["0.7.4"]:
            raise ValueError(f"NVLinkOneSidedAlltoAll supports at most {_MAX_RANKS['0.7.4']} EP "
                             f"ranks, got {self.ep_size}")
        MnnvlMemory.initialize()
        MnnvlMemory.set_comm_from_config(mapping, mnnvl_config)
        comm = MnnvlMemory.get_comm(mapping)
        lamport = False if config.lamport is None and config.cft is True else config.lamport
        if lamport is False and config.lamport is None:
            logger.info("NVLink one-sided Lamport transport off: cft=True keeps every step "
                        "for CFT counted writes")
        cft_reason = None if PLATFORM["cft"] else "the workspace is not shared through FABRIC " \
                                                  "handles"
        lamport_reason = _lamport_reason(params, config, self.ep_size)
        votes = comm.allgather((config.cft is not False and cft_reason is None,
                                lamport is not False and lamport_reason is None, None,
                                config.lamport_max_tokens))
        if len({v[3] for v in votes}) > 1:
            raise ValueError("lamport_max_tokens must be the same on every EP rank, got "
                             + ", ".join(sorted({repr(v[3]) for v in votes})))
        cft_capable, lamport_capable = all(v[0] for v in votes), all(v[1] for v in votes)
        _log_unavailable("CFT counted writes", config.cft, cft_capable, cft_reason)
        _log_unavailable("Lamport transport", lamport, lamport_capable, lamport_reason)
        self._dispatch_bytes, self._combine_bytes = _region_bytes(
            params, config.extra_payload_bytes_per_token, self.ep_size)
        self.lamport_max_tokens = 0
        if lamport_capable:
            limit = config.lamport_max_tokens or _LAMPORT_DEFAULT_MAX_TOKENS
            self.lamport_max_tokens = min(limit, 512, params.max_tokens_per_rank)
        key = (self.ep_rank, self.ep_size, params.max_tokens_per_rank, params.top_k,
               self._dispatch_bytes, self._combine_bytes, config.eplb_stats_num_experts,
               cft_capable, self.lamport_max_tokens)
        state = self._WORKSPACES.get(key)
        if state is None:
            state = self._WORKSPACES[key] = _Workspace(key, mapping, 1 << 20)
            comm.barrier()  # no peer publishes before every rank cleared its slice
            state.cft = cft_capable and type(self)._CFT_WORKSPACE_KEY is None
            if state.cft:
                type(self)._CFT_WORKSPACE_KEY = key
        state.refcount += 1
        self._state: Optional[_Workspace] = state
        self._round: Optional[_Round] = None
        self._combine_buffer: Optional[torch.Tensor] = None

    @classmethod
    def is_platform_supported(cls) -> bool:
        return True

    def active_rank_mask(self, active_ranks: Sequence[int]) -> torch.Tensor:
        return _mask_words(active_ranks, self.ep_size, _MASK_WORDS["0.7.4"])

    @property
    def lamport_enabled(self) -> bool:
        return self._state is not None and self.lamport_max_tokens > 0

    def _check_rank_mask(self, active_rank_mask: Optional[torch.Tensor]) -> None:
        if not self.config.enable_rank_mask:
            if active_rank_mask is not None:
                raise ValueError("active_rank_mask requires enable_rank_mask=True")
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("NVLinkOneSidedAlltoAll with enable_rank_mask=True cannot be "
                               "captured into a CUDA graph: the active-rank mask is fixed at "
                               "capture time.")

    def _transports(self, tpr: int, payloads: list[torch.Tensor], hidden_states: torch.Tensor,
                    scale: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                    stats: Optional[torch.Tensor]) -> tuple[bool, bool]:
        """(use_lamport, use_cft), as upstream's _dispatch_transports decides them."""
        lamport = (tpr <= self.lamport_max_tokens and stats is None
                   and (hidden_states.dtype == torch.bfloat16 if scale is None
                        else hidden_states.element_size() == 1)
                   and (weights is None or (weights.dim() == 2 and weights.element_size() == 4)))
        cft = (not lamport and self._state is not None and self._state.cft
               and (self.config.cft is True or tpr <= self.config.cft_max_tokens_for_dispatch)
               and all(p.shape[1] * p.element_size() % 16 == 0 for p in payloads))
        return lamport, cft

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: Optional[torch.Tensor] = None, *,
                 hidden_states_scale: Optional[torch.Tensor] = None,
                 runtime_max_tokens_per_rank: Optional[int] = None,
                 eplb_local_stats: Optional[torch.Tensor] = None,
                 active_rank_mask: Optional[torch.Tensor] = None) -> MoEEpDispatchResult:
        state = self._state
        if state is None:
            raise RuntimeError("NVLinkOneSidedAlltoAll has been destroyed")
        if state.owner is self:
            raise RuntimeError("dispatch called twice without an intervening combine")
        if state.owner is not None:
            raise RuntimeError("another NVLinkOneSidedAlltoAll sharing this workspace has a "
                               "dispatch awaiting its combine; instances that share a workspace "
                               "must run their rounds one after another")
        self._check_rank_mask(active_rank_mask)
        tpr = self._resolve_runtime_max_tokens_per_rank(runtime_max_tokens_per_rank)
        if topk_ids.dtype != torch.int32:
            topk_ids = topk_ids.to(torch.int32)
        payloads, idx = _payloads(hidden_states, hidden_states_scale, topk_ids, topk_weights)
        lamport, cft = self._transports(tpr, payloads, hidden_states, hidden_states_scale,
                                        topk_weights, eplb_local_stats)
        _check_dispatch(self, topk_ids, payloads, tpr, idx)
        _check(state.mapped, "the workspace is unmapped (checkpoint_prepare without restore): "
                             "the real kernels would fault")
        active = _active_ranks(self.config.enable_rank_mask, active_rank_mask, self.ep_size,
                               self.ep_rank, _MASK_WORDS["0.7.4"])
        recv, self._round = _dispatch_kernel(
            topk_ids, payloads, tpr, self.ep_rank, self.ep_size, self.params.top_k,
            self.params.num_experts, idx, self.params.invalid_expert_id, active, lamport,
            dist.group.WORLD)
        TRAFFIC.append(dict(op="moe_a2a_dispatch", transport="lamport" if lamport else
                            "cft" if cft else "fence", tokens_per_rank=tpr,
                            payloads=[(p.dtype, p.shape[1]) for p in payloads],
                            masked=active is not None,
                            active=None if active is None else sorted(active)))
        state.owner = self
        return _result(recv, hidden_states_scale is not None, topk_weights is not None, idx, tpr,
                       _gather_stats(eplb_local_stats, self.ep_size))

    def get_combine_input_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        if self._round is None:
            raise RuntimeError("get_combine_input_buffer called before dispatch")
        rows = self.ep_size * self._round.tokens_per_rank
        nbytes = rows * self.params.hidden_size * dtype.itemsize
        if nbytes > self._combine_bytes:
            raise ValueError(f"a {dtype} combine input needs {nbytes} bytes, more than the "
                             f"{self._combine_bytes}-byte combine region")
        if self._combine_buffer is None or self._combine_buffer.shape[0] != rows \
                or self._combine_buffer.dtype != dtype:
            self._combine_buffer = _uninitialized((rows, self.params.hidden_size), dtype,
                                                  torch.device("cpu"))
        return self._combine_buffer

    def combine(self, expert_output: torch.Tensor, *, output: Optional[torch.Tensor] = None,
                active_rank_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        rnd = self._round
        if rnd is None:
            raise RuntimeError("combine called before dispatch")
        self._check_rank_mask(active_rank_mask)
        payload = _combine_payload(expert_output, self.ep_size, rnd.tokens_per_rank)
        if output is None:
            output = torch.empty(rnd.local_num_tokens, payload.shape[-1], dtype=payload.dtype,
                                 device=payload.device)
        _check_combine(self, payload, output, rnd)
        _combine_kernel(payload, rnd, output, self.ep_size, self.config.use_low_precision_combine,
                        dist.group.WORLD)
        TRAFFIC.append(dict(op="moe_a2a_combine", dtype=payload.dtype,
                            transport="lamport" if rnd.lamport else "fence"))
        self._round = None
        assert self._state is not None
        self._state.owner = None
        return output

    def checkpoint_prepare(self) -> None:
        state = self._state
        if state is None:
            raise RuntimeError("NVLinkOneSidedAlltoAll has been destroyed")
        if state.owner is not None:
            raise RuntimeError("checkpoint_prepare called between dispatch and combine")
        if state.mapped:
            dist.barrier()
            state.mapped = False
            dist.barrier()

    def checkpoint_restore(self, comm_backend: Any) -> None:
        state = self._state
        if state is None:
            raise RuntimeError("NVLinkOneSidedAlltoAll has been destroyed")
        if state.mapped:
            return
        _check(comm_backend.Get_size() == self.ep_size and comm_backend.Get_rank() == self.ep_rank,
               "Cannot remap MNNVL memory over a communicator of another rank/size")
        comm_backend.allgather(self.ep_rank)  # the new handles
        state.mapped = True
        comm_backend.barrier()
        self._round = None

    def destroy(self) -> None:
        state = self._state
        if state is None:
            return
        if state.owner is self:
            state.owner = None
        self._state, self._round = None, None
        state.refcount -= 1
        if state.refcount > 0:
            return
        if type(self)._CFT_WORKSPACE_KEY == state.key:
            type(self)._CFT_WORKSPACE_KEY = None
        self._WORKSPACES.pop(state.key, None)
        MnnvlMemory.close_mnnvl_memory(state.memory.ptr)


# --- flashinfer.moe_ep (0.7.2.post1): NVLinkOneSidedAlltoAll over comm's MoeAlltoAll ----------
class _MoeAlltoAll:
    """flashinfer.comm.MoeAlltoAll (0.7.2.post1) as the one-sided class uses it: a workspace
    cached per (size, rank, ep size, max tokens, EPLB experts), one round per instance, the
    fence path only, checkpoint unmap/remap of the workspace."""

    _WORKSPACE_CACHE: dict[tuple, _Workspace] = {}

    def __init__(self, mapping: Any, max_num_tokens: int, top_k: int, num_experts: int,
                 dispatch_bytes: int, combine_bytes: int, eplb_stats_num_experts: int,
                 enable_rank_mask: bool, ep_rank: int, ep_size: int, params: MoEEpCommParams):
        if ep_size > _MAX_RANKS["0.7.2.post1"]:
            raise ValueError(f"Invalid EP size: {ep_size}")
        MnnvlMemory.initialize()
        self.ep_rank, self.ep_size, self.params = ep_rank, ep_size, params
        self.enable_rank_mask = enable_rank_mask
        self._dispatch_bytes, self._combine_bytes = dispatch_bytes, combine_bytes
        key = (dispatch_bytes + combine_bytes, ep_rank, ep_size, max_num_tokens,
               eplb_stats_num_experts, "trtllm")
        state = self._WORKSPACE_CACHE.get(key)
        if state is None:
            state = self._WORKSPACE_CACHE[key] = _Workspace(key, mapping, 1 << 20)
            MnnvlMemory.get_comm(mapping).barrier()
        self._workspace = state
        self._round: Optional[_Round] = None
        self.eplb_gathered_stats: Optional[torch.Tensor] = None

    def dispatch(self, topk_ids: torch.Tensor, payloads: list[torch.Tensor], tpr: int,
                 invalid_token_expert_id: int, expert_id_payload_index: int,
                 eplb_local_stats: Optional[torch.Tensor],
                 active_rank_mask: Optional[torch.Tensor]) -> list[torch.Tensor]:
        if not self._workspace.mapped:
            raise RuntimeError("MNNVL handles are unmapped")
        _check(self._round is None, "dispatch called twice without combine")
        _check_dispatch(self, topk_ids, payloads, tpr, expert_id_payload_index)
        active = _active_ranks(self.enable_rank_mask, active_rank_mask, self.ep_size,
                               self.ep_rank, _MASK_WORDS["0.7.2.post1"])
        recv, self._round = _dispatch_kernel(
            topk_ids, payloads, tpr, self.ep_rank, self.ep_size, self.params.top_k,
            self.params.num_experts, expert_id_payload_index, invalid_token_expert_id, active,
            False, dist.group.WORLD)
        self.eplb_gathered_stats = _gather_stats(eplb_local_stats, self.ep_size)
        TRAFFIC.append(dict(op="moe_a2a_dispatch", transport="fence", tokens_per_rank=tpr,
                            payloads=[(p.dtype, p.shape[1]) for p in payloads],
                            masked=active is not None,
                            active=None if active is None else sorted(active)))
        return recv

    def combine(self, payload: torch.Tensor, tpr: int, output: Optional[torch.Tensor],
                use_low_precision: bool) -> torch.Tensor:
        rnd = self._round
        _check(rnd is not None and rnd.tokens_per_rank == tpr, "combine without its dispatch")
        assert rnd is not None
        if output is None:
            output = torch.empty(rnd.local_num_tokens, payload.shape[-1], dtype=payload.dtype)
        _check_combine(self, payload, output, rnd)
        _combine_kernel(payload, rnd, output, self.ep_size, use_low_precision, dist.group.WORLD)
        TRAFFIC.append(dict(op="moe_a2a_combine", dtype=payload.dtype, transport="fence"))
        self._round, self.eplb_gathered_stats = None, None
        return output

    def checkpoint_prepare(self) -> None:
        if not self._workspace.mapped:
            return
        if self._round is not None:
            raise RuntimeError("Cannot unmap MNNVL handles during an active all-to-all phase")
        dist.barrier()
        self._workspace.mapped = False
        dist.barrier()

    def checkpoint_restore(self, comm_backend: Any) -> None:
        if self._workspace.mapped:
            return
        if comm_backend.Get_size() != self.ep_size or comm_backend.Get_rank() != self.ep_rank:
            raise RuntimeError("Cannot remap MNNVL handles because the communicator does not "
                               "match the graph-visible allocation layout")
        comm_backend.allgather(self.ep_rank)
        self._workspace.mapped = True
        comm_backend.barrier()
        self._round = None


class NVLinkOneSidedAlltoAll072(MoEEpCommunication):
    """0.7.2.post1's NVLinkOneSidedAlltoAll: rank-major dispatch/combine over comm's MoeAlltoAll
    (``alltoall``); ``dispatch``'s bound is ``max_tokens_per_rank``; ``destroy`` drops the
    instance's references (MoeAlltoAll caches the workspace for the process)."""

    backend_name = "nvlink_one_sided"
    alltoall_backend = "trtllm"

    def __init__(self, bootstrap: Any, params: MoEEpCommParams,
                 config: Optional[NVLinkOneSidedConfig072] = None):
        self.config = NVLinkOneSidedConfig072() if config is None else config
        mapping, mnnvl_config = _mnnvl_mapping_and_config(bootstrap, self.config.comm_backend)
        MoEEpCommunication.__init__(self, bootstrap, params)
        if self.config.extra_payload_bytes_per_token < 0:
            raise ValueError("extra_payload_bytes_per_token must be non-negative")
        MnnvlMemory.set_comm_from_config(mapping, mnnvl_config)
        dispatch_bytes, combine_bytes = _region_bytes(
            params, self.config.extra_payload_bytes_per_token, self.ep_size)
        self._alltoall: Optional[_MoeAlltoAll] = _MoeAlltoAll(
            mapping, params.max_tokens_per_rank, params.top_k, params.num_experts,
            dispatch_bytes, combine_bytes, self.config.eplb_stats_num_experts,
            self.config.enable_rank_mask, self.ep_rank, self.ep_size, params)
        self._tokens_per_rank: Optional[int] = None
        self._combine_buffer: Optional[torch.Tensor] = None

    @classmethod
    def is_platform_supported(cls) -> bool:
        return True

    @property
    def alltoall(self) -> _MoeAlltoAll:
        if self._alltoall is None:
            raise RuntimeError("NVLinkOneSidedAlltoAll has been destroyed")
        return self._alltoall

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: Optional[torch.Tensor] = None, *,
                 hidden_states_scale: Optional[torch.Tensor] = None,
                 max_tokens_per_rank: Optional[int] = None,
                 eplb_local_stats: Optional[torch.Tensor] = None,
                 active_rank_mask: Optional[torch.Tensor] = None) -> MoEEpDispatchResult:
        alltoall = self.alltoall
        if self._tokens_per_rank is not None:
            raise RuntimeError("dispatch called twice without an intervening combine")
        tpr = self.params.max_tokens_per_rank if max_tokens_per_rank is None \
            else max_tokens_per_rank
        if not 0 < tpr <= self.params.max_tokens_per_rank:
            raise ValueError(f"max_tokens_per_rank={tpr} must be in "
                             f"(0, {self.params.max_tokens_per_rank}]")
        if topk_ids.dtype != torch.int32:
            topk_ids = topk_ids.to(torch.int32)
        payloads, idx = _payloads(hidden_states, hidden_states_scale, topk_ids, topk_weights)
        recv = alltoall.dispatch(topk_ids, payloads, tpr, self.params.invalid_expert_id, idx,
                                 eplb_local_stats, active_rank_mask)
        self._tokens_per_rank = tpr
        return _result(recv, hidden_states_scale is not None, topk_weights is not None, idx, tpr,
                       alltoall.eplb_gathered_stats)

    def get_combine_input_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        if self._tokens_per_rank is None:
            raise RuntimeError("get_combine_input_buffer called before dispatch")
        self._combine_buffer = _uninitialized(
            (self.ep_size * self._tokens_per_rank, self.params.hidden_size), dtype,
            torch.device("cpu"))
        return self._combine_buffer

    def combine(self, expert_output: torch.Tensor, *, output: Optional[torch.Tensor] = None,
                active_rank_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        alltoall = self.alltoall
        tpr = self._tokens_per_rank
        if tpr is None:
            raise RuntimeError("combine called before dispatch")
        payload = _combine_payload(expert_output, self.ep_size, tpr)
        combined = alltoall.combine(payload, tpr, output, self.config.use_low_precision_combine)
        self._tokens_per_rank = None
        self._combine_buffer = None
        return combined

    def destroy(self) -> None:
        self._alltoall = None
        self._tokens_per_rank = None
        self._combine_buffer = None


def reset_state() -> None:
    """Forget the process-wide workspaces and switch the emulated GPU's transports off."""
    NVLinkOneSidedAlltoAll._WORKSPACES.clear()
    NVLinkOneSidedAlltoAll._CFT_WORKSPACE_KEY = None
    _MoeAlltoAll._WORKSPACE_CACHE.clear()
    PLATFORM.update(cft=False, lamport=False)
