"""Reference backend ``torch``: dispatch/combine with ``all_to_all_single`` over the EP group.

Runs anywhere torch.distributed runs (gloo on CPU, NCCL on GPU); the embedded default. A token is
sent to each destination rank once, however many of its experts live there; the receiving rank
sums its local experts' weighted outputs and sends one row back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from all2all.torch_manager import TorchAll2AllManager
from moe_plugins.config import DispatchConfig
from moe_plugins.counters import DispatchStats, tensor_bytes
from moe_plugins.interface import (ActivationFormat, AsyncResult, ExpertTokensMeta,
                                   PrepareFinalize, PrepareResult, RowScatterTarget,
                                   check_prepare_inputs, write_output)
from moe_plugins.layout import LocalIdMap, destination_ranks
from moe_plugins.quant import QuantScheme, QuantSpec, quantize_for_dispatch
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


class TorchPrepareFinalize(PrepareFinalize):
    """STANDARD layout: prepare returns [num_recv_tokens, hidden] rows with LOCAL topk ids."""

    activation_format = ActivationFormat.STANDARD

    def __init__(self, manager: TorchAll2AllManager, cfg: DispatchConfig):
        self.manager = manager
        self.cfg = cfg
        self.stats = DispatchStats()
        self._handle: Optional[_DispatchHandle] = None
        self._local_ids: Optional[LocalIdMap] = None  # made on the first receive
        # Per device, a 1-element int32 one: expanded, the source of the per-expert count scatter.
        self._ones: dict[torch.device, torch.Tensor] = {}

    def num_dispatchers(self) -> int:
        return self.manager.num_ranks

    def supports_async(self) -> bool:
        return True

    def reset_call_state(self) -> None:
        self._handle = None

    def _local_ids_and_counts(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Received PHYSICAL ids int64 [num_recv, num_topk] -> (LOCAL ids, -1 elsewhere; int32
        [num_local_experts] pairs per local expert) in five small kernels, no host sync."""
        one = self._ones.get(ids.device)
        if one is None:
            one = self._ones[ids.device] = torch.ones(1, dtype=torch.int32, device=ids.device)
        if self._local_ids is None:
            m = self.manager
            self._local_ids = LocalIdMap(m.placement, m.rank)
        local = self._local_ids(ids)
        # a token's experts are distinct, so pairs per local expert == tokens per expert; slot 0
        # of the scatter collects the -1 entries
        counts = torch.zeros(self.manager.placement.num_local + 1, dtype=torch.int32,
                             device=ids.device)
        counts.scatter_add_(0, (local + 1).flatten(), one.expand(local.numel()))
        return local, counts[1:]

    def prepare_async(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, quant: QuantSpec) -> AsyncResult:
        check_prepare_inputs(hidden_states, topk_weights, topk_ids)
        if self._handle is not None:
            raise RuntimeError("prepare called twice without finalize (or reset_call_state)")
        m = self.manager
        n = hidden_states.shape[0]
        hit = destination_ranks(topk_ids, m.placement)
        send_counts = hit.sum(dim=0)
        # One host sync for both split lists (the receive sizes must be known to allocate).
        send_splits, recv_splits = torch.stack([send_counts, m.exchange_counts(send_counts)]).tolist()
        num_recv = sum(recv_splits)
        # Rows sent, grouped by destination rank, each token once per rank.
        _, token_index = hit.t().nonzero(as_tuple=True)

        x, x_sf = quantize_for_dispatch(hidden_states, quant)
        ids = topk_ids if topk_ids.dtype is torch.int64 else topk_ids.long()
        weights = topk_weights if topk_weights.dtype is torch.float32 else topk_weights.float()
        payload = [x[token_index], ids[token_index], weights[token_index]]
        if x_sf is not None:
            payload.append(x_sf[token_index])
        sent = [m.all_to_all(t, send_splits, recv_splits, num_recv) for t in payload]

        s = self.stats
        rows = token_index.numel()
        s.calls += 1
        s.pairs += topk_ids.numel()
        s.rows += rows
        s.act_bytes += tensor_bytes(payload[0])
        s.sf_bytes += tensor_bytes(payload[3]) if x_sf is not None else 0
        s.meta_bytes += rows * ids.shape[1] * (8 + 4)  # int64 ids + float32 weights
        self._handle = _DispatchHandle(n, token_index, send_splits, recv_splits, num_recv)

        def hook() -> None:
            for _, work in sent:
                if work is not None:
                    work.wait()

        def receiver() -> PrepareResult:
            local, counts = self._local_ids_and_counts(sent[1][0])
            return PrepareResult(
                x=sent[0][0],
                x_sf=sent[3][0] if x_sf is not None else None,
                expert_tokens_meta=ExpertTokensMeta(counts),
                topk_ids=local,
                topk_weights=sent[2][0],
            )

        return AsyncResult(hook, receiver)

    def finalize_async(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget) -> AsyncResult:
        h = self._handle
        if h is None:
            raise RuntimeError("finalize called without a matching prepare on this backend")
        if fused_expert_output.shape[0] != h.num_recv:
            raise ValueError(f"fused_expert_output has {fused_expert_output.shape[0]} rows, "
                             f"prepare received {h.num_recv}")
        # Combine is the reverse all-to-all: what we received goes back where it came from.
        recv, work = self.manager.all_to_all(fused_expert_output, h.recv_splits, h.send_splits,
                                             h.token_index.numel())
        self.stats.combine_bytes += tensor_bytes(fused_expert_output)

        def hook() -> None:
            if work is not None:
                work.wait()

        def receiver() -> torch.Tensor:
            hidden = fused_expert_output.shape[1]
            acc = torch.zeros(h.num_tokens, hidden, dtype=torch.float32, device=recv.device)
            acc.index_add_(0, h.token_index, recv if recv.dtype is torch.float32 else recv.float())
            self._handle = None
            if isinstance(output, RowScatterTarget) or output.dtype is not fused_expert_output.dtype:
                return write_output(output, acc.to(fused_expert_output.dtype))
            # copy_ rounds to the output dtype on the way, as .to() would, without a temporary
            return write_output(output, acc)

        return AsyncResult(hook, receiver)


SPEC = BackendSpec(
    name="torch",
    prepare_finalize=TorchPrepareFinalize,
    manager=TorchAll2AllManager,
    capabilities=Capabilities(ep_dp=True, dp=True, tp=True, sp=True, row_scatter=True,
                              recv_hook=False, placements=True),
    quants=frozenset({QuantScheme.NONE, QuantScheme.FP8_BLOCK128, QuantScheme.NVFP4}),
    description="reference all_to_all_single over torch.distributed (gloo on CPU, NCCL on GPU)",
)
