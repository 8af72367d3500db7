"""Shared-expert overlap on one GPU at decode sizes (issue: overlap benchmark).

One EP-8 rank of a 256-expert model: 32 local experts (intermediate 2048), hidden 7168, topk 8,
one shared expert (intermediate 2048), bf16. With T tokens per rank the rank's experts receive
8*T (token, expert) pairs. Two tables:
  compute:  the routed path is the expert grouped GEMMs alone;
  transfer: the routed path also moves the dispatch and combine payload (8*T rows x hidden bf16
            each way) through the copy engine, device -> pinned host -> device, standing in for
            RDMA wire time that uses no SMs.
Each variant is captured in a CUDA graph and replayed; time per layer is the median over
repeats of the mean over replays, all in one process. The overlapped variant uses
moe_plugins.overlap (launch_shared / join), the code the layers run.

    python benchmarks/overlap_bench.py --out benchmarks/results/overlap_h200.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from conditions import run_conditions
from graph_timing import graph_ms
from moe_plugins.overlap import OverlapConfig, join, launch_shared, side_stream

H, E_LOCAL, INTER, TOPK, SHARED_INTER, EP = 7168, 32, 2048, 8, 2048, 8
TOKENS = (1, 8, 32, 128, 256, 1024)
CFG = OverlapConfig(overlap=True, overlap_max_tokens=1 << 30)  # measure every size


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [M, K] rows grouped by expert, b [G, K, N], offs int32 [G] cumulative ends -> [M, N]."""
    return torch._grouped_mm(a, b, offs=offs)


class Layer:
    def __init__(self, tokens: int, transfer: bool, dev: torch.device):
        g = torch.Generator(device=dev).manual_seed(0)
        bf = torch.bfloat16

        def rnd(*shape: int, fan_in: int) -> torch.Tensor:
            return (torch.randn(*shape, device=dev, generator=g) / fan_in ** 0.5).to(bf)

        self.x = rnd(tokens, H, fan_in=1)
        pairs = EP * tokens  # 8 ranks x T tokens x topk 8 / 8 ranks
        counts = torch.bincount(torch.randint(0, E_LOCAL, (pairs,), device=dev, generator=g),
                                minlength=E_LOCAL)
        self.offs = counts.cumsum(0).to(torch.int32)
        self.recv = rnd(pairs, H, fan_in=1)
        self.w13 = rnd(E_LOCAL, H, 2 * INTER, fan_in=H)
        self.w2 = rnd(E_LOCAL, INTER, H, fan_in=INTER)
        self.s13 = rnd(H, 2 * SHARED_INTER, fan_in=H)
        self.s2 = rnd(SHARED_INTER, H, fan_in=SHARED_INTER)
        self.transfer = transfer
        if transfer:
            self.host = torch.empty(pairs, H, dtype=bf, pin_memory=True)
            self.landed = torch.empty_like(self.recv)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        g, u = (x @ self.s13).chunk(2, dim=-1)
        return (F.silu(g) * u) @ self.s2

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        self.host.copy_(t, non_blocking=True)
        self.landed.copy_(self.host, non_blocking=True)
        return self.landed

    def routed(self) -> torch.Tensor:
        x = self._wire(self.recv) if self.transfer else self.recv  # dispatch
        g, u = grouped_mm(x, self.w13, self.offs).chunk(2, dim=-1)
        y = grouped_mm(F.silu(g) * u, self.w2, self.offs)
        return self._wire(y) if self.transfer else y  # combine

    # the four things timed
    def shared_alone(self) -> object:
        return self.shared(self.x)

    def routed_alone(self) -> object:
        return self.routed()

    def sequential(self) -> object:
        return self.shared(self.x), self.routed()

    def overlapped(self) -> object:
        handle = launch_shared(self.shared, self.x, CFG)
        try:
            y = self.routed()
        finally:
            s = join(handle)
        return s, y


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the results JSON here")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    side_stream(dev)  # the side stream exists before any capture, as in serving
    results = []
    for table in ("compute", "transfer"):
        print(f"\n[{table}] ms per layer (CUDA-graph replay)")
        print(f"{'tokens':>6} {'shared':>8} {'routed':>8} {'sequential':>10} {'overlapped':>10} "
              f"{'ideal':>8} {'over/ideal':>10} {'seq/over':>8} {'efficiency':>10}")
        for t in TOKENS:
            layer = Layer(t, table == "transfer", dev)
            ms = {name: graph_ms(getattr(layer, name), args.replays, args.repeats)
                  for name in ("shared_alone", "routed_alone", "sequential", "overlapped")}
            ideal = max(ms["shared_alone"], ms["routed_alone"])
            gain = ms["sequential"] - ideal
            eff = (ms["sequential"] - ms["overlapped"]) / gain if gain > 0 else float("nan")
            print(f"{t:>6} {ms['shared_alone']:>8.3f} {ms['routed_alone']:>8.3f} "
                  f"{ms['sequential']:>10.3f} {ms['overlapped']:>10.3f} {ideal:>8.3f} "
                  f"{ms['overlapped'] / ideal:>10.3f} {ms['sequential'] / ms['overlapped']:>8.3f} "
                  f"{eff:>10.2f}")
            results.append(dict(table=table, tokens=t, sequential_ms=round(ms["sequential"], 4),
                                overlapped_ms=round(ms["overlapped"], 4), ideal_ms=round(ideal, 4),
                                shared_ms=round(ms["shared_alone"], 4),
                                routed_ms=round(ms["routed_alone"], 4)))
            del layer
    if args.out:
        doc = dict(conditions=run_conditions(dev), results=results)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
