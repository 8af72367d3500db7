"""Multi-GPU validation and dispatch/combine latency (one process per GPU, NCCL).

    python benchmarks/multi_gpu.py --gpus N [--out results/multi_gpu_hN.json]

1. numerics: every layout of N ranks (EP over dp x tp, tp in {1, 2} where it divides; dp == 1
   layouts too), every applicable strategy, bf16 and FP8 block-128 dispatch, tokens 1/5/16 per DP
   group, every registered backend that is usable on this machine; each rank's output is compared
   element-wise with the single-process reference (moe_plugins.runner.reference).
2. latency: dispatch + combine of the reference backend at 1/8/32/128/256 tokens per rank
   (hidden 7168, topk 8, 256 experts), through our prepare/finalize classes and through the same
   transport written directly against torch.distributed, in the same process; prints our
   overhead.
   (DeepEP LL against its raw Buffer calls: benchmarks/deepep_ll_latency.py.)

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 etc. are set here too, as the device docs ask).
Runs with any N >= 1; N == 1 checks the script and the single-rank paths.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

from conditions import run_conditions  # noqa: E402
from moe_plugins.config import DispatchConfig  # noqa: E402
from moe_plugins.runner.demo import demo_inputs  # noqa: E402
from moe_plugins.groups import cached_dist_context  # noqa: E402
from moe_plugins.runner.layer import MoELayer  # noqa: E402
from moe_plugins.layout import ParallelLayout  # noqa: E402
from moe_plugins.config import MoEConfig  # noqa: E402
from moe_plugins.runner.model import MoEWeights  # noqa: E402
from moe_plugins.overlap import OverlapConfig  # noqa: E402
from moe_plugins.quant import QuantScheme, QuantSpec  # noqa: E402
from moe_plugins.runner.reference import reference_moe, within_tolerance  # noqa: E402
from moe_plugins.registry import get_backend, refusal_reason, registered_backends  # noqa: E402
from moe_plugins.strategy import applicable_strategies  # noqa: E402
from moe_plugins.prepare_finalize.torch import TorchPrepareFinalize  # noqa: E402

NUM_CFG = MoEConfig(hidden=1024, num_experts=16, num_topk=4, intermediate=256,
                    shared_intermediate=512, dtype=torch.bfloat16)
QUANTS = (QuantSpec(), QuantSpec(QuantScheme.FP8_BLOCK128))
LAT_TOKENS = (1, 8, 32, 128, 256)


def layouts(n: int) -> list[ParallelLayout]:
    """EP over all n GPUs as dp x tp with tp 1, tp 2 (when dp stays > 1), and dp 1."""
    out = [ParallelLayout(n, 1, True)]
    if n >= 4 and n % 2 == 0:
        out.append(ParallelLayout(n // 2, 2, True))
    if n >= 2:
        out.append(ParallelLayout(1, n, True))
    return out


def numerics(rank: int, n: int, dev: torch.device) -> list[dict]:
    rows = []
    weights = MoEWeights.random(NUM_CFG, seed=0)
    for layout in layouts(n):
        ctx = cached_dist_context(layout, dev)
        for name, spec in registered_backends().items():
            for quant in QUANTS:
                if refusal_reason(spec, layout, quant.scheme):
                    continue
                caps = spec.capabilities
                for strategy in applicable_strategies(layout, supports_sp=caps.sp,
                                                      supports_row_scatter=caps.row_scatter,
                                                      has_shared_expert=True):
                    for tokens in (1, 5, 16):
                        layer = MoELayer(weights.to(dev), ctx, spec, strategy, quant,
                                         OverlapConfig(overlap=True), max_tokens_per_rank=16)
                        x = demo_inputs(NUM_CFG, tokens, ctx.dp_rank, 0)
                        out = layer(x.to(dev)).cpu()
                        layer.destroy()
                        ok, err = within_tolerance(out, reference_moe(x, weights, quant))
                        rows.append(dict(layout=layout.describe(), backend=name,
                                         quant=quant.scheme.value, strategy=strategy.value,
                                         tokens=tokens, rank=rank, ok=ok, max_abs_err=err))
    return rows


def _time(fn, iters: int = 30) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def _raw_round_trip(pf: TorchPrepareFinalize, x: torch.Tensor, ids: torch.Tensor,
                    w: torch.Tensor) -> Callable[[], None]:
    """The same dispatch + combine written directly against torch.distributed, as a user would
    without our classes: destination ranks, counts exchange, the three dispatch
    all_to_all_single (rows, ids, weights), the combine one, and the sum back into tokens."""
    m = pf.manager

    def run() -> None:
        hit = torch.zeros(x.shape[0], m.num_ranks, dtype=torch.bool, device=x.device)
        hit.scatter_(1, ids // m.placement.num_local, True)
        counts = hit.sum(0)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)
        send, recv = torch.stack([counts, recv_counts]).tolist()
        _, token_index = hit.t().nonzero(as_tuple=True)
        sent = []
        # index_select, not advanced indexing: the same gather at a fraction of the host time
        # (what our backend does too)
        for t in (torch.index_select(x, 0, token_index), torch.index_select(ids, 0, token_index),
                  torch.index_select(w, 0, token_index)):
            out = torch.empty(sum(recv), *t.shape[1:], dtype=t.dtype, device=t.device)
            dist.all_to_all_single(out, t, recv, send)
            sent.append(out)
        back = torch.empty(sum(send), x.shape[1], dtype=x.dtype, device=x.device)
        dist.all_to_all_single(back, sent[0], send, recv)
        torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token_index, back.float())
    return run


def latency(rank: int, n: int, dev: torch.device) -> list[dict]:
    """The reference backend through our classes vs its raw all_to_all_single calls."""
    hidden, topk, experts = 7168, 8, 256
    layout = ParallelLayout(n, 1, True)
    ctx = cached_dist_context(layout, dev)
    spec = get_backend("torch")
    rows = []
    for tokens in LAT_TOKENS:
        pf = spec.build(ctx, DispatchConfig(experts, hidden, topk, 256, torch.bfloat16))
        assert isinstance(pf, TorchPrepareFinalize)
        g = torch.Generator(device=dev).manual_seed(rank)
        x = torch.randn(tokens, hidden, device=dev, generator=g).to(torch.bfloat16)
        ids = torch.rand(tokens, experts, device=dev, generator=g).topk(topk, -1).indices
        w = torch.rand(tokens, topk, device=dev, generator=g)
        out = torch.empty_like(x)

        def ours() -> None:
            prep = pf.prepare(x, w, ids, QuantSpec())
            pf.finalize(prep.x, w, ids, out)  # identity experts: the transport alone

        ours_us = _time(ours)
        raw_us = _time(_raw_round_trip(pf, x, ids, w))
        rows.append(dict(backend=spec.name, tokens=tokens, ours_us=ours_us, raw_us=raw_us,
                         overhead=ours_us / raw_us - 1))
    return rows


def worker(rank: int, n: int, port: int, queue) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n, timeout=datetime.timedelta(seconds=300),
                            device_id=dev)
    try:
        queue.put((rank, numerics(rank, n, dev), latency(rank, n, dev)))
    finally:
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--out")
    args = p.parse_args()
    if args.gpus < 1 or args.gpus > torch.cuda.device_count():
        print(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} GPUs", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(r, args.gpus, port, queue)) for r in range(args.gpus)]
    for pr in procs:
        pr.start()
    got = [queue.get(timeout=1800) for _ in procs]
    for pr in procs:
        pr.join()
    num = [row for _, rows, _ in got for row in rows]
    lat = [row for r, _, rows in got if r == 0 for row in rows]
    bad = [r for r in num if not r["ok"]]
    print(f"numerics: {len(num)} rank-checks, {len(bad)} out of tolerance")
    for r in bad[:20]:
        print("  FAIL", r)
    print(f"\n{'backend':<10} {'tokens':>6} {'ours us':>9} {'raw us':>9} {'overhead':>9}")
    for r in lat:
        print(f"{r['backend']:<10} {r['tokens']:>6} {r['ours_us']:>9.1f} {r['raw_us']:>9.1f} "
              f"{r['overhead']:>9.2%}")
    if args.out:
        with open(args.out, "w") as f:
            used = sorted({r.module for name in {row["backend"] for row in num}
                           for r in get_backend(name).required})
            conditions = run_conditions("cuda", used, device_text=(
                f"{args.gpus} x {torch.cuda.get_device_name()}"))
            json.dump(dict(conditions=conditions, gpus=args.gpus, numerics=num, latency=lat), f,
                      indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
