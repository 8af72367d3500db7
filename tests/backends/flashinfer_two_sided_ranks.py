"""Rank functions for the flashinfer_nvlink_two_sided tests: each installs the flashinfer emulation
(tests/emulation/flashinfer_two_sided.py) in sys.modules for its own duration only, runs on every
rank of a RankPool, and destroys what it built so the next test starts clean.

``run_layer`` and ``run_routed`` also run on the REAL flashinfer (tests/gpu/test_flashinfer_gpu.py):
``flavor=None`` installs nothing, ``device="cuda:0"`` puts the context, weights and tokens there,
and the emulation's traffic log is then empty. Outputs are returned on the CPU."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from tests.emulation import flashinfer_two_sided as emu
from moe_plugins.config import DispatchConfig
from moe_plugins.faults import clear_group_faults
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.runner.experts import TorchExperts
from moe_plugins.groups import DistContext, cached_dist_context
from moe_plugins.interface import BatchHint, PrepareFinalize, RowScatterTarget
from moe_plugins.runner.layer import MoELayer
from moe_plugins.layout import ParallelLayout, owned_rows
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights, route
from moe_plugins.overlap import OverlapConfig, SharedExpertHandle
from moe_plugins.quant import QuantScheme, QuantSpec
from moe_plugins.registry import get_backend
from moe_plugins.strategy import ReductionStrategy
from moe_plugins.all2all.flashinfer_nvlink_two_sided import FlashInferTwoSidedOptions

BACKEND = "flashinfer_nvlink_two_sided"
# (id, quant, activation dtype) of the layer tests, emulated and real: the quantized cases in
# float32, so the reference's own rounding stays inside tolerance_for.
QUANTS = [
    ("bf16", QuantSpec(), torch.bfloat16),
    ("fp8_block128", QuantSpec(QuantScheme.FP8_BLOCK128), torch.float32),
    ("nvfp4", QuantSpec(QuantScheme.NVFP4), torch.float32),
    ("fp8_block128-deferred", QuantSpec(QuantScheme.FP8_BLOCK128, defer_input_quant=True),
     torch.float32),
    ("nvfp4-deferred", QuantSpec(QuantScheme.NVFP4, defer_input_quant=True), torch.float32),
]


def _library(flavor: Optional[str]) -> contextlib.AbstractContextManager:
    """The emulated flashinfer of ``flavor``, or (None) whatever flashinfer is installed."""
    return emu.installed(flavor) if flavor is not None else contextlib.nullcontext()


def _traffic(op: str) -> list[dict]:
    return [dict(t) for t in emu.TRAFFIC if t["op"] == op]


def _build(ctx: DistContext, cfg: MoEConfig, num_tokens: int, quant: QuantSpec,
           options: Any = None) -> PrepareFinalize:
    return get_backend(BACKEND).build(ctx, DispatchConfig(
        cfg.num_experts, cfg.hidden, cfg.num_topk, max(num_tokens, 1), cfg.dtype, quant, options))


def _forget_faults(pf: PrepareFinalize) -> None:
    """Forget the fault state of ``pf``'s group on this rank: for probes that every rank makes
    alike (each refused or abandoned the same calls), so the group is still in step."""
    clear_group_faults(pf.manager.group)  # type: ignore[attr-defined]


@contextlib.contextmanager
def _backend(layout: ParallelLayout, cfg: MoEConfig, num_tokens: int, quant: QuantSpec,
             options: Any = None, device: str = "cpu") -> Iterator[PrepareFinalize]:
    """The backend built for ``cfg`` (emulation installed by the caller), destroyed on exit."""
    pf = _build(cached_dist_context(layout, device), cfg, num_tokens, quant, options)
    try:
        yield pf
    finally:
        # Probes that fail do so on every rank alike: the pool's group stays in step.
        pf.reset_call_state()
        _forget_faults(pf)
        pf.manager.destroy()  # type: ignore[attr-defined]


@dataclass
class _Routed:
    """This rank's tokens, their routing and its experts."""

    experts: TorchExperts
    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    quant: QuantSpec

    @classmethod
    def make(cls, layout: ParallelLayout, cfg: MoEConfig, num_tokens: int, quant: QuantSpec,
             seed: int = 0, device: str = "cpu") -> "_Routed":
        ctx = cached_dist_context(layout, device)
        w = MoEWeights.random(cfg, seed).to(ctx.device)
        x = demo_inputs(cfg, num_tokens, ctx.dp_rank, seed).to(ctx.device)
        tw, ti = route(x, w.router, cfg.num_topk, cfg.renormalize)
        return cls(TorchExperts(w.local_experts(layout.ep_size, ctx.rank), quant, cfg.dtype),
                   x, tw, ti, quant)

    def call(self, pf: PrepareFinalize, output: Optional[Any] = None) -> torch.Tensor:
        """prepare -> experts -> finalize (into ``output``, default a fresh tensor)."""
        prep = pf.prepare(self.x, self.topk_weights, self.topk_ids, self.quant)
        return pf.finalize(self.experts.apply(prep), self.topk_weights, self.topk_ids,
                           torch.empty_like(self.x) if output is None else output)


def run_layer(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, num_tokens: int,
              quant: QuantSpec, flavor: Optional[str], seed: int = 0,
              strategy: Optional[ReductionStrategy] = None, device: str = "cpu") -> dict:
    """One forward of a MoE layer (shared expert included) through the backend on the emulated
    flashinfer ``flavor``; reports the output, the API used, what crossed the all-to-all and the
    TP collectives the layer issued."""
    with _library(flavor):
        ctx = cached_dist_context(layout, device)
        layer = MoELayer(MoEWeights.random(cfg, seed).to(ctx.device), ctx, get_backend(BACKEND),
                         strategy, quant, OverlapConfig(overlap=False),
                         max_tokens_per_rank=max(num_tokens, 1))
        try:
            out = layer(demo_inputs(cfg, num_tokens, ctx.dp_rank, seed).to(ctx.device)).cpu()
            assert layer.pf is not None
            stats = layer.dispatch_stats
            api = layer.pf.manager.api.value  # type: ignore[attr-defined]
        finally:
            layer.destroy()
        return dict(out=out, strategy=layer.strategy, api=api, pairs=stats.pairs,
                    rows_sent=stats.rows, sf_bytes=stats.sf_bytes, act_bytes=stats.act_bytes,
                    meta_bytes=stats.meta_bytes, combine_bytes=stats.combine_bytes,
                    tp_collectives=[c.kind for c in layer.collectives.records],
                    comm=_traffic("moe_comm"), prepare=_traffic("moe_prepare"),
                    live_after_destroy=emu.live_allocations() if flavor is not None else None)


def run_routed(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, num_tokens: int,
               quant: QuantSpec, flavor: Optional[str], options: Any = None,
               device: str = "cpu") -> dict:
    """prepare -> TorchExperts -> finalize on this rank's tokens; reports what prepare returned,
    the traffic of the prepare alone and the routed output."""
    with _library(flavor), _backend(layout, cfg, num_tokens, quant, options, device) as pf:
        r = _Routed.make(layout, cfg, num_tokens, quant, device=device)
        prep = pf.prepare(r.x, r.topk_weights, r.topk_ids, quant)
        dispatch_comm = _traffic("moe_comm")
        out = pf.finalize(r.experts.apply(prep), r.topk_weights, r.topk_ids, torch.empty_like(r.x))
        return dict(out=out.cpu(), x_dtype=prep.x.dtype, x_shape=tuple(prep.x.shape),
                    x_sf=None if prep.x_sf is None else (prep.x_sf.dtype, tuple(prep.x_sf.shape)),
                    x_sf_swizzled=prep.x_sf_swizzled, topk_ids=prep.topk_ids.cpu(),
                    dispatch_comm=dispatch_comm, prepare=_traffic("moe_prepare"),
                    sf_bytes=pf.stats.sf_bytes, api=pf.manager.api.value)  # type: ignore[attr-defined]


def row_scatter(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, num_tokens: int,
                flavor: str) -> dict:
    """The same dispatch finalized twice: into a plain output, and added into a row-scatter
    target that already holds a shared-expert partial."""
    quant = QuantSpec()
    with emu.installed(flavor), _backend(layout, cfg, num_tokens, quant) as pf:
        r = _Routed.make(layout, cfg, num_tokens, quant)
        plain = r.call(pf)
        partial = torch.randn(r.x.shape, generator=torch.Generator().manual_seed(rank + 5))
        buf = partial.to(r.x.dtype).clone()
        rows = owned_rows(num_tokens, layout.tp, cached_dist_context(layout).tp_rank)
        got = r.call(pf, RowScatterTarget(SharedExpertHandle(buf, joined=True), rows))
        return dict(plain=plain, partial=partial, row_scatter=got, same_buffer=got is buf)


def lifecycle(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, flavor: str) -> dict:
    """Workspaces: none at construction, created by the first dispatch, shared by two layers of
    the same EP group, freed when the last one is destroyed."""
    quant, seen = QuantSpec(), {}
    with emu.installed(flavor):
        ctx = cached_dist_context(layout)
        first, second = _build(ctx, cfg, 4, quant), _build(ctx, cfg, 4, quant)
        seen["after_construction"] = emu.live_allocations()
        r = _Routed.make(layout, cfg, 4, quant)
        out_first = r.call(first)
        seen["after_first_dispatch"] = emu.live_allocations()
        out_second = r.call(second)
        seen["after_second_dispatch"] = emu.live_allocations()
        first.manager.destroy()  # type: ignore[attr-defined]
        first.manager.destroy()  # type: ignore[attr-defined]  (idempotent)
        seen["after_first_destroy"] = emu.live_allocations()
        out_again = r.call(second)  # the survivor still works
        second.manager.destroy()  # type: ignore[attr-defined]
        seen["after_last_destroy"] = emu.live_allocations()
        seen["mnnvl_moe_cache_cleared"] = emu.MnnvlMoe.moe_workspace is None
        try:
            r.call(second)
            seen["use_after_destroy"] = None
        except RuntimeError as e:
            seen["use_after_destroy"] = str(e)
        # the failed dispatch broke the group (nothing tells a rank its peers failed alike);
        # every rank probed the same, so the pool's group is forgotten for the next test
        seen["broken_after_use"] = second.faults.broken is not None
        _forget_faults(second)
        seen["outputs_equal"] = bool(torch.equal(out_first, out_second)
                                     and torch.equal(out_first, out_again))
        return seen


def second_mapping(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, flavor: str,
                   api: str) -> dict:
    """Two EP groups in one process on ``api``. Where it lives in MnnvlMoe's class cache (0.7.2.post1:
    MnnvlMoe, and moe_ep, which shares the cache) a layer on the other group is refused at its
    first dispatch (on every rank, before any collective) until the first group's layers go;
    0.7.4's moe_ep serves both groups at once."""
    quant, seen = QuantSpec(), {}
    options = FlashInferTwoSidedOptions(api=api)
    with emu.installed(flavor):
        ctx = cached_dist_context(layout)
        other = DistContext(layout, ctx.rank, dist.new_group(list(range(world))), None, ctx.device)
        a, b = _build(ctx, cfg, 4, quant, options), _build(other, cfg, 4, quant, options)
        r = _Routed.make(layout, cfg, 4, quant)
        try:
            out_a = r.call(a)
            try:
                seen["both_at_once"] = torch.equal(r.call(b), out_a)
                seen["refused"] = None
            except ValueError as e:
                seen["refused"] = str(e)
                b.reset_call_state()
                # the refusal came inside the dispatch, which breaks b's group; every rank was
                # refused alike, so its state is forgotten to show the group working afterwards
                seen["broken"] = b.faults.broken is not None
                _forget_faults(b)
                a.manager.destroy()  # type: ignore[attr-defined]
                seen["after_first_group_went"] = torch.equal(r.call(b), out_a)
        finally:
            a.manager.destroy()  # type: ignore[attr-defined]
            b.manager.destroy()  # type: ignore[attr-defined]
        return seen


def mixed_apis(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig) -> dict:
    """0.7.2.post1: a MnnvlMoe layer and a moe_ep layer of one EP group build different Mappings
    of it, and MnnvlMoe's class cache holds one: the second API is refused at its first dispatch
    (every rank alike, before any collective), never given the first one's cache to drop under
    it; once the MnnvlMoe layer went, the moe_ep layer runs, and the cache goes with the last."""
    quant, seen = QuantSpec(), {}
    with emu.installed("0.7.2.post1"):
        ctx = cached_dist_context(layout)
        mnnvl = _build(ctx, cfg, 4, quant, FlashInferTwoSidedOptions(api="mnnvl_moe"))
        moe_ep = _build(ctx, cfg, 4, quant, FlashInferTwoSidedOptions(api="moe_ep"))
        r = _Routed.make(layout, cfg, 4, quant)
        try:
            out = r.call(mnnvl)
            try:
                r.call(moe_ep)
                seen["refused"] = None
            except ValueError as e:
                seen["refused"] = str(e)
            moe_ep.reset_call_state()
            _forget_faults(moe_ep)  # every rank was refused alike
            seen["live_with_mnnvl"] = emu.live_allocations()
            mnnvl.manager.destroy()  # type: ignore[attr-defined]
            seen["after_mnnvl_went"] = emu.live_allocations()
            seen["moe_ep_right"] = torch.equal(r.call(moe_ep), out)
        finally:
            mnnvl.manager.destroy()  # type: ignore[attr-defined]
            moe_ep.manager.destroy()  # type: ignore[attr-defined]
        seen["after_both_went"] = emu.live_allocations()
        seen["cache_cleared"] = emu.MnnvlMoe.moe_workspace is None
        return seen


def reset_after_error(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                      flavor: str) -> dict:
    """A call that fails on every rank between prepare and finalize, then reset_call_state (what
    the layer does in `finally`): the group breaks (no rank can tell that its peers abandoned
    the call alike); once every rank forgets that, the next call gives the right output."""
    quant = QuantSpec()
    with emu.installed(flavor), _backend(layout, cfg, 4, quant) as pf:
        r = _Routed.make(layout, cfg, 4, quant)
        pf.prepare(r.x, r.topk_weights, r.topk_ids, quant)  # experts "raise" on every rank here
        pf.reset_call_state()
        broken = pf.faults.broken
        _forget_faults(pf)
        return dict(out=r.call(pf), broken=broken)


def issue_order(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, flavor: str) -> dict:
    """prepare_async and finalize_async issue nothing; their receivers issue every collective
    (what lets a shared expert forked in between overlap with the whole routed path)."""
    from tests.checks import count_dist_calls

    quant, seen = QuantSpec(QuantScheme.NVFP4), {}
    with emu.installed(flavor), _backend(layout, cfg, 4, quant) as pf:
        r = _Routed.make(layout, cfg, 4, quant)
        with count_dist_calls() as calls:
            sent = pf.prepare_async(r.x, r.topk_weights, r.topk_ids, quant)
            seen["prepare_async"] = (len(calls), len(emu.TRAFFIC), sent.hook)
            prep = sent.receiver()
            seen["prepare_receiver"] = (len(calls), len(emu.TRAFFIC))
            calls.clear()
            emu.TRAFFIC.clear()
            back = pf.finalize_async(r.experts.apply(prep), r.topk_weights, r.topk_ids,
                                     torch.empty_like(r.x))
            seen["finalize_async"] = (len(calls), len(emu.TRAFFIC), back.hook)
            back.receiver()
            seen["finalize_receiver"] = (len(calls), len(emu.TRAFFIC))
        seen["supports_async"] = pf.supports_async()
    return seen


def call_error(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, case: str) -> None:
    """Misuse that must raise on every rank before any collective is entered."""
    quant = QuantSpec()
    with emu.installed("0.7.2.post1"), _backend(layout, cfg, 4, quant) as pf:
        r = _Routed.make(layout, cfg, 8, quant)
        x, tw, ti = r.x, r.topk_weights, r.topk_ids
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


def workspace_refused(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig) -> None:
    """The library refuses the MNNVL workspace (as cuMemCreate/cuMemImportFromShareableHandle
    do where FABRIC handles or fd sharing are unavailable): the first dispatch must raise."""
    quant = QuantSpec()

    def refuse(mapping: Any, config: Any = None) -> Any:
        raise RuntimeError("CUDA error: CUDA_ERROR_NOT_SUPPORTED (cuMemCreate)")

    with emu.installed("0.7.2.post1"), _backend(layout, cfg, 8, quant) as pf:
        original = emu.MnnvlMoe.get_moe_workspaces
        emu.MnnvlMoe.get_moe_workspaces = staticmethod(refuse)
        try:
            r = _Routed.make(layout, cfg, 8, quant)
            pf.prepare(r.x, r.topk_weights, r.topk_ids, quant)
        finally:
            emu.MnnvlMoe.get_moe_workspaces = original


def handle_exchange_comm(rank: int, world: int) -> dict:
    """TorchGroupComm, the CommBackend flashinfer exchanges MNNVL handles through: allgather and
    bcast of Python objects, Split into the whole group, and a real split refused."""
    from moe_plugins.mnnvl.manager import TorchGroupComm

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


def run_bounded(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                tokens: list[int], layer_max: int, quant: QuantSpec, flavor: str,
                bound: Optional[int]) -> dict:
    """prepare (with this call's bound) -> TorchExperts -> finalize on a layer built for
    ``layer_max`` tokens per rank, rank r holding ``tokens[r]`` tokens. Reports the receive
    rows, the rows flashinfer's prepare was sized for, the routed output, and the errors of a
    bound below this rank's tokens and above the layer's."""
    with emu.installed(flavor), _backend(layout, cfg, layer_max, quant) as pf:
        r = _Routed.make(layout, cfg, tokens[rank], quant)
        errors = []
        for bad in (tokens[rank] - 1, layer_max + 1):
            if bad < tokens[rank] and bad < 1:
                continue
            try:
                pf.set_batch_hint(BatchHint(bad))
                pf.prepare(r.x, r.topk_weights, r.topk_ids, quant)
            except ValueError as e:
                errors.append(str(e))
            # each rank refused its probes before sending anything, so no call is owed
            _forget_faults(pf)
        # a refused call consumed its hint: without a new one the layer's bound applies
        pf.set_batch_hint(None if bound is None else BatchHint(bound))
        prep = pf.prepare(r.x, r.topk_weights, r.topk_ids, quant)
        out = pf.finalize(r.experts.apply(prep), r.topk_weights, r.topk_ids, torch.empty_like(r.x))
        return dict(out=out, x=r.x, recv_rows=prep.x.shape[0], ids_rows=prep.topk_ids.shape[0],
                    sf_rows=None if prep.x_sf is None else prep.x_sf.shape[0], errors=errors,
                    workspaces=emu.live_allocations())
