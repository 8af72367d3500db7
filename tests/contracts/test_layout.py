"""Token ownership: the one function that decides which rows a TP rank owns."""
from __future__ import annotations

import pytest
import torch

from moe_plugins.layout import (DestinationMap, LocalIdMap, ParallelLayout, destination_ranks,
                                local_expert_ids, owned_rows, slice_owned)
from moe_plugins.placement import ExpertPlacement


@pytest.mark.parametrize("num_tokens", [0, 1, 3, 5, 8, 9, 17])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_owned_rows_partition_all_tokens_in_order(num_tokens, tp):
    rows = [owned_rows(num_tokens, tp, r) for r in range(tp)]
    covered = [i for r in rows for i in range(r.start, r.stop)]
    assert covered == list(range(num_tokens))
    chunk = -(-num_tokens // tp)
    assert all(r.chunk == chunk and r.num_owned <= chunk for r in rows)


def test_trailing_ranks_may_own_zero_rows():
    assert [owned_rows(1, 4, r).num_owned for r in range(4)] == [1, 0, 0, 0]
    assert [owned_rows(5, 4, r).num_owned for r in range(4)] == [2, 2, 1, 0]


def test_owned_rows_rejects_bad_rank():
    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, 2\), got 2"):
        owned_rows(4, 2, 2)


def test_slice_owned_slices_hidden_and_routing_together():
    rows = owned_rows(5, 2, 1)
    h, ids, w = torch.arange(10.).reshape(5, 2), torch.arange(5).reshape(5, 1), torch.ones(5, 1)
    owned = slice_owned(rows, h, ids, w)
    assert owned.hidden_states.tolist() == [[6., 7.], [8., 9.]]
    assert owned.topk_ids.flatten().tolist() == [3, 4]


def test_slice_owned_refuses_routing_of_another_batch():
    with pytest.raises(ValueError, match=r"topk_ids has 8 tokens \(shape \(8, 2\)\).*computed for 4"):
        slice_owned(owned_rows(4, 2, 0), torch.zeros(4, 16), torch.zeros(8, 2, dtype=torch.long),
                    torch.zeros(4, 2))


def test_slice_owned_owning_every_row_hands_back_the_tensors_and_still_checks():
    h, ids, w = torch.zeros(4, 16), torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2)
    owned = slice_owned(owned_rows(4, 1, 0), h, ids, w)
    assert owned.hidden_states is h and owned.topk_ids is ids and owned.topk_weights is w
    with pytest.raises(ValueError, match=r"topk_weights has 3 tokens .*computed for 4"):
        slice_owned(owned_rows(4, 1, 0), h, ids, torch.zeros(3, 2))


def test_dp_without_ep_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="enable expert parallelism"):
        ParallelLayout(dp=2, tp=1, ep=False)


@pytest.mark.parametrize("layout,sp", [
    (ParallelLayout(2, 2, True), True), (ParallelLayout(1, 2, True), False),
    (ParallelLayout(2, 1, True), False), (ParallelLayout(1, 4, False), False)])
def test_sequence_parallel_rule(layout, sp):
    assert layout.sequence_parallel(backend_supports_sp=True) is sp
    assert layout.sequence_parallel(backend_supports_sp=False) is False


@pytest.mark.parametrize("placement,rank", [
    (ExpertPlacement.linear(16, 4), 0), (ExpertPlacement.linear(16, 4), 1),
    (ExpertPlacement.linear(16, 4), 3), (ExpertPlacement.linear(16, 16), 3),
    (ExpertPlacement.eplb(list(range(16)) + [0, 5, 9, 15], 4), 2),  # 5 slots per rank
], ids=["r0", "r1", "r3", "one_each", "redundant"])
def test_local_id_map_equals_local_expert_ids(placement, rank):
    """The one-lookup map gives local_expert_ids' answer for every id, -1 and out-of-range ids
    included, in int32 and int64."""
    ids = torch.tensor([[-3, -1, 0, 1], [3, 4, 7, 8], [11, 12, 15, 16], [40, 2, 5, 13],
                        [17, 19, 20, 10]])
    lookup = LocalIdMap(placement, rank)
    for dtype in (torch.int32, torch.int64):
        got = lookup(ids.to(dtype))
        assert got.dtype == torch.int64
        assert torch.equal(got, local_expert_ids(ids.to(dtype), placement, rank))
    # the unclamped lookup, for ids in [-1, num_physical): the same
    checked = ids.clamp(-1, placement.num_physical - 1)
    assert torch.equal(lookup.checked(checked), local_expert_ids(checked, placement, rank))


@pytest.mark.parametrize("placement", [
    ExpertPlacement.linear(16, 4), ExpertPlacement.linear(16, 1),
    ExpertPlacement.eplb(list(range(16)) + [0, 5, 9, 15], 4),  # 5 slots per rank
], ids=["linear4", "one_rank", "redundant"])
def test_destination_map_equals_destination_ranks_and_flags_bad_ids(placement):
    """The one-lookup map's rank columns are destination_ranks' answer; its last two columns
    mark the tokens with a -1 entry and those with an id outside [-1, num_physical), computed
    here independently (int32 and int64 ids)."""
    p = placement.num_physical
    ids = torch.tensor([[-3, -1, 0, 1], [3, 4, 7, 8], [11, 12, 15, -1], [p, 2, 5, 13],
                        [17 % p, 19 % p, -2, 10], [p + 7, -1, -1, -1]])
    r = placement.num_ranks
    for dtype in (torch.int32, torch.int64):
        hit = DestinationMap(placement)(ids.to(dtype))
        assert hit.shape == (r + 2, ids.shape[0]) and hit.dtype == torch.int64
        assert set(hit.flatten().tolist()) <= {0, 1}  # 0/1 flags, so row sums are counts
        hit = hit.bool()
        assert torch.equal(hit[:r], destination_ranks(ids.to(dtype), placement).t())
        assert hit[r].tolist() == [bool((row == -1).any()) for row in ids]
        assert hit[r + 1].tolist() == [bool(((row < -1) | (row >= p)).any()) for row in ids]


@pytest.mark.parametrize("given,current,expected", [
    ("cuda", 1, "cuda:1"), (torch.device("cuda"), 0, "cuda:0"), ("cuda:3", 1, "cuda:3"),
    ("cpu", 0, "cpu")])
def test_a_context_names_its_cuda_device_by_index(monkeypatch, given, current, expected):
    """Tensors name their CUDA device with its index; a context built on plain "cuda" (the
    current device) compared unequal to every tensor, and MoELayer refused every call as "on
    another device" (seen on the H200). The CUDA runtime's answers are stood in for here (no
    GPU on this machine); the GPU tests build their contexts on "cuda"."""
    from moe_plugins.groups import DistContext
    from moe_plugins.layout import ParallelLayout

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    ctx = DistContext(ParallelLayout(1, 1, False), 0, None, None, given)
    assert ctx.device == torch.device(expected)
