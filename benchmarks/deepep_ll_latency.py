"""Dispatch/combine latency of a low-latency backend vs the raw library Buffer calls:
``deepep_ll`` over DeepEP V1 (commit 567632d, built from source) or, with ``--backend nixl_ep``,
``nixl_ep`` over NIXL EP (built by scripts/gpu/nixl_ep.sh; its tcp_store_group is a PrefixStore
on a real TCPStore, the one the process group is initialized from).

One GPU, one process (EP world size 1). Both sides use the SAME library ``Buffer`` (the one our
manager built; DeepEP's and NIXL EP's have the same ``low_latency_*`` calls) and the same call shape
our backend's synchronous ``prepare``/``finalize`` make: the blocking calls (no receive hook: one
kernel launch for both phases), FP8 dispatch (``--bf16`` for bf16), combine into a preallocated
``out``. What differs is only our layer on top: input checks, topk dtype cast,
PrepareResult/handle bookkeeping, stats. The raw hook-mode calls (what an overlapped call, and
vLLM's in-tree classes, make) are printed as a reference line.

Each iteration records CUDA events around dispatch and combine; the GPU time between events
includes any gap the host leaves, so host overhead of our classes shows up there. A second
figure is host wall time per iteration (synchronized at the end of the timed loop). The paths
run in ``--rounds`` rounds, in an order that rotates per round; each figure is the median over
the rounds (a path timed first on a cold GPU, or always after the same other, read slower).
Last, one round trip of each is captured in a CUDA graph and replayed (as vLLM's decode does),
which takes the host out. Example:

    python benchmarks/deepep_ll_latency.py --tokens 64 --hidden 7168 --topk 8 --experts 32
    python benchmarks/deepep_ll_latency.py --backend nixl_ep --tokens 64
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conditions import run_conditions  # noqa: E402
from graph_timing import graph_ms  # noqa: E402
from moe_plugins.config import DispatchConfig  # noqa: E402
from moe_plugins.groups import DistContext  # noqa: E402
from moe_plugins.layout import ParallelLayout  # noqa: E402
from moe_plugins.lowlat.vendor import destroy_all_buffers  # noqa: E402
from moe_plugins.quant import QuantScheme, QuantSpec  # noqa: E402
from moe_plugins.registry import get_backend  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_pairs(dispatch: Callable[[], object], combine: Callable[[object], None], iters: int,
                warmup: int) -> dict:
    """Run dispatch -> combine ``warmup + iters`` times; per-op GPU-event means (us) and host
    wall time per iteration (us)."""
    for _ in range(warmup):
        combine(dispatch())
    torch.cuda.synchronize()
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    start = time.perf_counter()
    for e0, e1, e2 in events:
        e0.record()
        state = dispatch()
        e1.record()
        combine(state)
        e2.record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / iters * 1e6
    d = [a.elapsed_time(b) * 1e3 for a, b, _ in events]
    c = [b.elapsed_time(c) * 1e3 for _, b, c in events]
    return dict(dispatch_us=statistics.mean(d), combine_us=statistics.mean(c),
                dispatch_median_us=statistics.median(d), combine_median_us=statistics.median(c),
                wall_us=wall)


def _graph_us(round_trip: Callable[[], None], iters: int) -> float | None:
    """One dispatch + combine captured in a CUDA graph: GPU time per round trip (us), with no
    host launch cost, as under vLLM's CUDA-graph decode. None when it cannot be captured."""
    try:
        return graph_ms(round_trip, iters) * 1e3
    except RuntimeError as e:
        print(f"graph capture failed: {e}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["deepep_ll", "nixl_ep"], default="deepep_ll",
                   help="deepep_ll (DeepEP V1 built from source) or nixl_ep (scripts/gpu/nixl_ep.sh)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of every path, in a rotating order (median over rounds)")
    p.add_argument("--bf16", action="store_true", help="bf16 dispatch (default: FP8 block-128)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    spec = get_backend(args.backend)
    try:
        libs = [importlib.import_module(r.module) for r in spec.required]
    except ImportError as e:
        print(f"--backend {args.backend} needs its library built or installed ({e})",
              file=sys.stderr)
        return 2

    torch.cuda.set_device(0)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", _free_port(), world_size=1, is_master=True, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=0, world_size=1,
                            timeout=timeout)
    # What an engine passes: None for DeepEP, a tcp_store_group on the real store for NIXL EP.
    options = spec.manager.engine_options(dist.PrefixStore(args.backend, store))
    dev = torch.device("cuda")
    quant = QuantSpec() if args.bf16 else QuantSpec(QuantScheme.FP8_BLOCK128)
    ctx = DistContext(ParallelLayout(1, 1, True), 0, dist.group.WORLD, None, dev)
    pf = spec.build(ctx, DispatchConfig(args.experts, args.hidden, args.topk, args.tokens,
                                        torch.bfloat16, quant, options))
    m = pf.manager
    buffer = m.buffer
    use_fp8 = quant.quantized_on_wire

    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device=dev, generator=g).to(torch.bfloat16)
    scores = torch.rand(args.tokens, args.experts, device=dev, generator=g)
    topk_w, topk_ids = scores.topk(args.topk, dim=-1)
    topk_w = (topk_w / topk_w.sum(dim=-1, keepdim=True)).float().contiguous()
    topk_ids = topk_ids.to(m.topk_idx_dtype).contiguous()
    expert_out = torch.randn(m.num_local_experts, m.max_tokens_per_rank * m.num_ranks,
                             args.hidden, device=dev, generator=g).to(torch.bfloat16)
    out = torch.empty(args.tokens, args.hidden, dtype=torch.bfloat16, device=dev)

    def raw_dispatch(hook_mode: bool) -> Callable[[], object]:
        def run() -> object:
            _recv, _count, handle, _event, hook = buffer.low_latency_dispatch(
                x, topk_ids, m.max_tokens_per_rank, m.num_experts, use_fp8=use_fp8,
                async_finish=False, return_recv_hook=hook_mode)
            if hook_mode:
                hook()
            return handle
        return run

    def raw_combine(hook_mode: bool) -> Callable[[object], None]:
        def run(handle: object) -> None:
            _combined, _event, hook = buffer.low_latency_combine(
                expert_out, topk_ids, topk_w, handle, async_finish=False, zero_copy=False,
                return_recv_hook=hook_mode, out=out)
            if hook_mode:
                hook()
        return run

    def ours_dispatch() -> object:
        return pf.prepare(x, topk_w, topk_ids, quant)

    def ours_combine(_prep: object) -> None:
        pf.finalize(expert_out, topk_w, topk_ids, out)

    ours_name = f"{args.backend} (ours)"
    paths = {"raw, hook mode": (raw_dispatch(True), raw_combine(True)),
             ours_name: (ours_dispatch, ours_combine),
             "raw, no hook": (raw_dispatch(False), raw_combine(False))}
    # Rounds of every path, the order rotating per round (no path always runs first, on a
    # colder GPU, or right after another): per figure, the median over the rounds.
    runs: dict[str, list[dict]] = {name: [] for name in paths}
    names = list(paths)
    for i in range(args.rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            runs[name].append(_time_pairs(*paths[name], args.iters, args.warmup))
    rows = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            for name, rs in runs.items()}
    graph = {
        "raw, hook mode": _graph_us(lambda: raw_combine(True)(raw_dispatch(True)()), args.iters),
        ours_name: _graph_us(lambda: ours_combine(ours_dispatch()), args.iters),
        "raw, no hook": _graph_us(lambda: raw_combine(False)(raw_dispatch(False)()), args.iters),
    }
    # the baseline: the same (blocking) calls our synchronous prepare/finalize make
    raw, ours = rows["raw, no hook"], rows[ours_name]
    ratio = {k: ours[k] / raw[k] for k in ("dispatch_us", "combine_us", "wall_us")}
    ratio["total_us"] = ((ours["dispatch_us"] + ours["combine_us"])
                         / (raw["dispatch_us"] + raw["combine_us"]))

    print(f"{args.backend} vs raw {libs[0].__name__}.Buffer, 1 rank, {args.tokens} tokens, "
          f"hidden {args.hidden}, topk {args.topk}, "
          f"{args.experts} experts, {'bf16' if args.bf16 else 'fp8'} dispatch, "
          f"{args.rounds} rounds of {args.iters} iterations (median over rounds of the mean "
          f"CUDA-event intervals, us)")
    print(f"{'path':<20} {'dispatch':>10} {'combine':>10} {'total':>10} {'host/iter':>10}")
    for name, r in rows.items():
        print(f"{name:<20} {r['dispatch_us']:>10.2f} {r['combine_us']:>10.2f} "
              f"{r['dispatch_us'] + r['combine_us']:>10.2f} {r['wall_us']:>10.2f}")
    print(f"{'ours / raw no hook':<20} {ratio['dispatch_us']:>10.3f} {ratio['combine_us']:>10.3f} "
          f"{ratio['total_us']:>10.3f} {ratio['wall_us']:>10.3f}")
    if None not in graph.values():
        g_raw, g_ours, g_hook = graph["raw, no hook"], graph[ours_name], graph["raw, hook mode"]
        ratio["graph_total_us"] = g_ours / g_raw
        print(f"CUDA-graph replay, dispatch + combine: raw {g_raw:.2f} us (hook mode "
              f"{g_hook:.2f}), ours {g_ours:.2f} us, ours/raw {g_ours / g_raw:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(
            config=dict(tokens=args.tokens, hidden=args.hidden, topk=args.topk,
                        experts=args.experts, fp8=not args.bf16, iters=args.iters,
                        rounds=args.rounds,
                        device=torch.cuda.get_device_name(), backend=args.backend,
                        library=getattr(libs[0], "__file__", "?")),
            results=rows, graph_round_trip_us=graph, overhead_ratio=ratio,
            conditions=run_conditions("cuda", [r.module for r in spec.required])), indent=2))

    pf.reset_call_state()
    m.destroy()
    destroy_all_buffers()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
