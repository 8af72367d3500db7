"""Our ``--all2all-backend`` names, made from the registry: ``moe_plugins`` picks a backend by the
capability matrix (:func:`moe_plugins.registry.select_backend`), ``moe_plugins_<name>`` names the
registered backend ``<name>`` (e.g. ``moe_plugins_torch``). The prefix keeps our names apart
from vLLM's own (``deepep_low_latency``, ``nixl_ep``, ...), so a user picks vLLM's in-tree
backend or ours explicitly.
"""
from __future__ import annotations

from typing import Optional

from moe_plugins.registry import AUTO, registered_backends

__all__ = ["AUTO_BACKEND", "BACKEND_PREFIX", "vllm_backend_name", "our_backend_names",
    "dbo_backend_names", "fault_tolerance_backend_names", "registry_name", "is_our_backend"]


AUTO_BACKEND = "moe_plugins"


BACKEND_PREFIX = "moe_plugins_"


_names: dict[str, str] = {}


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


def forget_names() -> None:
    """Forget the names made from the registry (tests: after registering another backend)."""
    _names.clear()
