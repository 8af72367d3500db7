"""What the flashinfer MNNVL backends share (``flashinfer_nvlink_two_sided``,
``flashinfer_nvlink_one_sided``): the package and its install hint, the communicator flashinfer
exchanges MNNVL memory handles through (:class:`TorchGroupComm`, flashinfer's ``CommBackend``
over a torch.distributed group), the kernels' 16-byte row alignment, and the manager's common
half (:class:`MnnvlManager`: the EP group, the per-call receive bound, the live transport behind
one small interface, :class:`MnnvlTransport`, on which the prepare/finalize makes its calls).
flashinfer itself is imported by the backends' managers, lazily.
"""
from __future__ import annotations

import math
import pickle
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist

from moe_plugins.config import DispatchConfig
from moe_plugins.groups import DistContext
from moe_plugins.backend_manager import BackendManager

__all__ = ["FLASHINFER_EXTRA", "INSTALL_HINT", "ROW_ALIGN_BYTES", "TorchGroupComm",
           "pad_row_bytes", "Dispatched", "moe_ep_dispatch", "MnnvlTransport", "MnnvlManager"]

FLASHINFER_EXTRA = "flashinfer"  # moe-plugins' optional dependency (pyproject.toml)
INSTALL_HINT = "pip install 'flashinfer-python>=0.7.2' (moe-plugins' [flashinfer] extra)"
# The MNNVL kernels move rows as 16-byte vectors.
ROW_ALIGN_BYTES = 16


class TorchGroupComm:
    """flashinfer's ``CommBackend`` interface (``Get_rank``, ``Get_size``, ``allgather``,
    ``bcast``, ``barrier``, ``Split``) over a torch.distributed group. flashinfer uses it to
    exchange the MNNVL memory handles when it creates a workspace (instead of MPI). Objects travel
    pickled in uint8 tensors (torch's *_object collectives need numpy, which moe-plugins does
    not)."""

    def __init__(self, group: Optional["dist.ProcessGroup"]):
        self.group = group if group is not None else dist.group.WORLD

    def Get_rank(self) -> int:  # noqa: N802 (flashinfer's MPI-style names)
        return dist.get_rank(self.group)

    def Get_size(self) -> int:  # noqa: N802
        return dist.get_world_size(self.group)

    def _device(self) -> torch.device:
        if "nccl" in str(dist.get_backend(self.group)):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def allgather(self, data: Any) -> tuple[Any, ...]:
        dev, n = self._device(), self.Get_size()
        payload = torch.tensor(list(pickle.dumps(data)), dtype=torch.uint8, device=dev)
        sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
        dist.all_gather(sizes, torch.tensor([payload.numel()], device=dev), group=self.group)
        lengths = [int(t) for t in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=dev)
        padded[: payload.numel()] = payload
        bufs = [torch.empty_like(padded) for _ in range(n)]
        dist.all_gather(bufs, padded, group=self.group)
        return tuple(pickle.loads(bytes(b[:k].tolist())) for b, k in zip(bufs, lengths))

    def bcast(self, data: Any, root: int) -> Any:
        dev, src = self._device(), dist.get_global_rank(self.group, root)
        is_root = self.Get_rank() == root
        payload = list(pickle.dumps(data)) if is_root else []
        size = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
        dist.broadcast(size, src=src, group=self.group)
        buf = torch.tensor(payload, dtype=torch.uint8, device=dev) if is_root \
            else torch.empty(int(size), dtype=torch.uint8, device=dev)
        dist.broadcast(buf, src=src, group=self.group)
        return pickle.loads(bytes(buf.tolist()))

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def Split(self, color: int, key: int) -> "TorchGroupComm":  # noqa: N802
        """MPI_Comm_split. The EP mapping this manager builds (tp_size = EP size, one pp/cp rank)
        always splits into the whole group in rank order, which is this communicator itself."""
        members = self.allgather((color, key, self.Get_rank()))
        colors = {c for c, _, _ in members}
        order = [r for _, r in sorted((k, r) for _, k, r in members)]
        if len(colors) == 1 and order == list(range(len(members))):
            return self
        raise NotImplementedError(
            f"splitting the handle-exchange group into colors {sorted(colors)} (or reordering it) "
            "is not supported; moe-plugins builds an EP mapping that is one group in rank order"
        )


def pad_row_bytes(t: torch.Tensor, align: int = ROW_ALIGN_BYTES) -> torch.Tensor:
    """t [rows, cols] -> t (contiguous) when a row is a multiple of ``align`` bytes, else a copy
    whose rows are zero-padded to that (the two-sided kernels move rows as 16-byte vectors)."""
    row_bytes = t.shape[1] * t.element_size()
    if row_bytes % align == 0:
        return t.contiguous()
    padded = torch.zeros(t.shape[0], math.ceil(row_bytes / align) * align,
                         dtype=torch.uint8, device=t.device)
    padded[:, :row_bytes] = t.contiguous().view(torch.uint8)
    return padded.view(t.dtype)


@dataclass(frozen=True)
class Dispatched:
    """What one dispatch delivered to this rank, in the kernels' rank-major receive layout.

    x: [num_ranks * tokens_per_rank, *] the dispatched dtype (``tokens_per_rank``: the call's
        bound, see :meth:`MnnvlManager.tokens_per_rank`); rows past the received tokens hold
        unspecified values.
    x_sf: same rows as x, or None when no scales were sent.
    topk_ids: int32 [num_ranks * tokens_per_rank, num_topk], GLOBAL expert ids; ids of other
        ranks' experts and every id of a row that carries no token lie outside this rank's range.
    topk_weights: float32 [num_ranks * tokens_per_rank, num_topk].
    """

    x: torch.Tensor
    x_sf: Optional[torch.Tensor]
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


def moe_ep_dispatch(comm: Any, bound_keyword: str, x: torch.Tensor, x_sf: Optional[torch.Tensor],
                    topk_ids: torch.Tensor, topk_weights: torch.Tensor, tokens_per_rank: int,
                    **extra: Any) -> Dispatched:
    """One dispatch on a ``flashinfer.moe_ep`` communication object (two- or one-sided), whose
    call bound keyword (``bound_keyword``) differs between releases; ``extra``: further keywords
    of the call (one-sided: ``active_rank_mask``). Shapes as :class:`Dispatched` says."""
    res = comm.dispatch(x, topk_ids, topk_weights, hidden_states_scale=x_sf,
                        **{bound_keyword: tokens_per_rank}, **extra)
    return Dispatched(res.hidden_states, res.hidden_states_scale, res.topk_ids, res.topk_weights)


class MnnvlTransport(ABC):
    """One flashinfer API behind the calls a MNNVL backend makes. Per-call state (the dispatch's
    routing info) lives here until the matching combine or :meth:`reset`."""

    def __init__(self, manager: Any):
        self.m = manager

    @abstractmethod
    def dispatch(self, x: torch.Tensor, x_sf: Optional[torch.Tensor], topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, tokens_per_rank: int) -> Dispatched:
        """Rows as the manager's ``row_align_bytes`` asks; topk_ids int32, topk_weights
        float32; receive ``num_ranks * tokens_per_rank`` rows."""

    @abstractmethod
    def combine(self, expert_output: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """expert_output [num_ranks * tokens_per_rank, *] -> [num_tokens, *] summed per token."""

    @abstractmethod
    def reset(self) -> None:
        """Forget a dispatch whose combine will not come (an error in between)."""

    @abstractmethod
    def destroy(self) -> None:
        """Free what this transport holds; idempotent."""


class MnnvlManager(BackendManager):
    """What the flashinfer MNNVL managers share: the EP group (>= 2 ranks; PHYSICAL expert ``p``
    lives on EP rank ``p // num_local``, the kernels' contiguous partition, from ``placement``),
    the per-call receive bound, and the live transport the prepare/finalize calls.
    Subclasses set ``backend_name`` and ``row_align_bytes`` and build ``self._transport``."""

    backend_name: ClassVar[str] = ""
    #: rows the kernels take are padded to a multiple of this many bytes (1: as they come)
    row_align_bytes: ClassVar[int] = ROW_ALIGN_BYTES

    def _init_ep_layout(self, ctx: DistContext, cfg: DispatchConfig) -> None:
        """The EP layout's check (ValueError, touching no process group) and the placement."""
        layout = ctx.layout
        if layout.ep_size < 2:
            raise ValueError(
                f"backend '{self.backend_name}' needs an EP group of >= 2 ranks, got layout "
                f"{layout.describe()} (EP size {layout.ep_size}); with one rank nothing is "
                "dispatched: enable expert parallelism over >= 2 ranks, or use backend 'torch'")
        self.cfg = cfg
        self.placement = cfg.placement_for(layout.ep_size)
        self.num_experts, self.num_topk = self.placement.num_physical, cfg.num_topk
        self.max_tokens_per_rank = cfg.max_tokens_per_rank
        self._transport: Optional[MnnvlTransport] = None

    def _init_ep_process_group(self, ctx: DistContext) -> None:
        """This rank in the EP process group (after the backend's own config checks)."""
        layout = ctx.layout
        self.group = ctx.ep_group
        self.num_ranks = dist.get_world_size(self.group)
        if self.num_ranks != layout.ep_size:
            raise ValueError(f"the EP process group has {self.num_ranks} ranks but layout "
                             f"{layout.describe()} says {layout.ep_size}")
        self.rank = dist.get_rank(self.group)

    def tokens_per_rank(self, num_tokens: int, max_tokens_across_ranks: Optional[int]) -> int:
        """The bound a dispatch of ``num_tokens`` local tokens is sized by: the most tokens any
        rank sends in this call (every rank must give the same value; an engine knows it, e.g.
        vLLM's DP metadata), at least 1 (the kernels take no empty bound); None: the layer's
        ``max_tokens_per_rank``. ValueError when the bound is below ``num_tokens`` (this rank's
        sends would overrun the kernels' index buffers) or above the layer's bound."""
        if max_tokens_across_ranks is None:
            return self.max_tokens_per_rank
        bound = max(1, max_tokens_across_ranks)
        if not num_tokens <= bound <= self.max_tokens_per_rank:
            raise ValueError(
                f"a per-call bound (BatchHint.max_tokens_per_rank) of {max_tokens_across_ranks} "
                f"for a call of {num_tokens} tokens on a layer built for max_tokens_per_rank="
                f"{self.max_tokens_per_rank}: the bound must cover this rank's tokens and fit the "
                "layer; pass the largest token count any EP rank sends in this call"
            )
        return bound

    def recv_rows(self, tokens_per_rank: int) -> int:
        """Rows of a dispatch's receive buffers: num_ranks * tokens_per_rank."""
        return self.num_ranks * tokens_per_rank

    def transport(self) -> MnnvlTransport:
        """The live transport (the flashinfer release's API over this manager's workspaces); the
        prepare/finalize makes its dispatch and combine calls."""
        if self._transport is None:
            raise RuntimeError(f"the {self.backend_name} manager was destroyed")
        return self._transport

    def reset_call_state(self) -> None:
        if self._transport is not None:
            self._transport.reset()

    def destroy(self) -> None:
        """Free the workspaces (shared ones when their last user goes); idempotent."""
        t, self._transport = self._transport, None
        if t is not None:
            t.destroy()
