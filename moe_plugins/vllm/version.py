"""The one statement of the vLLM releases this plugin supports, and the check of the installed one.
"""
from __future__ import annotations

import importlib.metadata
from typing import Optional

__all__ = ["SUPPORTED_VLLM", "UnsupportedVllmError", "installed_vllm", "check_vllm_version"]


# The one statement of the supported vLLM range (docs/design.md, "vLLM glue"):
# distribution -> (major, minor).
SUPPORTED_VLLM: dict[str, tuple[int, int]] = {"vllm": (0, 33), "vllm-cpu": (0, 32)}


class UnsupportedVllmError(ImportError):
    """The installed vLLM is outside :data:`SUPPORTED_VLLM` (or not installed)."""


def _supported_text() -> str:
    return " or ".join(f"{d} {mj}.{mn}.x" for d, (mj, mn) in SUPPORTED_VLLM.items())


def installed_vllm() -> tuple[str, str]:
    """(distribution, version) of the installed vLLM: ``vllm`` (CUDA build) or ``vllm-cpu``.

    Reads the distribution metadata itself, not ``importlib.metadata.version``, which the CPU
    launcher (:mod:`moe_plugins.vllm.serve`) redirects for vLLM's own CLI."""
    for dist in SUPPORTED_VLLM:
        try:
            return dist, importlib.metadata.distribution(dist).version
        except importlib.metadata.PackageNotFoundError:
            continue
    raise UnsupportedVllmError(
        f"vLLM is not installed; moe-plugins' vLLM plugin supports {_supported_text()}: "
        "run `pip install 'moe-plugins[vllm]'` (CUDA) or `scripts/install-vllm-cpu.sh` (CPU)"
    )


def check_vllm_version(dist: Optional[str] = None, version: Optional[str] = None) -> tuple[str, str]:
    """Raise :class:`UnsupportedVllmError` unless ``dist`` ``version`` (default: the installed
    one) is in :data:`SUPPORTED_VLLM`; returns (distribution, version)."""
    if dist is None or version is None:
        dist, version = installed_vllm()
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release[:2]
    except InvalidVersion:
        release = ()
    if SUPPORTED_VLLM.get(dist) != tuple(release):
        raise UnsupportedVllmError(
            f"moe-plugins' vLLM plugin supports {_supported_text()}, found {dist} {version}. "
            "Install a supported vLLM (`pip install 'moe-plugins[vllm]'`, or "
            "`scripts/install-vllm-cpu.sh` for the CPU build), or run vLLM without this plugin "
            "by setting VLLM_PLUGINS to a list that leaves out 'moe_plugins'"
        )
    return dist, version
