"""The reduction strategy to recommend for a layout and model, from the decoder-layer TP bytes and
the shared experts' memory (what the vLLM glue and :func:`moe_plugins.planner.plan.plan_layer`
call)."""
from __future__ import annotations

from typing import Optional, Sequence

from moe_plugins.layout import ParallelLayout
from moe_plugins.planner.decoder import decoder_tp_collectives, weight_bytes
from moe_plugins.planner.link_model import LinkModel
from moe_plugins.planner.model_config import ModelSpec
from moe_plugins.planner.traffic import tokens_per_dp
from moe_plugins.config import MoEConfig
from moe_plugins.strategy import (ReductionStrategy, SharedPlacement, StrategyChoice,
                                  applicable_strategies, choose_strategy)

__all__ = ["recommend_strategy"]


def _gib(num_bytes: float) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    return f"{num_bytes / 2**20:.2f} MiB"


def recommend_strategy(layout: ParallelLayout, model: ModelSpec | MoEConfig, *, supports_sp: bool,
                       supports_row_scatter: bool, num_tokens: int | Sequence[int] = 256,
                       shared_expert_budget_bytes: Optional[int] = None,
                       single_collective: bool = True) -> StrategyChoice:
    """The strategy to run ``model`` with on ``layout``, from the decoder-layer cost model.

    Where SP applies (EP on, tp > 1, dp > 1, a backend with SP) it is weighed against the
    strategy a TP-sharded shared expert gets (:func:`moe_plugins.strategy.choose_strategy`:
    ROW_SCATTER_ALLREDUCE, or GATHER_PLUS_ALLREDUCE with the single collective off). Per
    decoder layer SP moves one all_reduce's worth of bytes (reduce_scatter + all_gather) and
    ROW_SCATTER two (the attention's all_reduce and its own), but SP replicates the shared
    expert on every TP rank. So SP is recommended when it moves no more TP bytes per decoder
    layer (for ``num_tokens`` tokens per DP group; the busiest group counts) and the replicated
    shared experts of all MoE layers fit ``shared_expert_budget_bytes`` per rank (None: no
    limit); else the TP-sharded alternative. Without SP the choice is ``choose_strategy``'s.

    The vLLM glue calls this with the model's dims; the returned reason names the numbers.
    """
    spec = model if isinstance(model, ModelSpec) else ModelSpec(model)
    cfg = spec.moe
    if shared_expert_budget_bytes is not None and (
            isinstance(shared_expert_budget_bytes, bool)
            or not isinstance(shared_expert_budget_bytes, int)):
        raise TypeError(f"shared_expert_budget_bytes must be an int (bytes) or None, got "
                        f"{shared_expert_budget_bytes!r} "
                        f"({type(shared_expert_budget_bytes).__name__}); pass int(gib * 2**30)")
    if shared_expert_budget_bytes is not None and shared_expert_budget_bytes < 0:
        raise ValueError(f"shared_expert_budget_bytes must be >= 0 or None, got "
                         f"{shared_expert_budget_bytes}")
    kw = dict(supports_sp=supports_sp, supports_row_scatter=supports_row_scatter,
              has_shared_expert=cfg.has_shared_expert)
    sharded = choose_strategy(layout, **kw, single_collective=single_collective,
                              shared_placement=SharedPlacement.TP_SHARDED)
    if ReductionStrategy.SP_ALLGATHER not in applicable_strategies(layout, **kw) \
            or sharded.strategy is ReductionStrategy.SP_ALLGATHER:
        return sharded
    tokens = max(tokens_per_dp(num_tokens, layout.dp))
    sp = ReductionStrategy.SP_ALLGATHER
    alt = sharded.strategy
    colls = {s: decoder_tp_collectives(s, cfg, tokens, layout.tp, spec.sp_attention)
             for s in (sp, alt)}
    wire = {s: sum(LinkModel.ring_wire_bytes(kind, b, layout.tp) for kind, b in colls[s])
            for s in (sp, alt)}
    launches = {s: len(colls[s]) for s in (sp, alt)}
    layers = spec.num_moe_layers
    replicated = weight_bytes(cfg, layout, SharedPlacement.REPLICATED)[0] * layers
    tp_sharded = weight_bytes(cfg, layout, SharedPlacement.TP_SHARDED)[0] * layers
    cost = (f"per decoder layer and TP rank at {tokens} tokens/DP group: {sp.value} sends "
            f"{wire[sp]} B in {launches[sp]} TP collectives, {alt.value} {wire[alt]} B in "
            f"{launches[alt]}; shared experts of {layers} MoE layer{'s' if layers != 1 else ''} "
            f"take {_gib(replicated)} per rank replicated, {_gib(tp_sharded)} TP-sharded")
    if shared_expert_budget_bytes is not None and replicated > shared_expert_budget_bytes:
        return StrategyChoice(alt, f"replicated shared experts ({_gib(replicated)} per rank) "
                              f"exceed the budget of {_gib(shared_expert_budget_bytes)}; {cost}")
    if wire[sp] > wire[alt]:
        return StrategyChoice(alt, f"{alt.value} moves fewer TP bytes; {cost}")
    budget = ("no shared-expert memory budget given" if shared_expert_budget_bytes is None
              else f"within the budget of {_gib(shared_expert_budget_bytes)}")
    return StrategyChoice(sp, f"SP moves fewer TP bytes per decoder layer and the replicated "
                          f"shared experts fit ({budget}); {cost}")
