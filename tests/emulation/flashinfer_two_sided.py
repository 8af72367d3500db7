"""Emulation of flashinfer's NVLink two-sided MoE all-to-all Python API on torch.distributed.

Follows the published wheels of flashinfer-python 0.7.2.post1 (the version vLLM 0.33 pins) and
0.7.4, read from flashinfer/comm/trtllm_alltoall.py, comm/mnnvl.py, comm/mapping.py,
moe_ep/config.py, moe_ep/core/comm/communication.py, moe_ep/backends/split/comm/nvlink_common.py
and nvlink_two_sided/ and the kernels behind them (csrc/trtllm_alltoall.cu,
csrc/trtllm_alltoall_prepare.cu); the names, parameters, defaults and dataclass fields are
checked against the wheels' source by tests/emulation/test_flashinfer_upstream.py (the table in
tests/emulation/flashinfer_upstream.json, read from the wheels by flashinfer_upstream.py):

- ``flashinfer.comm.trtllm_alltoall`` (0.7.2.post1 only): ``moe_prepare``, ``moe_comm``,
  ``get_moe_commworkspace_size_per_rank``, ``get_moe_prepare_workspace_size_per_rank``,
  ``MoEAlltoallInfo`` and ``MnnvlMoe`` (``get_moe_workspaces``, ``get_moe_prepare_workspace``,
  both warning that MnnvlMoe is deprecated, ``mnnvl_moe_alltoallv_prepare_without_allgather``,
  ``mnnvl_moe_alltoallv``, ``mnnvl_moe_alltoallv_combine``, with the class-level one-mapping
  workspace cache);
- ``flashinfer.comm.mapping.Mapping``, ``flashinfer.comm.mnnvl.MnnvlConfig`` / ``MnnvlMemory``;
- ``flashinfer.moe_ep``: ``BootstrapConfig``, ``MoEEpCommParams``, ``MoEEpDispatchResult``,
  ``MoEEpCommunication``, ``NVLinkTwoSidedConfig``, ``NVLinkTwoSidedAlltoAll``. Its constructor
  checks the ``comm_backend``'s rank and size against the bootstrap, all-gathers every rank's
  platform verdict over it (a collective) and builds a pure-EP ``Mapping`` (``gpus_per_node`` =
  EP size). 0.7.2.post1's takes its workspaces from ``MnnvlMoe`` (its one-mapping class cache),
  its ``dispatch`` bound is ``max_tokens_per_rank``; 0.7.4's (:class:`NVLinkTwoSidedAlltoAll074`)
  keeps its own per (ep_rank, ep_size) for the process, its bound is
  ``runtime_max_tokens_per_rank`` and a destroyed instance refuses to dispatch. ``destroy`` drops
  the instance's references only.

Sizes follow each call's ``max_token_count_per_rank`` (MnnvlMoe) / ``dispatch``'s bound (moe_ep,
checked against ``(0, params.max_tokens_per_rank]``): the receive rows of that call are
``ep_size`` times it, the workspaces do not change. The kernels' index contract is reproduced
exactly: ``moe_prepare`` lists, per destination rank, the
tokens with at least one expert there (in an arbitrary order, as the kernel's atomicAdd gives),
the backward slot ``token * top_k + first matching lane``, sends each token's expert ids with the
ids of other ranks replaced by ``slot_count``, receives rows grouped by source rank and fills the
expert ids of the rows past the received ones with ``slot_count``; ``moe_comm`` moves the rows
``send_indices`` selects to the peers' ``recv_indices`` rows. The checks the kernels make
(int32 routing, ``expert_count % 4``, ``1 <= top_k <= 32``, rows of 16-byte multiples, workspace
shape) raise as they do. What the real code leaves uninitialized (``torch.empty``) is filled with
NaN bytes (0xFF) and index buffers past their counts with an out-of-range index, so a consumer that
reads it fails loudly. Differences: rows move with ``all_to_all_single`` over the process group
whose ranks exchanged "handles" through the ``CommBackend`` when the workspace was created (the
emulation supports the default group only), tensors stay on their device (upstream allocates on
"cuda"), the workspaces are small placeholders, and there is no MPI fallback. Every ``moe_comm``
and ``moe_prepare`` call is logged in :data:`TRAFFIC`.

:func:`installed` presents the whole emulated flashinfer of a release: this module's two-sided
API and the one-sided class of tests/emulation/flashinfer_one_sided.py in ``flashinfer.moe_ep``
(with ``create_communication`` and ``flashinfer.fused_moe.QuantFormat``; 0.7.2.post1 also
``flashinfer.comm.moe_a2a_active_rank_mask``). Install it only inside a test or rank function
(it restores ``sys.modules``).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import sys
import types
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from tests.emulation import flashinfer_one_sided as one_sided
from tests.emulation.flashinfer_mnnvl import (_COMMUNICATION_REGISTRY, TRAFFIC, BootstrapConfig,
                                              CommBackend, Mapping, MnnvlConfig, MnnvlMemory,
                                              MoEEpCommParams, MoEEpCommunication, MoEEpDispatchResult,
                                              QuantFormat, _check, _mnnvl_mapping_and_config,
                                              _uninitialized, create_communication)

__all__ = ["installed", "not_installed", "FLAVORS", "TRAFFIC", "live_allocations", "reset_state"]

FLAVORS = ("0.7.2.post1", "0.7.4", "no_two_sided")
_BAD_INDEX = 1 << 30  # what an index buffer holds past its count: indexing with it fails
_ORDER_SEED = itertools.count(1234)


def _exchange_rows(t: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                   group: Any) -> torch.Tensor:
    """Rows of t [sum(send_counts), *] grouped by destination -> [sum(recv_counts), *] grouped by
    source, moved as bytes (what the kernels move; gloo has no fp8)."""
    row_shape = tuple(t.shape[1:])
    row_bytes = math.prod(row_shape) * t.element_size()
    send = t.contiguous().view(torch.uint8).reshape(t.shape[0], row_bytes)
    recv = torch.empty(sum(recv_counts), row_bytes, dtype=torch.uint8, device=t.device)
    dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)
    return recv.view(t.dtype).reshape(sum(recv_counts), *row_shape)



def _group_of(workspace: torch.Tensor, ep_size: int, ep_rank: int) -> Any:
    _check(workspace.dtype == torch.uint64, "allWorkspaces must be a uint64 tensor")
    _check(workspace.dim() == 2, "allWorkspaces must be a 2D tensor")
    _check(workspace.shape[0] == ep_size, "allWorkspaces must have epSize elements")
    _check(0 <= ep_rank < ep_size, "epRank must be in the range [0, epSize)")
    alloc = MnnvlMemory.allocated_map.get(workspace.data_ptr())
    _check(alloc is not None, "workspace memory was freed (MnnvlMemory closed): the real kernels "
                              "would fault on unmapped memory")
    assert alloc is not None
    _check(dist.get_world_size(alloc.group) == ep_size and dist.get_rank(alloc.group) == ep_rank,
           "ep_rank/ep_size do not match the ranks that created the workspace")
    return alloc.group


# --- flashinfer.comm.trtllm_alltoall ----------------------------------------------------------
def get_moe_commworkspace_size_per_rank(ep_size: int) -> int:
    return 1024 * 1024 * ep_size  # FIFOs, one per peer (a placeholder figure)


def get_moe_prepare_workspace_size_per_rank(ep_size: int) -> int:
    return (1024 * 1024 + 128) * ep_size


def moe_prepare(experts_ids: torch.Tensor, scales: Optional[torch.Tensor],
                experts_statics: Optional[torch.Tensor], workspace: torch.Tensor,
                max_token_count_per_rank: int, ep_rank: int, ep_size: int, expert_count: int,
                slot_count: int, top_k: int) -> tuple:
    """Exchange routing and per-rank counts; see the module docstring for the contract."""
    _check(experts_ids.dtype == torch.int32, "expertsIds must be int32")
    _check(expert_count % 4 == 0, "expertCount must be divisible by 4")
    _check(slot_count % 4 == 0, "slotCount must be divisible by 4")
    _check(1 <= top_k <= 32, "Only 1 <= topK <= 32 is supported now.")
    _check(experts_ids.dim() == 2 and experts_ids.shape[1] == top_k, "expertsIds is [tokens, topK]")
    n = experts_ids.shape[0]
    _check(n <= max_token_count_per_rank, f"{n} tokens > max_token_count_per_rank="
           f"{max_token_count_per_rank}: the kernel would write past its index buffers")
    if scales is not None:
        _check(scales.dtype == torch.float32 and scales.shape == experts_ids.shape,
               "scales must be float32 [tokens, topK]")
    group = _group_of(workspace, ep_size, ep_rank)
    dev = experts_ids.device
    rows = max_token_count_per_rank * ep_size
    max_send = max(ep_size, top_k)

    target = experts_ids.long() // (slot_count // ep_size)
    gen = torch.Generator().manual_seed(next(_ORDER_SEED))
    tokens, backward = [], []
    for r in range(ep_size):
        match = target == r
        toks = match.any(dim=1).nonzero().flatten()
        toks = toks[torch.randperm(toks.numel(), generator=gen).to(dev)]  # atomicAdd order
        lane = match.to(torch.int8).argmax(dim=1)[toks]
        tokens.append(toks)
        backward.append(toks * top_k + lane)
    send_counts = torch.tensor([t.numel() for t in tokens], dtype=torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    # The receive buffers hold max_token_count_per_rank rows per source rank (the CALL's bound,
    # which every rank must pass alike): more arriving would overrun them.
    _check(sum(rc) <= rows, f"{sum(rc)} rows arrive but the receive buffers hold "
           f"max_token_count_per_rank * ep_size = {rows}: a peer sent with a larger bound")
    sent = torch.cat(tokens)
    dest = torch.repeat_interleave(torch.arange(ep_size, device=dev), send_counts.to(dev))
    ids = experts_ids[sent].clone()
    ids[target[sent] != dest[:, None]] = slot_count
    recv_ids = _exchange_rows(ids, sc, rc, group)

    prepared_ids = torch.full((rows, top_k), slot_count, dtype=torch.int32, device=dev)
    prepared_ids[: recv_ids.shape[0]] = recv_ids
    prepared_scales = None
    if scales is not None:
        prepared_scales = _uninitialized((rows, top_k), torch.float32, dev)
        prepared_scales[: recv_ids.shape[0]] = _exchange_rows(scales[sent], sc, rc, group)
    gathered_statics = None
    if experts_statics is not None:
        gathered_statics = torch.empty(ep_size, expert_count, dtype=torch.int32, device=dev)
        dist.all_gather_into_tensor(gathered_statics, experts_statics.to(torch.int32).reshape(1, -1),
                                    group=group)

    def index_buffer(size: int, values: torch.Tensor) -> torch.Tensor:
        buf = torch.full((size,), _BAD_INDEX, dtype=torch.int32, device=dev)
        buf[: values.numel()] = values.to(torch.int32)
        return buf

    total_recv = recv_ids.shape[0]
    TRAFFIC.append(dict(op="moe_prepare", rows_sent=sent.numel(), rows_received=total_recv,
                        with_scales=scales is not None))
    return (prepared_ids, prepared_scales,
            torch.cumsum(send_counts, 0).to(torch.int32).to(dev),
            index_buffer(max_token_count_per_rank * max_send, sent),
            torch.cumsum(recv_counts, 0).to(torch.int32).to(dev),
            index_buffer(rows, torch.arange(total_recv, device=dev)),
            index_buffer(max_token_count_per_rank * max_send, torch.cat(backward)),
            gathered_statics)


def moe_comm(input: torch.Tensor, send_rank_cum_sum: torch.Tensor, send_indices: torch.Tensor,
             output: torch.Tensor, recv_rank_cum_sum: torch.Tensor, recv_indices: torch.Tensor,
             all_workspaces: torch.Tensor, ep_rank: int, ep_size: int) -> None:
    """Send ``input[send_indices]`` (grouped by destination per ``send_rank_cum_sum``) and write
    what arrives (grouped by source per ``recv_rank_cum_sum``) to ``output[recv_indices]``."""
    for name, t in (("sendRankCumSum", send_rank_cum_sum), ("sendIndices", send_indices),
                    ("recvRankCumSum", recv_rank_cum_sum), ("recvIndices", recv_indices)):
        _check(t.dtype == torch.int32 and t.dim() == 1, f"{name} must be a 1D int32 tensor")
    _check(input.dim() == 2 and output.dim() == 2, "input and output must be 2D tensors")
    _check(input.shape[1] == output.shape[1], "input and output must have the same second dimension")
    _check(input.dtype == output.dtype, "input and output must have the same dtype")
    _check(input.stride(1) == 1 and output.stride(1) == 1, "rows must be contiguous")
    _check(send_rank_cum_sum.numel() == ep_size and recv_rank_cum_sum.numel() == ep_size,
           "rank cumsums must have epSize elements")
    _check(input.shape[1] * input.element_size() % 16 == 0, "input.size(1) must be aligned to 16 bytes")
    group = _group_of(all_workspaces, ep_size, ep_rank)
    zero = torch.zeros(1, dtype=torch.int64)
    sc = torch.diff(torch.cat([zero, send_rank_cum_sum.cpu().long()])).tolist()
    rc = torch.diff(torch.cat([zero, recv_rank_cum_sum.cpu().long()])).tolist()
    # Rows move as bytes, like the kernel's 16-byte vectors (and any dtype, fp8 included).
    rows = input.view(torch.uint8)[send_indices[: sum(sc)].long()]
    output.view(torch.uint8)[recv_indices[: sum(rc)].long()] = _exchange_rows(rows, sc, rc, group)
    TRAFFIC.append(dict(op="moe_comm", dtype=input.dtype, cols=input.shape[1], rows_sent=sum(sc),
                        rows_received=sum(rc)))


@dataclass
class MoEAlltoallInfo:
    local_gather_indices: Optional[torch.Tensor]
    send_rank_count_cumsum: torch.Tensor
    send_rank_local_indices: torch.Tensor
    recv_rank_count_cumsum: torch.Tensor
    recv_rank_local_indices: torch.Tensor
    backward_recv_rank_local_indices: torch.Tensor
    local_token_allocation_count: int


_MNNVL_MOE_DEPRECATION = ("MnnvlMoe is deprecated; use flashinfer.moe_ep.NVLinkTwoSidedAlltoAll. "
                          "Its implementation will move into that class.")


class MnnvlMoe:
    """Static API over two process-wide workspaces for one mapping (as upstream); the two
    workspace getters warn that MnnvlMoe is deprecated (``typing_extensions.deprecated``)."""

    moe_workspace: Any = None
    moe_prepare_workspace: Any = None
    moe_workspace_tensor: Optional[torch.Tensor] = None
    moe_prepare_workspace_tensor: Optional[torch.Tensor] = None
    moe_mapping: Optional[Mapping] = None

    @staticmethod
    def get_moe_workspaces(mapping: Mapping, config: Optional[MnnvlConfig] = None) -> torch.Tensor:
        warnings.warn(_MNNVL_MOE_DEPRECATION, DeprecationWarning, stacklevel=2)
        if MnnvlMoe.moe_workspace is not None:
            assert mapping == MnnvlMoe.moe_mapping, "only one moe mapping supported now"
            assert MnnvlMoe.moe_workspace_tensor is not None
            return MnnvlMoe.moe_workspace_tensor
        MnnvlMoe.moe_mapping = mapping
        size = get_moe_commworkspace_size_per_rank(mapping.tp_size)
        if config:
            MnnvlMemory.set_comm_from_config(mapping, config)
        MnnvlMoe.moe_workspace = MnnvlMemory(mapping, size)
        MnnvlMoe.moe_workspace_tensor = MnnvlMoe.moe_workspace.as_torch_strided_tensor(torch.uint64)
        return MnnvlMoe.moe_workspace_tensor

    @staticmethod
    def get_moe_prepare_workspace(mapping: Mapping,
                                  config: Optional[MnnvlConfig] = None) -> torch.Tensor:
        warnings.warn(_MNNVL_MOE_DEPRECATION, DeprecationWarning, stacklevel=2)
        if MnnvlMoe.moe_prepare_workspace_tensor is not None:
            assert mapping == MnnvlMoe.moe_mapping, "only one moe mapping supported now"
            return MnnvlMoe.moe_prepare_workspace_tensor
        size = get_moe_prepare_workspace_size_per_rank(mapping.tp_size)
        if config:
            MnnvlMemory.set_comm_from_config(mapping, config)
        MnnvlMoe.moe_prepare_workspace = MnnvlMemory(mapping, size)
        MnnvlMoe.moe_prepare_workspace_tensor = \
            MnnvlMoe.moe_prepare_workspace.as_torch_strided_tensor(torch.uint64)
        return MnnvlMoe.moe_prepare_workspace_tensor

    @staticmethod
    def mnnvl_moe_alltoallv_prepare_without_allgather(
            expert_ids: torch.Tensor, scales: Optional[torch.Tensor],
            expert_statics: Optional[torch.Tensor], workspace: torch.Tensor,
            max_token_count_per_rank: int, ep_rank: int, ep_size: int, expert_count: int,
            slot_count: int, top_k: int) -> tuple:
        (ids, local_scales, send_cumsum, send_idx, recv_cumsum, recv_idx, backward_idx,
         statics) = moe_prepare(expert_ids, scales, expert_statics, workspace,
                                max_token_count_per_rank, ep_rank, ep_size, expert_count,
                                slot_count, top_k)
        info = MoEAlltoallInfo(None, send_cumsum, send_idx, recv_cumsum, recv_idx, backward_idx,
                               max_token_count_per_rank * ep_size)
        return info, ids, local_scales, statics

    @staticmethod
    def mnnvl_moe_alltoallv(x: torch.Tensor, alltoall_info: MoEAlltoallInfo,
                            workspace: torch.Tensor, ep_rank: int, ep_size: int) -> torch.Tensor:
        assert x.dim() == 2, "only 2D tensor supported, please reshape."
        out = _uninitialized((alltoall_info.local_token_allocation_count, x.shape[1]), x.dtype,
                             x.device)
        moe_comm(x, alltoall_info.send_rank_count_cumsum, alltoall_info.send_rank_local_indices,
                 out, alltoall_info.recv_rank_count_cumsum, alltoall_info.recv_rank_local_indices,
                 workspace, ep_rank, ep_size)
        return out

    @staticmethod
    def mnnvl_moe_alltoallv_combine(x: torch.Tensor, alltoall_info: MoEAlltoallInfo,
                                    workspace: torch.Tensor, ep_rank: int, ep_size: int,
                                    top_k: int, token_count: int) -> torch.Tensor:
        assert x.dim() == 2, "2D tensor supported, please reshape."
        out = torch.zeros(token_count * top_k, x.shape[1], dtype=x.dtype, device=x.device)
        moe_comm(x, alltoall_info.recv_rank_count_cumsum, alltoall_info.recv_rank_local_indices,
                 out, alltoall_info.send_rank_count_cumsum,
                 alltoall_info.backward_recv_rank_local_indices, workspace, ep_rank, ep_size)
        return torch.sum(out.reshape(token_count, top_k, x.shape[1]), dim=1, keepdim=False)


@dataclass
class NVLinkTwoSidedConfig:
    backend_name: str = "nvlink_two_sided"
    comm_backend: Any = None



def _two_sided_start(comm: "MoEEpCommunication", bootstrap: BootstrapConfig,
                     params: MoEEpCommParams, config: Optional[NVLinkTwoSidedConfig],
                     ) -> tuple[Mapping, MnnvlConfig]:
    """Both releases' NVLinkTwoSidedAlltoAll.__init__ up to the workspaces: its config, the
    group's Mapping (a collective), the base class, the experts check, MNNVL initialized."""
    comm.config = NVLinkTwoSidedConfig() if config is None else config
    mapping, mnnvl_config = _mnnvl_mapping_and_config(bootstrap, comm.config.comm_backend)
    MoEEpCommunication.__init__(comm, bootstrap, params)
    if params.num_experts % 4 != 0:
        raise ValueError("NVLinkTwoSidedAlltoAll requires num_experts divisible by 4, "
                         f"got {params.num_experts}")
    MnnvlMemory.initialize()
    return mapping, mnnvl_config


def _combine_input(state: Optional[dict[str, Any]],
                   expert_output: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    """Both releases' combine: the pending dispatch's state, and the expert output as rows
    ([E, T, H] flattened to [E*T, H])."""
    if state is None:
        raise RuntimeError("combine called before dispatch")
    if expert_output.dim() == 3:
        expert_output = expert_output.flatten(0, 1)
    return state, expert_output


def _into(output: Optional[torch.Tensor], combined: torch.Tensor) -> torch.Tensor:
    """Both releases' combine result: into ``output`` where given."""
    if output is None:
        return combined
    output.copy_(combined)
    return output



class NVLinkTwoSidedAlltoAll(MoEEpCommunication):
    """0.7.2.post1's NVLinkTwoSidedAlltoAll: rank-major dispatch/combine over MnnvlMoe, whose
    class-level workspaces (one mapping per process) it shares; one dispatch in flight."""

    def __init__(self, bootstrap: BootstrapConfig, params: MoEEpCommParams,
                 config: Optional[NVLinkTwoSidedConfig] = None):
        mapping, mnnvl_config = _two_sided_start(self, bootstrap, params, config)
        with warnings.catch_warnings():  # as upstream: MnnvlMoe's users see the warning
            warnings.filterwarnings("ignore", "MnnvlMoe is deprecated", DeprecationWarning)
            self._workspace: Optional[torch.Tensor] = MnnvlMoe.get_moe_workspaces(
                mapping, mnnvl_config)
            self._prepare_workspace: Optional[torch.Tensor] = \
                MnnvlMoe.get_moe_prepare_workspace(mapping, mnnvl_config)
        self._state: Optional[dict[str, Any]] = None

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: Optional[torch.Tensor] = None, *,
                 hidden_states_scale: Optional[torch.Tensor] = None,
                 max_tokens_per_rank: Optional[int] = None,
                 eplb_local_stats: Optional[torch.Tensor] = None) -> MoEEpDispatchResult:
        # 0.7.2.post1 has no destroyed check: after destroy the None workspace reaches the
        # kernel wrapper, which fails.
        if self._state is not None:
            raise RuntimeError("dispatch called twice without an intervening combine")
        tpr = self.params.max_tokens_per_rank if max_tokens_per_rank is None \
            else max_tokens_per_rank
        if not 0 < tpr <= self.params.max_tokens_per_rank:
            raise ValueError(f"max_tokens_per_rank={tpr} must be in "
                             f"(0, {self.params.max_tokens_per_rank}]")
        _check(self._workspace is not None and self._prepare_workspace is not None,
               "the workspace is None (the instance was destroyed)")
        assert self._workspace is not None and self._prepare_workspace is not None
        topk_ids = topk_ids.to(torch.int32)
        if topk_weights is not None:
            topk_weights = topk_weights.to(torch.float32)
        e = self.params.num_experts
        info, ids, weights, stats = MnnvlMoe.mnnvl_moe_alltoallv_prepare_without_allgather(
            topk_ids, topk_weights, eplb_local_stats, self._prepare_workspace, tpr, self.ep_rank,
            self.ep_size, e, e, self.params.top_k)
        if self.params.invalid_expert_id != e:
            ids.masked_fill_(ids == e, self.params.invalid_expert_id)
        hidden = MnnvlMoe.mnnvl_moe_alltoallv(hidden_states, info, self._workspace, self.ep_rank,
                                              self.ep_size)
        scale = None
        if hidden_states_scale is not None:
            scale = MnnvlMoe.mnnvl_moe_alltoallv(hidden_states_scale, info, self._workspace,
                                                 self.ep_rank, self.ep_size)
        self._state = dict(alltoall_info=info, local_num_tokens=hidden_states.shape[0],
                           tokens_per_rank=tpr)
        return MoEEpDispatchResult(hidden_states=hidden, topk_ids=ids, topk_weights=weights,
                                   tokens_per_rank=tpr, hidden_states_scale=scale,
                                   eplb_gathered_stats=stats)

    def combine(self, expert_output: torch.Tensor, *,
                output: Optional[torch.Tensor] = None) -> torch.Tensor:
        state, expert_output = _combine_input(self._state, expert_output)
        assert self._workspace is not None
        combined = MnnvlMoe.mnnvl_moe_alltoallv_combine(
            expert_output, state["alltoall_info"], self._workspace, ep_rank=self.ep_rank,
            ep_size=self.ep_size, top_k=self.params.top_k, token_count=state["local_num_tokens"])
        self._state = None
        return _into(output, combined)

    def destroy(self) -> None:
        # MnnvlMoe caches its workspaces process-wide (as upstream).
        self._workspace = None
        self._prepare_workspace = None
        self._state = None


class NVLinkTwoSidedAlltoAll074(MoEEpCommunication):
    """0.7.4's NVLinkTwoSidedAlltoAll (flashinfer/moe_ep/backends/split/comm/nvlink_two_sided/
    communication.py): its own workspaces per (ep_rank, ep_size) for the process (MnnvlMoe is
    gone), ``dispatch``'s per-call bound is ``runtime_max_tokens_per_rank``, a destroyed
    instance refuses to dispatch."""

    _WORKSPACES: dict[tuple[int, int], dict[str, Any]] = {}

    def __init__(self, bootstrap: BootstrapConfig, params: MoEEpCommParams,
                 config: Optional[NVLinkTwoSidedConfig] = None):
        mapping, mnnvl_config = _two_sided_start(self, bootstrap, params, config)
        MnnvlMemory.set_comm_from_config(mapping, mnnvl_config)
        key = (self.ep_rank, self.ep_size)
        ws = self._WORKSPACES.get(key)
        if ws is None:
            memory = MnnvlMemory(mapping, get_moe_commworkspace_size_per_rank(self.ep_size))
            prepare = MnnvlMemory(mapping, get_moe_prepare_workspace_size_per_rank(self.ep_size))
            ws = self._WORKSPACES[key] = dict(
                memory=memory, prepare_memory=prepare,
                workspace=memory.as_torch_strided_tensor(torch.uint64),
                prepare_workspace=prepare.as_torch_strided_tensor(torch.uint64))
        self._workspace: Optional[torch.Tensor] = ws["workspace"]
        self._prepare_workspace: Optional[torch.Tensor] = ws["prepare_workspace"]
        self._state: Optional[dict[str, Any]] = None

    def _alltoallv(self, x: torch.Tensor, output: torch.Tensor, send_cumsum: torch.Tensor,
                   send_indices: torch.Tensor, recv_cumsum: torch.Tensor,
                   recv_indices: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError(f"expected a 2D tensor, got shape {tuple(x.shape)}")
        assert self._workspace is not None
        moe_comm(x, send_cumsum, send_indices, output, recv_cumsum, recv_indices, self._workspace,
                 self.ep_rank, self.ep_size)
        return output

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: Optional[torch.Tensor] = None, *,
                 hidden_states_scale: Optional[torch.Tensor] = None,
                 runtime_max_tokens_per_rank: Optional[int] = None,
                 eplb_local_stats: Optional[torch.Tensor] = None) -> MoEEpDispatchResult:
        if self._workspace is None or self._prepare_workspace is None:
            raise RuntimeError("NVLinkTwoSidedAlltoAll has been destroyed")
        if self._state is not None:
            raise RuntimeError("dispatch called twice without an intervening combine")
        tpr = self._resolve_runtime_max_tokens_per_rank(runtime_max_tokens_per_rank)
        topk_ids = topk_ids.to(torch.int32)
        if topk_weights is not None:
            topk_weights = topk_weights.to(torch.float32)
        e = self.params.num_experts
        (ids, weights, send_cumsum, send_idx, recv_cumsum, recv_idx, backward_idx,
         stats) = moe_prepare(topk_ids, topk_weights, eplb_local_stats, self._prepare_workspace,
                              tpr, self.ep_rank, self.ep_size, e, e, self.params.top_k)
        if self.params.invalid_expert_id != e:
            ids.masked_fill_(ids == e, self.params.invalid_expert_id)
        rows = self.ep_size * tpr
        hidden = self._alltoallv(
            hidden_states, _uninitialized((rows, hidden_states.shape[1]), hidden_states.dtype,
                                          hidden_states.device),
            send_cumsum, send_idx, recv_cumsum, recv_idx)
        scale = None
        if hidden_states_scale is not None:
            scale = self._alltoallv(
                hidden_states_scale,
                _uninitialized((rows, hidden_states_scale.shape[1]), hidden_states_scale.dtype,
                               hidden_states_scale.device),
                send_cumsum, send_idx, recv_cumsum, recv_idx)
        self._state = dict(send_cumsum=send_cumsum, recv_cumsum=recv_cumsum, recv_indices=recv_idx,
                           backward_recv_indices=backward_idx,
                           local_num_tokens=hidden_states.shape[0])
        return MoEEpDispatchResult(hidden_states=hidden, topk_ids=ids, topk_weights=weights,
                                   tokens_per_rank=tpr, hidden_states_scale=scale,
                                   eplb_gathered_stats=stats)

    def combine(self, expert_output: torch.Tensor, *,
                output: Optional[torch.Tensor] = None) -> torch.Tensor:
        state, expert_output = _combine_input(self._state, expert_output)
        k, n = self.params.top_k, state["local_num_tokens"]
        per_slot = self._alltoallv(
            expert_output, expert_output.new_zeros(n * k, expert_output.shape[1]),
            state["recv_cumsum"], state["recv_indices"], state["send_cumsum"],
            state["backward_recv_indices"])
        self._state = None
        combined = torch.sum(per_slot.view(n, k, expert_output.shape[1]), dim=1)
        return _into(output, combined)

    def destroy(self) -> None:
        # The workspaces stay with the process for later instances (as upstream).
        self._workspace = None
        self._prepare_workspace = None
        self._state = None


# --- installing the modules -------------------------------------------------------------------
_NAMES = ("flashinfer", "flashinfer.comm", "flashinfer.comm.mapping", "flashinfer.comm.mnnvl",
          "flashinfer.comm.trtllm_alltoall", "flashinfer.moe_ep", "flashinfer.fused_moe")
_MISSING = object()


def reset_state() -> None:
    """Forget every process-wide cache of the emulated library and the traffic log."""
    for attr in ("moe_workspace", "moe_prepare_workspace", "moe_workspace_tensor",
                 "moe_prepare_workspace_tensor", "moe_mapping"):
        setattr(MnnvlMoe, attr, None)
    MnnvlMemory.comm = None
    MnnvlMemory.config = None
    MnnvlMemory.initialized = False
    MnnvlMemory.allocated_map.clear()
    NVLinkTwoSidedAlltoAll074._WORKSPACES.clear()
    one_sided.reset_state()
    _COMMUNICATION_REGISTRY.clear()
    TRAFFIC.clear()


def live_allocations() -> int:
    """MNNVL allocations not yet freed."""
    return len(MnnvlMemory.allocated_map)


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name, "emulated by tests/emulation/flashinfer_two_sided.py")
    mod.__dict__.update(attrs)
    return mod


def _build(flavor: str) -> dict[str, types.ModuleType]:
    if flavor not in FLAVORS:
        raise ValueError(f"unknown flavor {flavor!r}; one of {FLAVORS}")
    version = {"no_two_sided": "0.5.3"}.get(flavor, flavor)
    mods = {
        "flashinfer": _module("flashinfer", __version__=version),
        "flashinfer.comm": _module("flashinfer.comm", Mapping=Mapping),
        "flashinfer.comm.mapping": _module("flashinfer.comm.mapping", Mapping=Mapping),
        "flashinfer.comm.mnnvl": _module("flashinfer.comm.mnnvl", CommBackend=CommBackend,
                                         MnnvlConfig=MnnvlConfig, MnnvlMemory=MnnvlMemory),
    }
    if flavor == "0.7.2.post1":
        mods["flashinfer.comm.trtllm_alltoall"] = _module(
            "flashinfer.comm.trtllm_alltoall", MnnvlMoe=MnnvlMoe, MoEAlltoallInfo=MoEAlltoallInfo,
            moe_prepare=moe_prepare, moe_comm=moe_comm,
            get_moe_commworkspace_size_per_rank=get_moe_commworkspace_size_per_rank,
            get_moe_prepare_workspace_size_per_rank=get_moe_prepare_workspace_size_per_rank)
    if flavor in ("0.7.2.post1", "0.7.4"):
        new = flavor == "0.7.4"
        mods["flashinfer.moe_ep"] = _module(
            "flashinfer.moe_ep", BootstrapConfig=BootstrapConfig, MoEEpCommParams=MoEEpCommParams,
            MoEEpDispatchResult=MoEEpDispatchResult, MoEEpCommunication=MoEEpCommunication,
            NVLinkTwoSidedConfig=NVLinkTwoSidedConfig,
            NVLinkTwoSidedAlltoAll=NVLinkTwoSidedAlltoAll074 if new else NVLinkTwoSidedAlltoAll,
            NVLinkOneSidedConfig=(one_sided.NVLinkOneSidedConfig if new
                                  else one_sided.NVLinkOneSidedConfig072),
            NVLinkOneSidedAlltoAll=(one_sided.NVLinkOneSidedAlltoAll if new
                                    else one_sided.NVLinkOneSidedAlltoAll072),
            create_communication=create_communication)
        mods["flashinfer.fused_moe"] = _module("flashinfer.fused_moe", QuantFormat=QuantFormat)
        if not new:
            mods["flashinfer.comm"].moe_a2a_active_rank_mask = one_sided.moe_a2a_active_rank_mask
    for name, mod in mods.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(mods[parent], child, mod)
    return mods


@contextlib.contextmanager
def _swap_modules(replacement: dict[str, Any]) -> Iterator[None]:
    saved = {n: sys.modules.get(n, _MISSING) for n in _NAMES}
    for n in _NAMES:
        sys.modules.pop(n, None)
    sys.modules.update(replacement)
    try:
        yield
    finally:
        for n, mod in saved.items():
            if mod is _MISSING:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod


@contextlib.contextmanager
def installed(flavor: str = "0.7.2.post1") -> Iterator[None]:
    """The emulated flashinfer of ``flavor`` in sys.modules for the duration, fresh state on
    entry; sys.modules and the emulation's caches are restored on exit. Flavors: "0.7.2.post1"
    (MnnvlMoe and moe_ep), "0.7.4" (moe_ep only), "no_two_sided" (neither)."""
    reset_state()
    modules = _build(flavor)
    moe_ep = modules.get("flashinfer.moe_ep")
    if moe_ep is not None:  # what register_communication does at import time upstream
        _COMMUNICATION_REGISTRY.update(nvlink_two_sided=moe_ep.NVLinkTwoSidedAlltoAll,
                                       nvlink_one_sided=moe_ep.NVLinkOneSidedAlltoAll)
    with _swap_modules(modules):
        try:
            yield
        finally:
            reset_state()


@contextlib.contextmanager
def not_installed() -> Iterator[None]:
    """flashinfer unimportable for the duration (even where it is installed)."""
    with _swap_modules({"flashinfer": None}):
        yield
