"""Run functions as vLLM's dual-batch overlap runs a model's micro-batches: one thread per
micro-batch, each inside vLLM's own ``UBatchContext`` (``vllm.v1.worker.ubatching``), started
and joined as vLLM's ``UBatchWrapper._run_ubatches`` does (threads wait at the ready barrier,
then micro-batch 0 gets the CPU; they hand it over at each ``dbo_yield`` and on exit).

Everything of the protocol is vLLM's: its contexts, its events, its ``dbo_*`` functions that our
prepare/finalize and vLLM's ``FusedMoEKernel`` call. On CPU there are no CUDA streams: the
compute and communication "streams" are one object, the placeholder vLLM's ``current_stream()``
returns on its CPU platform, shared with the micro-batch threads (vLLM keeps it per thread), so
the contexts' stream switches never call CUDA (they switch from that object to itself).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import torch


def run_micro_batches(fns: Sequence[Callable[[], Any]], compute_stream: Optional[Any] = None,
                      comm_stream: Optional[Any] = None,
                      forward_contexts: Optional[Sequence[Any]] = None,
                      device_index: Optional[int] = None) -> list[Any]:
    """Run ``fns[i]`` as micro-batch ``i`` under vLLM's DBO protocol; returns their results in
    order. Streams default to vLLM's ``current_stream()`` (CPU: no stream switching); on CUDA
    pass vLLM's compute stream and a communication stream, and the device each thread selects
    first (as vLLM's ubatch threads do). An exception in a micro-batch is raised here (the
    other thread is released first)."""
    from vllm.utils import torch_utils
    from vllm.v1.worker.ubatching import make_ubatch_contexts

    n = len(fns)
    stream = torch_utils.current_stream()
    # vLLM keeps the current stream per thread (CPU: a placeholder object per thread); give
    # the micro-batch threads this thread's, so their "switches" stay on that one object.
    share_placeholder = compute_stream is None
    compute = compute_stream if compute_stream is not None else stream
    comm = comm_stream if comm_stream is not None else compute
    barrier = threading.Barrier(n + 1)
    ctxs = make_ubatch_contexts(num_micro_batches=n, compute_stream=compute, comm_stream=comm,
                                forward_contexts=list(forward_contexts or [None] * n),
                                ready_barrier=barrier)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            if device_index is not None:
                torch.accelerator.set_device_index(device_index)
            if share_placeholder:
                torch_utils._current_stream_tls.value = stream
            with ctxs[i]:
                results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)
            # let the other micro-batch run on (it would wait for this one's hand-over forever)
            ctxs[i].cpu_signal_event.set()

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    ctxs[0].cpu_wait_event.set()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise RuntimeError("a micro-batch thread did not finish within 120 s (hand-over lost)")
    return results
