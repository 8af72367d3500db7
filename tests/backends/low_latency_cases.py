"""The one-rank GPU checks shared by the low-latency backends (deepep_ll, nixl_ep) against their
REAL libraries: bf16 and FP8 dispatch (float block-128 and packed UE8M0 scales) at 1/5/64 tokens,
hook mode, the same rows as a raw ``Buffer.low_latency_dispatch``, combine with ``out=``, the
row-scatter finalize (with a real side-stream shared expert), hidden padding, each element-wise
against the single-process reference.

Not a test module: tests/gpu/test_<backend>_gpu.py imports everything here (``__all__``) and
provides two fixtures: ``ctx`` (a one-rank :class:`DistContext` on cuda:0) and ``build``
(``build(quant, hidden=CFG.hidden)`` -> a new backend of that layer shape over ``ctx``). With one
rank every expert is local, so dispatch and combine move tokens between this GPU's buffers; what
is checked is our backend's use of the library's API.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import socket
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from moe_plugins.config import DispatchConfig
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.runner.experts import TorchExperts
from moe_plugins.faults import clear_group_faults
from moe_plugins.groups import DistContext
from moe_plugins.interface import RowScatterTarget
from moe_plugins.layout import ParallelLayout, owned_rows
from moe_plugins.lowlat.vendor import destroy_all_buffers
from moe_plugins.lowlat.limits import unpack_ue8m0_scales
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import ExpertWeights, MoEWeights, SharedWeights, route
from moe_plugins.overlap import OverlapConfig, clear_side_streams, launch_shared
from moe_plugins.quant import QuantScheme, QuantSpec
from moe_plugins.runner.reference import reference_moe, tolerance_for

__all__ = [
    "free_port", "one_rank_context", "backend_factory", "CFG", "MAX_TOKENS", "BF16", "FP8", "DEV",
    "TIMEOUT", "one_buffer", "forget_abandoned_calls", "weights",
    "test_prepare_finalize_matches_reference", "test_hook_mode_defers_the_receive",
    "test_prepare_hands_over_what_the_raw_buffer_receives",
    "test_row_scatter_finalize_adds_into_owned_rows", "test_packed_ue8m0_scales",
    "test_unsupported_hidden_is_padded", "test_non_contiguous_inputs_give_the_contiguous_result",
]

CFG = MoEConfig(hidden=7168, num_experts=32, num_topk=8, intermediate=128,
                shared_intermediate=256, dtype=torch.bfloat16)
MAX_TOKENS = 64
BF16, FP8 = QuantSpec(), QuantSpec(QuantScheme.FP8_BLOCK128)
DEV = torch.device("cuda")
TIMEOUT = datetime.timedelta(seconds=120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_rank_context(**init: Any) -> Iterator[DistContext]:
    """A one-rank gloo group (``init``: how to rendezvous, e.g. ``init_method=`` or ``store=``)
    and its EP context on cuda:0; on exit every library buffer and side stream is released."""
    torch.cuda.set_device(0)
    assert not dist.is_initialized(), "run each backend's GPU tests in their own pytest process"
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=TIMEOUT, **init)
    try:
        yield DistContext(ParallelLayout(1, 1, True), 0, dist.group.WORLD, None, DEV)
    finally:
        destroy_all_buffers()
        clear_side_streams()
        dist.destroy_process_group()


def backend_factory(spec: Any, ctx: DistContext, options: Any = None) -> Callable[..., Any]:
    """``build(quant, hidden=CFG.hidden)``: a new backend of ``spec`` for that layer shape."""
    def build(quant: QuantSpec, hidden: int = CFG.hidden) -> Any:
        return spec.build(ctx, DispatchConfig(CFG.num_experts, hidden, CFG.num_topk, MAX_TOKENS,
                                              CFG.dtype, quant, options))
    return build


@pytest.fixture(scope="module", autouse=True)
def one_buffer(build):
    """Keep one backend alive for the whole module: every backend below has the same buffer
    key (kernel hidden 7168, 64 tokens, 32 experts), so they all share this one library Buffer.
    DeepEP initializes NVSHMEM per Buffer and finalizes it in destroy(), NIXL EP creates its agent
    per Buffer: one Buffer per process is the pattern both libraries' tests use."""
    pf = build(BF16)
    yield pf
    pf.manager.destroy()


@pytest.fixture(autouse=True)
def forget_abandoned_calls(ctx):
    """Several tests here stop a call after its dispatch (a prepare alone, a raw dispatch), which
    marks the EP group out of step. With ONE rank every rank abandoned the same call, so the
    group is sound again: forget it after each test (as the CPU tests do after such probes)."""
    yield
    clear_group_faults(ctx.ep_group)


@pytest.fixture(scope="module")
def weights() -> MoEWeights:
    return MoEWeights.random(CFG, 0)


def _routed_only(w: MoEWeights) -> MoEWeights:
    return dataclasses.replace(w, shared_w13=None, shared_w2=None, shared_gate=None)


def _experts(w: MoEWeights, quant: QuantSpec) -> TorchExperts:
    return TorchExperts(ExpertWeights(w.w13.to(DEV), w.w2.to(DEV), 0), quant, CFG.dtype)


def _shared(w: MoEWeights) -> SharedWeights:
    assert w.shared_w13 is not None and w.shared_w2 is not None
    return SharedWeights(w.shared_w13.to(DEV), w.shared_w2.to(DEV),
                         None if w.shared_gate is None else w.shared_gate.to(DEV))


def _inputs(w: MoEWeights, num_tokens: int, seed: int = 0):
    x = demo_inputs(CFG, num_tokens, 0, seed)
    tw, ti = route(x, w.router, CFG.num_topk, CFG.renormalize)
    return x, tw, ti


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = tolerance_for(ref, CFG.dtype)
    torch.testing.assert_close(got.float().cpu(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
@pytest.mark.parametrize("quant", [BF16, FP8], ids=["bf16", "fp8"])
def test_prepare_finalize_matches_reference(build, weights, quant, num_tokens):
    pf = build(quant)
    try:
        x, tw, ti = _inputs(weights, num_tokens)
        prep = pf.prepare(x.to(DEV), tw.to(DEV), ti.to(DEV), quant)
        assert (prep.x_sf is None) == (quant is BF16)
        assert prep.x.shape == (CFG.num_experts, MAX_TOKENS, CFG.hidden)
        counts = prep.expert_tokens_meta.expert_num_tokens
        assert counts.dtype == torch.int32
        assert counts.cpu().tolist() == torch.bincount(ti.flatten(), minlength=CFG.num_experts).tolist()
        if quant is FP8:
            assert prep.x.dtype == torch.float8_e4m3fn and prep.x_sf.dtype == torch.float32
            assert prep.x_sf.shape == (CFG.num_experts, MAX_TOKENS, CFG.hidden // 128)
        out = torch.empty(num_tokens, CFG.hidden, dtype=CFG.dtype, device=DEV)
        got = pf.finalize(_experts(weights, quant).apply(prep), tw.to(DEV), ti.to(DEV), out)
        assert got is out
        _close(out, reference_moe(x, _routed_only(weights), quant))
    finally:
        pf.reset_call_state()
        pf.manager.destroy()


@pytest.mark.parametrize("quant", [BF16, FP8], ids=["bf16", "fp8"])
def test_hook_mode_defers_the_receive(build, weights, quant):
    """prepare_async/finalize_async return the library's receive hooks; work issued between the
    send and the hook (a stand-in for the shared expert) does not disturb the result."""
    pf = build(quant)
    try:
        x, tw, ti = _inputs(weights, 16, seed=1)
        sent = pf.prepare_async(x.to(DEV), tw.to(DEV), ti.to(DEV), quant)
        assert callable(sent.hook)
        busy = torch.randn(2048, 2048, device=DEV)
        busy = busy @ busy
        sent.hook()
        prep = sent.receiver()
        out = torch.empty(16, CFG.hidden, dtype=CFG.dtype, device=DEV)
        done = pf.finalize_async(_experts(weights, quant).apply(prep), tw.to(DEV), ti.to(DEV), out)
        assert callable(done.hook)
        busy = busy @ busy
        done.hook()
        assert done.receiver() is out
        _close(out, reference_moe(x, _routed_only(weights), quant))
    finally:
        pf.reset_call_state()
        pf.manager.destroy()


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous tensor (the first two dims swapped in memory)."""
    out = t.transpose(0, 1).contiguous().transpose(0, 1)
    assert not out.is_contiguous()
    return out


@pytest.mark.parametrize("quant", [BF16, FP8], ids=["bf16", "fp8"])
def test_non_contiguous_inputs_give_the_contiguous_result(build, weights, quant):
    """Non-contiguous tokens, weights, ids and expert outputs: on the real library the runtime's
    host asserts refuse them before launching, and the prepare/finalize call again on copies
    (RuntimeCalls); the output equals the contiguous call's bit for bit, blocking and hooked."""
    pf = build(quant)
    try:
        assert pf.runtime_calls is not None
        x, tw, ti = _inputs(weights, 16, seed=3)
        args = (x.to(DEV), tw.to(DEV), ti.to(DEV).to(pf.manager.topk_idx_dtype))
        experts = _experts(weights, quant)
        outs = {}
        for strided in (False, True):
            call = tuple(map(_strided, args)) if strided else args
            prep = pf.prepare(*call, quant)
            expert_out = experts.apply(prep)
            out = torch.empty(16, CFG.hidden, dtype=CFG.dtype, device=DEV)
            pf.finalize(_strided(expert_out) if strided else expert_out, call[1], call[2], out)
            sent = pf.prepare_async(*call, quant)
            sent.hook()
            expert_out = experts.apply(sent.receiver())
            hooked = torch.empty_like(out)
            back = pf.finalize_async(_strided(expert_out) if strided else expert_out, call[1],
                                     call[2], hooked)
            back.hook()
            back.receiver()
            outs[strided] = (out, hooked)
        for a, b in zip(outs[False], outs[True]):
            assert torch.equal(a, b)
        _close(outs[True][0], reference_moe(x, _routed_only(weights), quant))
    finally:
        pf.reset_call_state()
        pf.manager.destroy()


def _row_order(rows: torch.Tensor) -> torch.Tensor:
    probe = torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(1),
                        dtype=torch.float64)
    return torch.argsort(rows.double().cpu() @ probe)


@pytest.mark.parametrize("quant", [BF16, FP8], ids=["bf16", "fp8"])
def test_prepare_hands_over_what_the_raw_buffer_receives(build, weights, quant):
    """Our prepare and a raw ``Buffer.low_latency_dispatch`` of the same tokens give the same
    counts and the same rows per expert (slot order inside an expert is the kernel's)."""
    pf = build(quant)
    try:
        x, tw, ti = _inputs(weights, 24, seed=2)
        xd, ids = x.to(DEV), ti.to(DEV)
        prep = pf.prepare(xd, tw.to(DEV), ids, quant)
        ours = (prep.x.clone(), None if prep.x_sf is None else prep.x_sf.float().clone(),
                prep.expert_tokens_meta.expert_num_tokens.clone())
        pf.reset_call_state()
        use_fp8 = quant is FP8
        # the library's own id dtype (DeepEP: int64; nixl_ep as built by nixl's meson: int32)
        recv, count, _handle, _event, _hook = pf.manager.buffer.low_latency_dispatch(
            xd, ids.to(pf.manager.topk_idx_dtype), pf.manager.max_tokens_per_rank,
            CFG.num_experts, use_fp8=use_fp8)
        raw_x, raw_sf = recv if use_fp8 else (recv, None)
        torch.cuda.synchronize()
        assert torch.equal(ours[2], count)
        for e in range(CFG.num_experts):
            c = int(count[e])
            a, b = ours[0][e, :c].float(), raw_x[e, :c].float()
            if use_fp8:
                a = a * ours[1][e, :c].repeat_interleave(128, dim=-1)
                b = b * raw_sf[e, :c].float().repeat_interleave(128, dim=-1)
            torch.testing.assert_close(a[_row_order(a)], b[_row_order(b)], atol=0, rtol=0)
    finally:
        pf.reset_call_state()
        pf.manager.destroy()


@pytest.mark.parametrize("quant", [BF16, FP8], ids=["bf16", "fp8"])
def test_row_scatter_finalize_adds_into_owned_rows(build, weights, quant):
    """A TP rank owning rows [5, 9) of 9 (tp 2, rank 1): the shared expert runs on a side
    stream over all 9 rows; finalize joins it and adds the routed output into the owned rows
    only, returning the same buffer."""
    pf = build(quant)
    try:
        n = 9
        x, tw, ti = _inputs(weights, n, seed=3)
        rows = owned_rows(n, 2, 1)
        s = rows.as_slice
        shared_fn = _shared(weights)
        handle = launch_shared(shared_fn, x.to(DEV), OverlapConfig(overlap=True))
        assert handle.overlapped  # a real side stream and event
        buffer = handle.output
        prep = pf.prepare(x[s].to(DEV), tw[s].to(DEV), ti[s].to(DEV), quant)
        got = pf.finalize(_experts(weights, quant).apply(prep), tw[s].to(DEV), ti[s].to(DEV),
                          RowScatterTarget(handle, rows))
        assert got is buffer
        shared_alone = _shared(weights)(x.to(DEV)).float().cpu()
        _close(got[: rows.start], shared_alone[: rows.start])  # rows it does not own: untouched
        _close(got[s], reference_moe(x, weights, quant)[s])
    finally:
        pf.reset_call_state()
        pf.manager.destroy()


def test_packed_ue8m0_scales(build, weights):
    """Experts asking for packed UE8M0 scales get int32 [.., hidden // 512] power-of-two scales."""

    class DeepGemmLike:
        def supports_packed_ue8m0_act_scales(self) -> bool:
            return True

    pf = build(FP8)
    try:
        pf.post_init_setup(DeepGemmLike())
        x, tw, ti = _inputs(weights, 8, seed=4)
        prep = pf.prepare(x.to(DEV), tw.to(DEV), ti.to(DEV), FP8)
        assert prep.x_sf.dtype == torch.int32
        assert prep.x_sf.shape == (CFG.num_experts, MAX_TOKENS, CFG.hidden // 512)
        counts = prep.expert_tokens_meta.expert_num_tokens.cpu()
        for e in range(CFG.num_experts):
            c = int(counts[e])
            if c == 0:
                continue
            scales = unpack_ue8m0_scales(prep.x_sf[e, :c].contiguous()).cpu()
            got = (prep.x[e, :c].float().cpu().view(c, -1, 128) * scales.unsqueeze(-1)).view(c, -1)
            want = x[(ti == e).any(dim=1)].float()
            amax = want.view(c, -1, 128).abs().amax(-1).clamp(min=1e-4)
            go, wo = _row_order(got), _row_order(want)
            torch.testing.assert_close(scales[go], torch.exp2(torch.ceil(torch.log2(amax / 448)))[wo],
                                       atol=0, rtol=0)
            torch.testing.assert_close(got[go], want[wo], atol=1e-3, rtol=0.0625)
    finally:
        pf.reset_call_state()
        pf.manager.destroy()


@pytest.mark.parametrize("quant", [BF16, FP8], ids=["bf16", "fp8"])
def test_unsupported_hidden_is_padded(build, one_buffer, quant):
    """A hidden-6400 layer runs on the 7168 kernels (zero-padded), same results, same Buffer."""
    cfg = dataclasses.replace(CFG, hidden=6400)
    w = MoEWeights.random(cfg, 5)
    pf = build(quant, hidden=6400)
    try:
        assert pf.manager.kernel_hidden == 7168 and pf.manager.buffer is one_buffer.manager.buffer
        x = demo_inputs(cfg, 7, 0, 5)
        tw, ti = route(x, w.router, cfg.num_topk, cfg.renormalize)
        prep = pf.prepare(x.to(DEV), tw.to(DEV), ti.to(DEV), quant)
        assert prep.x.shape[-1] == 6400
        experts = TorchExperts(ExpertWeights(w.w13.to(DEV), w.w2.to(DEV), 0), quant, cfg.dtype)
        out = torch.empty(7, 6400, dtype=cfg.dtype, device=DEV)
        pf.finalize(experts.apply(prep), tw.to(DEV), ti.to(DEV), out)
        _close(out, reference_moe(x, _routed_only(w), quant))
    finally:
        pf.reset_call_state()
        pf.manager.destroy()
