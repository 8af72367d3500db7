"""Rank functions that inject faults: a bad input on one rank, a rank that fails mid-way, a rank
that does not come, ranks in different layers, a rank process that dies. Each builds its layers
on NEW process groups with a short timeout (moe_plugins.groups.make_dist_context), so the broken
state a fault leaves stays with those groups and the pool's default group stays in step."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from moe_plugins.config import DispatchConfig
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.groups import make_dist_context
from moe_plugins.runner.layer import MoELayer
from moe_plugins.layout import ParallelLayout, owned_rows, slice_owned
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights, route
from moe_plugins.overlap import OverlapConfig
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import get_backend
from moe_plugins.strategy import ReductionStrategy


def _layer(ctx: Any, cfg: MoEConfig, strategy: Optional[ReductionStrategy], tokens: int) -> MoELayer:
    return MoELayer(MoEWeights.random(cfg, 0), ctx, get_backend("torch"), strategy, QuantSpec(),
                    OverlapConfig(overlap=False), max_tokens_per_rank=max(tokens, 1))


def _error(fn: Any) -> tuple[Optional[str], Optional[str], float]:
    """(exception type name, message, seconds) of calling fn; (None, None, s) when it returns."""
    t0 = time.monotonic()
    try:
        fn()
        return None, None, time.monotonic() - t0
    except Exception as e:  # the tests read what each rank saw
        return type(e).__name__, str(e), time.monotonic() - t0


BAD_INPUT_KINDS = ("expert_below_minus_one", "expert_too_large", "int_activations",
                   "tokens_mismatch", "wide_topk")


def expected_error(kind: str, cfg: MoEConfig) -> tuple[str, str]:
    """(error type, text in its message) a prepare must raise for ``corrupt(kind, ...)``."""
    return {
        "int_activations": ("TypeError", "integer activations would be truncated"),
        "wide_topk": ("ValueError", f"the layer was built for num_topk={cfg.num_topk}"),
        "expert_too_large": ("ValueError", f"expert ids outside [-1, {cfg.num_experts})"),
        "expert_below_minus_one": ("ValueError", f"expert ids outside [-1, {cfg.num_experts})"),
        "tokens_mismatch": ("ValueError", "must cover the same tokens"),
    }[kind]


def corrupt(kind: str, x: torch.Tensor, tw: torch.Tensor, ti: torch.Tensor, num_experts: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One of the bad inputs of issue 16, made from good ones."""
    if kind == "int_activations":
        return (x * 10).to(torch.int32), tw, ti
    if kind == "wide_topk":
        return x, torch.cat([tw, tw[:, :1]], dim=1), torch.cat([ti, ti[:, :1]], dim=1)
    if kind == "expert_too_large":
        ti = ti.clone()
        ti[0, 0] = num_experts
        return x, tw, ti
    if kind == "expert_below_minus_one":
        ti = ti.clone()
        ti[-1, -1] = -2
        return x, tw, ti
    if kind == "tokens_mismatch":
        return x[:-1], tw, ti
    raise AssertionError(kind)


def _torch_backend_call(ctx: Any, cfg: MoEConfig, tokens: int) -> tuple[Any, torch.Tensor,
                                                                         torch.Tensor, torch.Tensor]:
    """The torch backend on ``ctx`` and this rank's routed inputs: (pf, x, topk_weights,
    topk_ids) for ``tokens`` tokens of its DP group."""
    pf = get_backend("torch").build(ctx, DispatchConfig(cfg.num_experts, cfg.hidden, cfg.num_topk,
                                                        tokens, cfg.dtype))
    x = demo_inputs(cfg, tokens, ctx.dp_rank, 0)
    tw, ti = route(x, MoEWeights.random(cfg, 0).router, cfg.num_topk, cfg.renormalize)
    return pf, x, tw, ti


def bad_prepare_input_on_one_rank(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                                  bad_rank: int, kind: str, tokens: int, timeout_s: float) -> dict:
    """Every rank calls the torch backend's prepare; ``bad_rank`` passes a bad input. Then every
    rank runs a whole layer call (which must work: nothing is out of step)."""
    ctx = make_dist_context(layout, timeout_s=timeout_s, fresh_ep_group=True)
    pf, x, tw, ti = _torch_backend_call(ctx, cfg, tokens)
    owned = slice_owned(owned_rows(tokens, layout.tp, ctx.tp_rank), x, ti, tw)
    args = (owned.hidden_states, owned.topk_weights, owned.topk_ids)
    if rank == bad_rank:
        args = corrupt(kind, *args, cfg.num_experts)
    err_type, err, seconds = _error(lambda: pf.prepare(*args, QuantSpec()))
    pf.reset_call_state()
    layer = _layer(ctx, cfg, ReductionStrategy.ROW_SCATTER_ALLREDUCE, tokens)
    return dict(err_type=err_type, err=err, seconds=seconds, out=layer(x))


def fail_mid_way_on_one_rank(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                             bad_rank: int, tokens: int, timeout_s: float) -> dict:
    """``bad_rank``'s experts raise after the dispatch; its peers wait in the combine. Then every
    rank calls the layer again."""
    ctx = make_dist_context(layout, timeout_s=timeout_s, fresh_ep_group=True)
    layer = _layer(ctx, cfg, ReductionStrategy.ROW_SCATTER_ALLREDUCE, tokens)
    if rank == bad_rank:
        def fail(prep: Any) -> torch.Tensor:
            raise RuntimeError("injected expert failure on one rank")
        layer.experts.apply = fail  # type: ignore[method-assign]
    x = demo_inputs(cfg, tokens, ctx.dp_rank, 0)
    first = _error(lambda: layer(x))
    second = _error(lambda: layer(x))
    return dict(first=first, second=second)


def absent_peer(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig, absent_rank: int,
                tokens: int, timeout_s: float) -> dict:
    """Every rank but ``absent_rank`` calls the layer; the absent one returns at once."""
    ctx = make_dist_context(layout, timeout_s=timeout_s, fresh_ep_group=True)
    layer = _layer(ctx, cfg, None, tokens)
    if rank == absent_rank:
        return dict(first=(None, None, 0.0))
    return dict(first=_error(lambda: layer(demo_inputs(cfg, tokens, ctx.dp_rank, 0))))


def ranks_in_different_layers(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                              odd_rank: int, tokens: int, timeout_s: float) -> dict:
    """Two layers of equal config built in the same order everywhere; ``odd_rank`` calls the
    second while its peers call the first."""
    ctx = make_dist_context(layout, timeout_s=timeout_s, fresh_ep_group=True)
    a, b = _layer(ctx, cfg, None, tokens), _layer(ctx, cfg, None, tokens)
    x = demo_inputs(cfg, tokens, ctx.dp_rank, 0)
    return dict(first=_error(lambda: (b if rank == odd_rank else a)(x)))


def expert_ids_minus_one(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                         tokens: int) -> dict:
    """The torch backend with some expert ids -1 (no expert): prepare, the experts, finalize."""
    from moe_plugins.runner.experts import TorchExperts
    from moe_plugins.groups import cached_dist_context

    ctx = cached_dist_context(layout)
    pf, x, tw, ti = _torch_backend_call(ctx, cfg, tokens)
    ti = ti.clone()
    ti[::2, 0] = -1  # every other token loses its first expert
    prep = pf.prepare(x, tw, ti, QuantSpec())
    experts = TorchExperts(MoEWeights.random(cfg, 0).local_experts(layout.ep_size, ctx.rank),
                           QuantSpec(), cfg.dtype)
    out = pf.finalize(experts.apply(prep), tw, ti, torch.empty_like(x))
    return dict(out=out, topk_ids=ti, topk_weights=tw, x=x)


def finalize_with_other_topk_ids(rank: int, world: int, layout: ParallelLayout, cfg: MoEConfig,
                                 tokens: int) -> dict:
    """prepare with the router's ids, finalize with a copy of them (equal values: accepted, the
    same output as with the very tensor), then prepare again and finalize with other ids: must
    raise on every rank."""
    from moe_plugins.faults import clear_group_faults
    from moe_plugins.groups import cached_dist_context

    ctx = cached_dist_context(layout)
    pf, x, tw, ti = _torch_backend_call(ctx, cfg, tokens)
    outs = []
    for ids in (ti, ti.clone()):
        prep = pf.prepare(x, tw, ti, QuantSpec())
        expert_out = torch.arange(prep.x.shape[0] * cfg.hidden, dtype=torch.float32).view(
            prep.x.shape[0], cfg.hidden) % 7
        outs.append(pf.finalize(expert_out, tw, ids, torch.empty_like(x)))
    prep = pf.prepare(x, tw, ti, QuantSpec())
    err = _error(lambda: pf.finalize(torch.zeros(prep.x.shape[0], cfg.hidden), tw,
                                     (ti + 1) % cfg.num_experts, torch.empty_like(x)))
    pf.reset_call_state()
    clear_group_faults(ctx.ep_group)  # every rank abandoned this call alike
    return dict(err=err, same=outs[0], copy=outs[1])


def die(rank: int, world: int, dying_rank: int, how: str, timeout_s: float) -> None:
    """``dying_rank`` ends its process (exit code 3, or SIGKILL); the others wait in a
    collective on a new group."""
    group = dist.new_group(list(range(world)), timeout=__import__("datetime").timedelta(seconds=timeout_s))
    if rank == dying_rank:
        time.sleep(0.3)  # let the peers enter the collective
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(4), group=group)


def stop_or_sleep(rank: int, world: int, bad: int, how: str, timeout_s: float) -> None:
    """``bad`` stops its own process (``how="stop"``: SIGSTOP, as ``kill -STOP`` does) or sleeps
    far past the timeout (``"sleep"``: a rank busy outside the collectives); the others wait
    for it in a collective on a new group with a ``timeout_s`` bound and raise what a layer
    raises then (CollectiveError)."""
    import datetime

    from moe_plugins.faults import GroupFaults, collective_error

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=timeout_s))
    if rank == bad:
        time.sleep(0.3)  # let the peers enter the collective
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(600)
    try:
        dist.all_reduce(torch.ones(4), group=group)
    except RuntimeError as e:
        raise collective_error(GroupFaults(list(range(world)), rank), "test layer", "all_reduce",
                               timeout_s, e) from e


def exit_at_start(rank: int) -> None:
    """A RankPool ``init`` that makes rank 1 die before it joins the process group."""
    if rank == 1:
        os._exit(7)


def raise_on(rank: int, world: int, bad: int) -> None:
    """``bad`` raises its own error; the others the error its failure causes on them."""
    from moe_plugins.faults import PeerInputError

    if rank == bad:
        raise ValueError(f"bad on rank {rank}\nsecond line")
    raise PeerInputError(f"rank {bad} rejected its inputs")


def vllm_group_bounded(rank: int, world: int, timeout_s: float) -> dict:
    """A group made with a 10-minute timeout (as vLLM's are, with torch's default or more),
    bounded by the vLLM glue (no --distributed-timeout-seconds given); rank 1 stays away."""
    import datetime

    from moe_plugins.groups import TIMEOUT_ENV
    from moe_plugins.vllm.manager import bound_vllm_timeout

    os.environ[TIMEOUT_ENV] = f"{timeout_s:g}"
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(minutes=10))
    bound = bound_vllm_timeout(group)
    if rank == 1:
        return dict(bound=bound, error=None)
    return dict(bound=bound, error=_error(lambda: dist.all_reduce(torch.ones(2), group=group)))


REFUSED_INPUTS = ("wide", "numpy", "int", "too_many_tokens", "chunk", "backend_refusal")


def refused_input(kind: str, x: torch.Tensor, cfg: MoEConfig, capacity: int, dp_rank: int
                  ) -> object:
    """A layer input this rank refuses before sending anything (``kind``), made from ``x``."""
    if kind == "wide":  # the layer's own check
        return torch.cat([x, x[:, :1]], dim=1)
    if kind == "numpy":
        return x.float().numpy()
    if kind == "int":
        return x.to(torch.int32)
    if kind == "too_many_tokens":  # more than the backend's buffers hold (`capacity`)
        return demo_inputs(cfg, capacity + 1, dp_rank, 0)
    if kind == "chunk":  # with tp=2 TP rank 0 would own capacity + 1 rows, TP rank 1 capacity
        return demo_inputs(cfg, 2 * capacity + 1, dp_rank, 0)
    if kind == "backend_refusal":  # the input is fine; the backend refuses (see below)
        return x
    raise AssertionError(kind)


def _refuse_in_the_backend(layer: MoELayer) -> None:
    """Make this rank's backend refuse its next call before sending anything, as its own
    input checks do (the fault is injected at the refusal, the path after it is real)."""
    pf = layer.pf
    assert pf is not None
    send = pf.dispatch_send  # type: ignore[attr-defined]

    def refusing(*args: Any, **kwargs: Any) -> Any:
        pf.dispatch_send = send  # type: ignore[attr-defined]
        raise pf.faults.refuse(pf, pf.name, ValueError("injected backend refusal"))

    pf.dispatch_send = refusing  # type: ignore[attr-defined]


def refused_layer_call(rank: int, world: int, backend: str, layout: ParallelLayout,
                       cfg: MoEConfig, bad_ranks: list[int], kind: str, tokens: int,
                       capacity: int, timeout_s: float,
                       call_timeout_s: Optional[float] = None) -> dict:
    """Every rank calls a layer of ``backend`` (on new groups with a short timeout; the
    emulated library where the backend needs one; ``call_timeout_s`` as the layer's argument)
    ; the ``bad_ranks`` give it an input they refuse. Then every rank calls the layer again
    with its good input. Returns each call's (error type, message, seconds) and output, and
    whether the group ended up broken."""
    from tests.backends.low_latency_ranks import make_options, vendor_module
    from tests.emulation import installed

    vendor = vendor_module(backend) if backend in ("deepep_ll", "nixl_ep") else None
    with installed(vendor) if vendor else contextlib.nullcontext():
        ctx = make_dist_context(layout, timeout_s=timeout_s, fresh_ep_group=True)
        options = make_options(backend) if vendor else None
        layer = MoELayer(MoEWeights.random(cfg, 0), ctx, get_backend(backend), None, QuantSpec(),
                         OverlapConfig(overlap=False), max_tokens_per_rank=capacity,
                         backend_options=options, call_timeout_s=call_timeout_s)
        try:
            x = demo_inputs(cfg, tokens, ctx.dp_rank, 0)
            given = refused_input(kind, x, cfg, capacity, ctx.dp_rank) if rank in bad_ranks else x
            if kind == "backend_refusal" and rank in bad_ranks:
                _refuse_in_the_backend(layer)
            outs: list[Optional[torch.Tensor]] = []

            def call(inp: object) -> None:
                outs.append(layer(inp))

            first = _error(lambda: call(given))
            second = _error(lambda: call(x))
            return dict(first=first, second=second, outs=outs, broken=layer.faults.broken,
                        out=outs[-1] if second[0] is None else None)
        finally:
            layer.destroy()


def killed_mid_call(rank: int, world: int, victim: int, backend: str) -> dict:
    """EP ``world``, ``backend`` on its emulated library (the vendor's package replaced by
    tests/emulation, its collectives on gloo), no call bound set (the backstop): call 1 on every
    rank; in call 2 the victim's process is killed (SIGKILL) inside its experts, after its
    dispatch was sent, while its peers wait for it in the combine. Each survivor reports call
    2's error (type, text, seconds from the start of the call) and call 3's (``step`` /
    ``result`` of tests.gpu.ep_harness)."""
    from tests.backends.low_latency_ranks import make_options
    from tests.emulation import installed
    from tests.gpu.ep_harness import result, step

    cfg = MoEConfig(hidden=128, num_experts=8, num_topk=2, intermediate=32,
                    shared_intermediate=64, dtype=torch.bfloat16)  # DeepEP's activations
    with installed("nixl_ep" if backend == "nixl_ep" else "deep_ep"):
        ctx = make_dist_context(ParallelLayout(world, 1, True), timeout_s=60.0,
                                fresh_ep_group=True)
        layer = MoELayer(MoEWeights.random(cfg, 0), ctx, get_backend(backend), None, QuantSpec(),
                         OverlapConfig(overlap=False), max_tokens_per_rank=8,
                         backend_options=make_options(backend) if backend != "deepep_ht" else None)
        x = demo_inputs(cfg, 6, rank, 0)
        step("call 1")
        out = layer(x)
        if rank != victim:  # (a tensor is fetched from its process: a killed one has none)
            result({"call": 1, "out": out})
        if rank == victim:
            def die(prep: object) -> torch.Tensor:
                step("victim killed in call 2")
                os.kill(os.getpid(), signal.SIGKILL)
                raise AssertionError("unreachable")
            layer.experts.apply = die  # type: ignore[method-assign]
        for call in (2, 3):
            step(f"call {call}")
            got = _error(lambda: layer(x))
            result({"call": call, "type": got[0], "error": got[1], "seconds": got[2]})
        return {"returned": True}
