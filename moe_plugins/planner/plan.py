"""Analytic cost model of one decoder layer's communication (the attention's TP reduction and
the MoE block) under every applicable reduction strategy.

For a model shape, a parallel layout, the tokens of each DP group, a backend and a dispatch
quant scheme, :func:`plan_layer` gives per EP rank and per decoder layer: the tokens handed to
prepare and the (token, expert) pairs dispatched, the rows on the wire and the bytes sent and
received in dispatch (activations, ``x_sf`` and routing metadata separately) and combine, the TP
collectives with their bytes, the shared-expert and routed-expert weight bytes a rank holds, and a
communication time from :class:`moe_plugins.planner.link_model.LinkModel`. The recommended strategy is
the one :func:`recommend_strategy` picks from the decoder-layer numbers and a shared-expert memory budget;
the *default* is the one :func:`moe_plugins.strategy.choose_strategy` picks (what a
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
  destination rank). ``deepep_auto`` is planned in the mode it takes for the busiest rank's rows
  (``BackendSpec.wire_format_for``: low-latency, per pair, up to its default capacity).

Experts are placed by an :class:`moe_plugins.placement.ExpertPlacement` (linear by default:
expert ``e`` on EP rank ``e // (num_experts // num_ranks)``); its slots per rank, redundant
copies included, set the routed weight memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

import torch

from moe_plugins.config import DispatchConfig
from moe_plugins.interface import ActivationFormat
from moe_plugins.layout import ParallelLayout, owned_rows
from moe_plugins.planner.link_model import LinkModel
from moe_plugins.runner.model import MoEConfig
from moe_plugins.planner.model_config import ModelSpec
from moe_plugins.placement import ExpertPlacement
from moe_plugins.quant import FP8_BLOCK, NVFP4_BLOCK, QuantScheme, QuantSpec
from moe_plugins.registry import BackendSpec, WireLayout, refusal_reason
from moe_plugins.strategy import (ReductionStrategy, SharedPlacement, StrategyChoice,
                                  applicable_strategies, choose_strategy)

__all__ = ["Estimate", "WireFormat", "wire_format", "Routing", "CollectivePlan", "RankPlan",
           "TimeEstimate", "StrategyPlan", "LayerPlan", "plan_layer", "recommend_strategy",
           "decoder_tp_collectives", "expected_ranks_hit", "ranks_hit_bounds"]


# --------------------------------------------------------------------------------------------
# Quantities that may be known only within bounds
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    """A count known exactly (``min == max == expected``) or within exact bounds ``[min, max]``
    with ``expected`` its mean under uniform routing."""

    min: int
    max: int
    expected: float

    @classmethod
    def exact(cls, value: int) -> "Estimate":
        return cls(value, value, float(value))

    @property
    def is_exact(self) -> bool:
        return self.min == self.max

    def contains(self, value: float) -> bool:
        return self.min <= value <= self.max

    def scaled(self, k: int) -> "Estimate":
        return Estimate(self.min * k, self.max * k, self.expected * k)

    def __add__(self, other: "Estimate") -> "Estimate":
        return Estimate(self.min + other.min, self.max + other.max, self.expected + other.expected)

    def as_dict(self) -> dict[str, float]:
        return {"min": self.min, "max": self.max, "expected": self.expected}


_ZERO = Estimate.exact(0)


def expected_ranks_hit(num_experts: int, num_topk: int, num_ranks: int) -> Fraction:
    """Expected number of ranks a token's ``num_topk`` distinct experts (uniform over all
    ``num_experts``, placed evenly on ``num_ranks`` ranks) touch: ``R * (1 - C(E - E/R, K) /
    C(E, K))`` (a rank is missed when all K experts fall among the other ranks' experts)."""
    per = num_experts // num_ranks
    miss = Fraction(math.comb(num_experts - per, num_topk), math.comb(num_experts, num_topk))
    return num_ranks * (1 - miss)


def ranks_hit_bounds(num_experts: int, num_topk: int, num_ranks: int) -> tuple[int, int]:
    """(fewest, most) ranks one token's ``num_topk`` distinct experts can touch."""
    per = num_experts // num_ranks
    return -(-num_topk // per), min(num_topk, num_ranks)


# --------------------------------------------------------------------------------------------
# What one dispatched row carries
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WireFormat:
    """Bytes of one dispatched row and how rows are formed.

    per_pair: one row per (token, expert) pair (BATCHED format, DeepEP-LL style); else one row
        per (token, destination rank).
    wire_hidden: columns a row carries (the backend's kernel size, e.g. 2048 for a layer of
        hidden 256 on a low-latency backend; else the layer's hidden).
    act_bytes: activations of a row on the wire (model dtype, fp8 e4m3: wire_hidden bytes,
        nvfp4: wire_hidden / 2 bytes).
    sf_bytes: its ``x_sf`` (fp8 block-128: float32 per 128 values; nvfp4: e4m3 per 16 values,
        unswizzled on the wire); 0 when ``x_sf is None`` (unquantized or deferred quant).
    meta_bytes: routing metadata of a row (STANDARD: the token's num_topk ids, int64 or the
        backend's width, and float32 weights, which a STANDARD prepare hands the experts) plus
        the per-message header (low-latency kernels: 16 bytes, the source token index).
    combine_bytes: one combined row sent back (model dtype, wire_hidden columns).
    """

    per_pair: bool
    act_bytes: int
    sf_bytes: int
    meta_bytes: int
    combine_bytes: int
    wire_hidden: int = 0


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def wire_format(activation_format: ActivationFormat, cfg: MoEConfig, quant: QuantSpec,
                wire: Optional[WireLayout] = None) -> WireFormat:
    """The :class:`WireFormat` of a backend with ``activation_format`` for this layer and quant;
    ``wire``: the backend's :class:`moe_plugins.registry.WireLayout` (default: the layer's
    hidden, no header)."""
    quant.check_hidden(cfg.hidden)
    wire = wire if wire is not None else WireLayout(cfg.hidden)
    h, model_bytes = wire.hidden, _itemsize(cfg.dtype)
    if not quant.quantized_on_wire:
        act, sf = h * model_bytes, 0
    elif quant.scheme is QuantScheme.FP8_BLOCK128:
        act, sf = h, (h // FP8_BLOCK) * 4
    else:
        act, sf = h // 2, h // NVFP4_BLOCK
    per_pair = activation_format is ActivationFormat.BATCHED
    meta = (0 if per_pair else cfg.num_topk * (wire.topk_id_bytes + 4)) + wire.header_bytes
    return WireFormat(per_pair, act, sf, meta, h * model_bytes, h)


# --------------------------------------------------------------------------------------------
# Measured routing
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routing:
    """Where each EP rank's owned tokens went: build it with :meth:`from_topk_ids`, or directly
    from counts measured elsewhere.

    owned[s]: tokens rank s handed to prepare. tokens[s][d]: of those, how many have at least one
    expert on rank d (rows a once-per-rank backend sends). pairs[s][d]: (token, expert) pairs of
    rank s whose expert lives on rank d.
    """

    owned: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    pairs: tuple[tuple[int, ...], ...]

    @classmethod
    def from_topk_ids(cls, topk_ids: Sequence[torch.Tensor], num_experts: int,
                      placement: Optional[ExpertPlacement] = None) -> "Routing":
        """topk_ids[s]: int [num_owned_s, num_topk], PHYSICAL expert ids of the rows EP rank s
        handed to prepare (``len(topk_ids)`` is the EP size); ``placement``: where they are
        (None: linear over ``num_experts``)."""
        n = len(topk_ids)
        if placement is None:
            if n < 1 or num_experts % n:
                raise ValueError(f"routing of {n} ranks for {num_experts} experts: the EP size "
                                 "must divide the experts")
            placement = ExpertPlacement.linear(num_experts, n)
        if placement.num_ranks != n:
            raise ValueError(f"routing of {n} ranks under a placement over {placement.num_ranks}")
        num_experts, per = placement.num_physical, placement.num_local
        tokens, pairs = [], []
        for s, ids in enumerate(topk_ids):
            if ids.dim() != 2:
                raise ValueError(f"topk_ids of rank {s} has shape {tuple(ids.shape)}, expected "
                                 "[num_owned, num_topk]")
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
                raise ValueError(f"topk_ids of rank {s} hold ids in [{int(ids.min())}, "
                                 f"{int(ids.max())}], expected PHYSICAL expert ids in "
                                 f"[0, {num_experts})")
            dest = ids.long() // per
            hit = torch.zeros(ids.shape[0], n, dtype=torch.bool)
            hit[torch.arange(ids.shape[0]).unsqueeze(1).expand_as(dest), dest] = True
            tokens.append(tuple(int(v) for v in hit.sum(dim=0)))
            pairs.append(tuple(int(v) for v in torch.bincount(dest.flatten(), minlength=n)))
        return cls(tuple(int(t.shape[0]) for t in topk_ids), tuple(tokens), tuple(pairs))


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CollectivePlan:
    """One TP collective per layer: ``bytes`` is the tensor this rank contributes (what the layer's
    CollectiveLog records), ``wire_bytes`` what it sends under a ring algorithm."""

    kind: str
    bytes: int
    wire_bytes: int
    link: str
    time_us: float


@dataclass(frozen=True)
class RankPlan:
    """One EP rank, one MoE layer. Sent quantities are named as in
    :class:`moe_plugins.counters.DispatchStats`; ``recv_*`` are what this rank receives."""

    rank: int
    dp_rank: int
    tp_rank: int
    num_tokens: int  # tokens of this rank's DP group
    owned: int  # tokens handed to prepare (0 when the strategy does not dispatch)
    pairs: int
    rows: Estimate
    act_bytes: Estimate
    sf_bytes: Estimate
    meta_bytes: Estimate
    combine_bytes: Estimate
    recv_pairs: Estimate
    recv_rows: Estimate
    recv_act_bytes: Estimate
    recv_sf_bytes: Estimate
    recv_meta_bytes: Estimate
    recv_combine_bytes: Estimate
    tp_collectives: tuple[CollectivePlan, ...]  # the MoE block's
    shared_weight_bytes: int
    expert_weight_bytes: int
    attention_collectives: tuple[CollectivePlan, ...] = ()  # the attention's reduction

    @property
    def decoder_collectives(self) -> tuple[CollectivePlan, ...]:
        """Every TP collective of one decoder layer, in order: attention's, then the MoE's."""
        return self.attention_collectives + self.tp_collectives

    @property
    def decoder_tp_bytes(self) -> int:
        return sum(c.bytes for c in self.decoder_collectives)

    @property
    def decoder_tp_wire_bytes(self) -> int:
        return sum(c.wire_bytes for c in self.decoder_collectives)

    @property
    def dispatch_bytes(self) -> Estimate:
        return self.act_bytes + self.sf_bytes + self.meta_bytes

    @property
    def recv_dispatch_bytes(self) -> Estimate:
        return self.recv_act_bytes + self.recv_sf_bytes + self.recv_meta_bytes

    @property
    def tp_collective_bytes(self) -> int:
        return sum(c.bytes for c in self.tp_collectives)


@dataclass(frozen=True)
class TimeEstimate:
    """Communication time of one decoder layer (us): dispatch and combine all-to-alls, the MoE
    block's TP collectives (``tp_us``) and the attention's reduction (``attention_us``).
    Expected routing, or the measured one when the plan was given it."""

    dispatch_us: float
    combine_us: float
    tp_us: float
    attention_us: float = 0.0

    @property
    def total_us(self) -> float:
        return self.dispatch_us + self.combine_us + self.tp_us + self.attention_us


@dataclass(frozen=True)
class StrategyPlan:
    """One strategy: ``recommended`` by :func:`recommend_strategy`; ``default``: what
    :func:`moe_plugins.strategy.choose_strategy` (a layer left to itself) picks."""

    strategy: ReductionStrategy
    recommended: bool
    reason: str
    dispatches: bool
    ranks: tuple[RankPlan, ...]
    time: TimeEstimate
    default: bool = False

    @property
    def num_tp_collectives(self) -> int:
        """TP collectives of the MoE block (``moe-plugins demo``'s ``tp_collectives``)."""
        return len(self.ranks[0].tp_collectives)

    @property
    def num_decoder_tp_collectives(self) -> int:
        """TP collectives (launches) of one decoder layer: attention's and the MoE block's."""
        return len(self.ranks[0].decoder_collectives)


@dataclass(frozen=True)
class LayerPlan:
    model: ModelSpec
    layout: ParallelLayout
    num_tokens: tuple[int, ...]  # per DP group
    backend: str
    quant: QuantSpec
    link: LinkModel
    wire: WireFormat
    routing_given: bool
    strategies: tuple[StrategyPlan, ...]
    placement: Optional[ExpertPlacement] = None  # EP on: where the experts are (None: linear)

    @property
    def recommended(self) -> StrategyPlan:
        return next(s for s in self.strategies if s.recommended)

    @property
    def default(self) -> StrategyPlan:
        return next(s for s in self.strategies if s.default)

    def strategy(self, strategy: ReductionStrategy) -> StrategyPlan:
        for s in self.strategies:
            if s.strategy is strategy:
                return s
        raise ValueError(f"strategy {strategy.value} does not apply to layout "
                         f"{self.layout.describe()} with backend {self.backend}; applicable: "
                         f"{[s.strategy.value for s in self.strategies]}")


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------
def _shard(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what} {size} is not divisible by tp={parts}; pick a tp that divides it")
    return size // parts


def _weight_bytes(cfg: MoEConfig, layout: ParallelLayout, placement: SharedPlacement,
                  experts: Optional[ExpertPlacement] = None) -> tuple[int, int]:
    """(shared-expert bytes, routed-expert bytes) one rank holds: SwiGLU w13 [2I, H] + w2 [H, I]
    per expert (EP: the ``experts`` placement's slots per rank, redundant copies included),
    plus the shared expert's gate [1, H] when it has one."""
    item, h = _itemsize(cfg.dtype), cfg.hidden
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


def _tp_collectives(strategy: ReductionStrategy, cfg: MoEConfig, num_tokens: int, chunk: int
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


def _attention_collectives(strategy: ReductionStrategy, num_tokens: int, chunk: int,
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
    row_bytes = cfg.hidden * _itemsize(cfg.dtype)
    out = []
    for kind, n in _attention_collectives(strategy, rows.num_tokens, rows.chunk, sp_attention):
        out.append((kind, n * (tp if kind == "reduce_scatter" else 1) * row_bytes))
    out += [(kind, n * row_bytes) for kind, n in _tp_collectives(strategy, cfg, rows.num_tokens,
                                                                 rows.chunk)]
    return out


def _bounded(owned: Sequence[int], lo: int, hi: int, mean: Fraction) -> Estimate:
    n = sum(owned)
    return Estimate(n * lo, n * hi, float(n * mean))


def _traffic(cfg: MoEConfig, num_ranks: int, owned: Sequence[int], wire: WireFormat,
             routing: Optional[Routing]) -> tuple[list[Estimate], list[Estimate], list[Estimate],
                                                   list[list[float]]]:
    """Per rank: sent rows, received rows, received pairs; and the [src][dst] rows matrix (exact
    with routing, else expected) for the link model."""
    e, k, r = cfg.num_experts, cfg.num_topk, num_ranks
    if routing is not None:
        mat = routing.pairs if wire.per_pair else routing.tokens
        sent = [Estimate.exact(sum(mat[s])) for s in range(r)]
        recv = [Estimate.exact(sum(mat[s][d] for s in range(r))) for d in range(r)]
        recv_pairs = [Estimate.exact(sum(routing.pairs[s][d] for s in range(r))) for d in range(r)]
        return sent, recv, recv_pairs, [[float(v) for v in row] for row in mat]
    per = e // r
    must = max(0, k - (e - per))  # experts of a token that must land on any given rank
    pair_lo, pair_hi, pair_mean = must, min(k, per), Fraction(k, r)
    recv_pairs = [_bounded(owned, pair_lo, pair_hi, pair_mean)] * r
    if wire.per_pair:
        sent = [Estimate.exact(n * k) for n in owned]
        recv, p_dest = recv_pairs, pair_mean
    else:
        lo, hi = ranks_hit_bounds(e, k, r)
        hit = expected_ranks_hit(e, k, r)
        sent = [_bounded([n], lo, hi, hit) for n in owned]
        recv = [_bounded(owned, 1 if must else 0, 1, hit / r)] * r
        p_dest = hit / r
    return sent, recv, recv_pairs, [[float(n * p_dest) for _ in range(r)] for n in owned]


def _check_routing(routing: Routing, owned: Sequence[int], num_topk: int) -> None:
    if len(routing.owned) != len(owned):
        raise ValueError(f"routing covers {len(routing.owned)} ranks, the layout has {len(owned)}")
    for s, (got, want) in enumerate(zip(routing.owned, owned)):
        if got != want:
            raise ValueError(
                f"routing of rank {s} has {got} tokens but the rank owns {want} rows; pass the "
                "topk_ids of the owned rows only (sliced with moe_plugins.layout.owned_rows), "
                "never the whole DP group's")
        if sum(routing.pairs[s]) != got * num_topk:
            raise ValueError(f"routing of rank {s} has {sum(routing.pairs[s])} pairs for {got} "
                             f"tokens, expected {got} x num_topk={num_topk}")


def _per_dp(num_tokens: int | Sequence[int], dp: int) -> tuple[int, ...]:
    tokens = (num_tokens,) * dp if isinstance(num_tokens, int) else tuple(num_tokens)
    if len(tokens) != dp or any(not isinstance(t, int) or t < 0 for t in tokens):
        raise ValueError(f"num_tokens must be one count >= 0 or one per DP group ({dp}), "
                         f"got {num_tokens!r}")
    return tokens


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
    tokens = max(_per_dp(num_tokens, layout.dp))
    sp = ReductionStrategy.SP_ALLGATHER
    alt = sharded.strategy
    colls = {s: decoder_tp_collectives(s, cfg, tokens, layout.tp, spec.sp_attention)
             for s in (sp, alt)}
    wire = {s: sum(LinkModel.ring_wire_bytes(kind, b, layout.tp) for kind, b in colls[s])
            for s in (sp, alt)}
    launches = {s: len(colls[s]) for s in (sp, alt)}
    layers = spec.num_moe_layers
    replicated = _weight_bytes(cfg, layout, SharedPlacement.REPLICATED)[0] * layers
    tp_sharded = _weight_bytes(cfg, layout, SharedPlacement.TP_SHARDED)[0] * layers
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


def plan_layer(model: ModelSpec | MoEConfig, layout: ParallelLayout,
               num_tokens: int | Sequence[int], backend: BackendSpec,
               quant: QuantSpec = QuantSpec(), *, link: LinkModel = LinkModel(),
               routing: Optional[Routing] = None,
               shared_placement: SharedPlacement = SharedPlacement.TP_SHARDED,
               single_collective: bool = True,
               shared_expert_budget_bytes: Optional[int] = None,
               backend_options: object = None,
               placement: Optional[ExpertPlacement] = None) -> LayerPlan:
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
    top-k outside its kernels' limits) raises the backend's own error.
    """
    spec = model if isinstance(model, ModelSpec) else ModelSpec(model)
    cfg, caps = spec.moe, backend.capabilities
    tokens = _per_dp(num_tokens, layout.dp)
    options = applicable_strategies(layout, supports_sp=caps.sp, supports_row_scatter=caps.row_scatter,
                                    has_shared_expert=cfg.has_shared_expert)
    # As MoELayer builds a backend: EP on and a dispatching strategy (one rank sends to itself).
    dispatching = [s for s in options if s.dispatches and layout.ep]
    wire_row = WireLayout(cfg.hidden)
    if dispatching:  # the backend's own checks, as building it for a layer runs them
        wire_row = backend.wire_layout_for(DispatchConfig(
            cfg.num_experts, cfg.hidden, cfg.num_topk, max(1, *tokens), cfg.dtype, quant,
            backend_options, placement))
    why = refusal_reason(backend, layout, quant.scheme, require_available=False,
                         dtype=cfg.dtype if dispatching else None,
                         placement=placement if layout.ep else None)
    if why:
        raise ValueError(f"backend {backend.name!r} cannot serve layout {layout.describe()} with "
                         f"quant {quant.scheme.value}: {why}; change the layout, quant or backend")
    if layout.ep and cfg.num_experts % layout.ep_size:
        raise ValueError(f"num_experts={cfg.num_experts} is not divisible by the EP size "
                         f"{layout.ep_size}; pick an EP size that divides the experts")
    world = layout.world_size
    rows = [owned_rows(tokens[layout.dp_rank(r)], layout.tp, layout.tp_rank(r)) for r in range(world)]
    owned = [o.num_owned for o in rows]
    # a per-call backend (deepep_auto) sends per pair below its threshold, per rank above
    fmt = (backend.wire_format_for(max(owned)) if backend.wire_format_for is not None
           else caps.activation_format)
    wire = wire_format(fmt, cfg, quant, wire_row)
    item = _itemsize(cfg.dtype)

    default = choose_strategy(layout, supports_sp=caps.sp, supports_row_scatter=caps.row_scatter,
                              has_shared_expert=cfg.has_shared_expert,
                              single_collective=single_collective, shared_placement=shared_placement)
    choice = recommend_strategy(layout, spec, supports_sp=caps.sp,
                                supports_row_scatter=caps.row_scatter, num_tokens=tokens,
                                shared_expert_budget_bytes=shared_expert_budget_bytes,
                                single_collective=single_collective)
    if routing is not None and dispatching:
        _check_routing(routing, owned, cfg.num_topk)
    sent, recv, recv_pairs, row_matrix = (
        _traffic(cfg, world, owned, wire, routing) if dispatching else ([], [], [], []))

    def collectives(kinds: list[tuple[str, int]], r: int) -> tuple[CollectivePlan, ...]:
        group = layout.tp_group_ranks(layout.dp_rank(r))
        out = []
        for kind, n_rows in kinds:
            b = n_rows * (layout.tp if kind == "reduce_scatter" else 1) * cfg.hidden * item
            out.append(CollectivePlan(kind, b, link.ring_wire_bytes(kind, b, layout.tp),
                                      link.link(group), link.collective_us(kind, b, group)))
        return tuple(out)

    plans = []
    for strategy in options:
        dispatches = strategy in dispatching
        shared_b, routed_b = _weight_bytes(cfg, layout, strategy.shared_placement,
                                           placement if layout.ep else None)
        ranks, tp_time, attn_time = [], 0.0, 0.0
        for r in range(world):
            colls = collectives(_tp_collectives(strategy, cfg, rows[r].num_tokens, rows[r].chunk), r)
            attn = collectives(_attention_collectives(strategy, rows[r].num_tokens, rows[r].chunk,
                                                      spec.sp_attention), r)
            tp_time = max(tp_time, sum(c.time_us for c in colls))
            attn_time = max(attn_time, sum(c.time_us for c in attn))
            s_rows = sent[r] if dispatches else _ZERO
            r_rows = recv[r] if dispatches else _ZERO
            ranks.append(RankPlan(
                rank=r, dp_rank=layout.dp_rank(r), tp_rank=layout.tp_rank(r),
                num_tokens=rows[r].num_tokens, owned=owned[r] if dispatches else 0,
                pairs=owned[r] * cfg.num_topk if dispatches else 0,
                rows=s_rows, act_bytes=s_rows.scaled(wire.act_bytes),
                sf_bytes=s_rows.scaled(wire.sf_bytes), meta_bytes=s_rows.scaled(wire.meta_bytes),
                combine_bytes=r_rows.scaled(wire.combine_bytes),
                recv_pairs=recv_pairs[r] if dispatches else _ZERO, recv_rows=r_rows,
                recv_act_bytes=r_rows.scaled(wire.act_bytes),
                recv_sf_bytes=r_rows.scaled(wire.sf_bytes),
                recv_meta_bytes=r_rows.scaled(wire.meta_bytes),
                recv_combine_bytes=s_rows.scaled(wire.combine_bytes),
                tp_collectives=colls, shared_weight_bytes=shared_b,
                expert_weight_bytes=routed_b, attention_collectives=attn))
        if dispatches:
            row_bytes = wire.act_bytes + wire.sf_bytes + wire.meta_bytes
            disp = link.all_to_all_us([[v * row_bytes for v in row] for row in row_matrix])
            comb = link.all_to_all_us([[row_matrix[s][d] * wire.combine_bytes for s in range(world)]
                                       for d in range(world)])
        else:
            disp = comb = 0.0
        recommended = strategy is choice.strategy
        plans.append(StrategyPlan(strategy, recommended, choice.reason if recommended else "",
                                  dispatches, tuple(ranks),
                                  TimeEstimate(disp, comb, tp_time, attn_time),
                                  default=strategy is default.strategy))
    plans = [_with_comparison(p, plans) for p in plans]
    return LayerPlan(spec, layout, tokens, backend.name, quant, link, wire, routing is not None,
                     tuple(plans), placement if layout.ep else None)


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
