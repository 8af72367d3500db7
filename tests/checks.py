"""The one element-wise check of multi-rank outputs against the single-process reference."""
from __future__ import annotations

from typing import Optional, Union

import torch

from moe_plugins.runner.demo import demo_inputs
from moe_plugins.layout import ParallelLayout
from moe_plugins.runner.model import MoEConfig, MoEWeights
from moe_plugins.quant import QuantSpec
from moe_plugins.runner.reference import reference_moe, tolerance_for


def assert_matches_reference(results: list[dict], layout: ParallelLayout, cfg: MoEConfig,
                             num_tokens: Union[int, list[int]], quant: QuantSpec = QuantSpec(),
                             seed: int = 0, weights: Optional[MoEWeights] = None,
                             ranks: Optional[list[int]] = None, key: str = "out") -> None:
    """results[rank][key] [num_tokens, hidden] (cfg.dtype) equals reference_moe on that rank's
    DP-group inputs (moe_plugins.runner.demo.demo_inputs) within moe_plugins.runner.reference.tolerance_for.
    ``num_tokens``: one count for every DP group, or one per DP group."""
    weights = weights or MoEWeights.random(cfg, seed)
    for rank in ranks if ranks is not None else range(len(results)):
        out = results[rank][key]
        dp = layout.dp_rank(rank)
        n = num_tokens if isinstance(num_tokens, int) else num_tokens[dp]
        ref = reference_moe(demo_inputs(cfg, n, dp, seed), weights, quant)
        atol, rtol = tolerance_for(ref, cfg.dtype)
        assert out.dtype == cfg.dtype and out.shape == (n, cfg.hidden), \
            f"rank {rank}: {out.dtype} {tuple(out.shape)}"
        torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol,
                                   msg=lambda m: f"rank {rank}: {m}")
