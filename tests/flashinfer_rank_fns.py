"""Rank functions for the flashinfer_nvlink_two_sided tests: each installs the flashinfer emulation
(tests/emulation/flashinfer_two_sided.py) in sys.modules for its own duration only, runs on every
rank of a RankPool, and destroys what it built so the next test starts clean."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from emulation import flashinfer_two_sided as emu
from moe_plugins.config import DispatchConfig
from moe_plugins.demo import demo_inputs
from moe_plugins.experts import TorchExperts
from moe_plugins.groups import cached_dist_context
from moe_plugins.interface import PrepareFinalize, RowScatterTarget
from moe_plugins.layer import MoELayer
from moe_plugins.layout import ParallelLayout, owned_rows
from moe_plugins.model import MoEConfig, MoEWeights, route
from moe_plugins.overlap import OverlapConfig, SharedExpertHandle
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import get_backend

BACKEND = "flashinfer_nvlink_two_sided"


def _traffic(op: str) -> list[dict]:
    return [dict(t) for t in emu.TRAFFIC if t["op"] == op]


@contextlib.contextmanager
def _backend(layout: ParallelLayout, cfg: MoEConfig, num_tokens: int, quant: QuantSpec,
             options: Any = None) -> Iterator[PrepareFinalize]:
    """The backend built for ``cfg`` (emulation installed by the caller), destroyed on exit."""
    ctx = cached_dist_context(layout)
    pf = get_backend(BACKEND).build(ctx, DispatchConfig(
        cfg.num_experts, cfg.hidden, cfg.num_topk, max(num_tokens, 1), cfg.dtype, quant, options))
    try:
        yield pf
    finally:
        pf.manager.destroy()  # type: ignore[attr-defined]


def run_layer(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, num_tokens: int,
              quant: QuantSpec, flavor: str, seed: int = 0) -> dict:
    """One forward of a MoE layer (shared expert included) through the backend on the emulated
    flashinfer ``flavor``; reports the output, the API used and what crossed the all-to-all."""
    with emu.installed(flavor):
        ctx = cached_dist_context(layout)
        layer = MoELayer(MoEWeights.random(cfg, seed), ctx, get_backend(BACKEND), None, quant,
                         OverlapConfig(overlap=False), max_tokens_per_rank=max(num_tokens, 1))
        try:
            out = layer(demo_inputs(cfg, num_tokens, ctx.dp_rank, seed))
            assert layer.pf is not None
            stats = layer.dispatch_stats
            api = layer.pf.manager.api.value  # type: ignore[attr-defined]
        finally:
            layer.destroy()
        return dict(out=out, strategy=layer.strategy, api=api, pairs=stats.pairs,
                    rows_sent=stats.rows, sf_bytes=stats.sf_bytes, act_bytes=stats.act_bytes,
                    comm=_traffic("moe_comm"), prepare=_traffic("moe_prepare"),
                    live_after_destroy=emu.live_allocations())


def run_routed(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, num_tokens: int,
               quant: QuantSpec, flavor: str, options: Any = None, seed: int = 0) -> dict:
    """prepare -> TorchExperts -> finalize on this rank's tokens; reports what prepare returned,
    the traffic of the prepare alone and the routed output."""
    with emu.installed(flavor), _backend(layout, cfg, num_tokens, quant, options) as pf:
        ctx = cached_dist_context(layout)
        w = MoEWeights.random(cfg, seed)
        experts = TorchExperts(w.local_experts(layout.ep_size, ctx.rank), quant, cfg.dtype)
        x = demo_inputs(cfg, num_tokens, ctx.dp_rank, seed)
        tw, ti = route(x, w.router, cfg.num_topk, cfg.renormalize)
        prep = pf.prepare(x, tw, ti, quant)
        dispatch_comm = _traffic("moe_comm")
        out = pf.finalize(experts.apply(prep), tw, ti, torch.empty_like(x))
        return dict(out=out, x_dtype=prep.x.dtype, x_shape=tuple(prep.x.shape),
                    x_sf=None if prep.x_sf is None else (prep.x_sf.dtype, tuple(prep.x_sf.shape)),
                    x_sf_swizzled=prep.x_sf_swizzled, topk_ids=prep.topk_ids,
                    dispatch_comm=dispatch_comm, prepare=_traffic("moe_prepare"),
                    sf_bytes=pf.stats.sf_bytes, api=pf.manager.api.value)  # type: ignore[attr-defined]


def row_scatter(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, num_tokens: int,
                flavor: str, seed: int = 0) -> dict:
    """The same dispatch finalized twice: into a plain output, and added into a row-scatter
    target that already holds a shared-expert partial."""
    quant = QuantSpec()
    with emu.installed(flavor), _backend(layout, cfg, num_tokens, quant) as pf:
        ctx = cached_dist_context(layout)
        w = MoEWeights.random(cfg, seed)
        experts = TorchExperts(w.local_experts(layout.ep_size, ctx.rank), quant, cfg.dtype)
        x = demo_inputs(cfg, num_tokens, ctx.dp_rank, seed)
        tw, ti = route(x, w.router, cfg.num_topk, cfg.renormalize)
        plain = pf.finalize(experts.apply(pf.prepare(x, tw, ti, quant)), tw, ti, torch.empty_like(x))
        partial = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank + 5)).to(x.dtype)
        buf = partial.clone()
        target = RowScatterTarget(SharedExpertHandle(buf, joined=True),
                                  owned_rows(num_tokens, layout.tp, ctx.tp_rank))
        got = pf.finalize(experts.apply(pf.prepare(x, tw, ti, quant)), tw, ti, target)
        return dict(plain=plain, partial=partial, row_scatter=got, same_buffer=got is buf)


def lifecycle(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, flavor: str) -> dict:
    """Workspaces: none at construction, created by the first dispatch, shared by two layers of
    the same EP group, freed when the last one is destroyed."""
    quant, seen = QuantSpec(), {}
    with emu.installed(flavor):
        ctx = cached_dist_context(layout)
        spec = get_backend(BACKEND)
        dcfg = DispatchConfig(cfg.num_experts, cfg.hidden, cfg.num_topk, 4, cfg.dtype, quant)
        first, second = spec.build(ctx, dcfg), spec.build(ctx, dcfg)
        seen["after_construction"] = emu.live_allocations()
        w = MoEWeights.random(cfg, 0)
        experts = TorchExperts(w.local_experts(layout.ep_size, ctx.rank), quant, cfg.dtype)
        x = demo_inputs(cfg, 4, ctx.dp_rank, 0)
        tw, ti = route(x, w.router, cfg.num_topk, cfg.renormalize)

        def call(pf: PrepareFinalize) -> torch.Tensor:
            return pf.finalize(experts.apply(pf.prepare(x, tw, ti, quant)), tw, ti,
                               torch.empty_like(x))

        out_first = call(first)
        seen["after_first_dispatch"] = emu.live_allocations()
        out_second = call(second)
        seen["after_second_dispatch"] = emu.live_allocations()
        first.manager.destroy()  # type: ignore[attr-defined]
        first.manager.destroy()  # type: ignore[attr-defined]  (idempotent)
        seen["after_first_destroy"] = emu.live_allocations()
        out_again = call(second)  # the survivor still works
        second.manager.destroy()  # type: ignore[attr-defined]
        seen["after_last_destroy"] = emu.live_allocations()
        seen["mnnvl_moe_cache_cleared"] = emu.MnnvlMoe.moe_workspace is None
        try:
            call(second)
            seen["use_after_destroy"] = None
        except RuntimeError as e:
            seen["use_after_destroy"] = str(e)
        seen["outputs_equal"] = bool(torch.equal(out_first, out_second)
                                     and torch.equal(out_first, out_again))
        return seen


def reset_after_error(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                      flavor: str) -> dict:
    """A call that fails on every rank between prepare and finalize, then reset_call_state (what
    the layer does in `finally`): the next call works and gives the same output."""
    quant = QuantSpec()
    with emu.installed(flavor), _backend(layout, cfg, 4, quant) as pf:
        ctx = cached_dist_context(layout)
        w = MoEWeights.random(cfg, 0)
        experts = TorchExperts(w.local_experts(layout.ep_size, ctx.rank), quant, cfg.dtype)
        x = demo_inputs(cfg, 4, ctx.dp_rank, 0)
        tw, ti = route(x, w.router, cfg.num_topk, cfg.renormalize)
        pf.prepare(x, tw, ti, quant)  # experts "raise" here on every rank: no finalize
        pf.reset_call_state()
        out = pf.finalize(experts.apply(pf.prepare(x, tw, ti, quant)), tw, ti, torch.empty_like(x))
        return dict(out=out)


def call_error(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, case: str,
               flavor: str = "0.7.2.post1") -> None:
    """Misuse that must raise on every rank before any collective is entered."""
    quant = QuantSpec()
    with emu.installed(flavor), _backend(layout, cfg, 4, quant) as pf:
        ctx = cached_dist_context(layout)
        w = MoEWeights.random(cfg, 0)
        x = demo_inputs(cfg, 8, ctx.dp_rank, 0)
        tw, ti = route(x, w.router, cfg.num_topk, cfg.renormalize)
        if case == "too_many_tokens":  # built for 4 tokens per rank, given 8
            pf.prepare(x, tw, ti, quant)
        elif case == "mismatched_tokens":
            pf.prepare(x[:2], tw, ti, quant)
        elif case == "prepare_twice":
            pf.prepare(x[:4], tw[:4], ti[:4], quant)
            pf.prepare(x[:4], tw[:4], ti[:4], quant)
        elif case == "finalize_output_shape":
            prep = pf.prepare(x[:4], tw[:4], ti[:4], quant)
            pf.finalize(torch.zeros(prep.x.shape[0], cfg.hidden, dtype=cfg.dtype), tw[:4], ti[:4],
                        torch.empty(3, cfg.hidden, dtype=cfg.dtype))
        else:
            raise AssertionError(case)


def handle_exchange_comm(rank: int, world: int) -> dict:
    """TorchGroupComm, the CommBackend flashinfer exchanges MNNVL handles through: allgather and
    bcast of Python objects, Split into the whole group, and a real split refused."""
    import torch.distributed as dist

    from all2all.flashinfer import TorchGroupComm

    comm = TorchGroupComm(dist.group.WORLD)
    got = dict(gathered=comm.allgather({"rank": rank, "handle": b"h" * (rank + 3)}),
               bcast=comm.bcast(("from root", rank) if rank == 1 else None, root=1),
               split_is_self=comm.Split(0, comm.Get_rank()) is comm, refused=None)
    comm.barrier()
    try:
        comm.Split(rank % 2, rank)
    except NotImplementedError as e:
        got["refused"] = str(e)
    return got
