"""The plugin's switches, from ``--additional-config '{"moe_plugins": {...}}'`` (and the
``MOE_PLUGINS_*`` environment): :func:`plugin_settings` parses them into :class:`PluginSettings`.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from moe_plugins.overlap import OverlapConfig
from moe_plugins.planner.link_model import LinkModel
from moe_plugins.planner.presets import link_from_config
from moe_plugins.strategy import ReductionStrategy

__all__ = ["ADDITIONAL_CONFIG_KEY", "PluginSettings", "plugin_settings"]


ADDITIONAL_CONFIG_KEY = "moe_plugins"


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
        take per rank when :func:`moe_plugins.planner.recommend.recommend_strategy` weighs SP (replicated
        shared experts) against row-scatter (TP-sharded ones); None: no limit.
    link: ``link``, the system's links (:func:`moe_plugins.planner.presets.link_from_config`:
        a preset name, or an object of link fields over an optional preset): a backend that
        picks its transport per call (deepep_auto) switches where the time model puts its
        modes' crossover for each layer; None: at its low-latency capacity.
    """

    overlap: OverlapConfig
    strategy: Optional[ReductionStrategy] = None
    max_tokens_set: bool = False
    shared_expert_budget_bytes: Optional[int] = None
    link: Optional[LinkModel] = None


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
    raw_link = values.pop("link", None)
    link = (None if raw_link is None else
            link_from_config(raw_link, f"--additional-config {ADDITIONAL_CONFIG_KEY}.link"))
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
                         "(or 'strategy', 'shared_expert_budget_gb', 'link')") from None
    max_tokens_set = ("overlap_max_tokens" in values
                      or "MOE_PLUGINS_OVERLAP_MAX_TOKENS" in os.environ)
    return PluginSettings(overlap, strategy, max_tokens_set, budget, link)


def _budget_bytes(gib: Any) -> Optional[int]:
    if gib is None:
        return None
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib >= 0 \
            or not math.isfinite(gib * 2**30):  # JSON has NaN and Infinity
        raise ValueError(f"--additional-config {ADDITIONAL_CONFIG_KEY}.shared_expert_budget_gb="
                         f"{gib!r} is not a size; expected a number of GiB >= 0, e.g. "
                         f"'{{\"{ADDITIONAL_CONFIG_KEY}\": {{\"shared_expert_budget_gb\": 4}}}}'")
    return int(gib * 2**30)
