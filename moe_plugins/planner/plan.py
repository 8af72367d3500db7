"""Analytic cost model of one decoder layer's communication (the attention's TP reduction and
the MoE block) under every applicable reduction strategy.

For a model shape, a parallel layout, the tokens of each DP group, a backend and a dispatch
quant scheme, :func:`plan_layer` gives per EP rank and per decoder layer: the tokens handed to
prepare and the (token, expert) pairs dispatched, the rows on the wire and the bytes sent and
received in dispatch (activations, ``x_sf`` and routing metadata separately) and combine, the TP
collectives with their bytes, the shared-expert and routed-expert weight bytes a rank holds, and a
communication time on a :class:`moe_plugins.planner.link_model.LinkModel` (the all-to-alls by
:mod:`moe_plugins.planner.transport_time`, for the backend's transport; the TP collectives as
rings). The recommended strategy is the one
:func:`moe_plugins.planner.recommend.recommend_strategy` picks from the decoder-layer numbers and
a shared-expert memory budget; the *default* is the one
:func:`moe_plugins.strategy.choose_strategy` picks (what a
:class:`moe_plugins.runner.layer.MoELayer` uses when it is not told).

Counted per decoder layer, not per MoE block (docs/design.md, "Reduction strategies"): every TP
rank also runs the attention's reduction. Without SP it is one all_reduce of [num_tokens,
hidden]; under SP (SP_ALLGATHER) the attention ends with a reduce_scatter to the owned chunk and
the MoE block with an all_gather of it. ``RankPlan.tp_collectives`` are the MoE block's (what
``moe-plugins demo`` measures); ``RankPlan.decoder_collectives`` add the attention's.

Low-latency backends (deepep_ll, nixl_ep) send what their kernels send
(``BackendSpec.wire_layout``): rows padded up to the kernel hidden size and a 16-byte header per
(token, expert) message; the plan refuses a layer those backends refuse, with their own error.

What is exact and what is not (tests hold every exact quantity to what the reference backend and
torch.distributed counted on a real multi-rank run):

- exact: tokens and pairs per rank (owned rows x num_topk, with the ownership of
  :func:`moe_plugins.layout.owned_rows`), the TP collectives and their bytes, weight bytes, and
  every per-row byte count.
- routing-dependent: a STANDARD-format backend sends a token ONCE to each rank holding one of its
  experts, so its rows (and the bytes of those rows) depend on where the router sends tokens.
  Without routing the plan gives exact bounds (``min``/``max``) and the expected value under
  uniform routing (a token's num_topk distinct experts drawn uniformly from num_experts, spread
  evenly over the ranks). Pass the measured routing (:class:`Routing`) and every quantity is exact.
  A BATCHED-format (per-expert, DeepEP-LL-style) backend sends one row per pair: its sent rows are
  exact without routing. DeepEP's normal mode (``deepep_ht``) is STANDARD: one row per (token,
  destination rank). ``deepep_auto`` (``BackendSpec.call_modes``) is planned as the mode a layer
  of it built with the plan's link takes for the busiest rank's rows: low-latency (per pair) up
  to the time model's crossover, at most the capacity of ``CallModes.capacity`` rows per rank,
  normal mode above (:func:`moe_plugins.planner.crossover.low_latency_threshold`).

Experts are placed by an :class:`moe_plugins.placement.ExpertPlacement` (linear by default:
expert ``e`` on EP rank ``e // (num_experts // num_ranks)``); its slots per rank, redundant
copies included, set the routed weight memory.
"""
from __future__ import annotations

from typing import Optional, Sequence

from moe_plugins.config import MoEConfig
from moe_plugins.layout import ParallelLayout, owned_rows
from moe_plugins.placement import ExpertPlacement
from moe_plugins.planner.all_to_all import (AllToAllPlan, check_backend, check_dispatch,
                                            plan_all_to_all)
from moe_plugins.planner.crossover import low_latency_threshold
from moe_plugins.planner.decoder import attention_collectives, moe_tp_collectives, weight_bytes
from moe_plugins.planner.link_model import LinkModel
from moe_plugins.planner.model_config import ModelSpec
from moe_plugins.planner.recommend import recommend_strategy
from moe_plugins.planner.results import (CollectivePlan, LayerPlan, RankPlan, StrategyPlan,
                                         TimeEstimate)
from moe_plugins.planner.traffic import (Estimate, Routing, WireFormat, itemsize, tokens_per_dp,
                                         wire_format)
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import BackendSpec, WireLayout
from moe_plugins.strategy import SharedPlacement, applicable_strategies, choose_strategy

__all__ = ["plan_layer"]

_ZERO = Estimate.exact(0)


def plan_layer(model: ModelSpec | MoEConfig, layout: ParallelLayout,
               num_tokens: int | Sequence[int], backend: BackendSpec,
               quant: QuantSpec = QuantSpec(), *, link: LinkModel = LinkModel(),
               routing: Optional[Routing] = None,
               shared_placement: SharedPlacement = SharedPlacement.TP_SHARDED,
               single_collective: bool = True, shared_expert_budget_bytes: Optional[int] = None,
               backend_options: object = None, placement: Optional[ExpertPlacement] = None
               ) -> LayerPlan:
    """Plan one decoder layer (attention reduction + MoE block) under every strategy that applies
    to ``layout`` and ``backend``.

    num_tokens: tokens of each DP group (one count for all, or one per DP group).
    routing: the measured routing of the dispatching strategies (each EP rank's owned rows; all
        dispatching strategies slice the same rows); makes every routing-dependent count exact.
    shared_placement, single_collective: as in :func:`moe_plugins.strategy.choose_strategy`,
        which picks the default strategy.
    shared_expert_budget_bytes: per-rank memory the shared experts of all MoE layers may take;
        with the decoder-layer numbers, :func:`recommend_strategy` picks the recommended one.
    backend_options: the backend's options (``DispatchConfig.backend_options``), for the checks
        and wire layout a backend derives from them (e.g. low-latency ``pad_hidden``).
    placement: the expert placement (EP on; None: linear). Its slots per rank set the routed
        weight memory and the backend must be placement-aware (``Capabilities.placements``);
        the uniform-routing traffic estimate assumes each rank holds ``num_experts / ep_size``
        distinct experts (exact for linear and round-robin); with redundant copies give the
        measured ``routing`` (PHYSICAL ids, :meth:`Routing.from_topk_ids` with the placement).

    Raises ValueError naming what is wrong; a layer the backend itself refuses (dtype, hidden or
    top-k outside its kernels' limits) raises the backend's own error."""
    spec = model if isinstance(model, ModelSpec) else ModelSpec(model)
    cfg, caps = spec.moe, backend.capabilities
    tokens = tokens_per_dp(num_tokens, layout.dp)
    options = applicable_strategies(layout, supports_sp=caps.sp, supports_row_scatter=caps.row_scatter,
                                    has_shared_expert=cfg.has_shared_expert)
    # As MoELayer builds a backend: EP on and a dispatching strategy (one rank sends to itself).
    dispatching = [s for s in options if s.dispatches and layout.ep]
    rows = [owned_rows(tokens[layout.dp_rank(r)], layout.tp, layout.tp_rank(r))
            for r in range(layout.world_size)]
    owned = [o.num_owned for o in rows]
    traffic = _layer_traffic(cfg, layout, owned, backend, quant, link, routing, backend_options,
                             placement, bool(dispatching))
    transport = traffic.transport if traffic is not None else backend.transport
    disp, comb = traffic.times() if traffic is not None else (0.0, 0.0)
    wire = traffic.wire if traffic is not None else wire_format(
        caps.activation_format, cfg, quant, WireLayout(cfg.hidden))
    item = itemsize(cfg.dtype)

    default = choose_strategy(layout, supports_sp=caps.sp, supports_row_scatter=caps.row_scatter,
                              has_shared_expert=cfg.has_shared_expert,
                              single_collective=single_collective, shared_placement=shared_placement)
    choice = recommend_strategy(layout, spec, supports_sp=caps.sp,
                                supports_row_scatter=caps.row_scatter, num_tokens=tokens,
                                shared_expert_budget_bytes=shared_expert_budget_bytes,
                                single_collective=single_collective)

    plans = []
    for strategy in options:
        dispatches = strategy in dispatching
        shared_b, routed_b = weight_bytes(cfg, layout, strategy.shared_placement,
                                           placement if layout.ep else None)
        ranks, tp_time, attn_time = [], 0.0, 0.0
        for r in range(layout.world_size):
            colls = _tp_collectives(moe_tp_collectives(strategy, cfg, rows[r].num_tokens,
                                                       rows[r].chunk), layout, r, cfg.hidden,
                                    item, link)
            attn = _tp_collectives(attention_collectives(strategy, rows[r].num_tokens,
                                                         rows[r].chunk, spec.sp_attention),
                                   layout, r, cfg.hidden, item, link)
            tp_time = max(tp_time, sum(c.time_us for c in colls))
            attn_time = max(attn_time, sum(c.time_us for c in attn))
            ranks.append(_rank_plan(layout, r, rows[r].num_tokens, owned[r], cfg.num_topk,
                                    traffic if dispatches else None, wire, colls, attn,
                                    shared_b, routed_b))
        recommended = strategy is choice.strategy
        times = TimeEstimate(*((disp, comb) if dispatches else (0.0, 0.0)), tp_time, attn_time)
        plans.append(StrategyPlan(strategy, recommended, choice.reason if recommended else "",
                                  dispatches, tuple(ranks), times,
                                  default=strategy is default.strategy))
    plans = [_with_comparison(p, plans) for p in plans]
    return LayerPlan(spec, layout, tokens, backend.name, quant, link, wire, routing is not None,
                     tuple(plans), placement if layout.ep else None, transport)


def _layer_traffic(cfg: MoEConfig, layout: ParallelLayout, owned: list[int], backend: BackendSpec,
                   quant: QuantSpec, link: LinkModel, routing: Optional[Routing],
                   backend_options: object, placement: Optional[ExpertPlacement],
                   dispatching: bool) -> Optional[AllToAllPlan]:
    """The all-to-alls of a layer whose strategies dispatch (every dispatching strategy sends
    the same rows), else None after checking the backend takes the layer."""
    if dispatching:
        return _all_to_all(cfg, layout, owned, max(1, *owned), backend, quant, link, routing,
                           backend_options, placement)
    check_backend(backend, layout, quant, cfg, False, placement)
    if layout.ep and cfg.num_experts % layout.ep_size:
        raise ValueError(f"num_experts={cfg.num_experts} is not divisible by the EP size "
                         f"{layout.ep_size}; pick an EP size that divides the experts")
    return None


def _tp_collectives(kinds: list[tuple[str, int]], layout: ParallelLayout, rank: int, hidden: int,
                    item: int, link: LinkModel) -> tuple[CollectivePlan, ...]:
    """The TP collectives ``kinds`` ((kind, rows) each) of ``rank``'s TP group: bytes, wire
    bytes, link and time."""
    group = layout.tp_group_ranks(layout.dp_rank(rank))
    out = []
    for kind, n_rows in kinds:
        b = n_rows * (layout.tp if kind == "reduce_scatter" else 1) * hidden * item
        out.append(CollectivePlan(kind, b, link.ring_wire_bytes(kind, b, layout.tp),
                                  link.link(group), link.collective_us(kind, b, group)))
    return tuple(out)


def _rank_plan(layout: ParallelLayout, rank: int, num_tokens: int, owned: int, num_topk: int,
               traffic: Optional[AllToAllPlan], wire: WireFormat,
               colls: tuple[CollectivePlan, ...], attn: tuple[CollectivePlan, ...],
               shared_b: int, routed_b: int) -> RankPlan:
    """One rank's row of a strategy: what it sends and receives (``traffic`` None: a strategy
    that does not dispatch), its TP collectives and its weights."""
    dispatches = traffic is not None
    s_rows = traffic.sent[rank] if traffic is not None else _ZERO
    r_rows = traffic.recv[rank] if traffic is not None else _ZERO
    return RankPlan(
        rank=rank, dp_rank=layout.dp_rank(rank), tp_rank=layout.tp_rank(rank),
        num_tokens=num_tokens, owned=owned if dispatches else 0,
        pairs=owned * num_topk if dispatches else 0,
        rows=s_rows, act_bytes=s_rows.scaled(wire.act_bytes),
        sf_bytes=s_rows.scaled(wire.sf_bytes), meta_bytes=s_rows.scaled(wire.meta_bytes),
        combine_bytes=r_rows.scaled(wire.combine_bytes),
        recv_pairs=traffic.recv_pairs[rank] if traffic is not None else _ZERO,
        recv_rows=r_rows,
        recv_act_bytes=r_rows.scaled(wire.act_bytes),
        recv_sf_bytes=r_rows.scaled(wire.sf_bytes),
        recv_meta_bytes=r_rows.scaled(wire.meta_bytes),
        recv_combine_bytes=s_rows.scaled(wire.combine_bytes),
        tp_collectives=colls, shared_weight_bytes=shared_b,
        expert_weight_bytes=routed_b, attention_collectives=attn)


def _all_to_all(cfg: MoEConfig, layout: ParallelLayout, owned: list[int], max_tokens: int,
                backend: BackendSpec, quant: QuantSpec, link: LinkModel,
                routing: Optional[Routing], backend_options: object,
                placement: Optional[ExpertPlacement]) -> AllToAllPlan:
    """The layer's all-to-alls on ``backend``; a per-call backend (``BackendSpec.call_modes``)
    in the mode a layer of it built with ``link`` takes for the busiest rank's rows (its
    threshold: :func:`moe_plugins.planner.crossover.low_latency_threshold`, with the
    capacity the plan assumes), after both modes' own checks (its low-latency buffers hold
    that capacity)."""
    modes = backend.call_modes
    if modes is None:
        return plan_all_to_all(cfg, layout, owned, backend, quant, link, max_tokens=max_tokens,
                               routing=routing, backend_options=backend_options,
                               placement=placement)
    check_backend(backend, layout, quant, cfg, True, placement)
    # building the layer builds both modes
    sizes = ((modes.low_latency, modes.capacity), (modes.normal, max_tokens))
    for half, size in sizes:
        try:
            check_dispatch(cfg, layout, half, quant, size, backend_options, placement)
        except ValueError as e:
            raise ValueError(f"backend {backend.name!r}: its mode as {half.name!r}"
                             + (f" with {size} tokens per rank (the capacity the plan assumes)"
                                if half is modes.low_latency else "") + f": {e}") from None
    threshold = low_latency_threshold(cfg, layout.ep_size, quant, link, modes, modes.capacity)
    half, size = sizes[0] if max(owned) <= threshold.rows else sizes[1]
    return plan_all_to_all(cfg, layout, owned, half, quant, link, max_tokens=size,
                           routing=routing, backend_options=backend_options, placement=placement)


def _with_comparison(p: StrategyPlan, plans: list[StrategyPlan]) -> StrategyPlan:
    """The recommended strategy's reason gets the modelled cost; every other one says how it
    differs from the recommended."""
    rec = next(q for q in plans if q.recommended)
    n = p.num_decoder_tp_collectives
    colls = f"{n} TP collective{'s' if n != 1 else ''} per decoder layer"
    if p.recommended:
        fastest = min(plans, key=lambda q: q.time.total_us)
        note = ""
        if fastest.time.total_us < p.time.total_us:
            note = (f"; the link model puts {fastest.strategy.value} "
                    f"{p.time.total_us - fastest.time.total_us:.1f} us/layer faster (compute and "
                    "overlap are not modelled)")
        reason = f"{p.reason}; {colls}, est. {p.time.total_us:.1f} us/layer communication{note}"
    else:
        dt = p.time.total_us - rec.time.total_us
        dw = p.ranks[0].shared_weight_bytes - rec.ranks[0].shared_weight_bytes
        reason = (f"{colls}; {dt:+.1f} us/layer and {dw / 2**20:+.2f} MiB shared-expert weights "
                  f"per rank per MoE layer vs {rec.strategy.value}")
    return StrategyPlan(p.strategy, p.recommended, reason, p.dispatches, p.ranks, p.time,
                        p.default)
