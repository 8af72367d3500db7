"""The emulations themselves, checked the way DeepEP's tests/test_low_latency.py checks the real
kernels: every rank sends rows tagged with its rank and token index, -1 entries in topk_idx,
receive counts equal to the all-gathered routing, layout_range consistent with src_info, and
combine(dispatched rows) == x * sum(valid weights)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from emulation import installed
from moe_plugins.launch import RankError

pytestmark = pytest.mark.multirank

HIDDEN, TOKENS, TOPK, EXPERTS = 2048, 6, 3, 8


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.full((TOKENS, HIDDEN), float(rank - 8), dtype=torch.bfloat16)
    x[:, -128:] = torch.arange(TOKENS, dtype=torch.bfloat16).view(-1, 1)
    scores = torch.rand(TOKENS, EXPERTS, generator=g) + 1
    topk_idx = torch.topk(scores, TOPK, dim=-1).indices
    topk_idx[1, 2] = -1  # not selecting any expert is allowed
    topk_weights = torch.rand(TOKENS, TOPK, generator=g)
    return x, topk_idx, topk_weights


def _make_buffer(lib: str, world: int, num_rdma_bytes: int):
    import importlib

    module = importlib.import_module(lib)
    if lib == "deep_ep":
        return module.Buffer(dist.group.WORLD, num_rdma_bytes=num_rdma_bytes,
                             low_latency_mode=True, num_qps_per_rank=EXPERTS // world,
                             explicitly_destroy=True)
    buffer = module.Buffer(rank=dist.get_rank(), explicitly_destroy=True,
                           tcp_store_group=dist.PrefixStore(
                               "emu", dist.distributed_c10d._get_default_store()))
    buffer.update_memory_buffers(num_ranks=world, num_experts_per_rank=EXPERTS // world,
                                 num_rdma_bytes=num_rdma_bytes)
    buffer.connect_ranks(list(range(world)))
    return buffer


def roundtrip(rank: int, world: int, lib: str, use_fp8: bool, hook_mode: bool) -> dict:
    with installed(lib):
        import importlib

        module = importlib.import_module(lib)
        hint = (module.Buffer.get_low_latency_rdma_size_hint if lib == "deep_ep"
                else module.Buffer.get_rdma_size_hint)(TOKENS, HIDDEN, world, EXPERTS)
        buffer = _make_buffer(lib, world, hint)
        dispatch = buffer.low_latency_dispatch if lib == "deep_ep" else buffer.dispatch
        combine = buffer.low_latency_combine if lib == "deep_ep" else buffer.combine
        x, topk_idx, topk_weights = _inputs(rank)
        stats = torch.zeros(EXPERTS // world, dtype=torch.int32)
        recv, count, handle, event, hook = dispatch(
            x, topk_idx, TOKENS, EXPERTS, cumulative_local_expert_recv_stats=stats,
            use_fp8=use_fp8, async_finish=not hook_mode, return_recv_hook=hook_mode)
        if hook_mode:
            hook()
        else:
            event.current_stream_wait()
        recv_x = recv[0].float() * recv[1].repeat_interleave(128, dim=-1) if use_fp8 else recv
        out = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16)
        combined, event, hook = combine(recv_x.to(torch.bfloat16).contiguous(), topk_idx,
                                        topk_weights, handle, return_recv_hook=hook_mode, out=out)
        if hook_mode:
            hook()
        buffer.destroy()
        return dict(recv_x=recv_x.float(), count=count, stats=stats, src_info=handle[0],
                    layout_range=handle[1], combined=combined, out_is_combined=combined is out,
                    x=x, topk_idx=topk_idx, topk_weights=topk_weights)


@pytest.mark.parametrize("hook_mode", [True, False], ids=["hook", "no-hook"])
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("lib", ["deep_ep", "nixl_ep"])
def test_dispatch_combine_roundtrip(rank_pool, lib, use_fp8, hook_mode):
    world = 2
    results = rank_pool(world).run(roundtrip, lib, use_fp8, hook_mode)
    all_ids = torch.stack([r["topk_idx"] for r in results])  # [ranks, tokens, topk]
    e_l = EXPERTS // world
    for rank, r in enumerate(results):
        assert torch.equal(r["stats"], r["count"])
        for e in range(e_l):
            expert = rank * e_l + e
            n = int(r["count"][e])
            assert n == int((all_ids == expert).sum())
            ranges = r["layout_range"][e]
            assert n == int((ranges & 0xFFFFFFFF).sum())
            rows = r["recv_x"][e, :n]
            # every row is [src_rank - 8, ..., src_token]: check both against src_info/ranges
            assert torch.equal(rows[:, -1].round(), r["src_info"][e, :n].float())
            for src in range(world):
                begin, c = int(ranges[src]) >> 32, int(ranges[src]) & 0xFFFFFFFF
                assert c == int((all_ids[src] == expert).sum())
                assert bool((rows[begin:begin + c, :-128] == src - 8).all())
        weights = r["topk_weights"].masked_fill(r["topk_idx"] < 0, 0).sum(dim=1, keepdim=True)
        expected = (r["x"].float() * weights)
        torch.testing.assert_close(r["combined"].float(), expected, atol=0.05, rtol=0.01)
        assert r["out_is_combined"]


def unsupported_hidden(rank: int, world: int, lib: str) -> None:
    with installed(lib):
        buffer = _make_buffer(lib, world, 1 << 30)
        dispatch = buffer.low_latency_dispatch if lib == "deep_ep" else buffer.dispatch
        x = torch.zeros(2, 1024, dtype=torch.bfloat16)
        dispatch(x, torch.zeros(2, 1, dtype=torch.int64), 4, EXPERTS, use_fp8=False)


@pytest.mark.parametrize("lib", ["deep_ep", "nixl_ep"])
def test_unsupported_hidden_fails_like_the_kernel(rank_pool, lib):
    with pytest.raises(RankError) as e:
        rank_pool(2).run(unsupported_hidden, lib)
    assert e.value.exc_type == "RuntimeError" and "Unsupported hidden" in e.value.message
