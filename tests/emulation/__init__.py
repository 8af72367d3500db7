"""Faithful CPU emulations of vendor EP libraries that cannot be installed here.

Each module emulates one package's documented Python API on torch.distributed (gloo), with the
same signatures, tensor layouts and host-side checks, so the backend code that runs against it
runs unchanged against the real library on a GPU. Modules are injected into ``sys.modules``
only inside a test or rank function, through :func:`installed`, and restored afterwards, so
nothing outside the tests ever sees them (``moe-plugins list`` keeps reporting the real package
as missing).
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["installed", "DEEP_EP_SHAPES", "deep_ep_shape", "in_deep_ep_shape"]

_EMULATED = ("deep_ep", "nixl_ep")
#: The API shapes the deep_ep emulation presents: 567632d's V1 Buffer (tests.emulation.deep_ep)
#: and the current line's legacy Buffer (tests.emulation.deep_ep_legacy, d4f41e4 and later).
DEEP_EP_SHAPES = {"v1": "tests.emulation.deep_ep", "legacy": "tests.emulation.deep_ep_legacy"}
_SHAPE = ["v1"]  # what ``installed("deep_ep")`` presents in this process (deep_ep_shape)


@contextlib.contextmanager
def installed(*names: str, deep_ep_shape: str | None = None) -> Iterator[None]:
    """Make ``import <name>`` return the emulation of ``name`` (deep_ep, nixl_ep) in this
    process until the block exits; whatever was in sys.modules before is put back. deep_ep
    presents ``deep_ep_shape`` (a key of :data:`DEEP_EP_SHAPES`; None: this process's shape,
    :func:`deep_ep_shape`, "v1" by default)."""
    unknown = set(names) - set(_EMULATED)
    if unknown:
        raise ValueError(f"no emulation for {sorted(unknown)}; emulated: {list(_EMULATED)}")
    shape = _SHAPE[0] if deep_ep_shape is None else deep_ep_shape
    if shape not in DEEP_EP_SHAPES:
        raise ValueError(f"no deep_ep shape {shape!r}; shapes: {sorted(DEEP_EP_SHAPES)}")
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        sys.modules[n] = importlib.import_module(
            DEEP_EP_SHAPES[shape] if n == "deep_ep" else f"tests.emulation.{n}")
    try:
        yield
    finally:
        for n, module in saved.items():
            if module is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = module


@contextlib.contextmanager
def deep_ep_shape(shape: str) -> Iterator[None]:
    """Inside the block, ``installed("deep_ep")`` presents ``shape`` in this process."""
    if shape not in DEEP_EP_SHAPES:
        raise ValueError(f"no deep_ep shape {shape!r}; shapes: {sorted(DEEP_EP_SHAPES)}")
    before, _SHAPE[0] = _SHAPE[0], shape
    try:
        yield
    finally:
        _SHAPE[0] = before


def in_deep_ep_shape(rank: int, world: int, shape: str, fn: Callable[..., T], *args: Any,
                     **kwargs: Any) -> T:
    """A rank function: ``fn(rank, world, *args, **kwargs)`` with the deep_ep emulation
    presenting ``shape`` (``pool.run(in_deep_ep_shape, "legacy", fn, ...)``)."""
    with deep_ep_shape(shape):
        return fn(rank, world, *args, **kwargs)
