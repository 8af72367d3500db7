"""One backend's dispatch and combine all-to-alls for one layer and batch: the rows each EP rank
sends and receives (:mod:`moe_plugins.planner.traffic`), the row they carry on the wire, and the
busiest rank's time on a link model (:mod:`moe_plugins.planner.transport_time`), for a backend
with one transport. :func:`moe_plugins.planner.plan.plan_layer` puts them into a layer plan
(choosing a per-call backend's mode first); the mode crossover
(:mod:`moe_plugins.planner.crossover`) and the fit of the time model
(:mod:`moe_plugins.planner.fit`) time them directly."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from moe_plugins.config import DispatchConfig, MoEConfig
from moe_plugins.layout import ParallelLayout
from moe_plugins.placement import ExpertPlacement
from moe_plugins.planner.link_model import LinkModel
from moe_plugins.planner.traffic import (Estimate, Routing, WireFormat, check_routing,
                                         node_traffic, rank_traffic, wire_format)
from moe_plugins.planner.transport_time import FittedConstants, all_to_all_us
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import BackendSpec, Transport, WireLayout, refusal_reason

__all__ = ["AllToAllPlan", "plan_all_to_all", "check_dispatch", "check_backend"]


@dataclass(frozen=True)
class AllToAllPlan:
    """What one dispatch (and the combine that returns its rows) moves on ``transport``.

    wire: the bytes of one row. sent / recv: rows each EP rank sends / receives (exact, or
    bounds with the uniform-routing mean); recv_pairs: (token, expert) pairs each rank receives.
    rows: [src][dst] rows (exact with measured routing, else expected) the time is computed
    from; node_rows: [src][node] rows, for the NORMAL transport only. link: the link model the
    node rows were counted for."""

    transport: Transport
    wire: WireFormat
    sent: tuple[Estimate, ...]
    recv: tuple[Estimate, ...]
    recv_pairs: tuple[Estimate, ...]
    rows: tuple[tuple[float, ...], ...]
    node_rows: Optional[tuple[tuple[float, ...], ...]]
    link: LinkModel

    def times(self, constants: Optional[FittedConstants] = None) -> tuple[float, float]:
        """(dispatch, combine) time of the busiest rank (us) under ``constants`` (None: the
        fitted ones)."""
        w = self.wire
        disp = all_to_all_us(self.transport, "dispatch", self.rows,
                             w.act_bytes + w.sf_bytes + w.meta_bytes, self.link, self.node_rows,
                             constants)
        comb = all_to_all_us(self.transport, "combine", self.rows, w.combine_bytes, self.link,
                             self.node_rows, constants)
        return disp, comb


def check_backend(backend: BackendSpec, layout: ParallelLayout, quant: QuantSpec,
                  cfg: MoEConfig, dispatching: bool,
                  placement: Optional[ExpertPlacement] = None) -> None:
    """ValueError when ``backend`` cannot serve ``layout`` with ``quant`` (the registry's
    :func:`refusal_reason`, the activation dtype counted only where the layer dispatches)."""
    why = refusal_reason(backend, layout, quant.scheme, require_available=False,
                         dtype=cfg.dtype if dispatching else None,
                         placement=placement if layout.ep else None)
    if why:
        raise ValueError(f"backend {backend.name!r} cannot serve layout {layout.describe()} with "
                         f"quant {quant.scheme.value}: {why}; change the layout, quant or backend")


def check_dispatch(cfg: MoEConfig, layout: ParallelLayout, backend: BackendSpec,
                   quant: QuantSpec, max_tokens: int, backend_options: object = None,
                   placement: Optional[ExpertPlacement] = None) -> WireLayout:
    """What building ``backend`` for a dispatching layer of ``max_tokens`` tokens per rank
    checks (its own errors first, then the registry's, then the most tokens per rank its
    manager takes: ``BackendSpec.token_limit``), and the row it puts on the wire."""
    wire_row = backend.wire_layout_for(DispatchConfig(
        cfg.num_experts, cfg.hidden, cfg.num_topk, max(1, max_tokens), cfg.dtype, quant,
        backend_options, placement))
    check_backend(backend, layout, quant, cfg, True, placement)
    if cfg.num_experts % layout.ep_size:
        raise ValueError(f"num_experts={cfg.num_experts} is not divisible by the EP size "
                         f"{layout.ep_size}; pick an EP size that divides the experts")
    limit = backend.token_limit(layout.ep_size) if backend.token_limit is not None else None
    if limit is not None and max_tokens > limit.tokens:
        raise ValueError(f"backend {backend.name!r} takes at most {limit.tokens} tokens per rank "
                         f"over {layout.ep_size} EP ranks, this batch puts {max_tokens} on a "
                         f"rank ({limit.reason}); use fewer tokens per rank or another backend")
    return wire_row


def plan_all_to_all(cfg: MoEConfig, layout: ParallelLayout, owned: Sequence[int],
                    backend: BackendSpec, quant: QuantSpec, link: LinkModel, *,
                    max_tokens: int, routing: Optional[Routing] = None,
                    backend_options: object = None,
                    placement: Optional[ExpertPlacement] = None) -> AllToAllPlan:
    """The all-to-alls of a layer whose EP rank ``r`` hands prepare ``owned[r]`` rows, on
    ``backend``'s own transport and wire (a per-call backend's mode is chosen by the caller).

    max_tokens: the most tokens per rank the layer is built for (its buffers: at least the
    busiest rank's rows); the backend's own checks run on a config of that size, raising what
    building it would raise.
    routing / placement: as :func:`moe_plugins.planner.plan.plan_layer` takes them."""
    wire_row = check_dispatch(cfg, layout, backend, quant, max_tokens, backend_options, placement)
    wire = wire_format(backend.capabilities.activation_format, cfg, quant, wire_row)
    if routing is not None:
        check_routing(routing, owned, cfg.num_topk)
    sent, recv, recv_pairs, rows = rank_traffic(cfg, layout.world_size, owned, wire, routing)
    nodes = (node_traffic(cfg, owned, link.gpus_per_node, routing)
             if backend.transport is Transport.NORMAL else None)
    return AllToAllPlan(backend.transport, wire, tuple(sent), tuple(recv), tuple(recv_pairs),
                        tuple(tuple(r) for r in rows),
                        None if nodes is None else tuple(tuple(r) for r in nodes), link)
