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
from moe_plugins.layout import destination_ranks, local_expert_ids
from moe_plugins.quant import QuantScheme, QuantSpec, quantize_for_dispatch
from moe_plugins.registry import BackendSpec, Capabilities

__all__ = ["TorchPrepareFinalize", "SPEC"]


@dataclass
class _DispatchHandle:
    """What combine needs from dispatch. token_index: int64 [num_sent_rows], the owned row each
    sent row came from, grouped by destination rank."""

    num_tokens: int
    token_index: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]


class TorchPrepareFinalize(PrepareFinalize):
    """STANDARD layout: prepare returns [num_recv_tokens, hidden] rows with LOCAL topk ids."""

    activation_format = ActivationFormat.STANDARD

    def __init__(self, manager: TorchAll2AllManager, cfg: DispatchConfig):
        self.manager = manager
        self.cfg = cfg
        self.stats = DispatchStats()
        self._handle: Optional[_DispatchHandle] = None

    def num_dispatchers(self) -> int:
        return self.manager.num_ranks

    def supports_async(self) -> bool:
        return True

    def reset_call_state(self) -> None:
        self._handle = None

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
        # Rows sent, grouped by destination rank, each token once per rank.
        _, token_index = hit.t().nonzero(as_tuple=True)

        x, x_sf = quantize_for_dispatch(hidden_states, quant)
        payload = {"x": x[token_index], "ids": topk_ids.long()[token_index],
                   "weights": topk_weights.float()[token_index]}
        if x_sf is not None:
            payload["x_sf"] = x_sf[token_index]
        sent = {k: m.all_to_all(v, send_splits, recv_splits) for k, v in payload.items()}

        s = self.stats
        s.calls += 1
        s.pairs += topk_ids.numel()
        s.rows += token_index.numel()
        s.act_bytes += tensor_bytes(payload["x"])
        s.sf_bytes += tensor_bytes(payload.get("x_sf"))
        s.meta_bytes += tensor_bytes(payload["ids"]) + tensor_bytes(payload["weights"])
        self._handle = _DispatchHandle(n, token_index, send_splits, recv_splits)

        def hook() -> None:
            for _, work in sent.values():
                if work is not None:
                    work.wait()

        def receiver() -> PrepareResult:
            ids = sent["ids"][0]
            local = local_expert_ids(ids, m.placement, m.rank)
            # a token's experts are distinct, so pairs per local expert == tokens per expert
            valid = local >= 0
            counts = torch.zeros(m.placement.num_local, dtype=torch.int32, device=ids.device)
            counts.scatter_add_(0, local.clamp(min=0).flatten(), valid.flatten().to(torch.int32))
            return PrepareResult(
                x=sent["x"][0],
                x_sf=sent["x_sf"][0] if "x_sf" in sent else None,
                expert_tokens_meta=ExpertTokensMeta(counts),
                topk_ids=local,
                topk_weights=sent["weights"][0],
            )

        return AsyncResult(hook, receiver)

    def finalize_async(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget) -> AsyncResult:
        h = self._handle
        if h is None:
            raise RuntimeError("finalize called without a matching prepare on this backend")
        if fused_expert_output.shape[0] != sum(h.recv_splits):
            raise ValueError(f"fused_expert_output has {fused_expert_output.shape[0]} rows, "
                             f"prepare received {sum(h.recv_splits)}")
        # Combine is the reverse all-to-all: what we received goes back where it came from.
        recv, work = self.manager.all_to_all(fused_expert_output, h.recv_splits, h.send_splits)
        self.stats.combine_bytes += tensor_bytes(fused_expert_output)

        def hook() -> None:
            if work is not None:
                work.wait()

        def receiver() -> torch.Tensor:
            hidden = fused_expert_output.shape[1]
            acc = torch.zeros(h.num_tokens, hidden, dtype=torch.float32, device=recv.device)
            acc.index_add_(0, h.token_index, recv.float())
            combined = acc.to(fused_expert_output.dtype)
            self._handle = None
            return write_output(output, combined)

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
