"""Host time of the call bound per watched call: ``watch_call`` + ``WatchedCall.end`` (what a
layer adds per call with ``MOE_PLUGINS_CALL_TIMEOUT_S`` set), against the same loop with the
bound off. One process, no ranks; the watchdog thread runs as it does in a layer.

- ``--device cpu``: the call completes at its end (a host write).
- ``--device cuda``: ``end`` enqueues the GPU's write of the call's progress word on the
  current stream (the driver call), as after a layer's kernels.
- ``--layers-per-step L ...``: also the calls of steps of ``L`` layer calls inside a step window
  (``watch_step``, what the vLLM glue opens around each forward pass): the calls share the
  window's one completion mark, and the window's own host time is shared by its ``L`` calls.
- ``--device cuda`` also times the completion mark's driver call alone, each path the driver
  offers (``moe_plugins.callbound.gpu_progress.CudaProgress.PATHS``; the first that works is used).

    python benchmarks/watchdog_cost.py --device cpu
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conditions import run_conditions  # noqa: E402
from moe_plugins.callbound import CallBound, watch_step  # noqa: E402


def ns_per_call(bound: CallBound, device: torch.device, calls: int, batch: int,
                layers_per_step: int = 0) -> float:
    """Host time per ``bound.watch`` + ``end`` (ns), over ``calls`` calls, timed in batches of
    ``batch`` with the device synchronized between batches, outside the timed part: on CUDA
    each call enqueues one driver op, and a loop of nothing else would fill the launch queue
    and time the GPU's queue instead of the host (in a layer, kernels sit between the ops).
    ``layers_per_step`` > 0: the calls run in step windows of that many calls (a batch is a
    whole number of steps)."""
    watch = bound.watch
    # as the vLLM glue opens its windows: on CUDA, the current device, resolved per step
    window_device = None if device.type == "cuda" else device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if layers_per_step:
        batch = layers_per_step * max(1, batch // layers_per_step)
    total, n = 0, 0
    while n < calls:
        k = batch if layers_per_step else min(batch, calls - n)
        t0 = time.perf_counter_ns()
        if layers_per_step:
            for first in range(n, n + k, layers_per_step):
                with watch_step(window_device):
                    for i in range(first, first + layers_per_step):
                        call = watch(i)
                        if call is not None:
                            call.end(device)
        else:
            for i in range(n, n + k):
                call = watch(i)
                if call is not None:
                    call.end(device)
        total += time.perf_counter_ns() - t0
        sync()
        n += k
    return total / n


def driver_ns_per_write(calls: int, batch: int) -> dict[str, float]:
    """Host time (ns) of one completion-mark write (the driver call through ctypes) on the
    current stream, for each driver path that works here: ``calls`` writes in batches of
    ``batch``, the device synchronized between batches outside the timed part."""
    from moe_plugins.callbound.gpu_progress import CudaProgress, raw_stream

    out: dict[str, float] = {}
    stream = raw_stream(torch.cuda.current_device())
    for how in CudaProgress.PATHS:
        progress = CudaProgress(1, (how,))
        if not progress.ok:
            continue
        write, total, n = progress.write, 0, max(1, calls // batch) * batch
        for first in range(0, n, batch):
            t0 = time.perf_counter_ns()
            for i in range(first, first + batch):
                write(stream, 0, i)
            total += time.perf_counter_ns() - t0
            torch.cuda.synchronize()
        out[how] = round(total / n, 1)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--calls", type=int, default=20000, help="calls per sample")
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--batch", type=int, default=64,
                   help="calls timed between two synchronizations (below the launch-queue depth)")
    p.add_argument("--layers-per-step", type=int, nargs="*", default=[8, 58], metavar="L",
                   help="also time calls in step windows of L calls (default 8 and 58: "
                        "DeepSeek-V3's MoE layers per forward pass)")
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    on = CallBound("benchmark layer", 600.0, 600.0, device=device)
    off = CallBound("benchmark layer", 0)
    ns_per_call(on, device, 1000, args.batch)  # the thread, and on CUDA the progress buffer, start here
    # "off": the bound off; "on": a completion mark per call; "step L": calls in windows of L
    kinds = {"off": (off, 0), "on": (on, 0)}
    kinds.update({f"step {n}": (on, n) for n in args.layers_per_step})
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.samples):  # interleaved: drift of a shared machine hits all alike
        for k, (bound, per_step) in kinds.items():
            samples[k].append(ns_per_call(bound, device, args.calls, args.batch, per_step))
    med = {k: statistics.median(v) for k, v in samples.items()}
    added = {k: round(med[k] - med["off"], 1) for k in kinds if k != "off"}
    result = {"device": args.device, "calls_per_sample": args.calls, "samples": args.samples,
              "batch": args.batch,
              "ns_per_call_on": round(med["on"], 1), "ns_per_call_off": round(med["off"], 1),
              "added_ns_per_call": added["on"],
              "added_ns_per_call_in_steps": {k.split()[1]: v for k, v in added.items()
                                             if k.startswith("step")}}
    print(f"call bound off: {med['off']:.0f} ns per call (median of {args.samples} samples of "
          f"{args.calls} calls, {args.device}); added by the bound:")
    for k, v in added.items():
        what = ("a completion mark per call" if k == "on"
                else f"in step windows of {k.split()[1]} calls")
        print(f"  {v:8.0f} ns per call: {what}")
    if device.type == "cuda":
        result["driver_ns_per_write"] = driver_ns_per_write(args.calls, args.batch)
        for how, ns in result["driver_ns_per_write"].items():
            print(f"  {ns:8.0f} ns per write: {how} alone (the completion mark's driver call)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"conditions": run_conditions(device), **result}
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
