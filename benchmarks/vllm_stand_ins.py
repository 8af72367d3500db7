"""Import vLLM's Python (0.33 or 0.34) on a GPU machine that lacks vLLM's compiled extension.

On a GPU host with torch but without a compiled vLLM (the host's torch is not the one vLLM's
wheel was built for), vLLM's Python (the wheel without its ``.so`` files, as the offline kit of
tests/gpu/README.md holds it) imports after :func:`install` puts three stand-ins in place. Each
covers something a MoE layer never runs:

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


#: Only for the serving attempt (scripts/gpu/serve_attempt.sh), beyond the MoE layer: capability
#: queries vLLM's engine asks of its compiled ops while importing its worker, to pick linear
#: methods for quantized checkpoints. "Not supported" sends it to the non-CUTLASS paths; the
#: tiny bf16 checkpoint served there uses none of them.
SERVE_CAPABILITY_QUERIES = ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_fp4",
                            "mxfp4_experts_quant_supported", "cutlass_group_gemm_supported")


def install(capability_queries: tuple[str, ...] = ()) -> bool:
    """Put the stand-ins in place (before vLLM is imported), plus ``torch.ops._C`` capability
    queries named in ``capability_queries`` answering False. Returns True if it did, False
    where the real extension is present or they are already installed."""
    global _installed
    if _installed or _has_real_extension():
        return False
    for name in STAND_INS[:2]:
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules.setdefault("vllm.vllm_flash_attn", _StandInPackage("vllm.vllm_flash_attn"))
    ns = torch.ops._C
    for op in ("cutlass_scaled_mm_supports_block_fp8", *capability_queries):
        try:
            getattr(ns, op)
        except (AttributeError, RuntimeError):
            setattr(ns, op, lambda *a, **k: False)
    _installed = True
    return True
