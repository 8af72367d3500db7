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


# --------------------------------------------------------------------------------------------
# NVFP4 against vLLM's emulation and a hand-computed vector
# --------------------------------------------------------------------------------------------
def _one_block(values: list[float]) -> torch.Tensor:
    """A [1, 16] row whose block amax is 6, so that x_sf is exactly 1.0 and values stay as given."""
    return torch.tensor([values + [6.0] + [0.0] * (15 - len(values))])


def test_nvfp4_ties_round_to_even_hand_vector():
    """Midpoints go to the even code: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0,
    2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0 (signed alike). Bytes hold element 2j in the low
    nibble: e.g. (0.75, 1.75) -> codes (2, 4) -> 0x42."""
    x = _one_block([0.75, 1.75, 3.5, 0.25, 1.25, 2.5, 5.0, -0.75, -3.5])
    q, sf = quantize_nvfp4(x, global_scale=1.0)
    assert sf.float().tolist() == [[1.0]]
    # codes: 2 4 6 0 2 4 6 (8|2) (8|6) 7 0 0 0 0 0 0  (sign bit 8 for negatives, 6.0 is code 7)
    assert q.tolist() == [[0x42, 0x06, 0x42, 0xA6, 0x7E, 0x00, 0x00, 0x00]]
    assert dequantize_nvfp4(q, sf, 1.0)[0, :9].tolist() == [1.0, 2.0, 4.0, 0.0, 1.0, 2.0, 4.0,
                                                             -1.0, -4.0]


def _vllm_nvfp4():
    return pytest.importorskip(
        "vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils",
        reason="vLLM is not installed (scripts/setup.sh test)")


@pytest.mark.vllm
@pytest.mark.parametrize("global_scale", [1.0, 37.5])
def test_nvfp4_equals_vllm_reference_quant(global_scale):
    """Our codes, read with vLLM's own unpacker (break_fp4_bytes: low nibble first), and our
    block scales equal vLLM's ref_nvfp4_quant bit for bit, on random rows and on rows built of
    exact ties."""
    emu = _vllm_nvfp4()
    g = torch.Generator().manual_seed(0)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
    x = torch.cat([torch.randn(6, 64, generator=g) * 3,
                   torch.cat([ties, -ties, ties * 0.5, -ties * 4]).reshape(1, 64) / global_scale])
    q, sf = quantize_nvfp4(x, global_scale)
    ref_vals, ref_sf = emu.ref_nvfp4_quant(x, torch.tensor(global_scale), 16)
    assert torch.equal(sf.float(), ref_sf)
    assert torch.equal(emu.break_fp4_bytes(q, torch.float32), ref_vals)


@pytest.mark.vllm
@pytest.mark.parametrize("num_tokens", [3, 130])  # the tiled layout pads rows to 128
def test_nvfp4_swizzle_is_the_layout_vllm_reads(num_tokens):
    """vLLM's dequantize_to_dtype unswizzles the 128x4-tiled scales itself
    (convert_swizzled_to_linear): fed our swizzled scales it gives what it gives for our linear
    ones, and both equal our dequantization. (hidden 128: 8 scale columns; vLLM's unswizzle
    slices the padded columns by element count, so it only reads layouts whose scale columns
    are a multiple of 4.)"""
    emu = _vllm_nvfp4()
    x = torch.randn(num_tokens, 128, generator=torch.Generator().manual_seed(1))
    gs = 4.0
    q, sf = quantize_nvfp4(x, gs)
    inv = torch.tensor(1.0 / gs)  # vLLM's dequant multiplies by the inverse global scale
    from_swizzled = emu.dequantize_to_dtype(q, swizzle_nvfp4_sf(sf), inv, torch.float32,
                                            swizzle=True)
    from_linear = emu.dequantize_to_dtype(q, sf, inv, torch.float32, swizzle=False)
    assert torch.equal(from_swizzled, from_linear)
    torch.testing.assert_close(from_linear, dequantize_nvfp4(q, sf, gs), atol=0, rtol=1e-6)


# -- what QuantScheme and QuantSpec accept (issue 28: QuantScheme('int4') listed nothing) -------
@pytest.mark.parametrize("value", ["int4", "NVFP4", "fp8", "", None, 4])
def test_quant_scheme_lists_the_valid_values(value):
    with pytest.raises(ValueError) as e:
        QuantScheme(value)
    assert str(e.value) == (f"{value!r} is not a QuantScheme; expected one of 'none', "
                            "'fp8_block128', 'nvfp4'")


def test_quant_spec_takes_a_scheme_by_its_value():
    spec = QuantSpec("fp8_block128")
    assert spec.scheme is QuantScheme.FP8_BLOCK128 and spec == QuantSpec(QuantScheme.FP8_BLOCK128)
    assert spec.quantized_on_wire


@pytest.mark.parametrize("kw,error,message", [
    ({"scheme": "int4"}, ValueError,
     "QuantSpec.scheme: 'int4' is not a QuantScheme; expected one of 'none', 'fp8_block128'"),
    ({"scheme": 1}, TypeError, "QuantSpec.scheme must be a QuantScheme, got 1 (int); pass one of "
                               "QuantScheme.NONE, QuantScheme.FP8_BLOCK128, QuantScheme.NVFP4"),
    ({"scheme": None}, TypeError, "QuantSpec.scheme must be a QuantScheme, got None"),
    ({"defer_input_quant": 1}, TypeError,
     "QuantSpec.defer_input_quant must be a bool, got 1 (int)"),
    ({"defer_input_quant": "no"}, TypeError, "defer_input_quant must be a bool, got 'no' (str)"),
    ({"nvfp4_global_scale": 0.0}, ValueError,
     "QuantSpec.nvfp4_global_scale must be finite and > 0, got 0.0"),
    ({"nvfp4_global_scale": -2.0}, ValueError, "nvfp4_global_scale must be finite and > 0"),
    ({"nvfp4_global_scale": float("nan")}, ValueError, "must be finite and > 0, got nan"),
    ({"nvfp4_global_scale": float("inf")}, ValueError, "must be finite and > 0, got inf"),
    ({"nvfp4_global_scale": True}, TypeError,
     "QuantSpec.nvfp4_global_scale must be a number, got True (bool)"),
    ({"nvfp4_global_scale": torch.tensor(2.0)}, TypeError, "(Tensor); pass a float"),
    ({"nvfp4_swizzled_sf": 1}, TypeError,
     "QuantSpec.nvfp4_swizzled_sf must be True, False or None, got 1 (int)"),
])
def test_quant_spec_checks_every_field(kw, error, message):
    with pytest.raises(error) as e:
        QuantSpec(**kw)
    assert message in str(e.value)


def test_quant_spec_accepts_the_documented_values():
    spec = QuantSpec(QuantScheme.NVFP4, True, 448 * 6, False)
    assert spec.nvfp4_global_scale == 2688 and spec.nvfp4_swizzled_sf is False
    assert QuantSpec(nvfp4_global_scale=0.5, nvfp4_swizzled_sf=None).nvfp4_swizzled_sf is None
