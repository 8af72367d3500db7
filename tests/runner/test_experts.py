"""The reference experts' BATCHED path (the layout DeepEP low-latency hands over): per-expert
batches with a count per expert, slots past the count holding whatever the library left there."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_plugins.runner.experts import TorchExperts
from moe_plugins.interface import ExpertTokensMeta, PrepareResult
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights, route
from moe_plugins.quant import QuantScheme, QuantSpec, quantize_for_dispatch
from moe_plugins.runner.reference import reference_moe, tolerance_for

CFG = MoEConfig(hidden=256, num_experts=4, num_topk=2, intermediate=32, shared_intermediate=0)
SLOTS = 8


def _batched(x: torch.Tensor, ids: torch.Tensor, quant: QuantSpec
             ) -> tuple[PrepareResult, list[list[tuple[int, int]]]]:
    """Pack the tokens per expert as a low-latency dispatch does; unused slots hold NaN (and
    NaN scales). Returns the prepare result and, per expert, the (token, k) of each slot."""
    xq, x_sf = quantize_for_dispatch(x, quant)
    bx = torch.full((CFG.num_experts, SLOTS, xq.shape[1]), float("nan")).to(xq.dtype)
    bsf = None if x_sf is None else torch.full((CFG.num_experts, SLOTS, x_sf.shape[1]),
                                               float("nan"))
    slots: list[list[tuple[int, int]]] = [[] for _ in range(CFG.num_experts)]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            bx[e, len(slots[e])] = xq[t]
            if bsf is not None and x_sf is not None:
                bsf[e, len(slots[e])] = x_sf[t]
            slots[e].append((t, k))
    counts = torch.tensor([len(s) for s in slots], dtype=torch.int32)
    return PrepareResult(bx, bsf, ExpertTokensMeta(counts), None, None), slots


@pytest.mark.parametrize("quant", [QuantSpec(), QuantSpec(QuantScheme.FP8_BLOCK128)],
                         ids=["none", "fp8"])
def test_batched_rows_past_the_count_are_zero_and_valid_rows_match_the_reference(quant):
    w = dataclasses.replace(MoEWeights.random(CFG, 2), shared_w13=None, shared_w2=None,
                            shared_gate=None)
    x = torch.randn(3, CFG.hidden, generator=torch.Generator().manual_seed(4))
    tw, ti = route(x, w.router, CFG.num_topk, CFG.renormalize)
    prep, slots = _batched(x, ti, quant)
    out = TorchExperts(w.local_experts(1, 0), quant, torch.float32).apply(prep)
    assert out.shape == (CFG.num_experts, SLOTS, CFG.hidden)
    combined = torch.zeros(x.shape)
    for e, taken in enumerate(slots):
        assert torch.equal(out[e, len(taken):], torch.zeros_like(out[e, len(taken):]))
        for s, (t, k) in enumerate(taken):
            combined[t] += tw[t, k] * out[e, s]
    ref = reference_moe(x, w, quant)
    atol, rtol = tolerance_for(ref, torch.float32)
    torch.testing.assert_close(combined, ref, atol=atol, rtol=rtol)


def test_batched_path_reads_no_counts_on_the_host(monkeypatch):
    """The counts stay a tensor (a host read would be a sync per call, and fails inside a CUDA
    graph capture): reading them through .tolist()/.item()/int() raises here."""
    w = MoEWeights.random(CFG, 2)
    x = torch.randn(2, CFG.hidden, generator=torch.Generator().manual_seed(5))
    _, ti = route(x, w.router, CFG.num_topk, CFG.renormalize)
    prep, _ = _batched(x, ti, QuantSpec())

    class NoHostRead(torch.Tensor):
        def tolist(self):  # type: ignore[override]
            raise AssertionError("expert_num_tokens read on the host")

        def item(self):  # type: ignore[override]
            raise AssertionError("expert_num_tokens read on the host")

        def __int__(self):
            raise AssertionError("expert_num_tokens read on the host")

        def __bool__(self):
            raise AssertionError("expert_num_tokens read on the host")

    assert prep.expert_tokens_meta is not None
    counts = prep.expert_tokens_meta.expert_num_tokens.as_subclass(NoHostRead)
    guarded = dataclasses.replace(prep, expert_tokens_meta=ExpertTokensMeta(counts))
    expected = TorchExperts(w.local_experts(1, 0), QuantSpec(), torch.float32).apply(prep)
    got = TorchExperts(w.local_experts(1, 0), QuantSpec(), torch.float32).apply(guarded)
    torch.testing.assert_close(got.as_subclass(torch.Tensor), expected, atol=0, rtol=0)
