"""Per-layer latency of vLLM's MoE layer over DeepEP LL: our plugin's prepare/finalize vs vLLM's
in-tree ``DeepEPLLPrepareAndFinalize``, in one process, same kernels, buffer, weights, inputs.

The layer is vLLM's modular kernel with its SharedExperts (the shared expert inside the kernel
between the combine send and its receive hook), torch routing and torch batched experts (the
same on both sides; benchmarks/vllm_cuda_layer.py says why vLLM's own need its extension).
Default shape: one rank of an EP-8 DeepSeek-V3 layer (hidden 7168, 32 local experts of
intermediate 2048, top-8, shared expert of intermediate 2048).

Eager: host wall time per layer over a loop synchronized once at the end (what an
``--enforce-eager`` or uncaptured prefill step pays), median of rounds that alternate the two
sides. Graph: CUDA-graph replay of one layer (vLLM's decode), ms per replay. Ratio = ours /
in-tree (goal <= 1.00 in both modes).

    python benchmarks/vllm_layer.py --json benchmarks/results/vllm_layer_h200.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vllm_cuda_layer as H  # noqa: E402
from conditions import run_conditions  # noqa: E402
from graph_timing import graph_ms  # noqa: E402


def eager_us(fn: Callable[[], object], iters: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 128])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    rows = []
    for fp8 in (False, True):
        spec = H.LayerSpec(fp8=fp8, max_tokens=max(args.tokens))
        with H.vllm_layers(spec) as layers:
            for n in args.tokens:
                x, w, ids = layers.inputs(n, seed=n)
                fns = {side.name: (lambda side=side: layers.forward(side, x, w, ids))
                       for side in (layers.ours, layers.in_tree)}
                for fn in fns.values():
                    for _ in range(5):
                        fn()
                eager = {k: [] for k in fns}
                for _ in range(args.rounds):
                    for k, fn in fns.items():
                        eager[k].append(eager_us(fn, args.iters))
                graph = {k: graph_ms(fn, args.replays, repeats=3) * 1e3 for k, fn in fns.items()}
                quant = "fp8_block128" if fp8 else "bf16"
                for mode, vals in (("eager", {k: statistics.median(v) for k, v in eager.items()}),
                                   ("graph", graph)):
                    ours, theirs = vals[H.OURS], vals[H.IN_TREE]
                    rows.append(dict(tokens=n, quant=quant, mode=mode, ours_us=round(ours, 2),
                                     in_tree_us=round(theirs, 2), ratio=round(ours / theirs, 4)))
                    print(f"{quant:>13} {mode:>5} tokens={n:>4}  ours {ours:9.2f} us  "
                          f"in-tree {theirs:9.2f} us  ours/in-tree {ours / theirs:.4f}",
                          flush=True)
    print("\n| quant | mode | tokens | ours (us) | in-tree (us) | ours / in-tree |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['quant']} | {r['mode']} | {r['tokens']} | {r['ours_us']} | "
              f"{r['in_tree_us']} | {r['ratio']} |")
    if args.json:
        meta = dict(stood_in="vLLM's Python without its compiled extension "
                             "(benchmarks/vllm_stand_ins.py); torch experts on both sides",
                    shape="hidden 7168, 32 local experts x intermediate 2048, top-8, "
                          "shared intermediate 2048, EP world 1")
        args.json.write_text(json.dumps(dict(
            conditions=run_conditions("cuda", ["vllm", "deep_ep"]), meta=meta, rows=rows),
            indent=1))


if __name__ == "__main__":
    main()
