"""Reference quantization used for dispatch."""
from __future__ import annotations

import pytest
import torch

from moe_plugins.quant import (QuantScheme, QuantSpec, dequantize_fp8_block128, dequantize_nvfp4,
                               quantize_dequantize, quantize_for_dispatch, quantize_fp8_block128,
                               quantize_nvfp4, swizzle_nvfp4_sf, unswizzle_nvfp4_sf)


def test_fp8_block128_shapes_and_error_bound():
    x = torch.randn(5, 384)
    q, sf = quantize_fp8_block128(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 384)
    assert sf.dtype == torch.float32 and sf.shape == (5, 3)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each block's amax
    err = (dequantize_fp8_block128(q, sf) - x).abs().reshape(5, 3, 128)
    amax = x.abs().reshape(5, 3, 128).amax(-1, keepdim=True)
    assert (err <= amax * 2 ** -4 + 1e-6).all()


def test_nvfp4_shapes_and_exact_on_grid():
    # values already on the e2m1 grid times a power-of-two block scale survive exactly
    grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6] * 4).reshape(1, 32)
    x = torch.cat([grid, -grid]) * 0.5
    q, sf = quantize_nvfp4(x, global_scale=1.0)
    assert q.dtype == torch.uint8 and q.shape == (2, 16)
    assert sf.dtype == torch.float8_e4m3fn and sf.shape == (2, 2)
    torch.testing.assert_close(dequantize_nvfp4(q, sf, 1.0), x)


def test_swizzle_round_trip_with_padding():
    sf = torch.rand(130, 6).to(torch.float8_e4m3fn)
    flat = swizzle_nvfp4_sf(sf)
    assert flat.numel() == 256 * 8  # rows padded to 128, columns to 4
    assert torch.equal(unswizzle_nvfp4_sf(flat, 130, 6).float(), sf.float())


@pytest.mark.parametrize("spec", [QuantSpec(), QuantSpec(QuantScheme.FP8_BLOCK128, True),
                                  QuantSpec(QuantScheme.NVFP4, True)])
def test_unquantized_wire_has_no_scales(spec):
    x = torch.randn(3, 128)
    out, x_sf = quantize_for_dispatch(x, spec)
    assert x_sf is None and out is x


def test_deferred_rounding_equals_dispatch_rounding():
    x = torch.randn(4, 256)
    for scheme in (QuantScheme.FP8_BLOCK128, QuantScheme.NVFP4):
        q, sf = quantize_for_dispatch(x, QuantSpec(scheme))
        deq = dequantize_fp8_block128(q, sf) if scheme is QuantScheme.FP8_BLOCK128 \
            else dequantize_nvfp4(q, sf, 1.0)
        assert torch.equal(quantize_dequantize(x, QuantSpec(scheme, True)), deq)


def test_hidden_not_multiple_of_block_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of 128, got hidden=200"):
        QuantSpec(QuantScheme.FP8_BLOCK128).check_hidden(200)
