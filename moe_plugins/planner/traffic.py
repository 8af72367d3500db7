"""What the dispatch and combine all-to-alls move: counts known exactly or within bounds
(:class:`Estimate`), the bytes of one dispatched row (:class:`WireFormat`), measured routing
(:class:`Routing`) and the per-rank rows each rank sends and receives under it, or under uniform
routing when none is given."""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

import torch

from moe_plugins.interface import ActivationFormat
from moe_plugins.placement import ExpertPlacement
from moe_plugins.quant import FP8_BLOCK, NVFP4_BLOCK, QuantScheme, QuantSpec
from moe_plugins.registry import WireLayout
from moe_plugins.config import MoEConfig

__all__ = ["Estimate", "expected_ranks_hit", "ranks_hit_bounds", "WireFormat", "wire_format",
           "itemsize", "Routing", "rank_traffic", "node_traffic", "check_routing",
           "tokens_per_dp"]


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


def itemsize(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def wire_format(activation_format: ActivationFormat, cfg: MoEConfig, quant: QuantSpec,
                wire: Optional[WireLayout] = None) -> WireFormat:
    """The :class:`WireFormat` of a backend with ``activation_format`` for this layer and quant;
    ``wire``: the backend's :class:`moe_plugins.registry.WireLayout` (default: the layer's
    hidden, no header)."""
    quant.check_hidden(cfg.hidden)
    wire = wire if wire is not None else WireLayout(cfg.hidden)
    h, model_bytes = wire.hidden, itemsize(cfg.dtype)
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



def _bounded(owned: Sequence[int], lo: int, hi: int, mean: Fraction) -> Estimate:
    n = sum(owned)
    return Estimate(n * lo, n * hi, float(n * mean))


def rank_traffic(cfg: MoEConfig, num_ranks: int, owned: Sequence[int], wire: WireFormat,
                 routing: Optional[Routing]
                 ) -> tuple[list[Estimate], list[Estimate], list[Estimate], list[list[float]]]:
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


def check_routing(routing: Routing, owned: Sequence[int], num_topk: int) -> None:
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


def tokens_per_dp(num_tokens: int | Sequence[int], dp: int) -> tuple[int, ...]:
    """Tokens of each of ``dp`` DP groups from one count for all or one count per group."""
    tokens = (num_tokens,) * dp if isinstance(num_tokens, int) else tuple(num_tokens)
    if len(tokens) != dp or any(not isinstance(t, int) or t < 0 for t in tokens):
        raise ValueError(f"num_tokens must be one count >= 0 or one per DP group ({dp}), "
                         f"got {num_tokens!r}")
    return tokens



def node_traffic(cfg: MoEConfig, owned: Sequence[int], gpus_per_node: int,
                 routing: Optional[Routing] = None) -> list[list[float]]:
    """[src][node] rows each rank sends each node when a token goes once per destination node
    (DeepEP's normal mode over RDMA); ranks ``[k * gpus_per_node, (k + 1) * gpus_per_node)`` are
    node k. Uniform routing: the expected rows (a node is missed when all num_topk experts fall
    on the other nodes). With ``routing``: an upper bound, min(owned, rows to the node's ranks),
    exact when no token reaches two ranks of one node (measured routing counts ranks, not
    nodes)."""
    r = len(owned)
    nodes = [list(range(k, min(k + gpus_per_node, r))) for k in range(0, r, gpus_per_node)]
    if routing is not None:
        return [[float(min(owned[s], sum(routing.tokens[s][d] for d in ranks)))
                 for ranks in nodes] for s in range(r)]
    e, k, per = cfg.num_experts, cfg.num_topk, cfg.num_experts // r
    hit = [1 - Fraction(math.comb(e - per * len(ranks), k), math.comb(e, k)) for ranks in nodes]
    return [[float(n * h) for h in hit] for n in owned]
