"""What vLLM's forward context says about the current pass, as a :class:`BatchHint`.

A backend that picks its transport per call (``deepep_auto``) must pick the same one on every EP
rank, so the hint uses only values vLLM makes the same on every rank of the EP group:

- the largest batch: ``dp_metadata.num_tokens_across_dp_cpu`` (every DP rank's token count, the
  same table on all ranks); without DP metadata (dp == 1) every EP rank is a TP rank of one batch;
- prefill: vLLM synchronizes the CUDA-graph runtime mode across DP ranks (the minimum,
  ``v1/worker/dp_utils.py``). Where the configured mode runs decode batches as FULL graphs and
  mixed batches otherwise (``FULL_AND_PIECEWISE``, ``FULL_DECODE_ONLY``), a runtime mode other
  than FULL means some rank's batch is not a uniform decode batch: a prefill pass (or a decode
  batch beyond the captured sizes). Under other modes (``--enforce-eager``, ``PIECEWISE``,
  ``FULL``) the passes cannot be told apart and ``prefill`` is None: the token threshold alone
  decides.

Reads vLLM; imported by the glue only.
"""
from __future__ import annotations

import logging
from typing import Optional

from moe_plugins.interface import BatchHint
from moe_plugins.layout import ParallelLayout, owned_rows

logger = logging.getLogger(__name__)

__all__ = ["batch_hint", "prefill_pass"]

_WARNED: set[str] = set()


def prefill_pass(runtime_mode: object, configured_mode: object) -> Optional[bool]:
    """True/False when the synced runtime CUDA-graph mode tells a prefill pass from a decode
    pass under ``configured_mode`` (see the module doc), else None."""
    from vllm.config import CUDAGraphMode

    assert isinstance(configured_mode, CUDAGraphMode)
    if not (configured_mode.separate_routine()
            and configured_mode.decode_mode() == CUDAGraphMode.FULL):
        return None
    return runtime_mode != CUDAGraphMode.FULL


def batch_hint(num_tokens: int, layout: ParallelLayout,
               presliced: bool = False) -> Optional[BatchHint]:
    """The hint for a MoE call of ``num_tokens`` tokens (this DP group's; with ``presliced``,
    e.g. under SP, already this rank's chunk, the same size on every TP rank) under ``layout``,
    or None outside a vLLM forward pass. ``max_tokens_per_rank`` counts rows after TP slicing
    (the largest chunk of the largest DP batch)."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    context = get_forward_context()
    dp = context.dp_metadata
    chunk = num_tokens if presliced else owned_rows(num_tokens, layout.tp, 0).chunk
    largest = int(dp.num_tokens_across_dp_cpu.max()) if dp is not None else 0
    config = get_current_vllm_config_or_none()
    prefill = None
    if config is not None:
        prefill = prefill_pass(context.cudagraph_runtime_mode,
                               config.compilation_config.cudagraph_mode)
    if prefill is None and "prefill" not in _WARNED:
        _WARNED.add("prefill")
        logger.info("moe-plugins: vLLM's CUDA-graph mode does not separate decode from mixed "
                    "batches; per-call backends decide by the largest DP batch alone")
    return BatchHint(max(owned_rows(largest, layout.tp, 0).chunk, chunk), prefill)
