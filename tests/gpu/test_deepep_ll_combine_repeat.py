"""deepep_ll's low-latency combine repeated many times above 256 tokens per rank, on the REAL
DeepEP (one GPU, EP world size 1): the condition of DeepEP issue #621, whose combine receive
released a TMA stage to the next load before the proxy fence of DeepEP PR #642, so repeated runs
could return wrong rows. scripts/deepep/build.sh builds 567632d with that fence.

Every round is a whole dispatch + combine through our prepare/finalize on the same inputs, with
experts that scale each received row by a factor of its expert; each round's output is checked
element-wise against the reference computed on the host in float32 (independent of DeepEP and of
our code: out[t] = x[t] * sum_k w[t, k] * s[e[t, k]]), and against the first round bit for bit
(the combine is deterministic without the race). Its own pytest process (one library buffer per
process: its token capacity differs from the other GPU tests').

Run: ``python -m pytest -m gpu tests/gpu/test_deepep_ll_combine_repeat.py``; ROUNDS in the
environment (``MOE_PLUGINS_COMBINE_ROUNDS``, default 1000) sets the rounds per case.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
deep_ep = pytest.importorskip("deep_ep", reason="needs DeepEP built from source (scripts/deepep/build.sh)")

from moe_plugins.config import DispatchConfig  # noqa: E402
from moe_plugins.quant import QuantSpec  # noqa: E402
from moe_plugins.prepare_finalize.deepep_ll import SPEC  # noqa: E402
from tests.backends.low_latency_cases import DEV, free_port, one_rank_context  # noqa: E402

pytestmark = pytest.mark.gpu

HIDDEN, EXPERTS, TOPK = 7168, 32, 8
CAPACITY = 508  # the most the default NVSHMEM_QP_DEPTH (1024) admits (a multiple of 4), well above 256
ROUNDS = int(os.environ.get("MOE_PLUGINS_COMBINE_ROUNDS", "1000"))


@pytest.fixture(scope="module")
def pf():
    with one_rank_context(init_method=f"tcp://127.0.0.1:{free_port()}") as ctx:
        backend = SPEC.build(ctx, DispatchConfig(EXPERTS, HIDDEN, TOPK, CAPACITY, torch.bfloat16,
                                                 QuantSpec()))
        yield backend
        backend.manager.destroy()


def _inputs(num_tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    """x [num_tokens, HIDDEN] bf16, topk weights [num_tokens, TOPK] float32, topk ids
    [num_tokens, TOPK] int64 (distinct experts per token), and the per-expert scale [EXPERTS]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(num_tokens)])
    w = torch.rand(num_tokens, TOPK, generator=g) + 0.1
    w = w / w.sum(dim=1, keepdim=True)
    scale = 0.5 + torch.arange(EXPERTS, dtype=torch.float32) / EXPERTS
    return x, w, ids, scale


@pytest.mark.parametrize("num_tokens", [257, 384, CAPACITY])
def test_repeated_combine_above_256_tokens_is_right_every_time(pf, num_tokens):
    x, w, ids, scale = _inputs(num_tokens, seed=num_tokens)
    # the reference, on the host in float32, from the inputs alone
    ref = x.float() * (w * scale[ids]).sum(dim=1, keepdim=True)
    xd, wd, idd, sd = x.to(DEV), w.to(DEV), ids.to(DEV), scale.to(DEV)
    ref_d = ref.to(DEV)
    first = None
    bad_rounds = []
    for r in range(ROUNDS):
        prep = pf.prepare(xd, wd, idd, QuantSpec())
        # BATCHED: prep.x [EXPERTS, CAPACITY, HIDDEN]; rows past each expert's count are unused
        expert_out = (prep.x.float() * sd[:, None, None]).to(torch.bfloat16)
        out = torch.empty(num_tokens, HIDDEN, dtype=torch.bfloat16, device=DEV)
        pf.finalize(expert_out, wd, idd, out)
        # bf16 output of a float32 sum: within a few bf16 ulps of the float32 reference
        err = (out.float() - ref_d).abs()
        tol = 2e-2 * ref_d.abs() + 2e-2
        if not bool((err <= tol).all()):
            bad_rounds.append((r, int((err > tol).any(dim=1).sum()), float(err.max())))
        if first is None:
            first = out.clone()
        elif not torch.equal(out, first):
            rows = int((out != first).any(dim=1).sum())
            bad_rounds.append((r, rows, "differs from round 0"))
    torch.cuda.synchronize()
    assert not bad_rounds, (f"{len(bad_rounds)} of {ROUNDS} rounds wrong at {num_tokens} tokens "
                            f"(round, rows, max err or why): {bad_rounds[:10]}")
