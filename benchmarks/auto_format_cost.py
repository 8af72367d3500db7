"""Cost of presenting deepep_auto's low-latency receive layout in the STANDARD format.

Times :func:`moe_plugins.formats.batched_as_standard` (routing columns from the per-expert
counts; x viewed, block scales copied row-major) and :func:`standard_as_batched` (a view) on
CPU for DeepSeek-V3-like shapes: hidden 7168, 256 experts over 8 or 32 ranks, low-latency
capacity 128 tokens per rank. Prints JSON lines: the run's conditions (benchmarks/conditions.py),
then one line per shape. Single process, no GPU.

    python benchmarks/auto_format_cost.py > benchmarks/results/auto_format_cost_cpu.jsonl
"""
from __future__ import annotations

import json
import time

import torch

from conditions import run_conditions
from moe_plugins.formats import batched_as_standard, standard_as_batched
from moe_plugins.interface import ExpertTokensMeta, PrepareResult

HIDDEN, EXPERTS, CAPACITY, ITERS = 7168, 256, 128, 50


def _time(fn, iters: int = ITERS) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> None:
    torch.set_num_threads(1)
    print(json.dumps({"conditions": run_conditions("cpu")}))
    for ranks in (8, 32):
        e_l, slots = EXPERTS // ranks, CAPACITY * ranks
        counts = torch.randint(0, slots // 4, (e_l,), dtype=torch.int32)
        for fp8 in (False, True):
            dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
            x = torch.zeros(e_l, slots, HIDDEN, dtype=dtype)
            # the kernels' column-major block scales: [e_l, slots, hidden // 128] with stride 1
            sf = torch.zeros(e_l, HIDDEN // 128, slots).transpose(1, 2) if fp8 else None
            prep = PrepareResult(x, sf, ExpertTokensMeta(counts), None, None)
            out = torch.zeros(e_l * slots, HIDDEN, dtype=torch.bfloat16)
            to_std = _time(lambda: batched_as_standard(prep))
            back = _time(lambda: standard_as_batched(out, e_l))
            std = batched_as_standard(prep)
            print(json.dumps({
                "ranks": ranks, "local_experts": e_l, "slots": slots, "fp8": fp8,
                "rows_presented": std.x.shape[0], "x_is_view": std.x.data_ptr() == x.data_ptr(),
                "to_standard_us": round(to_std, 1), "to_batched_us": round(back, 1),
                "activation_bytes": x.numel() * x.element_size(),
                "copied_bytes": 0 if sf is None else sf.numel() * 4,
            }))


if __name__ == "__main__":
    main()
