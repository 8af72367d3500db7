"""Timing by CUDA-graph replay, shared by the GPU benchmarks: launch cost is taken out, so what
is left is the GPU work of what was captured."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def graph_ms(fn: Callable[[], object], replays: int, repeats: int = 1) -> float:
    """Capture ``fn`` once (after warm-up calls on a side stream, as CUDA graphs require) and
    return the median over ``repeats`` of the mean ms per replay over ``replays`` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    means = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        means.append(start.elapsed_time(end) / replays)
    return statistics.median(means)
