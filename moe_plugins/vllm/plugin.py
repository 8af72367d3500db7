"""vLLM general plugin: entry point ``vllm.general_plugins`` -> :func:`register`.

vLLM loads general plugins once in every process (API server, engine core, workers) before it
builds a model or its CLI. :func:`register` checks the installed vLLM against the supported range
(:mod:`moe_plugins.vllm.version`), then installs the hooks listed in
:mod:`moe_plugins.vllm.patches`. The hooks pass every call through unchanged unless
``--all2all-backend`` names one of our backends (:mod:`moe_plugins.vllm.names`); switches come
from ``--additional-config`` (:mod:`moe_plugins.vllm.settings`). This module imports no vLLM
code at import time.
"""
from __future__ import annotations

import logging

from moe_plugins.vllm.names import forget_names, our_backend_names
from moe_plugins.vllm.version import check_vllm_version

logger = logging.getLogger(__name__)

__all__ = ["register"]


_registered = False


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
    forget_names()
    _registered = False
