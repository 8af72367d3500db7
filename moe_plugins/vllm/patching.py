"""The machinery of rebinding vLLM internals (docs/design.md, "vLLM glue"): a :class:`Patch`
names one symbol, checks the original before anything is rebound, and keeps what undoes it.
The patches themselves, with their table, are :mod:`moe_plugins.vllm.patches`.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger(__name__)

__all__ = ["Patch", "VllmPatchError", "resolve", "check_signature", "revert_patch", "revert_all",
           "applied_symbols", "hooked_summary"]


class VllmPatchError(RuntimeError):
    """A patched vLLM symbol moved or changed its signature."""


@dataclass(frozen=True)
class Patch:
    """One rebinding. ``symbol`` is ``module:qualname``; ``expected`` is the original's parameter
    names (for the Literal field: in-tree names it must contain); ``cpu_only``: installed only on
    vLLM's CPU platform (vLLM itself imports that module only there)."""

    symbol: str
    why: str
    verified: tuple[str, ...]
    removal: str
    expected: tuple[str, ...]
    install: Callable[["Patch", list[str]], None]
    cpu_only: bool = False
    # A check of the original beyond its parameters, run before anything is patched (raises
    # VllmPatchError); e.g. a constant of its code that the patch changes.
    precheck: Callable[["Patch", Any], None] | None = None
    # The symbol is a value (a set of names), not a function: ``expected`` are in-tree names it
    # must hold, and the replacement keeps the original as ``__wrapped__``.
    value: bool = False
    # Where vLLM releases differ at a hook point, one Patch per variant: ``present`` tells from
    # the installed vLLM (a feature check, not its version) whether this variant is the one
    # that applies. ``releases`` names the verified releases that have it.
    present: Callable[[], bool] | None = None
    releases: str = "all supported"

    def applies(self) -> bool:
        if self.present is not None and not self.present():
            return False
        if not self.cpu_only:
            return True
        from vllm.platforms import current_platform

        return current_platform.is_cpu()


# symbol -> how to undo every rebinding made for it
_APPLIED: dict[str, list[Callable[[], None]]] = {}
_announced: set[str] = set()


def resolve(symbol: str) -> tuple[Any, str, Any]:
    """``module:Outer.attr`` -> (owner object, attribute name, current value). Raises
    :class:`VllmPatchError` naming what is missing."""
    module_name, _, qualname = symbol.partition(":")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise VllmPatchError(f"vLLM moved {symbol}: cannot import {module_name} ({e}); "
                             "moe-plugins' patches need an update for this vLLM") from e
    *path, attr = qualname.split(".")
    for part in path:
        if not hasattr(owner, part):
            raise VllmPatchError(f"vLLM moved {symbol}: {module_name} has no {part}")
        owner = getattr(owner, part)
    present = attr in vars(owner) if inspect.isclass(owner) else hasattr(owner, attr)
    if not present:
        raise VllmPatchError(f"vLLM moved {symbol}: {qualname} not found")
    return owner, attr, getattr(owner, attr)


def check_signature(patch: Patch, original: Callable[..., Any]) -> inspect.Signature:
    sig = inspect.signature(original)
    got = tuple(sig.parameters)
    if got != patch.expected:
        raise VllmPatchError(
            f"vLLM changed {patch.symbol}: parameters {got}, moe-plugins was verified against "
            f"{patch.expected} ({', '.join(patch.verified)}); the patch needs an update"
        )
    return sig


def _rebind(patch: Patch, owner: Any, attr: str, new: Any) -> None:
    original = getattr(owner, attr)
    setattr(owner, attr, new)
    _APPLIED.setdefault(patch.symbol, []).append(lambda: setattr(owner, attr, original))


def _rebind_importers(patch: Patch, owner: Any, attr: str, original: Any, new: Any) -> None:
    """Rebind ``attr`` also in every loaded vLLM module that did ``from <owner> import attr``
    (it holds ``original``); modules imported from now on pick up ``new`` from ``owner``."""
    for module_name, module in list(sys.modules.items()):
        # vars(), not getattr(): lazy modules (transformers) import on attribute access
        if (module_name.startswith("vllm.") and module is not owner
                and vars(module).get(attr) is original):
            _rebind(patch, module, attr, new)


def _announce(all2all_backend: str, where: str) -> None:
    """One INFO line per process when one of our names first reaches a hook."""
    if all2all_backend not in _announced:
        _announced.add(all2all_backend)
        logger.info("moe-plugins: --all2all-backend %s selected (first seen in %s); hooked: %s",
                    all2all_backend, where, hooked_summary())


def hooked_summary() -> str:
    return ", ".join(s.split(":", 1)[1] for s in _APPLIED)


def _current_all2all_backend() -> str | None:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return None if config is None else config.parallel_config.all2all_backend


def _is_ours(name: str | None) -> bool:
    from moe_plugins.vllm.names import is_our_backend

    return is_our_backend(name)


def _field_owner(patch: Patch) -> tuple[Any, str, Any]:
    module_name, _, qualname = patch.symbol.partition(":")
    cls_name, attr = qualname.split(".")
    cls = getattr(importlib.import_module(module_name), cls_name, None)
    if cls is None or attr not in getattr(cls, "__dataclass_fields__", {}) \
            or attr not in getattr(cls, "__pydantic_fields__", {}):
        raise VllmPatchError(f"vLLM moved {patch.symbol}: no pydantic dataclass field {attr}")
    return cls, attr, cls.__dataclass_fields__[attr].type


def _install_property(patch: Patch, ours: Callable[[Any], Any],
                      backend_of: Callable[[Any], Any] = lambda owner: owner.all2all_backend
                      ) -> None:
    """Rebind the property ``patch.symbol`` so that for our names (``backend_of(self)``) it
    returns ``ours(self)``; every other name gets vLLM's answer."""
    owner, attr, _ = resolve(patch.symbol)
    prop = vars(owner)[attr]
    if not isinstance(prop, property) or prop.fget is None:
        raise VllmPatchError(f"vLLM changed {patch.symbol}: expected a property")
    original = prop.fget
    check_signature(patch, original)

    def fget(self: Any) -> Any:
        return ours(self) if _is_ours(backend_of(self)) else original(self)

    fget.__name__ = attr
    fget.__wrapped__ = original  # type: ignore[attr-defined]
    _rebind(patch, owner, attr, property(fget))


def revert_patch(symbol: str) -> None:
    """Undo one patch installed by :func:`apply_patch`."""
    for undo in reversed(_APPLIED.pop(symbol, [])):
        undo()


def revert_all() -> None:
    """Undo every rebinding (tests; a process that unloads the plugin)."""
    for symbol in reversed(list(_APPLIED)):
        for undo in reversed(_APPLIED.pop(symbol)):
            undo()
    _announced.clear()


def applied_symbols() -> list[str]:
    return list(_APPLIED)
