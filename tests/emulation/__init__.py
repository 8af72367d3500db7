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
import importlib.machinery
import json
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar

T = TypeVar("T")

__all__ = ["installed", "DEEP_EP_SHAPES", "deep_ep_shape", "in_deep_ep_shape"]

_EMULATED = ("deep_ep", "nixl_ep")
#: The API shapes the deep_ep emulation presents: 567632d's V1 Buffer (tests.emulation.deep_ep)
#: and the current line's legacy Buffer (tests.emulation.deep_ep_legacy, d4f41e4 and later).
DEEP_EP_SHAPES = {"v1": "tests.emulation.deep_ep", "legacy": "tests.emulation.deep_ep_legacy"}
_SHAPE = ["v1"]  # what ``installed("deep_ep")`` presents in this process (deep_ep_shape)


@contextlib.contextmanager
def installed(*names: str, deep_ep_shape: str | None = None, deep_ep_build: Optional[dict] = None,
              platform: Any = None) -> Iterator[None]:
    """Make ``import <name>`` return the emulation of ``name`` (deep_ep, nixl_ep) in this
    process until the block exits; whatever was in sys.modules before is put back. deep_ep
    presents ``deep_ep_shape`` (a key of :data:`DEEP_EP_SHAPES`; None: this process's shape,
    :func:`deep_ep_shape`, "v1" by default).

    ``deep_ep_build``: a build record as ``scripts/deepep/build.sh`` writes it; deep_ep is then
    a package whose ``moe_plugins_build.json`` holds it (in a temporary folder, beside its
    ``__file__``) and whose kernels follow it; ``platform``: the
    :class:`tests.emulation.deep_ep.Platform` its Buffer runs on (None: the default)."""
    unknown = set(names) - set(_EMULATED)
    if unknown:
        raise ValueError(f"no emulation for {sorted(unknown)}; emulated: {list(_EMULATED)}")
    shape = _SHAPE[0] if deep_ep_shape is None else deep_ep_shape
    if shape not in DEEP_EP_SHAPES:
        raise ValueError(f"no deep_ep shape {shape!r}; shapes: {sorted(DEEP_EP_SHAPES)}")
    saved = {n: sys.modules.get(n) for n in names}
    folder = tempfile.TemporaryDirectory(prefix="emulated_deep_ep_")
    for n in names:
        sys.modules[n] = importlib.import_module(
            DEEP_EP_SHAPES[shape] if n == "deep_ep" else f"tests.emulation.{n}")
        if n == "deep_ep" and (deep_ep_build is not None or platform is not None):
            sys.modules[n] = _built(sys.modules[n], Path(folder.name), deep_ep_build, platform)
    try:
        yield
    finally:
        folder.cleanup()
        for n, module in saved.items():
            if module is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = module


def _built(base: types.ModuleType, folder: Path, build: Optional[dict],
           platform: Any) -> types.ModuleType:
    """A module object presenting ``base`` (an emulated deep_ep) as a package built with
    ``build`` (its record beside the package's ``__init__.py``, where the product reads it) on
    ``platform``: a fresh object, so nothing probed of another build is reused."""
    module = types.ModuleType("deep_ep", base.__doc__)
    module.__dict__.update({k: v for k, v in vars(base).items()
                            if k not in ("__name__", "__spec__", "__loader__")})
    package = folder / "deep_ep"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    module.__file__ = str(package / "__init__.py")
    # found as an installed package is (importlib.util.find_spec, which vLLM's has_deep_ep asks)
    module.__spec__ = importlib.machinery.ModuleSpec("deep_ep", None, origin=module.__file__,
                                                     is_package=True)
    if build is not None:
        (package / "moe_plugins_build.json").write_text(json.dumps(build))
    attrs: dict[str, Any] = {"build": build, "__module__": base.__name__}
    if platform is not None:
        attrs["platform"] = platform
    module.Buffer = type("Buffer", (base.Buffer,), attrs)
    return module


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
