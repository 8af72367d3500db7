"""example_allgather: all-gather dispatch, reduce-scatter combine, over the EP group.

Every rank receives every token of the EP group (padded to the largest rank's count) and runs its
local experts on all of them; reduce-scatter sums each token's partials back to its owner.
Wasteful on the wire (num_ranks x the rows of a real all-to-all) but short, which is the point.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_plugins.config import DispatchConfig
from moe_plugins.counters import DispatchStats, tensor_bytes
from moe_plugins.groups import DistContext, all_gather_tensor, reduce_scatter_tensor
from moe_plugins.interface import AsyncResult, PrepareFinalize, PrepareResult, RowScatterTarget, check_prepare_inputs, write_output
from moe_plugins.backend_manager import BackendManager
from moe_plugins.layout import local_expert_ids
from moe_plugins.quant import QuantScheme, QuantSpec
from moe_plugins.registry import BackendSpec, Capabilities


class AllGatherManager(BackendManager):
    """The EP group and the expert placement (``cfg.placement``, linear when None). It holds
    no buffers, so BackendManager's defaults serve: ``destroy`` frees nothing, ``engine_options``
    gives None (no options), ``masks_by_itself`` is False."""

    def __init__(self, ctx: DistContext, cfg: DispatchConfig):
        self.group = ctx.ep_group
        self.num_ranks = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.placement = cfg.placement_for(self.num_ranks)

    def gather(self, t: torch.Tensor, rows: int) -> torch.Tensor:
        """t [n, ...] padded to ``rows`` on every rank -> [num_ranks * rows, ...]."""
        padded = t.new_zeros(rows, *t.shape[1:])
        padded[: t.shape[0]] = t
        out = t.new_empty(self.num_ranks * rows, *t.shape[1:])
        all_gather_tensor(out, padded, self.group)
        return out


@dataclass
class _Handle:
    num_tokens: int
    rows: int


class AllGatherPrepareFinalize(PrepareFinalize):
    def __init__(self, manager: AllGatherManager, cfg: DispatchConfig):
        self.manager, self.cfg = manager, cfg
        self.stats = DispatchStats()
        self._handle: _Handle | None = None

    def num_dispatchers(self) -> int:
        return self.manager.num_ranks

    def reset_call_state(self) -> None:
        self._handle = None

    def prepare_async(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, quant: QuantSpec) -> AsyncResult:
        check_prepare_inputs(hidden_states, topk_weights, topk_ids)
        if quant.quantized_on_wire:
            raise ValueError(f"example_allgather sends unquantized activations, got quant "
                             f"{quant.scheme.value}; use QuantScheme.NONE or defer_input_quant")
        m, n = self.manager, hidden_states.shape[0]
        count = torch.tensor([n])
        counts = torch.empty(m.num_ranks, dtype=count.dtype)
        all_gather_tensor(counts, count, m.group)
        rows = int(counts.max())
        x = m.gather(hidden_states, rows)
        ids = m.gather(topk_ids.long() + 1, rows) - 1  # padding rows become id -1: no expert
        w = m.gather(topk_weights.float(), rows)
        local = local_expert_ids(ids, m.placement, m.rank)
        self._handle = _Handle(n, rows)
        self.stats.calls += 1
        self.stats.pairs += topk_ids.numel()
        self.stats.rows += rows
        self.stats.act_bytes += tensor_bytes(hidden_states[:1]) * rows
        result = PrepareResult(x, None, None, local, w)
        return AsyncResult(None, lambda: result)

    def finalize_async(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget) -> AsyncResult:
        h = self._handle
        if h is None:
            raise RuntimeError("finalize called without a matching prepare")
        mine = fused_expert_output.new_empty(h.rows, fused_expert_output.shape[1])
        reduce_scatter_tensor(mine, fused_expert_output, self.manager.group)
        self.stats.combine_bytes += tensor_bytes(fused_expert_output)
        self._handle = None

        def receiver() -> torch.Tensor:
            return write_output(output, mine[: h.num_tokens])

        return AsyncResult(None, receiver)


SPEC = BackendSpec(
    name="example_allgather",
    prepare_finalize=AllGatherPrepareFinalize,
    manager=AllGatherManager,
    capabilities=Capabilities(ep_dp=True, dp=True, tp=False, sp=False, row_scatter=True,
                              placements=True),
    quants=frozenset({QuantScheme.NONE}),
    description="example third-party backend: all-gather dispatch, reduce-scatter combine",
    use_for="an example to copy: the shortest backend that keeps the contract",
)
