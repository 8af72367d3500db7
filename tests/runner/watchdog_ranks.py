"""Rank functions of the call bound on CPU ranks (moe_plugins.callbound.watchdog): a slow start-up that
must end nobody, then a peer that hangs mid-call, which the bound must end; a peer that raises
mid-call, whose notice must make the others raise at once."""
from __future__ import annotations

import os
import time
from typing import Optional

import torch

from moe_plugins.groups import make_dist_context
from moe_plugins.layout import ParallelLayout
from moe_plugins.overlap import OverlapConfig
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import get_backend
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.runner.layer import MoELayer
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights
from tests.gpu.ep_harness import result, step

CFG = MoEConfig(hidden=128, num_experts=8, num_topk=2, intermediate=32, shared_intermediate=64)
BF16_CFG = MoEConfig(hidden=128, num_experts=8, num_topk=2, intermediate=32,
                     shared_intermediate=64, dtype=torch.bfloat16)  # DeepEP's activations


def slow_start_then_hang(rank: int, world: int, victim: int, call_timeout_s: float,
                         late_s: float) -> dict:
    """EP ``world``, torch backend, every layer under ``call_timeout_s`` (the start-up bound at
    its default). Rank ``victim`` enters its first call ``late_s`` late and is ``late_s`` slow
    again between its first and second calls (a peer still compiling: its peers wait for it in
    their first and in their second call); nobody may be ended. Calls 1-3 are reported
    (``result``) with their outputs. Then the victim hangs in call 4 (alive, in its experts,
    between dispatch and combine) for the bound plus 10 s: every other rank's watchdog must
    end it (reported by its call-timeout hook: the seconds from the start of call 4)."""
    from moe_plugins.callbound import on_call_timeout

    ctx = make_dist_context(ParallelLayout(world, 1, True), timeout_s=120.0, fresh_ep_group=True)
    layer = MoELayer(MoEWeights.random(CFG, 0), ctx, get_backend("torch"), None, QuantSpec(),
                     OverlapConfig(overlap=False), max_tokens_per_rank=8,
                     call_timeout_s=call_timeout_s)
    x = demo_inputs(CFG, 6, rank, 0)
    for call in (1, 2, 3):
        if rank == victim and call in (1, 2):
            step(f"late by {late_s:g} s before call {call}")
            time.sleep(late_s)
        step(f"call {call}")
        result({"call": call, "out": layer(x)})
    if rank == victim:
        inner = layer.experts.apply

        def hang(prep: object) -> torch.Tensor:
            step("victim hangs in call 4")
            time.sleep(call_timeout_s + 10.0)
            os._exit(0)
            return inner(prep)  # never reached
        layer.experts.apply = hang  # type: ignore[method-assign]
    t0 = time.monotonic()
    on_call_timeout(lambda e: result({"call": 4, "seconds": time.monotonic() - t0,
                                      "error": str(e)}))
    step("call 4")
    layer(x)
    return {"returned": True}


def raise_after_dispatch(rank: int, world: int, victim: int,
                         call_timeout_s: Optional[float]) -> dict:
    """EP ``world``, torch backend on gloo, every layer under ``call_timeout_s`` (None: the bound
    off): calls 1 and 2 right, then the victim's experts raise in call 3, after its dispatch was
    sent (the victim lives and raises its own error). The other ranks wait in call 3's combine
    for it: the victim's notice (moe_plugins.callbound.fault_notice) must make them raise at once with
    the victim's error, long before the bound or the process group's timeout (reported: the
    seconds from the start of call 3, the error); then each calls the layer once more."""
    ctx = make_dist_context(ParallelLayout(world, 1, True), timeout_s=120.0, fresh_ep_group=True)
    layer = MoELayer(MoEWeights.random(CFG, 0), ctx, get_backend("torch"), None, QuantSpec(),
                     OverlapConfig(overlap=False), max_tokens_per_rank=8,
                     call_timeout_s=call_timeout_s if call_timeout_s is not None else 0)
    x = demo_inputs(CFG, 6, rank, 0)
    for call in (1, 2):
        step(f"call {call}")
        result({"call": call, "out": layer(x)})
    if rank == victim:
        def fail(prep: object) -> torch.Tensor:
            raise ValueError(f"the experts of EP rank {rank} failed on purpose")
        layer.experts.apply = fail  # type: ignore[method-assign]
    for call in (3, 4):
        step(f"call {call}")
        t0 = time.monotonic()
        try:
            layer(x)
            result({"call": call, "seconds": time.monotonic() - t0, "type": None})
        except Exception as e:
            result({"call": call, "seconds": time.monotonic() - t0, "type": type(e).__name__,
                    "error": str(e)})
    return {"returned": True}


def deepep_build(library_timeout_s: float) -> dict:
    """The build record of scripts/deepep/build.sh for DeepEP 567632d built with
    ``DEEPEP_TIMEOUT_S=library_timeout_s`` (both constants; the cycles at 2 GHz)."""
    return {"line": "v1", "commit": "567632d",
            "patches": ["pr642-combine-fence", "pr695-rc-qp-assert", "pr678-timeout-override"],
            "timeouts": {"NUM_CPU_TIMEOUT_SECS": library_timeout_s,
                         "NUM_TIMEOUT_CYCLES": int(library_timeout_s * 2_000_000_000)}}


def bound_of_a_build(rank: int, world: int, backend: str, library_timeout_s: float) -> dict:
    """``backend``'s layer (EP ``world``) on the emulated DeepEP built with
    ``library_timeout_s``, no bound set: its bound (``CallBound.describe``) and seconds."""
    from tests.emulation import installed

    with installed("deep_ep", deep_ep_build=deepep_build(library_timeout_s)):
        ctx = make_dist_context(ParallelLayout(world, 1, True), timeout_s=60.0,
                                fresh_ep_group=True)
        layer = MoELayer(MoEWeights.random(BF16_CFG, 0), ctx, get_backend(backend), None,
                         QuantSpec(), OverlapConfig(overlap=False), max_tokens_per_rank=8)
        return {"bound": layer._bound.describe(), "seconds": layer._bound.timeout_s}


def hang_under_the_backstop(rank: int, world: int, victim: int, library_timeout_s: float,
                            call_timeout_s: Optional[float], hang_call: int = 3) -> dict:
    """EP ``world``, deepep_ll on the emulated DeepEP built with its own timeout
    ``library_timeout_s`` (the build record of scripts/deepep/build.sh; it traps at it: no mask
    buffer) and the layers built with ``call_timeout_s`` (None: no bound set, so the backstop;
    0: no bound). The calls before ``hang_call`` are right (reported); then the victim hangs in
    call ``hang_call`` (alive, in its experts, between its dispatch and its combine) for 10 s
    past the library's timeout; the others wait in that call's combine. Reported by each
    survivor: by its call-timeout hook, or where the call raised, its error; each with the
    seconds from the start of that call."""
    from moe_plugins.callbound import on_call_timeout
    from tests.emulation import installed

    with installed("deep_ep", deep_ep_build=deepep_build(library_timeout_s)):
        ctx = make_dist_context(ParallelLayout(world, 1, True), timeout_s=120.0,
                                fresh_ep_group=True)
        layer = MoELayer(MoEWeights.random(BF16_CFG, 0), ctx, get_backend("deepep_ll"), None,
                         QuantSpec(), OverlapConfig(overlap=False), max_tokens_per_rank=8,
                         call_timeout_s=call_timeout_s)
        result({"bound": layer._bound.describe()})
        x = demo_inputs(BF16_CFG, 6, rank, 0)
        for call in range(1, hang_call):
            step(f"call {call}")
            result({"call": call, "out": layer(x)})
        if rank == victim:
            def hang(prep: object) -> torch.Tensor:
                step(f"victim hangs in call {hang_call}")
                time.sleep(library_timeout_s + 10.0)
                os._exit(0)
            layer.experts.apply = hang  # type: ignore[method-assign]
        t0 = time.monotonic()
        on_call_timeout(lambda e: result({"call": hang_call, "seconds": time.monotonic() - t0,
                                          "error": str(e), "type": type(e).__name__}))
        step(f"call {hang_call}")
        try:
            layer(x)
        except Exception as e:  # the library's own timeout, where no bound ended the call
            result({"call": hang_call, "seconds": time.monotonic() - t0, "error": str(e),
                    "type": type(e).__name__, "cause": str(e.__cause__ or "")})
        return {"returned": True}

def library_times_out(rank: int, world: int, victim: int, library_timeout_s: float) -> dict:
    """EP ``world``, deepep_ht on the emulated DeepEP, whose dispatch's host wait for the
    peers' counts raises DeepEP's own "CPU recv timeout" after ``library_timeout_s`` (made
    short in this process), the call bound off (0: no backstop either). Call 1 on every rank;
    then the victim sits out call 2 (alive, asleep past that timeout) while the others make it.
    Reported by each survivor: call 2's error (type, text, its cause's text, seconds)."""
    import tests.emulation._ht_kernels as ht_kernels
    from tests.emulation import installed

    ht_kernels.NUM_CPU_TIMEOUT_SECS = library_timeout_s  # (this process's alone)
    # the build record says the same timeout, which deepep_ht's wrap of it names
    with installed("deep_ep", deep_ep_build=deepep_build(library_timeout_s)):
        ctx = make_dist_context(ParallelLayout(world, 1, True), timeout_s=60.0,
                                fresh_ep_group=True)
        layer = MoELayer(MoEWeights.random(BF16_CFG, 0), ctx, get_backend("deepep_ht"), None,
                         QuantSpec(), OverlapConfig(overlap=False), max_tokens_per_rank=8,
                         call_timeout_s=0)
        x = demo_inputs(BF16_CFG, 6, rank, 0)
        step("call 1")
        result({"call": 1, "out": layer(x)})
        step("call 2")
        if rank == victim:
            time.sleep(library_timeout_s + 3.0)
            return {"sat out": 2}
        t0 = time.monotonic()
        try:
            layer(x)
            result({"call": 2, "type": None})
        except Exception as e:
            result({"call": 2, "type": type(e).__name__, "error": str(e),
                    "cause": str(e.__cause__), "seconds": time.monotonic() - t0})
        return {"returned": True}
