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
from typing import Iterator

__all__ = ["installed"]

_EMULATED = ("deep_ep", "nixl_ep")


@contextlib.contextmanager
def installed(*names: str) -> Iterator[None]:
    """Make ``import <name>`` return the emulation of ``name`` (deep_ep, nixl_ep) in this
    process until the block exits; whatever was in sys.modules before is put back."""
    unknown = set(names) - set(_EMULATED)
    if unknown:
        raise ValueError(f"no emulation for {sorted(unknown)}; emulated: {list(_EMULATED)}")
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        sys.modules[n] = importlib.import_module(f"tests.emulation.{n}")
    try:
        yield
    finally:
        for n, module in saved.items():
            if module is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = module
