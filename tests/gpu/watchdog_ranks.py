"""Rank functions and child processes of tests/gpu/test_watchdog_gpu.py (the call bound on a
CUDA GPU, moe_plugins.callbound.watchdog). Import-safe without CUDA; everything here runs on cuda:0.

``python -m tests.gpu.watchdog_ranks stuck <kind> <bound_s>``: a watched call whose GPU work
spins for a minute; the watchdog must end the process (exit status 70) about ``bound_s`` after
the call began. Kinds: ``eager``; ``replay``, a CUDA-graph replay under ``expect_replay``;
``step-eager``, three layer calls in a step window (``watch_step``) of which the second spins;
``step-replay``, a graph captured as an engine captures it (no record of its calls) replayed in
a step window. It prints one JSON line per event (``captured``, ``timeout`` with the seconds
since the call began, ``not ended``).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch

#: cycles of torch.cuda._sleep that keep an H200's SM busy for about a minute (~2 GHz)
SPIN_MINUTE = 120 * 10**9


def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def stuck(kind: str, bound_s: float) -> None:
    """The child process of the stuck-call tests (see the module's text)."""
    from moe_plugins.callbound import (CallBound, capture_calls, expect_replay, on_call_timeout,
                                      watch_step)

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    bound = CallBound("spinning layer", bound_s, bound_s, device=dev)
    t0 = [time.monotonic()]
    on_call_timeout(lambda e: _say(event="timeout", seconds=time.monotonic() - t0[0],
                                   message=str(e)))
    if kind == "eager":
        t0[0] = time.monotonic()
        call = bound.watch(1)
        torch.cuda._sleep(SPIN_MINUTE)
        assert call is not None
        call.end(dev)
    elif kind == "step-eager":
        t0[0] = time.monotonic()
        with watch_step(dev):
            for n in (1, 2, 3):
                call = bound.watch(n)
                if n == 2:
                    torch.cuda._sleep(SPIN_MINUTE)
                assert call is not None
                call.end(dev)
    elif kind == "step-replay":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            assert bound.watch(1) is None
            torch.cuda._sleep(SPIN_MINUTE)
        _say(event="captured", calls=1)
        t0[0] = time.monotonic()
        with watch_step(dev):
            graph.replay()
    else:
        graph = torch.cuda.CUDAGraph()
        with capture_calls() as captured:
            with torch.cuda.graph(graph):
                assert bound.watch(1) is None  # recorded, not watched
                torch.cuda._sleep(SPIN_MINUTE)
        _say(event="captured", calls=len(captured.calls))
        t0[0] = time.monotonic()
        with expect_replay(captured, dev):
            graph.replay()
    torch.cuda.synchronize()  # a minute, unless the watchdog ends the process first
    _say(event="not ended", seconds=time.monotonic() - t0[0])


def graph_kill_job(rank: int, world: int, victim: int, call_timeout_s: float,
                   replay_in: str = "expect_replay") -> dict:
    """EP ``world`` on deepep_ll (one GPU shared by the ranks, tests/gpu/ep_harness.py), every
    layer under ``call_timeout_s``: two eager calls, the layer captured into a CUDA graph, two
    replays (each right against the reference), then the victim is killed (SIGKILL) before
    replay 3. Every other rank's replay 3 waits in DeepEP's kernels for the dead peer: the
    watchdog must end it within the bound (its hook reports the seconds since the replay
    began). ``replay_in``: ``expect_replay`` (the capture under ``capture_calls``, each replay
    under ``expect_replay``) or ``step_window`` (captured as an engine captures it, each replay
    in a step window, ``watch_step``, as the vLLM glue runs vLLM's replays)."""
    import torch.distributed as dist

    from moe_plugins.runner.demo import demo_inputs
    from moe_plugins.runner.model import MoEWeights
    from moe_plugins.runner.reference import reference_moe
    from contextlib import nullcontext

    from moe_plugins.callbound import capture_calls, expect_replay, on_call_timeout, watch_step
    from tests.gpu.cuda_graphs import capture
    from tests.gpu.ep_harness import result, step
    from tests.gpu.ep_ranks import CFG, QUANTS, _first_line, _forward, _Layers, compare

    layers = _Layers("deepep_ll", world, "cuda")
    dev = layers.dev
    try:
        weights = MoEWeights.random(CFG, 0)
        step("build the layer")
        layer = layers.build(CFG, weights, 1, None, QUANTS["bf16"], call_timeout_s=call_timeout_s)
        x = demo_inputs(CFG, 8, rank, 0)
        full = reference_moe(x, weights)
        for n in (1, 2):  # the second ends the layer's start-up bound
            step(f"eager call {n}")
            ok = compare(_forward(layer, x, dev), full, CFG.dtype)[0]
        result({"eager": 2, "ok": ok})
        static_x = x.to(dev)
        step("capture")
        windows = replay_in == "step_window"
        with nullcontext(None) if windows else capture_calls() as captured:
            graph, static_out = capture(lambda: layer(static_x))
        result({"captured": 1 if windows else len(captured.calls)})

        def watched() -> Any:
            return watch_step(dev) if windows else expect_replay(captured, dev)

        for k in (1, 2):
            step(f"replay {k}")
            with watched():
                graph.replay()
            torch.cuda.synchronize()
            result({"replay": k, "ok": compare(static_out.cpu(), full, CFG.dtype)[0]})
        dist.barrier()
        if rank == victim:
            step("victim killed before replay 3")
            time.sleep(0.5)  # the step reaches the parent first
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        on_call_timeout(lambda e: result({
            "replay": 3, "outcome": "ended", "type": type(e).__name__, "message": _first_line(e),
            "seconds": round(time.monotonic() - t0, 2)}))
        step("replay 3 (a peer is dead)")
        with watched():
            graph.replay()
        torch.cuda.synchronize()
        result({"replay": 3, "outcome": "returned", "seconds": round(time.monotonic() - t0, 2),
                "ok": compare(static_out.cpu(), full, CFG.dtype)[0]})
        return {"returned": True}
    finally:
        layers.destroy()


def capture_race_job(rank: int, world: int, rounds: int, call_timeout_s: float) -> dict:
    """One deepep_ll layer under ``call_timeout_s``, the watchdog polling every millisecond
    (host reads only), ``rounds`` rounds of (4 eager calls left in flight, a capture, a replay
    under ``expect_replay``): each round reports whether its capture succeeded, whether the
    last eager call and the replay are right, and whether the replay was seen complete; the
    job returns whether the watchdog thread is alive and whether it logged an internal error."""
    from moe_plugins.callbound import watchdog
    from moe_plugins.runner.demo import demo_inputs
    from moe_plugins.runner.model import MoEWeights
    from moe_plugins.runner.reference import reference_moe
    from moe_plugins.callbound import capture_calls, expect_replay, watchdog_alive
    from tests.gpu.cuda_graphs import capture
    from tests.gpu.ep_harness import result, step
    from tests.gpu.ep_ranks import CFG, QUANTS, _first_line, _Layers, compare

    watchdog.POLL_S = 0.001  # the thread looks all the time, captures included
    layers = _Layers("deepep_ll", world, "cuda")
    dev = layers.dev
    try:
        weights = MoEWeights.random(CFG, 0)
        layer = layers.build(CFG, weights, 1, None, QUANTS["bf16"], call_timeout_s=call_timeout_s)
        x = demo_inputs(CFG, 8, rank, 0)
        full = reference_moe(x, weights)
        x_dev = x.to(dev)
        for r in range(1, rounds + 1):
            step(f"round {r}")
            outs = [layer(x_dev) for _ in range(4)]  # in flight: no synchronization
            static_x = x_dev.clone()
            try:
                with capture_calls() as captured:
                    graph, static_out = capture(lambda: layer(static_x))
            except Exception as e:  # a failed capture is what this job counts
                torch.cuda.synchronize()
                result({"round": r, "captured": False, "error": _first_line(e)})
                continue
            with expect_replay(captured, dev) as replay:
                graph.replay()
            torch.cuda.synchronize()
            result({"round": r, "captured": True, "calls": len(captured.calls),
                    "eager_ok": compare(outs[-1].cpu(), full, CFG.dtype)[0],
                    "replay_ok": compare(static_out.cpu(), full, CFG.dtype)[0],
                    "replay_seen_complete": replay is not None and replay.finished()})
            del graph, static_out
        return {"watchdog_alive": watchdog_alive(),
                "internal_error": watchdog._WATCHDOG.last_error > float("-inf")}
    finally:
        layers.destroy()


def hook_kill_job(rank: int, world: int, victim: int, call_timeout_s: float,
                  device: str = "cuda") -> dict:
    """EP ``world`` on deepep_ll through vLLM's modular kernel with a shared expert
    (tests/gpu/ep_vllm_ranks.py: vLLM's state and ``SharedExperts``, our prepare/finalize built
    by vLLM's factory), the bound set as a user sets it (``MOE_PLUGINS_CALL_TIMEOUT_S``), each
    forward in a step window (``watch_step``, as the vLLM glue opens around vLLM's forward
    passes). Two calls right against the reference; in call 3 the victim, its dispatch
    received, dies in its experts (SIGKILL) before its combine's send. Every survivor's call 3
    sends its combine, runs the shared expert, then waits in the combine's receive (hook mode:
    vLLM calls our hook after the shared expert) for the victim's rows, which never come: the
    step window must end it within the bound (its hook reports the seconds since the call
    began). Reported per call: whether finalize went the hook way (a hook and a receiver)."""
    import torch.distributed as dist

    from moe_plugins.callbound import CALL_TIMEOUT_ENV
    from moe_plugins.callbound import on_call_timeout, watch_step
    from tests.gpu.ep_harness import result, step
    from tests.gpu.ep_ranks import CFG, _first_line, compare
    from tests.gpu.ep_vllm_ranks import Sides, _ref, vllm_world

    os.environ[CALL_TIMEOUT_ENV] = str(call_timeout_s)
    step("import vLLM")
    with vllm_world(rank, world, 1, "deepep_ll", device, False) as config:
        s = Sides(rank, world, 1, "deepep_ll", "bf16", device, False, config)
        pf = s.ours.pf
        hooked: list[bool] = []
        finalize_async = pf.finalize_async

        def seen(*args: Any, **kwargs: Any) -> Any:
            out = finalize_async(*args, **kwargs)
            hooked.append(isinstance(out, tuple) and out[0] is not None)
            return out

        pf.finalize_async = seen  # what vLLM's kernel got back: hook mode or not

        def call(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            x, w, ids = s.inputs(8, seed=n)
            xd, wd, idd = s.to_dev(x, w, ids)
            with watch_step(s.dev):
                out = s.forward(s.ours, xd, wd, idd)
            return x, out

        for n in (1, 2):  # the second ends the layer's start-up bound
            step(f"call {n}")
            x, out = call(n)
            s.sync()
            result({"call": n, "ok": compare(out.cpu(), _ref(s, x), CFG.dtype)[0],
                    "hook_mode": bool(hooked) and hooked[-1]})
        dist.barrier()
        if rank == victim:
            experts = s.ours.kernel.impl.fused_experts
            experts_apply = experts.apply

            def dying(*args: Any, **kwargs: Any) -> Any:
                s.sync()  # its dispatch arrived: the peers' receives of it complete
                step("victim killed in its experts, its dispatch received, before its "
                     "combine's send")
                time.sleep(0.5)  # the step reaches the parent first
                os.kill(os.getpid(), signal.SIGKILL)
                return experts_apply(*args, **kwargs)

            experts.apply = dying
        t0 = time.monotonic()
        on_call_timeout(lambda e: result({
            "call": 3, "outcome": "ended", "type": type(e).__name__,
            "message": _first_line(e), "seconds": round(time.monotonic() - t0, 2)}))
        step("call 3 (the victim dies in its experts)")
        x, out = call(3)
        result({"call": 3, "host_returned": round(time.monotonic() - t0, 2),
                "hook_mode": bool(hooked) and hooked[-1]})
        s.sync()
        result({"call": 3, "outcome": "returned",
                "seconds": round(time.monotonic() - t0, 2),
                "ok": compare(out.cpu(), _ref(s, x), CFG.dtype)[0]})
        return {"returned": True}


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "stuck" or sys.argv[2] not in (
            "eager", "replay", "step-eager", "step-replay"):
        sys.exit("usage: python -m tests.gpu.watchdog_ranks stuck "
                 "<eager|replay|step-eager|step-replay> <bound_s>")
    stuck(sys.argv[2], float(sys.argv[3]))
