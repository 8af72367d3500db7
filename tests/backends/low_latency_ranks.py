"""Rank functions of the low-latency backend tests (deepep_ll, nixl_ep).

Each injects the emulation of the backend's vendor package (tests/emulation) for its own
duration only, builds the backend through the registry exactly as a layer does, and returns
plain tensors/values to the test process.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from tests.emulation import installed
from moe_plugins.config import DispatchConfig
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.faults import clear_group_faults
from moe_plugins.groups import cached_dist_context
from moe_plugins.runner.layer import MoELayer
from moe_plugins.layout import ParallelLayout, owned_rows, slice_owned
from moe_plugins.lowlat.prepare_finalize import LowLatencyPrepareFinalize
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights, route
from moe_plugins.overlap import OverlapConfig
from moe_plugins.quant import QuantScheme, QuantSpec
from moe_plugins.registry import get_backend
from moe_plugins.strategy import ReductionStrategy
from tests.checks import count_dist_calls


def vendor_module(backend: str) -> str:
    """The package the backend imports (what the emulation stands in for)."""
    return get_backend(backend).manager.required.module


def default_store() -> "dist.Store":
    """A prefix store on the store the process group was initialized with (the RankPool's
    TCPStore), for nixl_ep's metadata exchange."""
    return dist.PrefixStore("nixl_ep", dist.distributed_c10d._get_default_store())


def make_options(backend: str, **overrides: Any) -> Any:
    """The backend's options dataclass; a store is added where the options take one."""
    options_type = get_backend(backend).manager.options_type
    names = {f.name for f in dataclasses.fields(options_type)}
    if "tcp_store_group" in names and "tcp_store_group" not in overrides:
        overrides["tcp_store_group"] = default_store()
    return options_type(**overrides)


def _dispatch_config(backend: str, cfg: MoEConfig, max_tokens: int, quant: QuantSpec,
                     options: Optional[dict]) -> DispatchConfig:
    return DispatchConfig(cfg.num_experts, cfg.hidden, cfg.num_topk, max_tokens, cfg.dtype, quant,
                          backend_options=make_options(backend, **(options or {})))


@contextlib.contextmanager
def built(backend: str, layout: ParallelLayout, cfg: MoEConfig, max_tokens: int = 4,
          quant: QuantSpec = QuantSpec(), options: Optional[dict] = None
          ) -> Iterator[LowLatencyPrepareFinalize]:
    """The backend's prepare/finalize on the emulated library; state reset and manager
    destroyed on exit."""
    with installed(vendor_module(backend)):
        pf = get_backend(backend).build(cached_dist_context(layout),
                                        _dispatch_config(backend, cfg, max_tokens, quant, options))
        assert isinstance(pf, LowLatencyPrepareFinalize)
        try:
            yield pf
        finally:
            # Probes abandon the same calls on every rank: the group is still in step.
            pf.reset_call_state()
            clear_group_faults(pf.manager.ctx.ep_group)
            pf.manager.destroy()


def run_ll_layer(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
                 strategy: Optional[ReductionStrategy], num_tokens: int,
                 quant: QuantSpec = QuantSpec(), seed: int = 0,
                 options: Optional[dict] = None, masked_rank: Optional[int] = None) -> dict:
    """One forward of a MoE layer through the backend on the emulated library. With
    ``masked_rank``, every other rank masks that rank before the forward. Also records how
    many receives were pending when the shared expert ran."""
    with installed(vendor_module(backend)):
        ctx = cached_dist_context(layout)
        layer = MoELayer(MoEWeights.random(cfg, seed), ctx, get_backend(backend), strategy, quant,
                         OverlapConfig(overlap=False), max_tokens_per_rank=max(num_tokens, 1),
                         backend_options=make_options(backend, **(options or {})))
        try:
            assert layer.pf is not None
            runtime = layer.pf.manager.buffer.runtime
            pending_at_shared: list[int] = []
            shared = layer.shared
            if shared is not None:
                def shared_spy(x: torch.Tensor) -> torch.Tensor:
                    pending_at_shared.append(runtime.pending_receives)
                    return shared(x)
                layer.shared = shared_spy  # type: ignore[assignment]
            if masked_rank is not None and rank != masked_rank:
                layer.pf.manager.set_rank_masked(masked_rank)
            masked = layer.pf.manager.masked_ranks() if masked_rank is not None else []
            x = demo_inputs(cfg, num_tokens, ctx.dp_rank, seed)
            start = runtime.launches
            with count_dist_calls() as calls:
                out = layer(x)
            launches = runtime.launches - start
            stats = layer.dispatch_stats
        finally:
            layer.destroy()
    rows = owned_rows(num_tokens, layout.tp, ctx.tp_rank)
    return dict(out=out, strategy=layer.strategy, pairs=stats.pairs, owned=rows.num_owned,
                sf_bytes=stats.sf_bytes, masked=masked, pending_at_shared=pending_at_shared,
                pending_after=runtime.pending_receives, launches=launches,
                tp_collectives=[n for n, _ in calls if n != "all_to_all_single"])


class PackedUE8M0Experts:
    """An experts object that asks for packed UE8M0 activation scales (as DeepGEMM does)."""

    def supports_packed_ue8m0_act_scales(self) -> bool:
        return True


def run_ll_prepare(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
                   num_tokens: int, quant: QuantSpec, seed: int = 0,
                   options: Optional[dict] = None, ue8m0_experts: bool = False) -> dict:
    """prepare alone on the owned slice; returns what it gave the experts, this rank's owned
    tokens and routing, and the receives pending before/after the hook."""
    with built(backend, layout, cfg, max(num_tokens, 1), quant, options) as pf:
        if ue8m0_experts:
            pf.post_init_setup(PackedUE8M0Experts())
        w = MoEWeights.random(cfg, seed)
        x = demo_inputs(cfg, num_tokens, layout.dp_rank(rank), seed)
        tw, ti = route(x, w.router, cfg.num_topk, cfg.renormalize)
        owned = slice_owned(owned_rows(num_tokens, layout.tp, layout.tp_rank(rank)), x, ti, tw)
        runtime = pf.manager.buffer.runtime
        sent = pf.prepare_async(owned.hidden_states, owned.topk_weights, owned.topk_ids, quant)
        pending_before = runtime.pending_receives
        assert sent.hook is not None
        sent.hook()
        prep = sent.receiver()
        meta = prep.expert_tokens_meta
        return dict(
            x=prep.x.clone(), x_sf=None if prep.x_sf is None else prep.x_sf.clone(),
            counts=None if meta is None else meta.expert_num_tokens.clone(),
            topk_ids=prep.topk_ids, topk_weights=prep.topk_weights,
            pending_before_hook=pending_before, pending_after_hook=runtime.pending_receives,
            tokens=owned.hidden_states, ids=owned.topk_ids,
            num_local_experts=pf.manager.num_local_experts,
            max_tokens=pf.max_num_tokens_per_rank(), stats=dataclasses.asdict(pf.stats))


def _zeros_call(pf: LowLatencyPrepareFinalize, n: int, ids_dtype: torch.dtype = torch.int64
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = pf.cfg.num_topk
    return (torch.zeros(n, pf.cfg.hidden, dtype=torch.bfloat16), torch.full((n, k), 1.0 / k),
            (torch.arange(n * k) % pf.cfg.num_experts).view(n, k).to(ids_dtype))


def _random_call(cfg: MoEConfig, seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
    """n random tokens bf16 [n, hidden], weights float32 [n, num_topk] (not normalized) and
    distinct expert ids int64 [n, num_topk] per token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cfg.hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.num_topk]
                       for _ in range(n)])
    return x, torch.rand(n, cfg.num_topk, generator=g), ids


def prepare_with_ids(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
                     ids_dtype: torch.dtype) -> list[int]:
    """prepare + finalize with topk ids of ``ids_dtype``; returns the receive counts."""
    with built(backend, layout, cfg) as pf:
        x, w, ids = _zeros_call(pf, 2, ids_dtype)
        prep = pf.prepare(x, w, ids, QuantSpec())
        out = torch.empty(2, cfg.hidden, dtype=torch.bfloat16)
        pf.finalize(torch.zeros(prep.x.shape, dtype=torch.bfloat16), w, ids, out)
        assert prep.expert_tokens_meta is not None
        return prep.expert_tokens_meta.expert_num_tokens.tolist()


def blocking_and_hooked_round_trips(rank: int, world: int, backend: str, layout: ParallelLayout,
                                    cfg: MoEConfig) -> dict:
    """One round trip through the blocking ``prepare``/``finalize`` and one through
    ``prepare_async``/``finalize_async`` with their hooks, identity experts (the received rows
    go straight back), same inputs; returns the library launches each made and both outputs."""
    with built(backend, layout, cfg) as pf:
        runtime = pf.manager.buffer.runtime
        x, w, ids = _random_call(cfg, rank, 3)
        w = w / w.sum(dim=1, keepdim=True)
        start = runtime.launches
        prep = pf.prepare(x, w, ids, QuantSpec())
        out_blocking = torch.empty_like(x)
        pf.finalize(prep.x.clone(), w, ids, out_blocking)
        blocking = runtime.launches - start
        start = runtime.launches
        sent = pf.prepare_async(x, w, ids, QuantSpec())
        assert sent.hook is not None
        sent.hook()
        prep = sent.receiver()
        out_hooked = torch.empty_like(x)
        back = pf.finalize_async(prep.x.clone(), w, ids, out_hooked)
        assert back.hook is not None
        back.hook()
        back.receiver()
        return dict(x=x, blocking=blocking, hooked=runtime.launches - start,
                    out_blocking=out_blocking, out_hooked=out_hooked)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` in a non-contiguous tensor (the first two dims swapped in
    memory)."""
    out = t.transpose(0, 1).contiguous().transpose(0, 1)
    assert not out.is_contiguous() and torch.equal(out, t)
    return out


def strided_round_trips(rank: int, world: int, backend: str, layout: ParallelLayout,
                        cfg: MoEConfig) -> dict:
    """The same round trip, blocking and hooked, once with contiguous inputs and once with
    non-contiguous tokens, weights, ids and expert outputs (the same values); returns both
    outputs and the library launches each made (deepep_ll leaves the layout to the runtime's
    asserts, which refuse such inputs before launching: the call is made again on copies)."""
    with built(backend, layout, cfg) as pf:
        runtime = pf.manager.buffer.runtime
        x, w, ids = _random_call(cfg, rank, 4)
        outs, launches = {}, {}
        for strided in (False, True):
            args = (_strided(x), _strided(w), _strided(ids)) if strided else (x, w, ids)
            start = runtime.launches
            prep = pf.prepare(*args, QuantSpec())
            expert_out = prep.x.nan_to_num()  # the slots nothing was received in hold NaN
            expert_out = _strided(expert_out) if strided else expert_out
            outs[strided, "blocking"] = pf.finalize(expert_out, args[1], args[2],
                                                    torch.empty_like(x))
            sent = pf.prepare_async(*args, QuantSpec())
            sent.hook()
            prep = sent.receiver()
            expert_out = prep.x.nan_to_num()  # the slots nothing was received in hold NaN
            expert_out = _strided(expert_out) if strided else expert_out
            back = pf.finalize_async(expert_out, args[1], args[2], torch.empty_like(x))
            back.hook()
            outs[strided, "hooked"] = back.receiver()
            launches[strided] = runtime.launches - start
        return dict(outs=outs, launches=launches, direct=pf.runtime_calls is not None)


def stats_after_calls(rank: int, world: int, backend: str, layout: ParallelLayout,
                      cfg: MoEConfig) -> dict:
    """The backend's stats after a bf16 round trip, an FP8 one, an FP8 dispatch whose call is
    then abandoned (reset_call_state, on every rank alike) and a bf16 dispatch still waiting
    for its combine; 3 tokens each."""
    with built(backend, layout, cfg) as pf:
        x, w, ids = _zeros_call(pf, 3)
        fp8 = QuantSpec(QuantScheme.FP8_BLOCK128)
        out = torch.empty_like(x)
        for quant in (QuantSpec(), fp8):
            prep = pf.prepare(x, w, ids, quant)
            pf.finalize(torch.zeros(prep.x.shape, dtype=torch.bfloat16), w, ids, out)
        pf.prepare(x, w, ids, fp8)
        pf.reset_call_state()
        clear_group_faults(pf.manager.ctx.ep_group)
        prep = pf.prepare(x, w, ids, QuantSpec())
        in_flight = dataclasses.asdict(pf.stats)
        pf.finalize(torch.zeros(prep.x.shape, dtype=torch.bfloat16), w, ids, out)
        return dict(in_flight=in_flight, done=dataclasses.asdict(pf.stats),
                    kernel_hidden=pf.manager.kernel_hidden)


def runtime_failures(rank: int, world: int, backend: str, layout: ParallelLayout,
                     cfg: MoEConfig) -> dict:
    """The emulated runtime's dispatch, then its combine, fail with valid inputs (a
    RuntimeError, as a CUDA error reaches Python through pybind11), on every rank alike. Each
    error must reach the caller as it is, after one runtime call: an error of the runtime that
    is not one of its input asserts is never answered by calling again."""
    from moe_plugins.lowlat.vendor import RuntimeCalls

    with built(backend, layout, cfg) as pf:
        calls = pf.runtime_calls
        assert calls is not None
        made = {"dispatch": 0, "combine": 0}

        def failing(name: str) -> Any:
            def call(*args: Any) -> tuple:
                made[name] += 1
                raise RuntimeError(f"emulated {name} failure")
            return call

        x, w, ids = _zeros_call(pf, 2)
        errors = {}
        pf.runtime_calls = RuntimeCalls(failing("dispatch"), calls.combine)
        try:
            pf.prepare(x, w, ids, QuantSpec())
        except RuntimeError as e:
            errors["dispatch"] = str(e)
        clear_group_faults(pf.manager.ctx.ep_group)
        pf.runtime_calls = RuntimeCalls(calls.dispatch, failing("combine"))
        prep = pf.prepare(x, w, ids, QuantSpec())
        try:
            pf.finalize(torch.zeros(prep.x.shape, dtype=torch.bfloat16), w, ids,
                        torch.empty_like(x))
        except RuntimeError as e:
            errors["combine"] = str(e)
        broken = pf.faults.broken is not None
        # the real combine must still run on every rank: the peers' dispatch is in flight
        clear_group_faults(pf.manager.ctx.ep_group)
        pf.runtime_calls = calls
        return dict(errors=errors, made=made, broken=broken)


def float32_expert_outputs(rank: int, world: int, backend: str, layout: ParallelLayout,
                           cfg: MoEConfig) -> tuple[Optional[str], Optional[str]]:
    """finalize with float32 expert outputs (every rank alike): (error type, message)."""
    with built(backend, layout, cfg) as pf:
        x, w, ids = _zeros_call(pf, 2)
        prep = pf.prepare(x, w, ids, QuantSpec())
        try:
            pf.finalize(torch.zeros(prep.x.shape), w, ids, torch.empty_like(x))
        except TypeError as e:
            return type(e).__name__, str(e)
        return None, None


def runtime_and_wrapper_round_trips(rank: int, world: int, backend: str, layout: ParallelLayout,
                                    cfg: MoEConfig) -> dict:
    """The same blocking and hooked round trips through the library's C++ runtime (the path on
    the known releases' signatures, RuntimeCalls) and through its buffer's Python methods (the
    path on any other signatures); returns whether the runtime path was chosen and all
    outputs."""
    with built(backend, layout, cfg) as pf:
        x, w, ids = _random_call(cfg, rank, 3)
        chosen = pf.runtime_calls is not None
        calls = pf.runtime_calls
        outs = {}
        for direct in (True, False):
            pf.runtime_calls = calls if direct else None
            prep = pf.prepare(x, w, ids, QuantSpec())
            outs[direct, "blocking"] = pf.finalize(prep.x.clone(), w, ids, torch.empty_like(x))
            sent = pf.prepare_async(x, w, ids, QuantSpec())
            sent.hook()
            prep = sent.receiver()
            back = pf.finalize_async(prep.x.clone(), w, ids, torch.empty_like(x))
            back.hook()
            outs[direct, "hooked"] = back.receiver()
        return dict(chosen=chosen, outs=outs, x=x, w=w)


def prepare_too_many_tokens(rank: int, world: int, backend: str, layout: ParallelLayout,
                            cfg: MoEConfig) -> None:
    with built(backend, layout, cfg, max_tokens=4) as pf:
        cap = pf.max_num_tokens_per_rank()
        assert cap is not None
        pf.prepare(*_zeros_call(pf, cap + 1), QuantSpec())


def finalize_wrong_shape_then_prepare(rank: int, world: int, backend: str, layout: ParallelLayout,
                                      cfg: MoEConfig) -> dict:
    """finalize with an expert output of the wrong shape (must raise ValueError and drop the
    dispatch handle); the next prepare must raise naming it (the group is out of step: no host
    exchange tells this rank that its peers failed alike); once every rank forgets the fault
    (they all failed the same way), prepare + finalize work again."""
    from moe_plugins.faults import LayerBrokenError

    with built(backend, layout, cfg) as pf:
        x, w, ids = _zeros_call(pf, 2)
        prep = pf.prepare(x, w, ids, QuantSpec())
        e_l, slots, h = prep.x.shape
        out = torch.empty(2, h, dtype=torch.bfloat16)
        try:
            pf.finalize(torch.zeros(e_l, slots - 1, h, dtype=torch.bfloat16), w, ids, out)
            error = None
        except ValueError as e:
            error = str(e)
        try:
            pf.prepare(x, w, ids, QuantSpec())
            second_error = None
        except LayerBrokenError as e:
            second_error = str(e)
        clear_group_faults(pf.manager.ctx.ep_group)
        prep = pf.prepare(x, w, ids, QuantSpec())
        pf.finalize(torch.zeros(prep.x.shape, dtype=torch.bfloat16), w, ids, out)
        return dict(error=error, second_error=second_error, out=out)


def mask_peer(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
              offset: int, options: Optional[dict] = None) -> list[int]:
    """Mask EP rank (rank + offset) % world (offset 0: this rank itself)."""
    with built(backend, layout, cfg, options=options) as pf:
        pf.manager.set_rank_masked((rank + offset) % world)
        return pf.manager.masked_ranks()


def bad_mask_requests(peer: int, world: int) -> list[tuple[str, Any, Any, str]]:
    """Every mask request a masking entry point must refuse (``set_rank_masked``,
    ``update_mask``), as (label, rank, masked, the exception type expected): flags that are not
    a bool or the int 0/1 (a string, a float, None, tensors of any shape, 0-d included) and
    ranks that are not an int in [0, world). ``peer``: a valid rank other than the caller's."""
    return [
        ("masked='False'", peer, "False", "TypeError"),  # bool('False') is True: masked it
        ("masked='True'", peer, "True", "TypeError"),
        ("masked='1'", peer, "1", "TypeError"),
        ("masked=''", peer, "", "TypeError"),
        ("masked=1.5", peer, 1.5, "TypeError"),
        ("masked=1.0", peer, 1.0, "TypeError"),
        ("masked=0.0", peer, 0.0, "TypeError"),
        ("masked=None", peer, None, "TypeError"),
        ("masked=2", peer, 2, "ValueError"),
        ("masked=-1", peer, -1, "ValueError"),
        ("masked=tensor(1)", peer, torch.tensor(1), "TypeError"),
        ("masked=tensor(True)", peer, torch.tensor(True), "TypeError"),
        ("masked=tensor([1])", peer, torch.tensor([1]), "TypeError"),
        ("masked=tensor([0, 1])", peer, torch.tensor([0, 1]), "TypeError"),
        ("rank=True", True, True, "TypeError"),
        ("rank=1.0", float(peer), True, "TypeError"),
        ("rank='1'", str(peer), True, "TypeError"),
        ("rank=None", None, True, "TypeError"),
        ("rank=tensor(1)", torch.tensor(peer), True, "TypeError"),
        ("rank=-1", -1, True, "ValueError"),
        ("rank=world", world, True, "ValueError"),
    ]


def refused_masks(mask: Any, current: Any) -> list[tuple[str, Optional[tuple[str, str]], Any]]:
    """Each request of :func:`bad_mask_requests` (for this rank's next peer) through ``mask``
    (a masking entry point: ``(rank, masked) -> None``): (label, (exception type, message) or
    None where it was taken, ``current()`` afterwards: the mask state it must not change)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for label, r, m, _ in bad_mask_requests((rank + 1) % world, world):
        try:
            mask(r, m)
            got = None
        except (TypeError, ValueError) as e:
            got = (type(e).__name__, str(e))
        out.append((label, got, current()))
    return out


def bad_masks_then_forward(rank: int, world: int, backend: str, layout: ParallelLayout,
                           cfg: MoEConfig, num_tokens: int, options: Optional[dict] = None
                           ) -> dict:
    """A layer on the backend; every bad mask request through its manager's
    ``set_rank_masked`` (:func:`refused_masks`: the library's mask and the ranks callers masked
    after each), then a forward; then the int 1 and 0 mask and unmask the next rank."""
    from moe_plugins.lowlat.manager import _CALLER_MASKED

    with installed(vendor_module(backend)):
        ctx = cached_dist_context(layout)
        layer = MoELayer(MoEWeights.random(cfg, 0), ctx, get_backend(backend), None, QuantSpec(),
                         OverlapConfig(overlap=False), max_tokens_per_rank=max(num_tokens, 1),
                         backend_options=make_options(backend, **(options or {})))
        try:
            assert layer.pf is not None
            manager = layer.pf.manager
            before = (manager.masked_ranks(), sorted(_CALLER_MASKED.get(manager._buffer_key, ())))
            refused = refused_masks(manager.set_rank_masked, lambda: (
                manager.masked_ranks(), sorted(_CALLER_MASKED.get(manager._buffer_key, ()))))
            out = layer(demo_inputs(cfg, num_tokens, ctx.dp_rank, 0))
            peer = (rank + 1) % world
            manager.set_rank_masked(peer, 1)
            after_one = manager.masked_ranks()
            manager.set_rank_masked(peer, 0)
            after_zero = manager.masked_ranks()
        finally:
            layer.destroy()
    return dict(before=before, refused=refused, out=out, after_one=after_one,
                after_zero=after_zero)


def buffer_sharing(rank: int, world: int, backend: str, layout: ParallelLayout,
                   cfg: MoEConfig) -> dict:
    """Two layers of the same sizes share one buffer; the last destroy() destroys it."""
    with built(backend, layout, cfg) as first:
        with built(backend, layout, cfg) as second:
            shared = second.manager.buffer is first.manager.buffer
        runtime = first.manager.buffer.runtime
        alive_after_one = runtime is not None and not runtime.destroyed
        with built(backend, layout, dataclasses.replace(cfg, num_topk=cfg.num_topk + 1)) as other:
            same_size_other_topk = other.manager.buffer is first.manager.buffer
    return dict(shared=shared, alive_after_one=alive_after_one,
                destroyed_after_last=runtime.destroyed, same_size_other_topk=same_size_other_topk)


def buffer_state(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
                 options: Optional[dict] = None) -> dict:
    """The emulated buffer's constructor arguments and state, and the sizes the manager chose."""
    with built(backend, layout, cfg, options=options) as pf:
        m, b = pf.manager, pf.manager.buffer
        state = {k: v for k, v in vars(b).items() if isinstance(v, (int, bool, str))}
        runtime = b.runtime
        store = m.options.tcp_store_group if hasattr(m.options, "tcp_store_group") else None
        return dict(
            buffer=state, kernel_hidden=m.kernel_hidden, max_tokens=m.max_tokens_per_rank,
            num_ranks=m.num_ranks, num_experts=m.num_experts,
            num_local_experts=m.num_local_experts,
            expected_rdma=type(b).get_rdma_size_hint(m.max_tokens_per_rank, m.kernel_hidden,
                                                     m.num_ranks, m.num_experts)
            if hasattr(type(b), "get_rdma_size_hint") else
            type(b).get_low_latency_rdma_size_hint(m.max_tokens_per_rank, m.kernel_hidden,
                                                   m.num_ranks, m.num_experts),
            connected=sorted(getattr(runtime, "connected", [])),
            own_key_left=None if store is None else store.check([f"NIXL_EP/{rank}"]))


def build_only(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
               max_tokens: int, options: Optional[dict] = None) -> None:
    with built(backend, layout, cfg, max_tokens=max_tokens, options=options):
        pass


def bad_prepare(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
                kind: str) -> tuple[Optional[str], Optional[str]]:
    """prepare with one of fault_rank_fns.corrupt's bad inputs, on every rank alike (the
    low-latency kernels have no host exchange: a rank alone raising would leave its peers in
    the dispatch). Returns (error type, message)."""
    from tests.runner.faults_ranks import corrupt

    with built(backend, layout, cfg) as pf:
        x, w, ids = _zeros_call(pf, 2)
        x, w, ids = corrupt(kind, x, w, ids, cfg.num_experts)
        try:
            pf.prepare(x, w, ids, QuantSpec())
        except (ValueError, TypeError) as e:
            return type(e).__name__, str(e)
        return None, None


def finalize_other_ids(rank: int, world: int, backend: str, layout: ParallelLayout,
                       cfg: MoEConfig) -> tuple[Optional[str], Optional[str]]:
    """prepare, finalize with an equal copy of the topk ids (accepted: compared by value), then
    prepare again and finalize with other ids (not the ones given to prepare)."""
    with built(backend, layout, cfg) as pf:
        x, w, ids = _zeros_call(pf, 2)
        prep = pf.prepare(x, w, ids, QuantSpec())
        pf.finalize(torch.zeros(prep.x.shape, dtype=torch.bfloat16), w, ids.clone(),
                    torch.empty(2, cfg.hidden, dtype=torch.bfloat16))
        prep = pf.prepare(x, w, ids, QuantSpec())
        try:
            pf.finalize(torch.zeros(prep.x.shape, dtype=torch.bfloat16), w,
                        (ids + 1) % cfg.num_experts, torch.empty(2, cfg.hidden, dtype=torch.bfloat16))
        except ValueError as e:
            return type(e).__name__, str(e)
        return None, None


def owed_call(rank: int, world: int, backend: str, layout: ParallelLayout, cfg: MoEConfig,
              next_tokens: int, timeout_s: float) -> dict:
    """Direct use of the backend (no layer; ``cfg`` without a shared expert): rank 0's prepare
    refuses its input (more tokens than the buffers hold) while rank 1's call goes on. Rank 0's
    next prepare has ``next_tokens`` tokens: 0 is the owed call without its tokens (rank 1's
    call completes, with the right output); any other count would pair with rank 1's pending
    call, so it must break the group instead. Returns what each step raised or returned (with
    the seconds) and this rank's routed output."""
    from moe_plugins.groups import make_dist_context
    from moe_plugins.runner.experts import TorchExperts
    from tests.runner.faults_ranks import _error

    with installed(vendor_module(backend)):
        ctx = make_dist_context(layout, timeout_s=timeout_s, fresh_ep_group=True)
        pf = get_backend(backend).build(ctx, _dispatch_config(backend, cfg, 4, QuantSpec(), None))
        try:
            weights = MoEWeights.random(cfg, 0)
            experts = TorchExperts(weights.local_experts(world, rank), QuantSpec(), cfg.dtype)
            seen: dict[str, Any] = {"out": None}
            n = 3
            if rank == 0:
                x5 = demo_inputs(cfg, 5, 0, 1)
                w5, ids5 = route(x5, weights.router, cfg.num_topk, cfg.renormalize)
                seen["refused"] = _error(lambda: pf.prepare(x5, w5, ids5, QuantSpec()))
                n = next_tokens
            x = demo_inputs(cfg, n, ctx.dp_rank, 0)
            w, ids = route(x, weights.router, cfg.num_topk, cfg.renormalize)

            def round_trip() -> None:
                prep = pf.prepare(x, w, ids, QuantSpec())
                seen["out"] = pf.finalize(experts.apply(prep), w, ids, torch.empty_like(x))

            seen["call"] = _error(round_trip)
            seen["broken"] = pf.faults.broken
            return seen
        finally:
            pf.reset_call_state()
            pf.manager.destroy()


def deterministic_round_trip(rank: int, world: int, backend: str, layout: ParallelLayout,
                             cfg: MoEConfig) -> dict:
    """One blocking round trip under torch.use_deterministic_algorithms(True) (restored after):
    the error prepare raised (type, message) or None, and the library launches made."""
    with built(backend, layout, cfg) as pf:
        runtime = pf.manager.buffer.runtime
        x, w, ids = _zeros_call(pf, 2)
        start, error = runtime.launches, None
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            prep = pf.prepare(x, w, ids, QuantSpec())
            pf.finalize(torch.zeros(prep.x.shape, dtype=torch.bfloat16), w, ids,
                        torch.empty(2, cfg.hidden, dtype=torch.bfloat16))
        except (ValueError, TypeError) as e:
            error = (type(e).__name__, str(e))
        finally:
            torch.use_deterministic_algorithms(before)
        return dict(error=error, launches=runtime.launches - start,
                    direct=pf.runtime_calls is not None)



def build_with_qp_depth(rank: int, world: int, backend: str, layout: ParallelLayout,
                        cfg: MoEConfig, depth: str) -> Optional[str]:
    """Build ``backend`` with ``$NVSHMEM_QP_DEPTH`` = ``depth`` in this rank's process (put back
    after): the ValueError's text, or None where it built."""
    import os

    before = os.environ.get("NVSHMEM_QP_DEPTH")
    os.environ["NVSHMEM_QP_DEPTH"] = depth
    try:
        build_only(rank, world, backend, layout, cfg, 8)
        return None
    except ValueError as e:
        return str(e)
    finally:
        if before is None:
            del os.environ["NVSHMEM_QP_DEPTH"]
        else:
            os.environ["NVSHMEM_QP_DEPTH"] = before
