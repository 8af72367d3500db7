"""Backend ``deepep_ll``: DeepEP's V1 low-latency kernels (``Buffer.low_latency_dispatch`` /
``low_latency_combine`` with ``return_recv_hook``).

The prepare/finalize (the library calls) is the shared low-latency one of
:mod:`moe_plugins.lowlat.prepare_finalize`; the buffer, its sizes and which runtime methods take
the calls are in :mod:`moe_plugins.all2all.deepep_ll`.
"""
from __future__ import annotations

from moe_plugins.all2all.deepep_ll import DeepEPLLManager
from moe_plugins.lowlat.prepare_finalize import LowLatencyPrepareFinalize, low_latency_spec

__all__ = ["DeepEPLLPrepareFinalize", "SPEC"]


class DeepEPLLPrepareFinalize(LowLatencyPrepareFinalize):
    """BATCHED prepare/finalize over a :class:`moe_plugins.all2all.deepep_ll.DeepEPLLManager`."""

    manager: DeepEPLLManager


SPEC = low_latency_spec(
    "deepep_ll", DeepEPLLPrepareFinalize, DeepEPLLManager,
    "DeepEP V1 low-latency dispatch/combine (NVSHMEM/IBGDA, NVLink), receive hooks, FP8 block-128",
    priority=30,
    use_for="decode: small batches, CUDA graphs, the shared expert between send and receive; "
            "vLLM's dual-batch overlap and fault tolerance",
)
