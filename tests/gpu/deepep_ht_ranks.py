"""Rank function of tests/gpu/test_deepep_ht_gpu.py: deepep_ht / deepep_auto prepare ->
reference experts -> finalize on one rank of a two-process world on one device
(tests/gpu/ep_harness.py), bf16 and FP8 at several batch sizes, each element-wise against the
single-process reference of the rank's own tokens. ``device="cpu"`` runs it on the emulated
deep_ep (tests/emulation), which is how the CPU tests check it before a GPU does."""
from __future__ import annotations

from typing import Any

import torch

from tests.gpu.ep_harness import rank_device, result, step

HIDDEN, EXPERTS, TOPK = 2048, 16, 4
LL_CAPACITY = 64
# Two processes on one GPU time-slice, so DeepEP's spin-waiting kernels run slowly: on the
# H200, normal-mode dispatch of 256 tokens took ~5 s and of 1024 tokens 36 s, and the 1024-token
# combine did not end within 110 s (tests/gpu/README.md). Hence at most 256 tokens here.
TOKENS = {"deepep_ht": [0, 1, 37, 256], "deepep_auto": [1, LL_CAPACITY, LL_CAPACITY + 1, 256]}


def run_ht(rank: int, world: int, backend: str, device: str) -> list[dict]:
    """Every (quant, token count) of ``TOKENS[backend]`` on one backend built through the
    registry: reports each step before it starts and each result as it comes."""
    from moe_plugins.all2all.deepep_auto import DeepEPAutoOptions
    from moe_plugins.config import DispatchConfig
    from moe_plugins.groups import DistContext
    from moe_plugins.layout import ParallelLayout
    from moe_plugins.quant import QuantScheme, QuantSpec
    from moe_plugins.registry import get_backend
    from moe_plugins.runner.demo import demo_inputs
    from moe_plugins.runner.experts import TorchExperts
    from moe_plugins.config import MoEConfig
    from moe_plugins.runner.model import ExpertWeights, MoEWeights, route
    from moe_plugins.runner.reference import reference_moe, tolerance_for
    from tests.gpu.ep_ranks import vendor

    import torch.distributed as dist

    dev = rank_device(device)
    step(f"init: {dev} and a gloo group of {world}")
    ctx = DistContext(ParallelLayout(world, 1, True), rank, dist.group.WORLD, None, dev)
    cfg = MoEConfig(hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, intermediate=128,
                    shared_intermediate=0, dtype=torch.bfloat16)
    w = MoEWeights.random(cfg, 0)
    local = w.local_experts(world, rank)
    experts_w = ExpertWeights(local.w13.to(dev), local.w2.to(dev), local.first_expert)
    options: Any = DeepEPAutoOptions(ll_max_tokens_per_rank=LL_CAPACITY) \
        if backend == "deepep_auto" else None
    results = []
    with vendor(backend, device):
        for quant in (QuantSpec(), QuantSpec(QuantScheme.FP8_BLOCK128)):
            step(f"build {backend} ({quant.scheme.value}): DeepEP Buffer")
            pf = get_backend(backend).build(ctx, DispatchConfig(
                EXPERTS, HIDDEN, TOPK, max(TOKENS[backend]), cfg.dtype, quant,
                backend_options=options))
            experts = TorchExperts(experts_w, quant, cfg.dtype)
            try:
                for n in TOKENS[backend]:
                    x = demo_inputs(cfg, n, rank, 0)
                    tw, ti = route(x, w.router, TOPK, cfg.renormalize)
                    step(f"{backend} {quant.scheme.value} {n} tokens: prepare")
                    prep = pf.prepare(x.to(dev), tw.to(dev), ti.to(dev), quant)
                    step(f"{backend} {quant.scheme.value} {n} tokens: experts and finalize")
                    got = torch.empty(n, HIDDEN, dtype=cfg.dtype, device=dev)
                    pf.finalize(experts.apply(prep), tw.to(dev), ti.to(dev), got)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    ref = reference_moe(x, w, quant)
                    atol, rtol = tolerance_for(ref, cfg.dtype)
                    err = (got.float().cpu() - ref).abs()
                    ok = bool((err <= atol + rtol * ref.abs()).all())
                    res = dict(quant=quant.scheme.value, tokens=n, ok=ok,
                               max_abs_err=float(err.max()) if err.numel() else 0.0,
                               x_sf_none=prep.x_sf is None, modes=dict(pf.stats.modes))
                    results.append(res)
                    result(res)  # kept even if a later step stalls
            finally:
                pf.reset_call_state()
                pf.manager.destroy()
    step("teardown")
    dist.barrier()
    return results


def check_results(backend: str, values: list) -> None:
    """Every rank's results within tolerance; x_sf exactly for FP8; deepep_auto's modes."""
    bad = [(r, res) for r, rank_results in enumerate(values) for res in rank_results
           if not res["ok"]]
    assert not bad, f"{backend}: outputs differ from the reference: {bad}"
    for rank_results in values:
        for res in rank_results:
            assert res["x_sf_none"] == (res["quant"] == "none")
        if backend == "deepep_auto":
            # calls of up to LL_CAPACITY tokens fit the low-latency buffers, the others do not
            ll = sum(n <= LL_CAPACITY for n in TOKENS[backend])
            assert rank_results[-1]["modes"] == {"low_latency": ll,
                                                 "normal": len(TOKENS[backend]) - ll}
