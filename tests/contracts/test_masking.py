"""The one check of a rank-mask request (moe_plugins.masking), every masking entry point's
first step: what it takes, what it refuses and what its messages say. The entry points
themselves (set_rank_masked, the vLLM manager's update_mask) are tested on ranks with the
emulated libraries (tests/backends/test_low_latency.py, tests/vllm_glue/test_vllm_dbo.py)."""
from __future__ import annotations

import pytest

from moe_plugins.masking import checked_mask_request
from tests.backends.low_latency_ranks import bad_mask_requests


@pytest.mark.parametrize("masked,expected", [(True, True), (False, False), (1, True), (0, False)])
def test_bools_and_the_ints_0_and_1_are_taken_as_bools(masked, expected):
    rank, got = checked_mask_request(2, masked, 4, "set_rank_masked")
    assert (rank, got) == (2, expected) and type(got) is bool


@pytest.mark.parametrize("label,rank,masked,err_type",
                         bad_mask_requests(1, 2), ids=[r[0] for r in bad_mask_requests(1, 2)])
def test_everything_else_is_refused_saying_what_was_given_and_the_fix(label, rank, masked,
                                                                      err_type):
    with pytest.raises((TypeError, ValueError)) as e:
        checked_mask_request(rank, masked, 2, "update_mask")
    text = str(e.value)
    assert type(e.value).__name__ == err_type, text
    assert text.startswith("update_mask: ") and "Pass " in text
    given = masked if label.startswith("masked") else rank
    if hasattr(given, "shape"):
        assert f"of shape {tuple(given.shape)}" in text, text
    else:
        assert repr(given) in text, text


def test_the_flag_message_says_a_string_is_not_parsed():
    with pytest.raises(TypeError, match=r"got 'False' \(str\).*bool\('False'\) is True"):
        checked_mask_request(1, "False", 2, "set_rank_masked")
