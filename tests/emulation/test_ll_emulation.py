"""The emulations themselves, checked the way DeepEP's tests/backends/test_low_latency.py checks the real
kernels: every rank sends rows tagged with its rank and token index, -1 entries in topk_idx,
receive counts equal to the all-gathered routing, layout_range consistent with src_info, and
combine(dispatched rows) == x * sum(valid weights)."""
from __future__ import annotations

import importlib
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from tests.emulation import in_deep_ep_shape, installed
from moe_plugins.runner.launch import RankError

pytestmark = pytest.mark.multirank

HIDDEN, TOKENS, TOPK, EXPERTS = 2048, 6, 3, 8


def _idx_dtype(module) -> torch.dtype:
    """The library's topk id dtype (DeepEP: int64; nixl_ep as nixl's meson builds it: int32)."""
    return getattr(module, "topk_idx_t", torch.int64)


def _inputs(rank: int, duplicate: bool = False, idx_dtype: torch.dtype = torch.int64
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.full((TOKENS, HIDDEN), float(rank - 8), dtype=torch.bfloat16)
    x[:, -128:] = torch.arange(TOKENS, dtype=torch.bfloat16).view(-1, 1)
    scores = torch.rand(TOKENS, EXPERTS, generator=g) + 1
    topk_idx = torch.topk(scores, TOPK, dim=-1).indices
    topk_idx[1, 2] = -1  # not selecting any expert is allowed
    if duplicate:  # one token routed twice to one expert (the kernels allow it)
        topk_idx[0, 1] = topk_idx[0, 0]
    topk_weights = torch.rand(TOKENS, TOPK, generator=g)
    return x, topk_idx.to(idx_dtype), topk_weights


def _make_buffer(lib: str, world: int, num_rdma_bytes: int):
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


def roundtrip(rank: int, world: int, lib: str, use_fp8: bool, hook_mode: bool,
              duplicate: bool = False) -> dict:
    with installed(lib):
        module = importlib.import_module(lib)
        hint = (module.Buffer.get_low_latency_rdma_size_hint if lib == "deep_ep"
                else module.Buffer.get_rdma_size_hint)(TOKENS, HIDDEN, world, EXPERTS)
        buffer = _make_buffer(lib, world, hint)
        dispatch = buffer.low_latency_dispatch if lib == "deep_ep" else buffer.dispatch
        combine = buffer.low_latency_combine if lib == "deep_ep" else buffer.combine
        x, topk_idx, topk_weights = _inputs(rank, duplicate, _idx_dtype(module))
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


@pytest.mark.parametrize("duplicate", [False, True], ids=["distinct", "duplicate-expert"])
@pytest.mark.parametrize("hook_mode", [True, False], ids=["hook", "no-hook"])
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("lib", ["deep_ep", "nixl_ep"])
def test_dispatch_combine_roundtrip(rank_pool, lib, use_fp8, hook_mode, duplicate):
    """With a token routed twice to one expert, dispatch sends it twice (two slots) and combine
    gives (w1 + w2) x row: its receive buffer has one slot per (expert, token), which the
    reduction reads once per top-k entry (DeepEP internode_ll.cu)."""
    world = 2
    results = rank_pool(world).run(roundtrip, lib, use_fp8, hook_mode, duplicate)
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
        dispatch(x, torch.zeros(2, 1, dtype=_idx_dtype(importlib.import_module(lib))), 4,
                 EXPERTS, use_fp8=False)


@pytest.mark.parametrize("lib", ["deep_ep", "nixl_ep"])
def test_unsupported_hidden_fails_like_the_kernel(rank_pool, lib):
    with pytest.raises(RankError) as e:
        rank_pool(2).run(unsupported_hidden, lib)
    assert e.value.exc_type == "RuntimeError" and "Unsupported hidden" in e.value.message


def combine_after_the_rank_bound_moved(rank: int, world: int) -> Optional[str]:
    """nixl_ep: dispatch with both ranks active, then rank 0 masks rank 1 (its active rank
    bound drops to 1) and combines the dispatch's layout: nixl_ep checks the bound at combine
    time and refuses. Rank 1 does not combine (rank 0 fails before any transfer)."""
    with installed("nixl_ep"):
        import nixl_ep

        buffer = _make_buffer("nixl_ep", world, nixl_ep.Buffer.get_rdma_size_hint(
            TOKENS, HIDDEN, world, EXPERTS))
        x, topk_idx, topk_weights = _inputs(rank, idx_dtype=nixl_ep.topk_idx_t)
        recv, _, handle, _, hook = buffer.dispatch(x, topk_idx, TOKENS, EXPERTS, use_fp8=False,
                                                   return_recv_hook=True)
        hook()
        error = None
        if rank == 0:
            buffer.update_mask_buffer(1, True)
            try:
                buffer.combine(recv, topk_idx, topk_weights, handle)
            except RuntimeError as e:
                error = str(e)
        dist.barrier()
        buffer.destroy()
        return error


def test_nixl_combine_checks_the_active_rank_bound_at_combine_time(rank_pool):
    errors = rank_pool(2).run(combine_after_the_rank_bound_moved)
    assert errors[0] is not None and "active_rank_bound" in errors[0]


def test_buffer_size_hints_follow_each_librarys_signal_word():
    """DeepEP's LowLatencyLayout counts signals in 4-byte ints, nixl_ep's EPLayout in 8-byte
    uint64s (csrc/config.hpp of each); everything else is the same layout. Worked out here for
    128 tokens, hidden 7168, 256 experts."""
    with installed("deep_ep"):
        import deep_ep

        deep = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 16, 256)
    with installed("nixl_ep"):
        import nixl_ep

        nixl = nixl_ep.Buffer.get_rdma_size_hint(128, 7168, 16, 256)
    scales = 7168 // 128
    dispatch_msg = 16 + max(7168 * 2, 7168 + scales * 4)
    combine_msg = scales * 4 + 7168 * 2
    send = max(128 * dispatch_msg, 256 * 128 * combine_msg)
    recv = max(256 * 128 * dispatch_msg, 256 * 128 * combine_msg)

    def hint(signal_bytes: int) -> int:
        total = 2 * send + 2 * recv + 2 * (-(-(256 * signal_bytes) // 128) * 128)
        return (total + 128) // 128 * 128

    assert deep == hint(4) and nixl == hint(8) and nixl - deep == 2 * 256 * 4


def dispatch_out_of_range(rank: int, world: int, lib: str) -> list[int]:
    """Dispatch with an expert id past the last expert: the kernels do not check (they would
    write outside their buffers); the emulation drops the pair. Returns the receive counts."""
    with installed(lib):
        buffer = _make_buffer(lib, world, 1 << 30)
        dispatch = buffer.low_latency_dispatch if lib == "deep_ep" else buffer.dispatch
        x, topk_idx, _ = _inputs(rank, idx_dtype=_idx_dtype(importlib.import_module(lib)))
        topk_idx[0, 0] = EXPERTS
        _, count, _, _, _ = dispatch(x, topk_idx, TOKENS, EXPERTS, use_fp8=False)
        buffer.destroy()
        return count.tolist()


@pytest.mark.parametrize("lib", ["deep_ep", "nixl_ep"])
def test_out_of_range_expert_ids_are_not_checked_by_the_kernels(rank_pool, lib):
    """So nothing below our prepare catches them: see test_low_latency's bad-input test."""
    counts = rank_pool(2).run(dispatch_out_of_range, lib)
    sent = sum(sum(c) for c in counts)
    ids = [_inputs(r)[1] for r in range(2)]
    assert sent == sum(int((i >= 0).sum()) for i in ids) - 2  # one dropped pair per rank


# -- the deep_ep emulation's two API shapes against their upstream files ----------------------

#: The Buffer methods our DeepEP backends call: every shape emulates them.
CALLED = {"__init__", "low_latency_dispatch", "low_latency_combine", "clean_low_latency_buffer",
          "get_low_latency_rdma_size_hint", "get_local_buffer_tensor", "destroy",
          "low_latency_update_mask_buffer", "low_latency_query_mask_buffer",
          "low_latency_clean_mask_buffer", "get_dispatch_config", "get_combine_config",
          "get_dispatch_layout", "dispatch", "combine"}


def _emulated_methods(buffer_cls: type) -> dict[str, tuple[tuple[str, Optional[str]], ...]]:
    import inspect

    out = {}
    for name in dir(buffer_cls):
        attr = inspect.getattr_static(buffer_cls, name)
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        if not inspect.isfunction(attr) or (name.startswith("_") and name != "__init__"):
            continue
        params = inspect.signature(attr).parameters.values()
        out[name] = tuple((p.name, None if p.default is p.empty else repr(p.default))
                          for p in params if p.name != "self")
    return out


@pytest.mark.parametrize("shape", ["v1", "legacy"])
def test_emulations_have_the_upstream_signatures(shape):
    """Every method the emulated Buffer has is upstream's, with upstream's parameters and
    defaults (567632d deep_ep/buffer.py; d4f41e4 deep_ep/buffers/legacy.py), and it has every
    method our backends call."""
    from tests.emulation.deep_ep_upstream import UPSTREAM

    with installed("deep_ep", deep_ep_shape=shape):
        import deep_ep

        emulated = _emulated_methods(deep_ep.Buffer)
    upstream = UPSTREAM[shape]
    assert CALLED <= set(emulated), CALLED - set(emulated)
    assert set(emulated) <= set(upstream), set(emulated) - set(upstream)
    for name, params in emulated.items():
        assert params == upstream[name], (shape, name)


def test_the_two_upstream_shapes_differ_where_the_backends_probe():
    """What moe_plugins.stack.deepep handles: the constructor's use_fabric and internode
    dispatch's num_worst_tokens are the only parameter differences of the two files."""
    from tests.emulation.deep_ep_upstream import UPSTREAM

    v1, legacy = UPSTREAM["v1"], UPSTREAM["legacy"]
    assert set(v1) == set(legacy)
    differ = {n for n in v1 if v1[n] != legacy[n]}
    assert differ == {"__init__", "internode_dispatch"}
    assert [p for p, _ in v1["__init__"] if p not in dict(legacy["__init__"])] == ["use_fabric"]
    assert [p for p, _ in v1["internode_dispatch"]
            if p not in dict(legacy["internode_dispatch"])] == ["num_worst_tokens"]


def test_the_legacy_shape_round_trips_like_the_v1_shape(rank_pool):
    """The current line's legacy Buffer moves the same rows as 567632d's (same kernels): hook
    and FP8 round trips bit-equal between the two shapes."""
    v1 = rank_pool(2).run(roundtrip, "deep_ep", True, True)
    legacy = rank_pool(2).run(in_deep_ep_shape, "legacy", roundtrip, "deep_ep", True, True)
    for a, b in zip(v1, legacy):
        for key in ("count", "layout_range", "combined"):
            torch.testing.assert_close(a[key], b[key], atol=0, rtol=0)
        for e, n in enumerate(a["count"].tolist()):  # the slots past the count hold no row
            torch.testing.assert_close(a["recv_x"][e, :n], b["recv_x"][e, :n], atol=0, rtol=0)
            assert torch.equal(a["src_info"][e, :n], b["src_info"][e, :n])


def legacy_module_facts(rank: int, world: int) -> dict:
    with installed("deep_ep", deep_ep_shape="legacy"):
        import deep_ep

        buffer = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=1 << 20, low_latency_mode=True,
                                num_qps_per_rank=4, allow_mnnvl=True, explicitly_destroy=True)
        fabric = buffer.use_fabric
        buffer.destroy()
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            buffer = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=1 << 20,
                                    low_latency_mode=True, num_qps_per_rank=4,
                                    explicitly_destroy=True)
            x, topk_idx, _ = _inputs(rank)
            try:
                buffer.low_latency_dispatch(x, topk_idx, TOKENS, EXPERTS, use_fp8=False)
                refused = False
            except AssertionError:
                refused = True
            buffer.destroy()
        finally:
            torch.use_deterministic_algorithms(before)
        return dict(fabric=fabric, refused=refused, version=deep_ep.__version__,
                    extension=deep_ep.Config.__module__, elastic=hasattr(deep_ep, "ElasticBuffer"))


def test_the_legacy_shape_has_the_current_lines_behaviour(rank_pool):
    """d4f41e4's legacy.py: the runtime's fabric flag is allow_mnnvl, the calls assert
    check_torch_deterministic(), the extension is deep_ep._C, ElasticBuffer beside it."""
    for r in rank_pool(2).run(legacy_module_facts):
        assert r == dict(fabric=True, refused=True, version="2.1.0", extension="deep_ep._C",
                         elastic=True)


def waits_against_a_silent_peer(rank: int, world: int, timeout_s: float) -> dict:
    """Rank 0's store-fabric waits on rank 1, which sends only in the last case: masked after
    the wait began, masked before it, and sending. Seconds each wait took and which ranks its
    timeout masked."""
    import threading
    import time

    from tests.emulation._ll_fabric import StoreFabric

    store = dist.distributed_c10d._get_default_store()
    out = {}
    for case in ("masked-while-waiting", "masked-before", "sends"):
        active, masked = [True, True], []
        fabric = StoreFabric(store, f"emu_ll_test/{case}", rank, world, lambda: active,
                             masked.append, timeout_s, mask_enabled=True)
        msgs = torch.full((2, 4), rank + 1, dtype=torch.uint8)
        dest = torch.tensor([0, 1])
        if rank == 1:
            if case == "sends":
                fabric.send(msgs, dest)
            dist.barrier()
            continue
        wait = fabric.send(msgs, dest)
        if case == "masked-before":
            active[1] = False
        elif case == "masked-while-waiting":  # the host masks the peer 0.3 s into the wait
            threading.Timer(0.3, active.__setitem__, (1, False)).start()
        t0 = time.monotonic()
        recv, src = wait()
        out[case] = dict(seconds=time.monotonic() - t0, masked=masked, sources=src.tolist(),
                         values=recv[:, 0].tolist())
        dist.barrier()
    return out


def test_the_store_fabric_reads_the_mask_as_a_wait_begins_as_the_kernels_do(rank_pool):
    """DeepEP 567632d (csrc/kernels/internode_ll.cu, the dispatch and combine receives and the
    barrier) and NIXL EP (examples/device/ep/csrc/kernels/nixl_ep_ll.cu) read a peer's mask word
    once before spinning on its signal: ``if (not is_rank_masked(..)) while (<no signal> and
    <not timed out>);``. A mask the host sets while a wait spins does not end it: only the
    timeout does, which then masks the peer itself. A peer masked before the wait is skipped."""
    got = rank_pool(2).run(waits_against_a_silent_peer, 1.5)[0]
    spinning = got["masked-while-waiting"]
    assert spinning["seconds"] >= 1.5 and spinning["masked"] == [1], spinning
    assert spinning["sources"] == [0]  # its own row only
    before = got["masked-before"]
    assert before["seconds"] < 1.5 and before["masked"] == [] and before["sources"] == [0]
    sends = got["sends"]
    assert sends["masked"] == [] and sends["sources"] == [0, 1] and sends["values"] == [1, 2]
