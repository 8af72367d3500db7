"""The per-expert token counts vLLM's experts get (``mk.ExpertTokensMetadata``) from what our
backends hand back (:class:`moe_plugins.interface.ExpertTokensMeta`, or a lazy one whose counts
are made only when read)."""
from __future__ import annotations

from typing import Optional, Union

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk

from moe_plugins.interface import ExpertTokensMeta, LazyExpertTokensMeta

__all__ = ["LazyTokensMetadata", "vllm_tokens_meta"]


class LazyTokensMetadata(mk.ExpertTokensMetadata):
    """vLLM's ExpertTokensMetadata over a backend's :class:`LazyExpertTokensMeta`: the counts
    are made when vLLM's experts read them (its STANDARD experts route by the ids and do not)."""

    def __init__(self, meta: LazyExpertTokensMeta):
        self._meta = meta
        self.expert_num_tokens_cpu = None
        self.psum_recv_per_rank = None

    @property  # type: ignore[override]
    def expert_num_tokens(self) -> torch.Tensor:
        return self._meta.expert_num_tokens


def vllm_tokens_meta(meta: Union[ExpertTokensMeta, LazyExpertTokensMeta, None]
                     ) -> Optional[mk.ExpertTokensMetadata]:
    """vLLM's metadata for a backend's ``expert_tokens_meta`` (counts: int [num_local_experts]);
    None where the backend hands none."""
    if meta is None:
        return None
    if isinstance(meta, LazyExpertTokensMeta):
        return LazyTokensMetadata(meta)
    return mk.ExpertTokensMetadata(meta.expert_num_tokens, None)
