"""Read a MoE model's shape from a Hugging Face-style ``config.json``.

Two families are understood, told apart by the routed-expert field:

- DeepSeek-V2/V3 (``n_routed_experts``): hidden_size, n_routed_experts, num_experts_per_tok,
  moe_intermediate_size, n_shared_experts (shared expert = n_shared_experts x
  moe_intermediate_size, no gate), num_hidden_layers, first_k_dense_replace (optional
  moe_layer_freq), torch_dtype.
- Qwen2-MoE / Qwen3-MoE (``num_experts``): hidden_size, num_experts, num_experts_per_tok,
  moe_intermediate_size, shared_expert_intermediate_size (with a sigmoid gate; Qwen3-MoE has no
  shared expert and may leave it out), num_hidden_layers (optional decoder_sparse_step,
  mlp_only_layers), torch_dtype.

Newer transformers write ``dtype`` instead of ``torch_dtype``; both are read. A multimodal config
whose language model sits under ``text_config`` is read from there.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from moe_plugins.config import MoEConfig

__all__ = ["ModelSpec", "load_model_config", "model_spec_from_dict", "HF_DTYPES",
           "SP_ATTENTION_REDUCTIONS"]

HF_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
}


#: The attention's TP reduction under sequence parallelism, by how vLLM 0.32 builds the family:
#: DeepSeek-V2/V3 reduce_scatter the attention output to the owned chunk (``o_proj`` with
#: ``reduce_results=not use_sequence_parallel_moe``) and all_gather before the next attention;
#: Qwen3-MoE (and Llama-4) keep the attention's all_reduce, take the owned chunk locally
#: (``sequence_parallel_chunk``) and all_gather after the MoE.
SP_ATTENTION_REDUCTIONS = ("reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class ModelSpec:
    """One MoE layer's shape (``moe``), how many MoE layers the model has, where it came from,
    and the attention's TP reduction under SP (``sp_attention``, one of
    :data:`SP_ATTENTION_REDUCTIONS`; the docs/design.md model, reduce_scatter, by default)."""

    moe: MoEConfig
    num_moe_layers: int = 1
    name: str = ""
    sp_attention: str = "reduce_scatter"

    def __post_init__(self) -> None:
        if self.sp_attention not in SP_ATTENTION_REDUCTIONS:
            raise ValueError(f"sp_attention must be one of {list(SP_ATTENTION_REDUCTIONS)}, got "
                             f"{self.sp_attention!r}")


class _Fields:
    """Typed access to a config dict; every error names the file and the field."""

    def __init__(self, data: Mapping[str, Any], source: str, family: str):
        self.data, self.source, self.family = data, source, family

    def _fail(self, field: str, got: str, expected: str) -> ValueError:
        return ValueError(f"model config {self.source}: field '{field}' {got}, expected {expected} "
                          f"({self.family} layout); fix the field in the file")

    def int(self, field: str, minimum: int = 1, default: int | None = None) -> int:
        if field not in self.data:
            if default is not None:
                return default
            raise self._fail(field, "is missing", f"an integer >= {minimum}")
        v = self.data[field]
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self._fail(field, f"is {v!r}", f"an integer >= {minimum}")
        return v

    def topk(self, experts_field: str) -> int:
        experts = self.int(experts_field)
        topk = self.int("num_experts_per_tok")
        if topk > experts:
            raise self._fail("num_experts_per_tok", f"is {topk}",
                             f"at most {experts_field}={experts}")
        return topk

    def int_list(self, field: str) -> list[int]:
        v = self.data.get(field, [])
        if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                              for i in v):
            raise self._fail(field, f"is {v!r}", "a list of layer indices")
        return v

    def dtype(self) -> torch.dtype:
        field = "torch_dtype" if "torch_dtype" in self.data or "dtype" not in self.data else "dtype"
        if field not in self.data:
            raise self._fail("torch_dtype", "is missing", f"one of {sorted(HF_DTYPES)}")
        v = self.data[field]
        if not isinstance(v, str) or v not in HF_DTYPES:
            raise self._fail(field, f"is {v!r}", f"one of {sorted(HF_DTYPES)}")
        return HF_DTYPES[v]


def _deepseek(f: _Fields) -> tuple[MoEConfig, int]:
    num_layers = f.int("num_hidden_layers")
    first_dense = f.int("first_k_dense_replace", minimum=0)
    freq = f.int("moe_layer_freq", default=1)
    inter = f.int("moe_intermediate_size")
    cfg = MoEConfig(hidden=f.int("hidden_size"), num_experts=f.int("n_routed_experts"),
                    num_topk=f.topk("n_routed_experts"), intermediate=inter,
                    shared_intermediate=f.int("n_shared_experts", minimum=0) * inter,
                    shared_gate=False, renormalize=bool(f.data.get("norm_topk_prob", True)),
                    dtype=f.dtype())
    return cfg, sum(1 for i in range(num_layers) if i >= first_dense and i % freq == 0)


def _qwen(f: _Fields) -> tuple[MoEConfig, int]:
    num_layers = f.int("num_hidden_layers")
    step = f.int("decoder_sparse_step", default=1)
    dense = set(f.int_list("mlp_only_layers"))
    # Qwen3-MoE has no shared expert; for every other Qwen-style config the field is required,
    # so a typo cannot silently drop the shared expert from the plan.
    shared_default = 0 if f.data.get("model_type") == "qwen3_moe" else None
    shared = f.int("shared_expert_intermediate_size", minimum=0, default=shared_default)
    cfg = MoEConfig(hidden=f.int("hidden_size"), num_experts=f.int("num_experts"),
                    num_topk=f.topk("num_experts"),
                    intermediate=f.int("moe_intermediate_size"), shared_intermediate=shared,
                    shared_gate=shared > 0, renormalize=bool(f.data.get("norm_topk_prob", False)),
                    dtype=f.dtype())
    return cfg, sum(1 for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def model_spec_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> ModelSpec:
    """A :class:`ModelSpec` from a parsed config; ValueError naming the field when one is missing
    or wrong."""
    if not isinstance(data, Mapping):
        raise ValueError(f"model config {source}: expected a JSON object, got {type(data).__name__}")
    if ("n_routed_experts" not in data and "num_experts" not in data
            and isinstance(data.get("text_config"), Mapping)):
        data = data["text_config"]
    if "n_routed_experts" in data:
        f = _Fields(data, source, "DeepSeek-V2/V3")
        (cfg, layers), sp_attention = _deepseek(f), "reduce_scatter"
    elif "num_experts" in data:
        f = _Fields(data, source, "Qwen2/3-MoE")
        (cfg, layers), sp_attention = _qwen(f), "all_reduce"
    else:
        raise ValueError(
            f"model config {source}: neither field 'n_routed_experts' (DeepSeek-V2/V3) nor "
            "'num_experts' (Qwen2/3-MoE) is present; this is not a MoE config moe-plugins can read "
            "(pass the shape with --hidden/--experts/--topk/... instead)")
    if layers < 1:
        raise f._fail("num_hidden_layers", "leaves no MoE layer",
                      "at least one layer past the dense ones")
    name = str(data.get("_name_or_path") or data.get("model_type") or source)
    return ModelSpec(cfg, layers, name, sp_attention)


def load_model_config(path: str | Path) -> ModelSpec:
    """Read ``path`` (a Hugging Face ``config.json``); see the module docstring for the fields."""
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise ValueError(f"cannot read model config {p}: {e.strerror or e}; pass the path of a "
                         "Hugging Face config.json") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"model config {p} is not a UTF-8 text file (byte "
                         f"{e.object[e.start]:#04x} at offset {e.start}); pass the path of a "
                         "Hugging Face config.json") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"model config {p} is not valid JSON: {e}; pass the path of a Hugging "
                         "Face config.json") from None
    except RecursionError:
        raise ValueError(f"model config {p} nests too deeply to parse; pass the path of a Hugging "
                         "Face config.json") from None
    return model_spec_from_dict(data, str(p))
