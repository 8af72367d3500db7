"""PrepareResult.x_sf_swizzled and the one place that reads swizzled nvfp4 scales (TorchExperts)."""
from __future__ import annotations

import pytest
import torch

from moe_plugins.runner.experts import TorchExperts
from moe_plugins.interface import ExpertTokensMeta, PrepareResult
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights, route
from moe_plugins.quant import (QuantScheme, QuantSpec, quantize_dequantize, quantize_for_dispatch,
                               swizzle_nvfp4_sf)

CFG = MoEConfig(hidden=256, num_experts=4, num_topk=2, intermediate=32, shared_intermediate=0)


def _prepared(num_tokens: int, quant: QuantSpec) -> tuple[PrepareResult, TorchExperts]:
    w = MoEWeights.random(CFG, 3)
    x = torch.randn(num_tokens, CFG.hidden, generator=torch.Generator().manual_seed(1))
    tw, ti = route(x, w.router, CFG.num_topk, CFG.renormalize)
    xq, x_sf = quantize_for_dispatch(x, quant)
    return (PrepareResult(xq, x_sf, None, ti, tw),
            TorchExperts(w.local_experts(1, 0), quant, torch.float32))


@pytest.mark.parametrize("num_tokens", [1, 130])  # the tiled layout pads rows to 128
def test_swizzled_nvfp4_scales_give_the_same_output(num_tokens):
    prep, experts = _prepared(num_tokens, QuantSpec(QuantScheme.NVFP4))
    assert prep.x_sf is not None
    swizzled = PrepareResult(prep.x, swizzle_nvfp4_sf(prep.x_sf), None, prep.topk_ids,
                             prep.topk_weights, x_sf_swizzled=True)
    assert swizzled.x_sf is not None and swizzled.x_sf.dim() == 1
    torch.testing.assert_close(experts.apply(swizzled), experts.apply(prep), atol=0, rtol=0)


def test_swizzled_without_scales_is_refused():
    x = torch.zeros(2, CFG.hidden)
    with pytest.raises(ValueError, match="x_sf is None"):
        PrepareResult(x, None, None, None, None, x_sf_swizzled=True)


def test_swizzled_scales_of_another_scheme_are_refused():
    prep, experts = _prepared(3, QuantSpec(QuantScheme.FP8_BLOCK128))
    bad = PrepareResult(prep.x, prep.x_sf, None, prep.topk_ids, prep.topk_weights,
                        x_sf_swizzled=True)
    with pytest.raises(ValueError, match="nvfp4 layout"):
        experts.apply(bad)


def test_batched_with_swizzled_scales_is_refused():
    prep, experts = _prepared(3, QuantSpec(QuantScheme.NVFP4))
    assert prep.x_sf is not None
    batched = PrepareResult(prep.x.unsqueeze(0), swizzle_nvfp4_sf(prep.x_sf),
                            ExpertTokensMeta(torch.tensor([3], dtype=torch.int32)), None, None,
                            x_sf_swizzled=True)
    with pytest.raises(ValueError, match="BATCHED"):
        experts.apply(batched)


@pytest.mark.parametrize("scheme", [QuantScheme.FP8_BLOCK128, QuantScheme.NVFP4])
def test_zero_tokens_round_trip(scheme):
    """A rank with no tokens still quantizes and dequantizes (empty, not an error)."""
    out = quantize_dequantize(torch.zeros(0, CFG.hidden), QuantSpec(scheme))
    assert out.shape == (0, CFG.hidden)
