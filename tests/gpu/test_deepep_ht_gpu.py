"""deepep_ht and deepep_auto against the REAL DeepEP V1 (567632d) with TWO processes on ONE GPU.

DeepEP's normal-mode kernels run on 2, 4 or 8 ranks only (``SWITCH_RANKS``), so one rank per
GPU cannot run them on a one-GPU machine. Here two processes share ``cuda:0`` (DeepEP's
intranode buffers are exchanged as CUDA IPC handles, which another process on the same device
can open) over a gloo group of 2 (NCCL refuses two ranks on one device; DeepEP itself only
all-gathers objects over the group). Each rank runs prepare -> reference experts -> finalize
for bf16 and FP8 dispatch at several batch sizes (deepep_auto: on both sides of its threshold)
and compares element-wise with the single-process reference of its own tokens.

Two ranks on one GPU may not work: DeepEP (or NVSHMEM, for deepep_auto's low-latency side) may
refuse it, or the kernels of the two processes, which spin-wait on each other, may never run at
the same time. The test then does not hang: every step is reported by the ranks as it starts,
the whole run is bounded (``MOE_PLUGINS_GPU_TIMEOUT_S``, default 300 s), and where it stopped
(the step, and the exception text or "timed out") is written as JSON to
``MOE_PLUGINS_GPU_RECORD`` (default ``tests/gpu/results/deepep_two_ranks_one_gpu.json``) for
tests/gpu/README.md; the test is then an expected failure (xfail) naming the step, not a pass.
A numerical mismatch is a plain failure. Timings from a shared GPU mean nothing: none are taken.

Run: ``python -m pytest -m gpu tests/gpu/test_deepep_ht_gpu.py -q -rxs`` from the repository
root, with DeepEP 567632d importable and this package installed editable.
"""
from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("deep_ep", reason="needs DeepEP's V1 line (567632d) built from source")

pytestmark = pytest.mark.gpu

WORLD = 2
TIMEOUT_S = float(os.environ.get("MOE_PLUGINS_GPU_TIMEOUT_S", "300"))
RECORD = Path(os.environ.get("MOE_PLUGINS_GPU_RECORD", Path(__file__).parent / "results"
                             / "deepep_two_ranks_one_gpu.json"))
HIDDEN, EXPERTS, TOPK = 2048, 16, 4
LL_CAPACITY = 64
# Two processes on one GPU time-slice, so DeepEP's spin-waiting kernels run slowly: on the
# H200, normal-mode dispatch of 256 tokens took ~5 s and of 1024 tokens 36 s, and the 1024-token
# combine did not end within 110 s (tests/gpu/README.md). Hence at most 256 tokens here.
TOKENS = {"deepep_ht": [0, 1, 37, 256], "deepep_auto": [1, LL_CAPACITY, LL_CAPACITY + 1, 256]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, backend: str, out: "mp.Queue[Any]") -> None:
    """One rank: report each step before it starts, then the numerics (or the error)."""
    step = "start"
    t0 = time.monotonic()

    def at(name: str) -> None:
        nonlocal step
        step = name
        out.put((rank, "step", (name, round(time.monotonic() - t0, 2))))

    try:
        import torch.distributed as dist

        from all2all.deepep_auto import DeepEPAutoOptions
        from moe_plugins.config import DispatchConfig
        from moe_plugins.runner.demo import demo_inputs
        from moe_plugins.runner.experts import TorchExperts
        from moe_plugins.groups import DistContext
        from moe_plugins.layout import ParallelLayout
        from moe_plugins.runner.model import ExpertWeights, MoEConfig, MoEWeights, route
        from moe_plugins.quant import QuantScheme, QuantSpec
        from moe_plugins.runner.reference import reference_moe, tolerance_for
        from moe_plugins.registry import get_backend

        at("init: cuda:0 and a gloo group of 2")
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=TIMEOUT_S))
        layout = ParallelLayout(WORLD, 1, True)
        ctx = DistContext(layout, rank, dist.group.WORLD, None, dev)
        cfg = MoEConfig(hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, intermediate=128,
                        shared_intermediate=0, dtype=torch.bfloat16)
        w = MoEWeights.random(cfg, 0)
        local = w.local_experts(WORLD, rank)
        experts_w = ExpertWeights(local.w13.to(dev), local.w2.to(dev), local.first_expert)
        options = DeepEPAutoOptions(ll_max_tokens_per_rank=LL_CAPACITY) \
            if backend == "deepep_auto" else None
        results = []
        for quant in (QuantSpec(), QuantSpec(QuantScheme.FP8_BLOCK128)):
            at(f"build {backend} ({quant.scheme.value}): DeepEP Buffer")
            pf = get_backend(backend).build(ctx, DispatchConfig(
                EXPERTS, HIDDEN, TOPK, max(TOKENS[backend]), cfg.dtype, quant,
                backend_options=options))
            experts = TorchExperts(experts_w, quant, cfg.dtype)
            try:
                for n in TOKENS[backend]:
                    x = demo_inputs(cfg, n, rank, 0)
                    tw, ti = route(x, w.router, TOPK, cfg.renormalize)
                    at(f"{backend} {quant.scheme.value} {n} tokens: prepare")
                    prep = pf.prepare(x.to(dev), tw.to(dev), ti.to(dev), quant)
                    at(f"{backend} {quant.scheme.value} {n} tokens: experts and finalize")
                    got = torch.empty(n, HIDDEN, dtype=cfg.dtype, device=dev)
                    pf.finalize(experts.apply(prep), tw.to(dev), ti.to(dev), got)
                    torch.cuda.synchronize()
                    ref = reference_moe(x, w, quant)
                    atol, rtol = tolerance_for(ref, cfg.dtype)
                    err = (got.float().cpu() - ref).abs()
                    ok = bool((err <= atol + rtol * ref.abs()).all())
                    res = dict(quant=quant.scheme.value, tokens=n, ok=ok,
                               max_abs_err=float(err.max()) if err.numel() else 0.0,
                               x_sf_none=prep.x_sf is None, modes=dict(pf.stats.modes))
                    results.append(res)
                    out.put((rank, "result", res))  # kept even if a later step stalls
            finally:
                pf.reset_call_state()
                pf.manager.destroy()
        at("teardown")
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, "done", results))
    except BaseException as e:  # report where, then let the parent decide
        out.put((rank, "error", dict(step=step, type=type(e).__name__, message=str(e),
                                     traceback=traceback.format_exc())))


def _run(backend: str) -> dict:
    """Start both ranks, collect their reports within TIMEOUT_S; kill them on a timeout."""
    ctx = mp.get_context("spawn")
    out: "mp.Queue[Any]" = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, backend, out), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    steps: dict[int, list[tuple[str, float]]] = {r: [] for r in range(WORLD)}
    partial: dict[int, list[dict]] = {r: [] for r in range(WORLD)}
    final: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(final) < WORLD:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, kind, payload = out.get(timeout=min(left, 5.0))
            except queue.Empty:
                if any(not p.is_alive() and r not in final for r, p in enumerate(procs)):
                    break  # a rank died without a report (a crash in DeepEP)
                continue
            if kind == "step":
                steps[rank].append(payload)
            elif kind == "result":
                partial[rank].append(payload)
            else:
                final[rank] = (kind, payload)
    finally:
        for p in procs:
            p.join(timeout=1 if len(final) == WORLD else 0)
            if p.is_alive():
                p.kill()
    return dict(steps=steps, final=final, partial=partial,
                exitcodes=[p.exitcode for p in procs],
                timed_out=len(final) < WORLD and time.monotonic() >= deadline)


def _record(backend: str, run: dict) -> dict:
    """Write where the run stopped (for tests/gpu/README.md) and return the entry."""
    entry = {
        "backend": backend, "deep_ep": "567632d (as built on the GPU machine)",
        "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
        "timed_out": run["timed_out"], "timeout_s": TIMEOUT_S, "exitcodes": run["exitcodes"],
        "last_step": {str(r): s[-1][0] if s else None for r, s in sorted(run["steps"].items())},
        # (step, seconds since the rank started) for every step, to see where time went
        "steps": {str(r): s for r, s in sorted(run["steps"].items())},
        # each rank's results as they came, also those before a step that did not finish
        "partial_results": {str(r): p for r, p in sorted(run["partial"].items())},
        "errors": {str(r): p for r, (k, p) in sorted(run["final"].items()) if k == "error"},
        "results": {str(r): p for r, (k, p) in sorted(run["final"].items()) if k == "done"},
    }
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    data[backend] = entry
    RECORD.write_text(json.dumps(data, indent=2))
    return entry


@pytest.mark.parametrize("backend", ["deepep_ht", "deepep_auto"])
def test_two_ranks_on_one_gpu_match_reference(backend):
    run = _run(backend)
    entry = _record(backend, run)
    if entry["errors"] or len(entry["results"]) < WORLD:
        where = "; ".join(
            f"rank {r}: {e['type']} at '{e['step']}': {e['message'].splitlines()[0][:300]}"
            for r, e in entry["errors"].items()) or (
            f"{'timed out' if run['timed_out'] else 'died'} at steps {entry['last_step']} "
            f"(exit codes {run['exitcodes']})")
        pytest.xfail(f"{backend} with two ranks on one GPU did not complete: {where} "
                     f"(recorded in {RECORD})")
    bad = [(r, res) for r, rank_results in entry["results"].items() for res in rank_results
           if not res["ok"]]
    assert not bad, f"{backend}: outputs differ from the reference: {bad}"
    for rank_results in entry["results"].values():
        for res in rank_results:
            assert res["x_sf_none"] == (res["quant"] == "none")
        if backend == "deepep_auto":
            # calls of up to LL_CAPACITY tokens fit the low-latency buffers, the others do not
            ll = sum(n <= LL_CAPACITY for n in TOKENS[backend])
            assert rank_results[-1]["modes"] == {"low_latency": ll,
                                                 "normal": len(TOKENS[backend]) - ll}
