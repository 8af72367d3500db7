"""The low-latency backends (deepep_ll, nixl_ep) on CPU, against emulations of deep_ep and
nixl_ep (tests/emulation), multi-rank over gloo, compared with the single-process reference.
deep_ep presents 567632d's V1 Buffer unless a test says otherwise; the tests parametrized by
``shape`` also run on the current line's legacy Buffer (d4f41e4 and later)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.runner import faults_ranks as fault_rank_fns
from tests.backends import low_latency_ranks as ll_rank_fns
from tests.backend_lists import LOW_LATENCY
from tests.checks import assert_matches_reference
from tests.emulation import in_deep_ep_shape, installed
from moe_plugins.cli import main as cli_main
from moe_plugins.config import DispatchConfig
from moe_plugins.groups import DistContext
from moe_plugins.interface import ActivationFormat
from moe_plugins.runner.launch import RankError
from moe_plugins.layout import ParallelLayout
from moe_plugins.lowlat.limits import (KERNEL_HIDDEN_SIZES, MAX_TOPK, round_up_hidden_size,
                                       token_capacity, unpack_ue8m0_scales)
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights
from moe_plugins.quant import QuantScheme, QuantSpec, dequantize_fp8_block128, quantize_fp8_block128
from moe_plugins.registry import get_backend
from moe_plugins.strategy import ReductionStrategy as S

BACKENDS = LOW_LATENCY  # the registry's low-latency backends (tests/backend_lists.py)
#: (backend, deep_ep API shape) of the tests run on both DeepEP lines; nixl_ep has one shape.
ON_EACH_LINE = [("deepep_ll", "v1"), ("deepep_ll", "legacy"), ("nixl_ep", None)]
LINE_IDS = ["deepep_ll-v1", "deepep_ll-legacy", "nixl_ep"]


def _run(pool, shape, fn, *args):
    """``pool.run(fn, *args)``, with deep_ep presenting ``shape`` where it is not None."""
    return pool.run(fn, *args) if shape is None else pool.run(in_deep_ep_shape, shape, fn, *args)
BF16, FP8 = QuantSpec(), QuantSpec(QuantScheme.FP8_BLOCK128)
QUANTS = [BF16, FP8]
QUANT_IDS = ["bf16", "fp8"]


def _cfg(**kw: object) -> MoEConfig:
    return MoEConfig(**{"hidden": 2048, "num_experts": 8, "num_topk": 3, "intermediate": 32,
                        "shared_intermediate": 64, "dtype": torch.bfloat16, **kw})


# -- the layer, multi-rank, against the reference ------------------------------------------

LAYER_CASES = [
    (ParallelLayout(2, 1, True), S.LOCAL),  # tp 1
    (ParallelLayout(2, 2, True), S.ROW_SCATTER_ALLREDUCE),  # tp 2, row-scatter finalize
    (ParallelLayout(2, 2, True), S.GATHER_PLUS_ALLREDUCE),  # tp 2, row-scatter off
]
LAYER_IDS = ["tp1", "tp2-row_scatter", "tp2-gather"]


@pytest.mark.multirank
@pytest.mark.parametrize("num_tokens", [1, 3, 5, 8, 9])
@pytest.mark.parametrize("layout,strategy", LAYER_CASES, ids=LAYER_IDS)
@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_matches_reference(rank_pool, backend, quant, layout, strategy, num_tokens):
    cfg = _cfg()
    results = rank_pool(layout.world_size).run(ll_rank_fns.run_ll_layer, backend, layout, cfg,
                                               strategy, num_tokens, quant)
    assert_matches_reference(results, layout, cfg, num_tokens, quant)
    for r in results:
        assert r["strategy"] is strategy
        assert r["pairs"] == r["owned"] * cfg.num_topk  # the owned slice, never all tokens
        assert (r["sf_bytes"] > 0) == (quant.quantized_on_wire and r["owned"] > 0)
        if strategy is S.ROW_SCATTER_ALLREDUCE:
            assert r["tp_collectives"] == ["all_reduce"]


@pytest.mark.multirank
@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("layout,strategy", LAYER_CASES[:2], ids=LAYER_IDS[:2])
def test_layer_matches_reference_on_the_current_deepep_line(rank_pool, quant, layout, strategy):
    """deepep_ll on the current line's legacy Buffer (the tests above run on 567632d's)."""
    cfg = _cfg()
    results = _run(rank_pool(layout.world_size), "legacy", ll_rank_fns.run_ll_layer, "deepep_ll",
                   layout, cfg, strategy, 5, quant)
    assert_matches_reference(results, layout, cfg, 5, quant)
    assert all(r["strategy"] is strategy for r in results)


@pytest.mark.multirank
@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_parallel_matches_reference(rank_pool, backend, quant):
    layout, cfg = ParallelLayout(2, 2, True), _cfg()
    results = rank_pool(4).run(ll_rank_fns.run_ll_layer, backend, layout, cfg, S.SP_ALLGATHER, 5,
                               quant)
    assert_matches_reference(results, layout, cfg, 5, quant)


@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_deferred_fp8_quant_dispatches_bf16(rank_pool, backend):
    """defer_input_quant: activations travel in bf16 (no scales) and the experts round them."""
    layout, cfg, quant = ParallelLayout(2, 1, True), _cfg(), QuantSpec(QuantScheme.FP8_BLOCK128, True)
    results = rank_pool(2).run(ll_rank_fns.run_ll_layer, backend, layout, cfg, S.LOCAL, 8, quant)
    assert_matches_reference(results, layout, cfg, 8, quant)
    assert all(r["sf_bytes"] == 0 for r in results)


@pytest.mark.multirank
@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_unsupported_hidden_is_padded(rank_pool, backend, quant):
    """hidden 256 runs as 2048 (zero-padded inside prepare/finalize), same results."""
    layout, cfg = ParallelLayout(2, 2, True), _cfg(hidden=256)
    results = rank_pool(4).run(ll_rank_fns.run_ll_layer, backend, layout, cfg,
                               S.ROW_SCATTER_ALLREDUCE, 5, quant)
    assert_matches_reference(results, layout, cfg, 5, quant)


@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_expert_runs_between_send_and_receive(rank_pool, backend):
    """Hook order: the dispatch send is issued, the shared expert launched, then the receive."""
    layout, cfg = ParallelLayout(2, 2, True), _cfg()
    results = rank_pool(4).run(ll_rank_fns.run_ll_layer, backend, layout, cfg,
                               S.ROW_SCATTER_ALLREDUCE, 5, BF16)
    for r in results:
        assert r["pending_at_shared"] == [1]  # the dispatch's receive had not run yet
        assert r["pending_after"] == 0


@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_blocking_calls_launch_once_and_match_the_hooked_ones(rank_pool, backend):
    """prepare/finalize (nothing to overlap) make one library launch each where the hooked
    calls make two (send, then the receive in the hook), and give the same output: the tokens
    back (identity experts, weights summing to 1)."""
    results = rank_pool(2).run(ll_rank_fns.blocking_and_hooked_round_trips, backend,
                               ParallelLayout(2, 1, True), _cfg())
    for r in results:
        assert (r["blocking"], r["hooked"]) == (2, 4)
        torch.testing.assert_close(r["out_blocking"], r["out_hooked"], atol=0, rtol=0)
        torch.testing.assert_close(r["out_blocking"].float(), r["x"].float(), atol=2e-2,
                                   rtol=2e-2)


@pytest.mark.multirank
@pytest.mark.parametrize("backend,shape", ON_EACH_LINE, ids=LINE_IDS)
def test_runtime_calls_match_the_python_methods(rank_pool, backend, shape):
    """Both backends call the emulated C++ runtime directly (DeepEP 567632d's and d4f41e4's
    signatures, the same, and nixl_ep 1.5.1's, as the real buffers have them); the same round
    trips through the buffer's Python methods (the path for other signatures) give bit-equal
    outputs, and both give the tokens back."""
    results = _run(rank_pool(2), shape, ll_rank_fns.runtime_and_wrapper_round_trips, backend,
                   ParallelLayout(2, 1, True), _cfg())
    for r in results:
        assert r["chosen"] is True
        for mode in ("blocking", "hooked"):
            torch.testing.assert_close(r["outs"][True, mode], r["outs"][False, mode], atol=0,
                                       rtol=0)
            expected = (r["x"].float() * r["w"].sum(dim=1, keepdim=True)).to(torch.bfloat16)
            torch.testing.assert_close(r["outs"][True, mode].float(), expected.float(),
                                       atol=3e-2, rtol=2e-2)


@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs_give_the_contiguous_result(rank_pool, backend):
    """Tokens, weights, ids and expert outputs that are not contiguous (same values) give the
    contiguous call's output bit for bit, blocking and hooked, with the same library launches:
    the prepare/finalize leave their layout to the runtime's asserts, which refuse them before
    launching (RuntimeCalls), and call again on copies."""
    for r in rank_pool(2).run(ll_rank_fns.strided_round_trips, backend,
                              ParallelLayout(2, 1, True), _cfg()):
        assert r["direct"]
        assert r["launches"][True] == r["launches"][False] == 6
        for mode in ("blocking", "hooked"):
            torch.testing.assert_close(r["outs"][True, mode], r["outs"][False, mode], atol=0,
                                       rtol=0)


@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_stats_count_pairs_and_the_combines_that_ran(rank_pool, backend):
    """Every dispatch counts its (token, expert) pairs (bf16 rows 2 bytes a column, FP8 one
    plus a float32 scale per 128 columns, a 16-byte header each); the combine bytes are those
    of the dispatches whose combine ran: not an abandoned call's, not one still in flight."""
    cfg = _cfg()
    for r in rank_pool(2).run(ll_rank_fns.stats_after_calls, backend, ParallelLayout(2, 1, True),
                              cfg):
        kh, pairs = r["kernel_hidden"], 3 * cfg.num_topk  # pairs per call
        for got, calls, combined in ((r["in_flight"], 4, 2), (r["done"], 4, 3)):
            assert got == dict(calls=calls, pairs=4 * pairs, rows=4 * pairs,
                               act_bytes=(2 * 2 + 2) * pairs * kh,
                               sf_bytes=2 * pairs * kh // 128 * 4, meta_bytes=4 * pairs * 16,
                               combine_bytes=combined * pairs * kh * 2), got


@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_runtime_failure_reaches_the_caller_unchanged(rank_pool, backend):
    """A RuntimeError of the library's runtime on valid inputs (not an input assert) is raised
    as it is, after one call, and breaks the group; it is never retried."""
    for r in rank_pool(2).run(ll_rank_fns.runtime_failures, backend, ParallelLayout(2, 1, True),
                              _cfg()):
        assert r["errors"] == {"dispatch": "emulated dispatch failure",
                               "combine": "emulated combine failure"}
        assert r["made"] == {"dispatch": 1, "combine": 1} and r["broken"]


@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_expert_outputs_rejected(rank_pool, backend):
    for err_type, err in rank_pool(2).run(ll_rank_fns.float32_expert_outputs, backend,
                                          ParallelLayout(2, 1, True), _cfg()):
        assert err_type == "TypeError"
        assert err == f"{backend}: expert outputs must be bfloat16 for the combine kernel, got " \
                      "torch.float32"


def test_runtime_calls_only_on_the_known_signatures(caplog):
    """Another deep_ep.Buffer (other parameters of its low-latency methods, or no runtime):
    the manager calls the Python methods, and says so once at INFO."""
    import logging

    from moe_plugins.all2all.deepep_ll import runtime_calls_known
    from tests.emulation import deep_ep as emulated

    class Renamed(emulated.Buffer):
        def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank,  # type: ignore[override]
                                 num_experts, use_fp8=True):
            raise AssertionError("not called")

    class NoRuntime:
        low_latency_dispatch = emulated.Buffer.low_latency_dispatch
        low_latency_combine = emulated.Buffer.low_latency_combine

    known = object.__new__(emulated.Buffer)
    known.runtime = object.__new__(emulated.DeepEPRuntime)
    assert runtime_calls_known(known)
    renamed = object.__new__(Renamed)
    renamed.runtime = known.runtime
    with caplog.at_level(logging.INFO, logger="moe_plugins.lowlat.vendor"):
        assert not runtime_calls_known(renamed)
        assert not runtime_calls_known(renamed)  # logged once per class
        assert not runtime_calls_known(NoRuntime())
    lines = [r.getMessage() for r in caplog.records if r.name == "moe_plugins.lowlat.vendor"]
    assert len(lines) == 2 and "Renamed" in lines[0] and "calling them instead" in lines[0]
    assert lines[0].startswith("deepep_ll: ") and "DeepEP 567632d" in lines[0]


def test_every_shared_gpu_case_is_exported():
    """tests/gpu/test_<backend>_gpu.py take the shared GPU cases by ``import *``: a case left
    out of ll_gpu_cases.__all__ would never run on the GPU, for either backend."""
    from tests.backends import low_latency_cases as ll_gpu_cases

    cases = {n for n in dir(ll_gpu_cases) if n.startswith("test_")}
    assert cases and cases <= set(ll_gpu_cases.__all__), cases - set(ll_gpu_cases.__all__)


def test_nixl_runtime_calls_only_on_the_known_signatures():
    """nixl_ep: the runtime's calls on v1.4.0 / 1.5.1's low-latency methods (the emulation
    has them), the combine's under DeepEP's positional signature; None for v1.0's buffer
    (dispatch / combine only)."""
    from moe_plugins.all2all.nixl_ep import runtime_calls
    from tests.emulation import nixl_ep as emulated

    class V10:
        runtime = object.__new__(emulated._NixlRuntime)

        def dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                     use_fp8=True):
            raise AssertionError("not called")

        combine = dispatch

    known = object.__new__(emulated.Buffer)
    known.runtime = V10.runtime
    calls = runtime_calls(known)
    assert calls is not None and calls.dispatch is emulated._NixlRuntime.dispatch
    assert runtime_calls(V10()) is None


@pytest.mark.multirank
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "no_shared"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_dispatches_blocking_when_nothing_runs_between(rank_pool, backend, shared):
    """The layer runner hooks the dispatch only to run the shared expert between its send and
    receive: with one, 2 + 1 launches (hooked dispatch, blocking combine); without, 1 + 1.
    Both match the reference."""
    layout, cfg = ParallelLayout(2, 1, True), _cfg(shared_intermediate=64 if shared else 0)
    results = rank_pool(2).run(ll_rank_fns.run_ll_layer, backend, layout, cfg, S.LOCAL, 5, BF16)
    assert [r["launches"] for r in results] == [3 if shared else 2] * 2
    assert_matches_reference(results, layout, cfg, 5, BF16)


@pytest.mark.multirank
@pytest.mark.parametrize("backend,shape", ON_EACH_LINE, ids=LINE_IDS)
def test_masked_rank_is_left_out(rank_pool, backend, shape):
    """Elastic masking: ranks 0-2 mask rank 3; their tokens get no contribution from rank 3's
    experts (as if those experts output zero). nixl_ep's receive layout shrinks to 3 ranks."""
    layout, cfg = ParallelLayout(4, 1, True), _cfg()
    options = {"enable_shrink": True} if backend == "deepep_ll" else None
    results = _run(rank_pool(4), shape, ll_rank_fns.run_ll_layer, backend, layout, cfg, S.LOCAL,
                   6, BF16, 0, options, 3)
    w = MoEWeights.random(cfg, 0)
    per_rank = cfg.num_experts // 4
    w2 = w.w2.clone()
    w2[3 * per_rank:] = 0
    assert_matches_reference(results, layout, cfg, 6, BF16, weights=dataclasses.replace(w, w2=w2),
                             ranks=[0, 1, 2])
    assert [r["masked"] for r in results[:3]] == [[3]] * 3


@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_mask_requests_are_refused_before_the_mask_changes(rank_pool, backend):
    """set_rank_masked refuses every flag that is not a bool or the int 0/1 (``'False'`` would
    otherwise mask the rank: a result without its experts and no error) and every rank that is
    not an int of the group, with a TypeError/ValueError naming what was given and the fix,
    before the library's mask or the record of caller masks changes; the layer then still
    gives the reference result, and the int 1 / 0 mask and unmask."""
    layout, cfg = ParallelLayout(2, 1, True), _cfg()
    options = {"enable_shrink": True} if backend == "deepep_ll" else None
    results = rank_pool(2).run(ll_rank_fns.bad_masks_then_forward, backend, layout, cfg, 5,
                               options)
    expected = ll_rank_fns.bad_mask_requests(1, 2)
    for rank, r in enumerate(results):
        assert r["before"] == ([], [])
        assert [label for label, _, _ in r["refused"]] == [e[0] for e in expected]
        for (label, got, state), (_, _, _, err_type) in zip(r["refused"], expected):
            assert got is not None, f"rank {rank}: {label} was taken"
            assert got[0] == err_type, f"rank {rank}: {label}: {got}"
            assert "set_rank_masked" in got[1] and "got " in got[1] and "Pass " in got[1], got
            assert state == ([], []), f"rank {rank}: {label} changed the mask: {state}"
        assert r["after_one"] == [(rank + 1) % 2] and r["after_zero"] == []
    assert_matches_reference(results, layout, cfg, 5)


# -- what prepare hands the experts ----------------------------------------------------------

def _order(rows: torch.Tensor) -> torch.Tensor:
    """A fixed order of rows (by a random projection), to compare row sets."""
    probe = torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return torch.argsort(rows.double() @ probe)


def _routed_tokens(results: list[dict], expert: int) -> torch.Tensor:
    rows = [r["tokens"][(r["ids"] == expert).any(dim=1)] for r in results]
    return torch.cat(rows)


@pytest.mark.multirank
@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_prepare_gives_batched_layout(rank_pool, backend, quant):
    layout, cfg, n = ParallelLayout(2, 1, True), _cfg(), 7
    results = rank_pool(2).run(ll_rank_fns.run_ll_prepare, backend, layout, cfg, n, quant)
    for rank, r in enumerate(results):
        e_l, slots = r["num_local_experts"], r["max_tokens"] * 2
        assert r["max_tokens"] == token_capacity(n, 2) == 8
        assert r["x"].shape == (e_l, slots, cfg.hidden)
        assert r["topk_ids"] is None and r["topk_weights"] is None
        assert r["pending_before_hook"] == 1 and r["pending_after_hook"] == 0
        if quant is BF16:
            assert r["x"].dtype == torch.bfloat16 and r["x_sf"] is None
        else:
            assert r["x"].dtype == torch.float8_e4m3fn
            assert r["x_sf"].dtype == torch.float32
            assert r["x_sf"].shape == (e_l, slots, cfg.hidden // 128)
            assert r["x_sf"].stride(1) == 1  # the kernels' column-major scales
        assert r["counts"].dtype == torch.int32
        for e in range(e_l):
            expected = _routed_tokens(results, rank * e_l + e)
            assert int(r["counts"][e]) == expected.shape[0]
            c = expected.shape[0]
            if quant is BF16:
                got = r["x"][e, :c]
                torch.testing.assert_close(got[_order(got)], expected[_order(expected)],
                                           atol=0, rtol=0)
            else:
                # The kernel multiplies by 448 / amax where the reference divides by
                # amax / 448: the two may round an element one e4m3 step apart (<= 1/8).
                got = dequantize_fp8_block128(r["x"][e, :c], r["x_sf"][e, :c].contiguous())
                want = dequantize_fp8_block128(*quantize_fp8_block128(expected))
                torch.testing.assert_close(got[_order(got)], want[_order(want)], atol=1e-3,
                                           rtol=0.125)


@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_prepare_packed_ue8m0_scales_for_experts_that_ask(rank_pool, backend):
    """Experts that read packed UE8M0 scales get int32 [.., hidden // 512] holding the
    power-of-two scales 2 ** ceil(log2(amax / 448)) of each 128-column block."""
    layout, cfg, n = ParallelLayout(2, 1, True), _cfg(), 5
    results = rank_pool(2).run(ll_rank_fns.run_ll_prepare, backend, layout, cfg, n, FP8, 0,
                               None, True)
    for rank, r in enumerate(results):
        e_l = r["num_local_experts"]
        assert r["x_sf"].dtype == torch.int32
        assert r["x_sf"].shape == (e_l, r["max_tokens"] * 2, cfg.hidden // 512)
        for e in range(e_l):
            expected = _routed_tokens(results, rank * e_l + e).float()
            c = expected.shape[0]
            scales = unpack_ue8m0_scales(r["x_sf"][e, :c])  # [c, hidden // 128]
            got = (r["x"][e, :c].float().view(c, -1, 128) * scales.unsqueeze(-1)).view(c, -1)
            amax = expected.view(c, -1, 128).abs().amax(-1).clamp(min=1e-4)
            want_scales = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
            go, wo = _order(got), _order(expected)
            torch.testing.assert_close(scales[go], want_scales[wo], atol=0, rtol=0)
            # e4m3 keeps 3 mantissa bits: half a step is <= 1/16 of the value
            torch.testing.assert_close(got[go], expected[wo], atol=1e-3, rtol=0.0625)


@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_topk_ids_are_widened(rank_pool, backend):
    """Router ids in int32 are cast to the library's topk_idx_t (int64) before dispatch."""
    layout, cfg = ParallelLayout(2, 1, True), _cfg()
    c32 = rank_pool(2).run(ll_rank_fns.prepare_with_ids, backend, layout, cfg, torch.int32)
    c64 = rank_pool(2).run(ll_rank_fns.prepare_with_ids, backend, layout, cfg, torch.int64)
    assert c32 == c64 and sum(map(sum, c64)) == 2 * 2 * cfg.num_topk


# -- errors ----------------------------------------------------------------------------------

@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_float_topk_ids_rejected(rank_pool, backend):
    with pytest.raises(RankError) as e:
        rank_pool(2).run(ll_rank_fns.prepare_with_ids, backend, ParallelLayout(2, 1, True), _cfg(),
                         torch.float32)
    assert e.value.exc_type == "TypeError"
    assert "topk_ids must be int32 or int64" in e.value.message and "float32" in e.value.message


@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_too_many_tokens_rejected(rank_pool, backend):
    with pytest.raises(RankError) as e:
        rank_pool(2).run(ll_rank_fns.prepare_too_many_tokens, backend, ParallelLayout(2, 1, True),
                         _cfg())
    assert e.value.exc_type == "ValueError"
    assert "5 tokens" in e.value.message and "max_tokens_per_rank" in e.value.message


@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_finalize_resets_the_handle_and_breaks_the_group(rank_pool, backend):
    results = rank_pool(2).run(ll_rank_fns.finalize_wrong_shape_then_prepare, backend,
                               ParallelLayout(2, 1, True), _cfg())
    for r in results:
        assert r["error"] is not None and "expected [" in r["error"]
        assert "out of step" in r["second_error"] and "expected [" in r["second_error"]
        torch.testing.assert_close(r["out"], torch.zeros_like(r["out"]))  # zero expert outputs


def _ctx() -> DistContext:
    """A context whose group is never touched: these errors come before any collective."""
    return DistContext(ParallelLayout(2, 1, True), 0, None, None, torch.device("cpu"))


def _options(backend: str, **kw: object) -> object:
    """The backend's options; where they take a store, an in-process one."""
    options_type = get_backend(backend).manager.options_type
    if "tcp_store_group" in {f.name for f in dataclasses.fields(options_type)}:
        kw.setdefault("tcp_store_group", dist.HashStore())
    return options_type(**kw)


def _config(backend: str, **kw: object) -> DispatchConfig:
    fields = {"num_experts": 8, "hidden": 2048, "num_topk": 2, "dtype": torch.bfloat16,
              "backend_options": _options(backend), **kw}
    return DispatchConfig(**fields)


def _build(backend: str, cfg: DispatchConfig) -> None:
    with installed(ll_rank_fns.vendor_module(backend)):
        get_backend(backend).build(_ctx(), cfg)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hidden_above_kernel_sizes_rejected(backend):
    with pytest.raises(ValueError, match=r"hidden=9000 is larger than .* \(8192\)"):
        _build(backend, _config(backend, hidden=9000))


@pytest.mark.parametrize("backend", BACKENDS)
def test_unsupported_hidden_without_padding_rejected(backend):
    cfg = _config(backend, hidden=1000, backend_options=_options(backend, pad_hidden=False))
    with pytest.raises(ValueError, match=r"hidden=1000 is not a size .* hidden=2048"):
        _build(backend, cfg)


def test_round_up_hidden_size_rule():
    assert [round_up_hidden_size(h) for h in (1, 2048, 2049, 7000, 8192)] == \
        [2048, 2048, 2560, 7168, 8192]
    assert list(KERNEL_HIDDEN_SIZES) == sorted(KERNEL_HIDDEN_SIZES)


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_above_kernel_limit_rejected(backend):
    with pytest.raises(ValueError, match=rf"num_topk={MAX_TOPK + 1} exceeds .* {MAX_TOPK}"):
        _build(backend, _config(backend, num_experts=16, num_topk=MAX_TOPK + 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_layer_rejected(backend):
    with pytest.raises(ValueError, match="bfloat16 activations, the layer is torch.float32"):
        _build(backend, _config(backend, dtype=torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nvfp4_rejected(backend):
    with pytest.raises(ValueError, match="quant scheme nvfp4 is not supported"):
        _build(backend, _config(backend, quant=QuantSpec(QuantScheme.NVFP4)))


@pytest.mark.parametrize("options", [None, "empty"], ids=["no-options", "no-store"])
def test_nixl_without_store_rejected(options):
    opts = None if options is None else get_backend("nixl_ep").manager.options_type()
    with pytest.raises(ValueError) as e:
        _build("nixl_ep", _config("nixl_ep", backend_options=opts))
    msg = str(e.value)
    assert "tcp_store_group" in msg and "agent metadata" in msg and "connect" in msg
    assert "PrefixStore" in msg


def test_options_of_another_backend_rejected():
    deepep_options = get_backend("deepep_ll").manager.options_type()
    with pytest.raises(TypeError, match="must be a NixlEPOptions, got DeepEPLLOptions"):
        _build("nixl_ep", _config("nixl_ep", backend_options=deepep_options))


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_package_raises_import_error_naming_the_extra(backend):
    spec = get_backend(backend)
    module = spec.manager.required.module
    assert module not in sys.modules and importlib.util.find_spec(module) is None
    install = spec.manager.required.install
    with pytest.raises(ImportError, match=rf"needs the '{module}' package.*{re.escape(install)}"):
        spec.build(_ctx(), _config(backend))


def test_emulation_is_visible_only_inside_its_block():
    with installed("deep_ep", "nixl_ep"):
        assert importlib.import_module("deep_ep").__name__ == "tests.emulation.deep_ep"
    assert "deep_ep" not in sys.modules and "nixl_ep" not in sys.modules
    assert get_backend("deepep_ll").required[0].missing() is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_spec_reports_missing_package_and_gpu(backend):
    reason = get_backend(backend).unavailable_reason()
    module = get_backend(backend).manager.required.module
    assert f"package '{module}' not installed" in reason
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in reason


def test_list_shows_backends_not_usable_and_why(capsys):
    assert cli_main(["list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    for name, extra in (("deepep_ll", "docs/backends.md"), ("nixl_ep", "[nixl] extra")):
        row = rows[name]
        assert row["usable"] is False and extra in row["reason"]
        assert (row["ep_dp"], row["dp"], row["tp"], row["sp"]) == (True, True, True, True)
        assert row["quants"] == ["fp8_block128", "none"]
    assert "DeepEP publishes no wheel" in rows["deepep_ll"]["reason"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_capabilities(backend):
    caps = get_backend(backend).capabilities
    assert caps.activation_format is ActivationFormat.BATCHED
    assert caps.recv_hook and caps.row_scatter and get_backend(backend).needs_cuda


# -- buffers ----------------------------------------------------------------------------------

@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_layers_share_one_buffer_destroyed_by_the_last(rank_pool, backend):
    results = rank_pool(2).run(ll_rank_fns.buffer_sharing, backend, ParallelLayout(2, 1, True),
                               _cfg())
    for r in results:
        assert r["shared"] and r["alive_after_one"] and r["destroyed_after_last"]
        assert r["same_size_other_topk"]  # top-k does not change the buffer size


@pytest.mark.multirank
@pytest.mark.parametrize("shape", ["v1", "legacy"])
@pytest.mark.parametrize("nvlink", [True, False], ids=["nvlink", "no-nvlink"])
def test_deepep_buffer_arguments(rank_pool, nvlink, shape):
    cfg = _cfg(hidden=256)
    results = _run(rank_pool(2), shape, ll_rank_fns.buffer_state, "deepep_ll",
                   ParallelLayout(2, 1, True), cfg, {"allow_nvlink": nvlink})
    for r in results:
        b = r["buffer"]
        assert (r["kernel_hidden"], r["max_tokens"]) == (2048, 4)
        assert b["low_latency_mode"] and b["explicitly_destroy"]
        assert b["num_rdma_bytes"] == r["expected_rdma"] and b["num_nvl_bytes"] == 0
        assert b["num_qps_per_rank"] == r["num_local_experts"] == 4
        assert b["allow_nvlink_for_low_latency_mode"] is nvlink
        assert b["enable_shrink"] is False and b["use_fabric"] is False


@pytest.mark.multirank
@pytest.mark.parametrize("nvlink", [True, False], ids=["nvlink", "no-nvlink"])
def test_nixl_buffer_lifecycle(rank_pool, nvlink):
    results = rank_pool(2).run(ll_rank_fns.buffer_state, "nixl_ep", ParallelLayout(2, 1, True),
                               _cfg(), {"allow_nvlink": nvlink})
    for rank, r in enumerate(results):
        b = r["buffer"]
        assert b["rank"] == rank and b["group_size"] == 2 and b["explicitly_destroy"]
        assert b["num_rdma_bytes"] == r["expected_rdma"]
        assert b["disable_ll_nvlink"] is (not nvlink)
        assert r["connected"] == [0, 1]
        assert r["own_key_left"] is False  # connect_ranks cleaned its metadata key up


@pytest.mark.multirank
def test_deepep_qp_depth_limit(rank_pool):
    with pytest.raises(RankError) as e:
        rank_pool(2).run(ll_rank_fns.build_only, "deepep_ll", ParallelLayout(2, 1, True), _cfg(),
                         600)
    assert e.value.exc_type == "ValueError"
    assert "NVSHMEM_QP_DEPTH >= 1202" in e.value.message


@pytest.mark.multirank
@pytest.mark.parametrize("depth", ["abc", "0", "-5", "1.5"])
def test_a_qp_depth_that_is_not_a_number_is_named_on_every_rank(rank_pool, depth):
    """NVSHMEM_QP_DEPTH that is not a positive whole number: a ValueError naming the variable
    and the value on every rank at construction (not int()'s "invalid literal")."""
    errors = rank_pool(2).run(ll_rank_fns.build_with_qp_depth, "deepep_ll",
                              ParallelLayout(2, 1, True), _cfg(), depth)
    for e in errors:
        assert e is not None and f"NVSHMEM_QP_DEPTH={depth!r} is not a positive whole number" \
            in e and "set it to e.g. 1024" in e, e


@pytest.mark.multirank
def test_deepep_builds_up_to_the_planned_token_limit(rank_pool):
    """The most tokens per rank the plan lets deepep_ll take (``BackendSpec.token_limit``, 510
    at EP 2 with the default QP depth: the capacity rounds up to even there) is where the
    manager on the emulated DeepEP stops building: that many builds, one more is refused."""
    layout, limit = ParallelLayout(2, 1, True), get_backend("deepep_ll").token_limit(2).tokens
    assert limit == 510
    pool = rank_pool(2)
    pool.run(ll_rank_fns.build_only, "deepep_ll", layout, _cfg(), limit)
    with pytest.raises(RankError) as e:
        pool.run(ll_rank_fns.build_only, "deepep_ll", layout, _cfg(), limit + 1)
    assert e.value.exc_type == "ValueError" and "NVSHMEM_QP_DEPTH >= 1026" in e.value.message


@pytest.mark.multirank
def test_deepep_masking_needs_shrink_mode(rank_pool):
    with pytest.raises(RankError) as e:
        rank_pool(2).run(ll_rank_fns.mask_peer, "deepep_ll", ParallelLayout(2, 1, True), _cfg(), 1)
    assert e.value.exc_type == "ValueError" and "enable_shrink=True" in e.value.message


@pytest.mark.multirank
def test_nixl_cannot_mask_the_local_rank(rank_pool):
    with pytest.raises(RankError) as e:
        rank_pool(2).run(ll_rank_fns.mask_peer, "nixl_ep", ParallelLayout(2, 1, True), _cfg(), 0)
    assert e.value.exc_type == "ValueError" and "cannot mask the local rank" in e.value.message


@pytest.mark.multirank
@pytest.mark.parametrize("kind", fault_rank_fns.BAD_INPUT_KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_prepare_inputs_are_clear_errors(rank_pool, backend, kind):
    """Out-of-range expert ids included: the kernels do not check them (the emulation, like
    them, drops such pairs silently), so prepare does (LowLatencyOptions.check_expert_ids)."""
    results = rank_pool(2).run(ll_rank_fns.bad_prepare, backend, ParallelLayout(2, 1, True),
                               _cfg(), kind)
    err_type, text = fault_rank_fns.expected_error(kind, _cfg())
    for got_type, got in results:
        assert got_type == err_type and text in got, got


@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_finalize_with_other_topk_ids_rejected(rank_pool, backend):
    for err_type, err in rank_pool(2).run(ll_rank_fns.finalize_other_ids, backend,
                                          ParallelLayout(2, 1, True), _cfg()):
        assert err_type == "ValueError" and "not the ones given to prepare" in err


def test_the_first_method_the_buffer_has_is_bound():
    """A manager binds the first of its method names the buffer has: nixl_ep v1.1+'s
    low_latency_* (its dispatch/combine forward there), v1.0's dispatch/combine; none is an
    AttributeError naming them."""
    from moe_plugins.all2all.nixl_ep import NixlEPManager
    from moe_plugins.lowlat.vendor import first_method

    class V10:
        def dispatch(self) -> str:
            return "dispatch"

    class V11(V10):
        def low_latency_dispatch(self) -> str:
            return "low_latency_dispatch"

    names = NixlEPManager.dispatch_methods
    assert first_method(V11(), names)() == "low_latency_dispatch"
    assert first_method(V10(), names)() == "dispatch"
    with pytest.raises(AttributeError, match="low_latency_dispatch, dispatch"):
        first_method(object(), names)


@pytest.mark.multirank
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_prepare_is_owed_and_only_the_call_without_tokens_settles_it(rank_pool, backend):
    """Direct use (no layer): after rank 0's prepare refused its input, rank 1 is in that call.
    Rank 0's call with no tokens of its own completes it (rank 1's output is the reference's);
    a call with tokens would pair with it, so rank 0 breaks its group and raises naming both
    calls, and rank 1 ends in an error within the group timeout instead of a result."""
    cfg, layout, timeout_s = _cfg(shared_intermediate=0), ParallelLayout(2, 1, True), 4.0
    served = rank_pool(2).run(ll_rank_fns.owed_call, backend, layout, cfg, 0, timeout_s)
    assert served[0]["refused"][0] == "ValueError" and "buffers hold 4" in served[0]["refused"][1]
    assert [r["call"][0] for r in served] == [None, None]
    assert served[0]["broken"] is None and served[1]["broken"] is None
    assert served[0]["out"].shape == (0, cfg.hidden)
    assert_matches_reference(served, layout, cfg, [0, 3], ranks=[1])
    if backend == "nixl_ep":
        # NIXL EP reaches its peers through its agents, not our process group: a peer waits
        # until the library's kernel timeout (timeout_ms), which the emulation does not model
        return
    t0 = time.monotonic()
    paired = rank_pool(2).run(ll_rank_fns.owed_call, backend, layout, cfg, 2, timeout_s)
    assert time.monotonic() - t0 < 4 * timeout_s
    err_type, err, seconds = paired[0]["call"]
    assert err_type == "LayerBrokenError" and seconds < 1.0
    assert "refused its inputs to a call of" in err and "with 2 token(s)" in err
    assert paired[1]["call"][0] is not None and paired[1]["out"] is None


@pytest.mark.multirank
@pytest.mark.parametrize("shape", ["v1", "legacy"])
def test_deterministic_torch_is_refused_where_deepep_refuses_it(rank_pool, shape):
    """torch's deterministic algorithms with fill_uninitialized_memory: the current line's
    Buffer asserts in every call (check_torch_deterministic), so deepep_ll refuses the call on
    every rank before anything is sent, also where it calls the runtime without the wrapper;
    567632d checks nothing and the call runs."""
    results = _run(rank_pool(2), shape, ll_rank_fns.deterministic_round_trip, "deepep_ll",
                   ParallelLayout(2, 1, True), _cfg())
    for r in results:
        assert r["direct"]  # the runtime is called without the wrapper on both lines
        if shape == "legacy":
            assert r["error"][0] == "ValueError" and "fill_uninitialized_memory = False" in \
                r["error"][1] and "current line" in r["error"][1]
            assert r["launches"] == 0
        else:
            assert r["error"] is None and r["launches"] == 2
