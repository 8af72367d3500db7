"""The deep_ep normal-mode emulation (tests/emulation/_ht_kernels.py), in both API shapes,
against what DeepEP 567632d documents (d4f41e4's legacy Buffer the same) and its own
tests/test_intranode.py checks, on gloo ranks: the layout, the
received rows (grouped by source rank), local top-k ids, per-expert counts, num_worst_tokens,
cached dispatch, unweighted combine, the events, and the host checks."""
from __future__ import annotations

import pytest
import torch

from tests.backends import deepep_ht_ranks as ht_rank_fns
from tests.emulation import in_deep_ep_shape

pytestmark = pytest.mark.multirank

WORLD, TOKENS, EXPERTS, HIDDEN, TOPK = 4, 11, 16, 128, 3


@pytest.fixture(scope="module", params=["v1", "legacy"])
def results(rank_pool, request):
    """Both API shapes of the emulation: 567632d's Buffer and the current line's legacy one."""
    return rank_pool(WORLD).run(in_deep_ep_shape, request.param, ht_rank_fns.raw_normal_mode,
                                TOKENS, EXPERTS, HIDDEN, TOPK)


def test_layout(results):
    per = EXPERTS // WORLD
    for r in results:
        ids = r["topk_idx"]
        valid = ids >= 0
        want_in_rank = torch.zeros(TOKENS, WORLD, dtype=torch.bool)
        for t in range(TOKENS):
            for k in range(TOPK):
                if ids[t, k] >= 0:
                    want_in_rank[t, ids[t, k] // per] = True
        assert torch.equal(r["in_rank"], want_in_rank)
        assert r["per_rank"].dtype == torch.int32
        assert r["per_rank"].tolist() == want_in_rank.sum(dim=0).tolist()
        assert r["per_expert"].tolist() == [int((ids[valid] == e).sum()) for e in range(EXPERTS)]
        assert r["per_rdma"] is None  # intranode


def test_dispatch_rows_ids_and_counts(results):
    per = EXPERTS // WORLD
    for rank, r in enumerate(results):
        sent = [int(s["in_rank"][:, rank].sum()) for s in results]
        assert r["recv_x"].shape[0] == sum(sent)
        assert r["rank_prefix"][:, rank].tolist() == torch.tensor(sent).cumsum(0).tolist()
        # rows come grouped by source rank, each row holding the value of its source
        start = 0
        for src, n in enumerate(sent):
            assert bool((r["recv_x"][start:start + n].float() == src).all())
            assert bool((r["recv_w"][start:start + n][r["recv_ids"][start:start + n] >= 0]
                         == src).all())
            start += n
        ids = r["recv_ids"]
        assert bool(((ids == -1) | ((ids >= 0) & (ids < per))).all())
        assert bool((r["recv_w"][ids == -1] == 0).all())
        assert r["counts"] == [int((ids == e).sum()) for e in range(per)]
        assert r["aligned"] == [-(-c // 4) * 4 for c in r["counts"]]
        assert r["poisoned"]  # before the event was waited for


def test_num_worst_tokens_and_cached_dispatch(results):
    for r in results:
        x, ids, w, counts = r["worst"]
        n = r["recv_x"].shape[0]
        assert x.shape[0] == TOKENS * WORLD and counts == []
        assert torch.equal(x[:n], r["recv_x"]) and torch.equal(ids[:n], r["recv_ids"])
        assert bool((ids[n:] == -1).all())
        assert torch.equal(r["cached"], r["recv_x"])


def test_combine_sums_without_weights(results):
    """As test_intranode.py checks: combined / ranks-reached == x; weights summed the same way."""
    for rank, r in enumerate(results):
        reached = r["in_rank"].sum(dim=1, keepdim=True).float()
        x = torch.full((TOKENS, HIDDEN), float(rank))
        torch.testing.assert_close(r["combined"].float(), x * reached, atol=0, rtol=0)
        ids = r["topk_idx"]
        want_w = torch.where(ids >= 0, torch.full(ids.shape, float(rank)), torch.zeros(ids.shape))
        torch.testing.assert_close(r["combined_w"], want_w, atol=0, rtol=0)
        assert "Unsupported type" in r["combine_error"]
