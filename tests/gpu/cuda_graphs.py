"""CUDA-graph capture as every GPU test does it: warm-up calls on a side stream first (CUDA
graphs want the work's lazy set-up, allocator pools and library buffers touched outside the
capture), then one capture of ``fn`` on the current stream."""
from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch

T = TypeVar("T")


def capture(fn: Callable[[], T], warmups: int = 2, pool: Optional[Any] = None
            ) -> tuple[torch.cuda.CUDAGraph, T]:
    """``warmups`` calls of ``fn`` on a side stream, then ``fn`` captured (into the memory
    ``pool`` when given, shared with other graphs) -> (the graph, what the captured call
    returned: its static output, refilled by every ``graph.replay()``)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
