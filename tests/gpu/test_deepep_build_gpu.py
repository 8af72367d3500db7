"""The DeepEP this GPU host runs is the one scripts/deepep/build.sh builds: 567632d with the
three patches it keeps (PR #642's combine fence, PR #695's RC QP check, PR #678's timeout
override), and the timeouts it was built with are what our backstop reads
(scripts/gpu/deepep_patches.sh runs this with MOE_PLUGINS_EXPECT_DEEPEP_TIMEOUT_S set to the
DEEPEP_TIMEOUT_S of its build)."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
deep_ep = pytest.importorskip("deep_ep", reason="needs DeepEP built by scripts/deepep/build.sh")


def test_the_installed_deepep_is_the_patched_build():
    from moe_plugins.stack.deepep import V1, describe_deepep

    found = describe_deepep(deep_ep)
    assert found.line == V1 and found.commit == "567632d", found.describe()
    assert {"pr642-combine-fence", "pr695-rc-qp-assert",
            "pr678-timeout-override"} <= set(found.patches), found.describe()
    expected = os.environ.get("MOE_PLUGINS_EXPECT_DEEPEP_TIMEOUT_S")
    if expected is not None:
        assert found.timeouts.recorded and found.timeouts.cpu_s == float(expected)
        assert found.timeouts.kernel_s == float(expected), found.describe()
