"""Where the host time of the ``torch`` backend's round trip goes, line by line.

A diagnostic beside :mod:`host_overhead` (same process setup, same inputs, same paths): it runs
the ``raw`` (the transport written directly on torch.distributed) and ``ours`` (our blocking
``prepare`` + ``finalize``) round trips under ``line_profiler`` and prints, per line of the
backend's functions and of the raw closure, the host microseconds per round trip. On CUDA a
line's time is its launch cost, except at the host syncs (the header's ``tolist``, raw's
``nonzero``), which also wait for the GPU. line_profiler adds about a microsecond per line
executed, to both paths alike.

    python benchmarks/line_profile.py --device cuda --tokens 64 > lines.txt

Needs ``pip install line_profiler`` (not a dependency of the package).
"""
from __future__ import annotations

import argparse
import datetime
import sys
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist

import host_overhead as ho
from conditions import conditions_line, run_conditions
from moe_plugins.groups import DistContext
from moe_plugins.layout import DestinationMap, LocalIdMap, ParallelLayout
from moe_plugins.prepare_finalize import torch as tr


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--tokens", type=int, nargs="+", default=[64])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--round-trips", type=int, default=400)
    args = p.parse_args(argv)
    try:
        from line_profiler import LineProfiler
    except ImportError:
        print("needs line_profiler: pip install line_profiler", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    sys.stdout.write(conditions_line(run_conditions(dev)))
    if args.device == "cuda":
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    dist.init_process_group("gloo" if args.device == "cpu" else "cpu:gloo,cuda:nccl",
                            init_method=f"tcp://127.0.0.1:{ho._free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=120))
    ctx = DistContext(ParallelLayout(1, 1, True), 0, dist.group.WORLD, None, dev)
    try:
        for tokens in args.tokens:
            bench = SimpleNamespace(experts=32, torch_hidden=args.hidden, topk=8, tokens=[tokens])
            paths = ho.torch_paths(ctx, bench, ho.Case("torch", tokens, "bf16"), "not profiled")
            for name in ("raw", "ours"):
                fn = paths[name]
                lp = LineProfiler()
                targets = [fn] if name == "raw" else [
                    fn, tr.TorchPrepareFinalize._dispatch, tr.TorchPrepareFinalize._received,
                    tr.TorchPrepareFinalize._pack_rows, tr.TorchPrepareFinalize._combine,
                    tr.TorchPrepareFinalize._combined, tr._RowLayout.unpack,
                    tr.TorchPrepareFinalize._all_to_all, tr.TorchPrepareFinalize._exchange_header,
                    DestinationMap.__call__, LocalIdMap.checked]
                for t in targets:
                    lp.add_function(t)
                for _ in range(50):
                    fn()
                sync()
                lp.enable()
                for _ in range(args.round_trips):
                    fn()
                sync()
                lp.disable()
                print(f"\n##### {tokens} tokens, path {name}, {args.round_trips} round trips "
                      "(Time and Per Hit in us; divide Time by the round trips)")
                lp.print_stats(output_unit=1e-6, stripzeros=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
