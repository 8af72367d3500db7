"""The guards and imports every vLLM-on-CUDA test module shares: skip the module cleanly without
a GPU, DeepEP's V1 build or vLLM 0.33's Python; install the stand-ins for vLLM's compiled
extension first (benchmarks/vllm_stand_ins.py); return the harness, benchmarks/vllm_cuda_layer.py.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]


def load() -> ModuleType:
    """benchmarks/vllm_cuda_layer.py, imported; call at module level (it skips the module)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU", allow_module_level=True)
    pytest.importorskip("deep_ep", reason="needs DeepEP's V1 line built from source")
    if str(_ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(_ROOT / "benchmarks"))
    import vllm_stand_ins

    vllm_stand_ins.install()
    pytest.importorskip("vllm", reason="needs vLLM 0.33's Python (scripts/gpu/h200.sh installs it)")
    import vllm_cuda_layer

    return vllm_cuda_layer


def spec(fp8: bool = False) -> object:
    """The layer the vLLM-on-CUDA tests build: small experts keep the float32 reference fast;
    hidden 7168 and top-8 as DeepSeek-V3."""
    return load().LayerSpec(num_experts=32, intermediate=256, shared_intermediate=512, fp8=fp8)


def layers(fp8: bool, dbo: bool = False) -> Iterator[object]:
    """A module fixture's body: both sides (ours, in-tree) of :func:`spec`, torn down after."""
    with load().vllm_layers(spec(fp8), dbo=dbo) as built:
        yield built
