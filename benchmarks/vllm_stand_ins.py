"""Import vLLM 0.33's Python on a GPU machine that lacks vLLM's compiled extension.

The lent H200 has torch 2.11 and no vLLM; vLLM's Python (the wheel without its ``.so`` files,
see /work/shared/gpu/README.md) imports there after :func:`install` puts three stand-ins in
place. Each covers something a MoE layer never runs:

- ``vllm._C_stable_libtorch`` / ``vllm._moe_C_stable_libtorch``: empty modules. vLLM's CUDA
  platform imports them at module top to register its compiled ops; the MoE path we run uses
  none of those ops (our experts and routing are torch code, see benchmarks/vllm_cuda_layer.py).
- ``vllm.vllm_flash_attn``: a stand-in package (any attribute is an inert object). Its
  ``__init__`` raises without the FlashAttention extension; only attention imports it.
- ``torch.ops._C.cutlass_scaled_mm_supports_block_fp8`` returning False: asked once at import
  of vLLM's FP8 utilities to pick a GEMM; our experts are torch code and do not use it.

Call :func:`install` before the first ``import vllm``; it is idempotent and does nothing where
vLLM's compiled extension is importable (a real vLLM install).
"""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import torch

__all__ = ["install", "STAND_INS"]

STAND_INS = ("vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch", "vllm.vllm_flash_attn",
             "torch.ops._C.cutlass_scaled_mm_supports_block_fp8")


class _Inert:
    """Any attribute or call gives another inert object (for the flash-attn package)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is a stand-in (vLLM's FlashAttention extension is not "
                           "installed here); a MoE layer never calls it")


class _StandInPackage(types.ModuleType):
    __path__: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(f"{self.__name__}.{name}")


_installed = False


def _has_real_extension() -> bool:
    """vLLM's compiled extension is on disk (looked up without importing vllm)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(any(Path(d).glob("_C*.so"))
               for d in spec.submodule_search_locations)


def install() -> bool:
    """Put the stand-ins in place (before vLLM is imported). Returns True if it did, False
    where the real extension is present or they are already installed."""
    global _installed
    if _installed or _has_real_extension():
        return False
    for name in STAND_INS[:2]:
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules.setdefault("vllm.vllm_flash_attn", _StandInPackage("vllm.vllm_flash_attn"))
    ns = torch.ops._C
    try:
        ns.cutlass_scaled_mm_supports_block_fp8
    except (AttributeError, RuntimeError):
        setattr(ns, "cutlass_scaled_mm_supports_block_fp8", lambda *a, **k: False)
    _installed = True
    return True
