"""Glue to the vendor libraries' runtimes, shared by the DeepEP (both modes) and NIXL EP managers.

- :func:`import_vendor`: the lazy import, an ImportError naming the install step when missing;
- the process's reference-counted buffer cache (:func:`buffer_cache`, :func:`destroy_all_buffers`):
  one library buffer per EP group and size, shared by a model's layers;
- :class:`RuntimeCalls` and :func:`wrappers_match`: where a library's low-latency Python methods
  are those of a known release, whose bodies are one C++ runtime call each, the prepare/finalize
  calls that runtime directly.
"""
from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable


from moe_plugins.registry import RequiredPackage

logger = logging.getLogger(__name__)

__all__ = ["first_method", "import_vendor", "RuntimeCalls", "WRAPPER_PARAMETERS", "wrappers_match",
    "buffer_cache", "destroy_all_buffers"]


def first_method(obj: Any, names: tuple[str, ...]) -> Callable[..., Any]:
    """The bound method of ``obj`` named by the first of ``names`` it has (AttributeError
    naming them all when it has none)."""
    for name in names:
        method = getattr(obj, name, None)
        if method is not None:
            return method
    raise AttributeError(f"{type(obj).__name__} has none of the methods {', '.join(names)}")


def import_vendor(required: RequiredPackage, backend: str) -> ModuleType:
    """Import a backend's vendor package; ImportError naming the install step when it is
    missing or its import fails (a package may check its environment at import: DeepEP's
    current line asserts that torch's NCCL is the one it was built against)."""
    try:
        return importlib.import_module(required.module)
    except Exception as e:  # ImportError, or a package's own check at import (DeepEP's NCCL)
        raise ImportError(
            f"backend {backend!r} needs the '{required.module}' package, which is not "
            f"importable ({type(e).__name__}: {e}); {required.install}"
        ) from e


@dataclass(frozen=True)
class RuntimeCalls:
    """A library's C++ runtime methods that take the low-latency calls directly, bypassing its
    Python wrapper (:mod:`moe_plugins.all2all.deepep_ll`'s module doc says why), with the positional
    signatures of DeepEP 567632d's ``deep_ep_cpp.Buffer`` (csrc/deep_ep.cpp). Both are unbound,
    called with ``buffer.runtime`` read on each call (a destroyed buffer has none, and the call
    raises):

    - ``dispatch(runtime, x, topk_idx, cumulative_local_expert_recv_stats,
      dispatch_wait_recv_cost_stats, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
      round_scale, use_ue8m0, async, return_recv_hook)`` -> (recv_x, recv_x_scales or None,
      recv_count, src_info, layout_range, event, hook);
    - ``combine(runtime, x, topk_idx, topk_weights, src_info, layout_range,
      combine_wait_recv_cost_stats, num_max_dispatch_tokens_per_rank, num_experts, use_logfmt,
      zero_copy, async, return_recv_hook, out)`` -> (combined_x, event, hook).

    Their first statements are host asserts (``EP_HOST_ASSERT``, a RuntimeError through
    pybind11) that nothing has been launched or changed before: x bfloat16, 2-D (dispatch) or
    3-D (combine) and contiguous; topk_idx 2-D, contiguous, in ``topk_idx_t``; the dispatch's
    tokens within ``num_max_dispatch_tokens_per_rank``; topk_weights float32, 2-D and
    contiguous. :class:`LowLatencyPrepareFinalize` leaves exactly those checks to them: where
    one refuses a call, it names the fault (or copies a non-contiguous input) and calls again.
    """

    dispatch: Callable[..., tuple]
    combine: Callable[..., tuple]


#: The parameters of the low-latency Python methods of DeepEP 567632d's ``deep_ep.Buffer`` and
#: of nixl_ep v1.4.0 / 1.5.1's ``nixl_ep.Buffer`` (nixl_ep forked DeepEP's; ``self`` first),
#: whose bodies are one runtime call each (all2all/deepep_ll.py, all2all/nixl_ep.py).
WRAPPER_PARAMETERS: dict[str, tuple[str, ...]] = {
    "low_latency_dispatch": (
        "self", "x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts",
        "cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats", "use_fp8",
        "round_scale", "use_ue8m0", "async_finish", "return_recv_hook"),
    "low_latency_combine": (
        "self", "x", "topk_idx", "topk_weights", "handle", "use_logfmt", "zero_copy",
        "async_finish", "return_recv_hook", "out", "combine_wait_recv_cost_stats"),
}


_WRAPPERS_LOGGED: set[type] = set()


def wrappers_match(buffer: Any, runtime_methods: tuple[str, ...], backend: str,
                   release: str) -> bool:
    """Whether ``buffer``'s low-latency Python methods have :data:`WRAPPER_PARAMETERS`, those
    of ``release``, whose bodies are known to be one call each of ``buffer.runtime``'s
    ``runtime_methods``: then the runtime can take the calls directly (:class:`RuntimeCalls`).
    Otherwise INFO once per buffer class."""
    cls = type(buffer)
    try:
        known = all(tuple(inspect.signature(getattr(cls, name)).parameters) == params
                    for name, params in WRAPPER_PARAMETERS.items())
    except (AttributeError, TypeError, ValueError):
        known = False
    known = known and all(callable(getattr(getattr(buffer, "runtime", None), name, None))
                          for name in runtime_methods)
    if not known and cls not in _WRAPPERS_LOGGED:
        _WRAPPERS_LOGGED.add(cls)
        logger.info("%s: %s.%s's low-latency methods are not those of %s; calling them instead "
                    "of its C++ runtime", backend, cls.__module__, cls.__name__, release)
    return known


class _BufferCache:
    """Library buffers shared by the managers of one EP group and size (a model's MoE layers all
    share one), reference-counted; the last :meth:`release` destroys the buffer."""

    def __init__(self) -> None:
        self._entries: dict[tuple, list[Any]] = {}  # key -> [buffer, refs, destroy]

    def acquire(self, key: tuple, create: Callable[[], Any], destroy: Callable[[Any], None]) -> Any:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = [create(), 0, destroy]
        entry[1] += 1
        return entry[0]

    def release(self, key: tuple) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._entries[key]
            entry[2](entry[0])

    def clear(self) -> None:
        entries, self._entries = list(self._entries.values()), {}
        for buffer, _, destroy in entries:
            destroy(buffer)


_BUFFERS = _BufferCache()


def buffer_cache() -> _BufferCache:
    """The process's reference-counted cache of vendor buffers (``acquire(key, create, destroy)``
    / ``release(key)``); every DeepEP and NIXL EP manager keeps its buffer here, so
    :func:`destroy_all_buffers` frees them all."""
    return _BUFFERS


def destroy_all_buffers() -> None:
    """Destroy every cached low-latency buffer of this process (engine teardown, tests). The
    managers that used them must not be used afterwards."""
    _BUFFERS.clear()
