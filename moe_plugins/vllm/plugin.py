"""vLLM general plugin: entry point ``vllm.general_plugins`` -> :func:`register`.

vLLM loads general plugins once in every process (API server, engine core, workers) before it
builds a model or its CLI. :func:`register` checks the installed vLLM against the supported range
(:mod:`moe_plugins.vllm.version`) and every hook point against the patch table, then installs the
hooks listed in :mod:`moe_plugins.vllm.patches`; where either check fails it stands aside and
vLLM runs as if the plugin were absent. The hooks pass every call through unchanged unless
``--all2all-backend`` names one of our backends (:mod:`moe_plugins.vllm.names`); switches come
from ``--additional-config`` (:mod:`moe_plugins.vllm.settings`). This module imports no vLLM
code at import time.
"""
from __future__ import annotations

import logging
from typing import Optional

from moe_plugins.vllm.names import forget_names, our_backend_names
from moe_plugins.vllm.patching import VllmPatchError
from moe_plugins.vllm.version import (INSTALL_HINT, UnsupportedVllmError, check_vllm_version,
                                      supported_text)

logger = logging.getLogger(__name__)

__all__ = ["register", "standing_aside"]


_registered = False
#: Why the plugin stands aside in this process (None: active or not yet registered).
_standing_aside: Optional[str] = None


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
    process) and never raises: vLLM must start whatever we find.

    On a supported vLLM whose hook points are all where the patch table expects them, installs
    pass-through hooks that act only for our ``--all2all-backend`` names. Otherwise (a release
    outside :data:`~moe_plugins.vllm.version.SUPPORTED_VLLM`, a moved or changed internal, any
    error while checking) it rebinds none of them, logs one WARNING with what it found, what is
    supported and how to install it, and stands aside: vLLM serves its own backends as if the
    plugin were absent, and a config that names one of ours fails at config time with the same
    facts (:func:`moe_plugins.vllm.patches.apply_refusal`)."""
    global _registered, _standing_aside
    if _registered:
        return
    _registered = True
    _share_vllm_log_handler()
    from moe_plugins.vllm import patches as vllm_patches

    try:
        dist, version = check_vllm_version()
    except UnsupportedVllmError as e:
        _stand_aside(str(e))
        return
    try:
        hooked = vllm_patches.apply_all(list(our_backend_names()))
    except Exception as e:  # never break vLLM: every failure here means "stand aside"
        what = str(e) if isinstance(e, VllmPatchError) else f"{type(e).__name__}: {e}"
        _stand_aside(f"{what} (found {dist} {version}; moe-plugins supports {supported_text()}: "
                     f"{INSTALL_HINT})")
        return
    _standing_aside = None
    logger.debug("moe-plugins registered with %s %s: --all2all-backend accepts %s; hooked %s",
                 dist, version, sorted(our_backend_names()), ", ".join(hooked))


def _stand_aside(reason: str) -> None:
    """Rebind nothing, say so once, and refuse our names at config time with ``reason``."""
    global _standing_aside
    from moe_plugins.vllm import patches as vllm_patches

    _standing_aside = reason
    logger.warning("moe-plugins: the vLLM plugin is off in this process, none of its hooks is "
                   "installed: %s. vLLM's own --all2all-backend values work as without the "
                   "plugin; ours (moe_plugins*) are refused at config time", reason)
    vllm_patches.apply_refusal(list(our_backend_names()), reason)


def standing_aside() -> Optional[str]:
    """Why the plugin stands aside in this process, or None (active, or not registered)."""
    return _standing_aside


def _reset_for_tests() -> None:
    """Undo :func:`register` (tests only): revert the hooks and forget the names."""
    global _registered, _standing_aside
    from moe_plugins.vllm import patches as vllm_patches

    vllm_patches.revert_all()
    forget_names()
    _registered = False
    _standing_aside = None
