"""One mask contract (moe_plugins/masking.py): our masked flag means "left out of dispatch and
combine" on every backend; each library's word is translated in one place. DeepEP's and NIXL
EP's mask words: nonzero = masked; flashinfer moe_ep's active_rank_mask: 1 = active."""
from __future__ import annotations

import pytest
import torch

from moe_plugins.config import MoEConfig
from moe_plugins.masking import MaskWord, library_word, masked_from_library
from tests.backends import mask_contract_ranks

CFG = MoEConfig(hidden=2048, num_experts=8, num_topk=2, intermediate=32, shared_intermediate=0,
                dtype=torch.bfloat16)


def test_each_library_word_translates_to_the_one_flag():
    # DeepEP / NIXL EP: int32 per rank, nonzero = masked
    assert masked_from_library([0, 1, 0, 7], MaskWord.NONZERO_MASKED) == [1, 3]
    assert [library_word(m, MaskWord.NONZERO_MASKED) for m in (True, False)] == [1, 0]
    # flashinfer moe_ep: active_rank_mask, 1 = active, 0 = left out
    assert masked_from_library([1, 0, 1, 0], MaskWord.ONE_ACTIVE) == [1, 3]
    assert [library_word(m, MaskWord.ONE_ACTIVE) for m in (True, False)] == [0, 1]
    for word in MaskWord:  # a round trip through either word gives the flag back
        flags = [True, False, False, True]
        assert masked_from_library([library_word(f, word) for f in flags], word) == [0, 3]


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["deepep_ll", "nixl_ep"])  # deepep_auto: deepep_ll's
def test_each_backend_stores_our_flag_as_its_library_word(rank_pool, backend):
    results = rank_pool(2).run(mask_contract_ranks.flag_and_library_word, backend, CFG)
    for rank, rows in enumerate(results):
        for row in rows:
            peer = row["peer"]
            assert row["word"] is MaskWord.NONZERO_MASKED
            assert row["ours"] == ([peer] if row["masked"] else [])
            assert bool(row["library"][peer]) is row["masked"]  # nonzero = masked
            assert row["library"][rank] == 0  # this rank is never masked here
