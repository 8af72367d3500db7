"""What one decoder layer issues and holds on each TP rank besides the all-to-alls: its TP
collectives (the attention's reduction, then the MoE block's, as docs/design.md "Reduction
strategies" counts them) and the shared- and routed-expert weight bytes."""
from __future__ import annotations

from typing import Optional

from moe_plugins.layout import ParallelLayout, owned_rows
from moe_plugins.placement import ExpertPlacement
from moe_plugins.planner.traffic import itemsize
from moe_plugins.config import MoEConfig
from moe_plugins.strategy import ReductionStrategy, SharedPlacement

__all__ = ["weight_bytes", "moe_tp_collectives", "attention_collectives", "decoder_tp_collectives"]


def _shard(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what} {size} is not divisible by tp={parts}; pick a tp that divides it")
    return size // parts


def weight_bytes(cfg: MoEConfig, layout: ParallelLayout, placement: SharedPlacement,
                  experts: Optional[ExpertPlacement] = None) -> tuple[int, int]:
    """(shared-expert bytes, routed-expert bytes) one rank holds: SwiGLU w13 [2I, H] + w2 [H, I]
    per expert (EP: the ``experts`` placement's slots per rank, redundant copies included),
    plus the shared expert's gate [1, H] when it has one."""
    item, h = itemsize(cfg.dtype), cfg.hidden
    shared = 0
    if cfg.has_shared_expert:
        s = (_shard(cfg.shared_intermediate, layout.tp, "shared expert intermediate size")
             if placement is SharedPlacement.TP_SHARDED else cfg.shared_intermediate)
        shared = (3 * s * h + (h if cfg.shared_gate else 0)) * item
    if layout.ep:
        per = experts.num_local if experts is not None else cfg.num_experts // layout.ep_size
        routed = per * 3 * cfg.intermediate * h * item
    else:
        routed = cfg.num_experts * 3 * _shard(cfg.intermediate, layout.tp,
                                              "routed expert intermediate size") * h * item
    return shared, routed


def moe_tp_collectives(strategy: ReductionStrategy, cfg: MoEConfig, num_tokens: int, chunk: int
                       ) -> list[tuple[str, int]]:
    """(kind, rows of [rows, hidden]) of each TP collective the layer issues, in order."""
    if strategy is ReductionStrategy.LOCAL:
        return []
    if strategy in (ReductionStrategy.TP_UNIFIED, ReductionStrategy.ROW_SCATTER_ALLREDUCE):
        return [("all_reduce", num_tokens)]
    if strategy is ReductionStrategy.SP_ALLGATHER:
        return [("all_gather", chunk)]
    # GATHER_PLUS_ALLREDUCE: the routed rows (padded chunk), then the shared partials.
    return [("all_gather", chunk)] + ([("all_reduce", num_tokens)] if cfg.has_shared_expert else [])


def attention_collectives(strategy: ReductionStrategy, num_tokens: int, chunk: int,
                           sp_attention: str) -> list[tuple[str, int]]:
    """(kind, rows of [rows, hidden]) of the attention's TP reduction: none at tp == 1; under SP
    with ``sp_attention == 'reduce_scatter'`` a reduce_scatter of the padded [chunk * tp,
    hidden] to the owned chunk (rows given as chunk, scaled by tp where bytes are counted; the
    MoE block then ends with the all_gather); else one all_reduce of [num_tokens, hidden]."""
    if strategy is ReductionStrategy.LOCAL:
        return []
    if strategy is ReductionStrategy.SP_ALLGATHER and sp_attention == "reduce_scatter":
        return [("reduce_scatter", chunk)]
    return [("all_reduce", num_tokens)]


def decoder_tp_collectives(strategy: ReductionStrategy, cfg: MoEConfig, num_tokens: int, tp: int,
                           sp_attention: str = "reduce_scatter") -> list[tuple[str, int]]:
    """(kind, bytes this rank contributes) of every TP collective of one decoder layer under
    ``strategy`` for a DP group of ``num_tokens`` tokens: the attention's reduction, then the
    MoE block's. A reduce_scatter contributes its whole (padded) input, an all_gather the owned
    chunk, an all_reduce the whole tensor. ``sp_attention``: see
    :data:`moe_plugins.planner.model_config.SP_ATTENTION_REDUCTIONS`."""
    rows = owned_rows(num_tokens, tp, 0)
    row_bytes = cfg.hidden * itemsize(cfg.dtype)
    out = []
    for kind, n in attention_collectives(strategy, rows.num_tokens, rows.chunk, sp_attention):
        out.append((kind, n * (tp if kind == "reduce_scatter" else 1) * row_bytes))
    out += [(kind, n * row_bytes) for kind, n in moe_tp_collectives(strategy, cfg,
                                                                    rows.num_tokens, rows.chunk)]
    return out
