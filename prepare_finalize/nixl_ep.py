"""Backend ``nixl_ep``: NIXL EP's low-latency kernels (``nixl_ep.Buffer.dispatch`` / ``combine``
with ``return_recv_hook``), elastic rank masking.

The prepare/finalize (the library calls) is the shared low-latency one of
:mod:`moe_plugins.lowlat.prepare_finalize`; the buffer lifecycle (store, memory, connections) and
which runtime methods take the calls are in :mod:`moe_plugins.all2all.nixl_ep`.
"""
from __future__ import annotations

from moe_plugins.all2all.nixl_ep import NixlEPManager
from moe_plugins.lowlat.prepare_finalize import LowLatencyPrepareFinalize, low_latency_spec

__all__ = ["NixlEPPrepareFinalize", "SPEC"]


class NixlEPPrepareFinalize(LowLatencyPrepareFinalize):
    """BATCHED prepare/finalize over a :class:`moe_plugins.all2all.nixl_ep.NixlEPManager`."""

    manager: NixlEPManager


SPEC = low_latency_spec(
    "nixl_ep", NixlEPPrepareFinalize, NixlEPManager,
    "NIXL EP low-latency dispatch/combine (UCX/NIXL device API), receive hooks, FP8 block-128, "
    "elastic rank masking",
    priority=20,
    use_for="decode where NIXL (UCX) is the fabric or a failed peer must be masked (elastic EP); "
            "vLLM's dual-batch overlap and fault tolerance",
)
