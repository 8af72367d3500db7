"""Backend ``flashinfer_nvlink_one_sided``: flashinfer's NVLink one-sided all-to-all (STANDARD).

The dispatch writes each token once per destination rank, with its scales (only when the
activations are quantized: ``x_sf is not None``) and its int32 ids and float32 weights, straight
into the receiver's buffer; the combine reads each rank's partial back and sums them on the
token's rank. The prepare/finalize is the MNNVL backends' shared one
(:mod:`moe_plugins.mnnvl.prepare_finalize`: quantization before the all-to-all with scales
unswizzled, the nvfp4 swizzle after it, row-scatter finalize, the shared expert on the side
stream overlapping the whole call); the manager
(:mod:`moe_plugins.all2all.flashinfer_nvlink_one_sided`) owns flashinfer's object and adapts the
release's API, the transports the library picks and the rank mask.
"""
from __future__ import annotations

import torch

from moe_plugins.all2all.flashinfer_nvlink_one_sided import FlashInferOneSidedManager
from moe_plugins.config import DispatchConfig
from moe_plugins.mnnvl.manager import FLASHINFER_EXTRA, INSTALL_HINT
from moe_plugins.mnnvl.prepare_finalize import MnnvlPrepareFinalize
from moe_plugins.quant import QuantScheme
from moe_plugins.registry import (BackendSpec, Capabilities, RequiredPackage, Transport,
                                  WireLayout)

__all__ = ["FlashInferNVLinkOneSidedPrepareFinalize", "SPEC"]


class FlashInferNVLinkOneSidedPrepareFinalize(MnnvlPrepareFinalize):
    """The MNNVL prepare/finalize over a :class:`FlashInferOneSidedManager`: ``num_ranks *
    tokens_per_rank`` receive rows, source-rank major; rows that carry no token have topk_ids -1
    in every column (flashinfer's ``invalid_expert_id``) and unspecified x. topk_ids are LOCAL
    expert ids, -1 where the expert lives on another rank."""

    manager_type = FlashInferOneSidedManager
    manager: FlashInferOneSidedManager


def _wire_layout(cfg: DispatchConfig) -> WireLayout:
    """Rows carry the layer's hidden; each carries its routing as int32 ids and float32 weights
    (payloads of the same dispatch), what the prepare/finalize counts."""
    return WireLayout(cfg.hidden, topk_id_bytes=4)


SPEC = BackendSpec(
    name="flashinfer_nvlink_one_sided",
    prepare_finalize=FlashInferNVLinkOneSidedPrepareFinalize,
    manager=FlashInferOneSidedManager,
    # EP/DP, TP (each TP rank dispatches the rows it owns), row-scatter and SP (vLLM's
    # use_sequence_parallel_moe lists this backend). No dual-batch overlap: objects of one layout
    # share flashinfer's workspace, which refuses a second round before the first's combine.
    # Rank masking is the manager's (set_rank_masked, enable_rank_mask), not an engine's fault
    # tolerance (rank_masking): the library never masks a silent peer by itself, its wait
    # traps the kernel (docs/backends.md says why vLLM's polls cannot be served).
    capabilities=Capabilities(ep_dp=True, dp=True, tp=True, sp=True, row_scatter=True,
                              recv_hook=False, placements=True, micro_batch=False,
                              rank_masking=False),
    quants=frozenset({QuantScheme.NONE, QuantScheme.FP8_BLOCK128, QuantScheme.NVFP4}),
    required=(RequiredPackage("flashinfer", INSTALL_HINT, FLASHINFER_EXTRA),),
    needs_cuda=True,
    # the combine kernels take 16-bit expert outputs only
    dtypes=frozenset({torch.bfloat16, torch.float16}),
    wire_layout=_wire_layout,
    transport=Transport.NVLINK_ONE_SIDED,
    priority=26,  # TensorRT-LLM's first choice on NVLink; after DeepEP LL (receive hooks)
    description="flashinfer NVLink one-sided all-to-all (moe_ep NVLinkOneSidedAlltoAll, "
                "0.7.2.post1+; CFT and Lamport transports from 0.7.4); rank masking",
    use_for="decode and prefill inside one NVLink domain (GB200/GB300 NVL72: MNNVL); SP; "
            "NVFP4 on the wire",
)
