"""The published measurements the time model was fitted on, and its residual on each.

Every row is from DeepEP V1's README (deepseek-ai/DeepEP, the tables "Normal kernels with
NVLink and RDMA forwarding" and "Low-latency kernels with pure RDMA"): H800, one ConnectX-7
400 Gb/s NIC per GPU, hidden 7168, top-8 of 256 experts, FP8 dispatch, BF16 combine. Nothing
else was fitted. The low-latency rows are times (128 tokens per rank). The normal-mode rows
are bandwidths at 4096 tokens per rank, turned into times the way DeepEP's tests count bytes:
intranode, every received (token, rank) row (the rank's own included); internode, every
(token, node) row sent over RDMA (the own node included); each row hidden x (1 + 4/128) bytes
in FP8 and hidden x 2 in BF16, with uniform routing's expected rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_plugins.layout import ParallelLayout
from moe_plugins.planner.link_model import LinkModel
from moe_plugins.planner.plan import plan_layer
from moe_plugins.planner.presets import LINK_PRESETS
from moe_plugins.planner.traffic import expected_ranks_hit
from moe_plugins.quant import QuantScheme, QuantSpec
from moe_plugins.registry import get_backend
from moe_plugins.config import MoEConfig

__all__ = ["CalibrationRow", "CALIBRATION_ROWS", "CALIBRATION_MODEL", "predict_us",
           "published_us", "residuals"]

#: The published tests' layer: hidden 7168, 256 experts, top-8 (DeepSeek-V3's MoE).
CALIBRATION_MODEL = MoEConfig(hidden=7168, num_experts=256, num_topk=8, intermediate=2048,
                              shared_intermediate=0, dtype=torch.bfloat16)


@dataclass(frozen=True)
class CalibrationRow:
    """One published figure: ``backend`` at EP ``ep`` with ``tokens`` per rank, ``phase``
    'dispatch' or 'combine'; ``value`` in ``unit`` ('us', or 'GB/s' as DeepEP counts it)."""

    backend: str
    ep: int
    tokens: int
    phase: str
    value: float
    unit: str

    @property
    def label(self) -> str:
        mode = "low-latency" if self.backend == "deepep_ll" else (
            "normal, intranode" if self.ep <= 8 else "normal, internode")
        return f"{mode} EP {self.ep} {self.phase}"


# EP -> (dispatch, combine), as the README's tables give them
_LOW_LATENCY_US = {8: (77.0, 114.0), 16: (118.0, 195.0), 32: (155.0, 273.0)}  # 128 tokens/rank
_NORMAL_GBPS = {8: (153.0, 158.0), 16: (43.0, 43.0), 32: (58.0, 57.0)}  # 4096 tokens/rank

CALIBRATION_ROWS: tuple[CalibrationRow, ...] = tuple(
    CalibrationRow(backend, ep, tokens, phase, value, unit)
    for backend, tokens, unit, table in (("deepep_ll", 128, "us", _LOW_LATENCY_US),
                                         ("deepep_ht", 4096, "GB/s", _NORMAL_GBPS))
    for ep, values in table.items()
    for phase, value in zip(("dispatch", "combine"), values))


def published_us(row: CalibrationRow, gpus_per_node: int = 8) -> float:
    """The published figure as a time (us); bandwidths are converted as the module docstring
    says."""
    if row.unit == "us":
        return row.value
    m = CALIBRATION_MODEL
    row_bytes = m.hidden * (1 + 4 / 128) if row.phase == "dispatch" else m.hidden * 2
    nodes = -(-row.ep // gpus_per_node)
    # intranode: (token, rank) rows received; internode: (token, node) rows sent over RDMA
    hits = float(expected_ranks_hit(m.num_experts, m.num_topk, row.ep if nodes == 1 else nodes))
    return row.tokens * hits * row_bytes / (row.value * 1e3)


def predict_us(row: CalibrationRow, link: LinkModel = LINK_PRESETS["h800-cx7"]) -> float:
    """The model's busiest-rank time (us) for ``row``'s set-up, through :func:`plan_layer`."""
    plan = plan_layer(CALIBRATION_MODEL, ParallelLayout(row.ep, 1, True), row.tokens,
                      get_backend(row.backend), QuantSpec(QuantScheme.FP8_BLOCK128), link=link)
    t = plan.recommended.time
    return t.dispatch_us if row.phase == "dispatch" else t.combine_us


def residuals(link: LinkModel = LINK_PRESETS["h800-cx7"]) -> list[tuple[CalibrationRow, float,
                                                                         float, float]]:
    """(row, published us, predicted us, relative residual) for every calibration row."""
    out = []
    for row in CALIBRATION_ROWS:
        pub, pred = published_us(row, link.gpus_per_node), predict_us(row, link)
        out.append((row, pub, pred, pred / pub - 1))
    return out
