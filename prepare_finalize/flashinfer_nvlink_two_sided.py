"""Backend ``flashinfer_nvlink_two_sided``: flashinfer's MNNVL two-sided all-to-all-v (STANDARD).

The routing (topk ids and weights) goes first (``moe_prepare``), then the activations and, only
when they are quantized, their scales; the combine sends each row back to its token's top-k slot
and sums the slots. The prepare/finalize is the MNNVL backends' shared one
(:mod:`moe_plugins.mnnvl.prepare_finalize`); the manager
(:mod:`moe_plugins.all2all.flashinfer_nvlink_two_sided`) owns the workspaces and adapts the
flashinfer release's API (its transport), on which that class makes the dispatch and combine
calls.
"""
from __future__ import annotations

from moe_plugins.all2all.flashinfer_nvlink_two_sided import FlashInferAll2AllManager
from moe_plugins.config import DispatchConfig
from moe_plugins.mnnvl.manager import FLASHINFER_EXTRA, INSTALL_HINT
from moe_plugins.mnnvl.prepare_finalize import MnnvlPrepareFinalize
from moe_plugins.quant import QuantScheme
from moe_plugins.registry import (BackendSpec, Capabilities, RequiredPackage, Transport,
                                  WireLayout)

__all__ = ["FlashInferNVLinkTwoSidedPrepareFinalize", "SPEC"]


class FlashInferNVLinkTwoSidedPrepareFinalize(MnnvlPrepareFinalize):
    """The MNNVL prepare/finalize over a :class:`FlashInferAll2AllManager` (see
    :class:`moe_plugins.mnnvl.prepare_finalize.MnnvlPrepareFinalize` for the layout)."""

    manager_type = FlashInferAll2AllManager
    manager: FlashInferAll2AllManager


def _wire_layout(cfg: DispatchConfig) -> WireLayout:
    """Rows carry the layer's hidden; the routing travels with each row as int32 ids and float32
    weights (``moe_prepare``), what :meth:`_count_dispatch` counts."""
    return WireLayout(cfg.hidden, topk_id_bytes=4)


SPEC = BackendSpec(
    name="flashinfer_nvlink_two_sided",
    prepare_finalize=FlashInferNVLinkTwoSidedPrepareFinalize,
    manager=FlashInferAll2AllManager,
    # EP/DP and TP: every TP rank dispatches only the rows it owns (the layer and the vLLM
    # adapter slice them with moe_plugins.layout before prepare; vLLM's in-tree two-sided
    # backend sends every token from every TP rank), so row-scatter applies as well. SP no:
    # vLLM's use_sequence_parallel_moe does not list this backend.
    capabilities=Capabilities(ep_dp=True, dp=True, tp=True, sp=False, row_scatter=True,
                              recv_hook=False, placements=True),
    quants=frozenset({QuantScheme.NONE, QuantScheme.FP8_BLOCK128, QuantScheme.NVFP4}),
    required=(RequiredPackage("flashinfer", INSTALL_HINT, FLASHINFER_EXTRA),),
    needs_cuda=True,
    wire_layout=_wire_layout,
    transport=Transport.NVLINK_TWO_SIDED,
    priority=25,  # after DeepEP LL (hooks overlap better), before NixlEP and the reference
    description="flashinfer MNNVL two-sided all-to-all-v (MnnvlMoe in 0.7.2.post1, moe_ep in "
                "0.7.4+); shared expert overlaps on the side stream",
    use_for="decode and prefill inside one NVLink domain (receive rows sized per call); "
            "NVFP4 on the wire",
)
