"""The published measurements the time model is fitted on and checked against, each with its
source, turned into times the way DeepEP counts bytes; and the model's residual on each.

Every row is from DeepEP V1's README at commit 567632d (deepseek-ai/DeepEP, section
"Performance"): H800, one ConnectX-7 400 Gb/s InfiniBand NIC per GPU, hidden 7168, top-8
experts, FP8 dispatch, BF16 combine. The low-latency rows are times at 128 tokens per rank;
EP 8, 16 and 32 are fitted (:mod:`moe_plugins.planner.fit`), EP 64, 128 and 256 are not (they
check the model away from its fit). The normal-mode rows are bandwidths at 4096 tokens per rank
(EP 8 intranode, EP 16 and 32 internode, all fitted), turned into times by
:func:`published_us` with DeepEP's own byte counting. The README's internode EP 64 row is not
used: DeepEP's test routes it to 4 of the 8 nodes (``num_topk_groups = min(num_nodes, 4)``),
routing the model does not count; at 2 and 4 nodes that limit keeps every node.

DeepEP's byte counting, read from its tests at 567632d and written here without the model's
traffic code (so an error there cannot cancel in the comparison):

- ``tests/test_intranode.py``: bandwidth = rank 0's received bytes / time, the received rows
  being ``recv_x`` (one row per (token, rank 0) pair of every rank's tokens, rank 0's own
  included), ``hidden x 2`` bytes each, times ``fp8_factor = (1 + 4/128) / 2`` for FP8.
- ``tests/test_internode.py``: bandwidth = rank 0's RDMA bytes / time, the rows being
  ``num_rdma_token_sent`` (one per (token, node) pair of rank 0's tokens, its own node
  included), ``hidden x 2`` bytes each, ``fp8_factor`` for FP8; the combine counts the same rows
  in BF16.
- Routing: each token's top-k of ``randn().abs() + 1`` scores over all experts, so its experts
  are a uniform draw of k distinct ones; a block of ``b`` of the ``E`` experts (a rank's, a
  node's) is missed with probability ``prod_{i<k} (E - b - i) / (E - i)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from moe_plugins.config import MoEConfig
from moe_plugins.layout import ParallelLayout
from moe_plugins.planner.link_model import LinkModel
from moe_plugins.planner.plan import plan_layer
from moe_plugins.planner.presets import LINK_PRESETS
from moe_plugins.quant import QuantScheme, QuantSpec
from moe_plugins.registry import get_backend

__all__ = ["PublishedRow", "PUBLISHED_ROWS", "FITTED_ROWS", "CHECK_ROWS", "CALIBRATION_MODEL",
           "CALIBRATION_QUANT", "published_us", "predict_us", "residuals"]

#: The published tests' layer: hidden 7168, 256 experts, top-8 (DeepSeek-V3's MoE; DeepEP's
#: normal-mode tests default to 256 experts; its low-latency test to 288, which changes no
#: low-latency time: one message per (token, expert) pair, spread evenly over the ranks).
CALIBRATION_MODEL = MoEConfig(hidden=7168, num_experts=256, num_topk=8, intermediate=2048,
                              shared_intermediate=0, dtype=torch.bfloat16)
#: FP8 dispatch (block-128 scales), BF16 combine.
CALIBRATION_QUANT = QuantSpec(QuantScheme.FP8_BLOCK128)

_README = "deepseek-ai/DeepEP README.md at 567632d, Performance"
_LL_TABLE = f"{_README}, 'Low-latency kernels with pure RDMA' (128 tokens per batch)"
_NORMAL_TABLE = (f"{_README}, 'Normal kernels with NVLink and RDMA forwarding' (4096 tokens per "
                 "batch)")


@dataclass(frozen=True)
class PublishedRow:
    """One published figure: ``backend`` (the transport it measured) at EP ``ep`` with
    ``tokens`` per rank, ``phase`` 'dispatch' or 'combine'; ``value`` in ``unit`` ('us', or
    'GB/s' as DeepEP counts it); ``source`` names the table and row; ``fitted``: the fit uses
    it (else it checks the model)."""

    backend: str
    ep: int
    tokens: int
    phase: str
    value: float
    unit: str
    source: str
    fitted: bool

    @property
    def label(self) -> str:
        mode = "low-latency" if self.backend == "deepep_ll" else (
            "normal, intranode" if self.ep <= 8 else "normal, internode")
        return f"{mode} EP {self.ep} {self.phase}"


def _ll(ep: int, dispatch_us: float, combine_us: float, fitted: bool) -> list[PublishedRow]:
    return [PublishedRow("deepep_ll", ep, 128, phase, value, "us",
                         f"{_LL_TABLE}, row #EP {ep}, {phase} latency", fitted)
            for phase, value in (("dispatch", dispatch_us), ("combine", combine_us))]


def _normal(ep: int, dispatch_gbps: float, combine_gbps: float) -> list[PublishedRow]:
    kind = "Intranode" if ep <= 8 else "Internode"
    return [PublishedRow("deepep_ht", ep, 4096, phase, value, "GB/s",
                         f"{_NORMAL_TABLE}, row {kind} #EP {ep}, {phase} bottleneck bandwidth",
                         True)
            for phase, value in (("dispatch", dispatch_gbps), ("combine", combine_gbps))]


#: Every published row the planner uses, as the README gives them.
PUBLISHED_ROWS: tuple[PublishedRow, ...] = tuple(
    _ll(8, 77, 114, True) + _ll(16, 118, 195, True) + _ll(32, 155, 273, True)
    + _ll(64, 173, 314, False) + _ll(128, 192, 369, False) + _ll(256, 194, 360, False)
    + _normal(8, 153, 158) + _normal(16, 43, 43) + _normal(32, 58, 57))
FITTED_ROWS = tuple(r for r in PUBLISHED_ROWS if r.fitted)
CHECK_ROWS = tuple(r for r in PUBLISHED_ROWS if not r.fitted)


def _hit(num_experts: int, block: int, num_topk: int) -> Fraction:
    """Probability that a token's ``num_topk`` distinct uniform experts touch a given block of
    ``block`` experts."""
    miss = Fraction(1)
    for i in range(num_topk):
        miss *= Fraction(num_experts - block - i, num_experts - i)
    return 1 - miss


def published_us(row: PublishedRow, gpus_per_node: int = 8) -> float:
    """The published figure as a time (us): a latency as given; a bandwidth converted with the
    bytes DeepEP's test divided by the time (module doc)."""
    if row.unit == "us":
        return row.value
    m = CALIBRATION_MODEL
    row_bytes = m.hidden * 2 * (Fraction(1 + Fraction(4, 128), 2) if row.phase == "dispatch"
                                else 1)
    nodes = -(-row.ep // gpus_per_node)
    if nodes == 1:  # rank 0's received rows: every rank's tokens that touch rank 0
        rows = row.ep * row.tokens * _hit(m.num_experts, m.num_experts // row.ep, m.num_topk)
    else:  # rank 0's RDMA rows: its tokens times the nodes they touch, its own included
        rows = row.tokens * nodes * _hit(m.num_experts, m.num_experts // nodes, m.num_topk)
    return float(rows * row_bytes) / (row.value * 1e3)


def predict_us(row: PublishedRow, link: LinkModel = LINK_PRESETS["h800-cx7"]) -> float:
    """The model's busiest-rank time (us) for ``row``'s set-up, through :func:`plan_layer`."""
    plan = plan_layer(CALIBRATION_MODEL, ParallelLayout(row.ep, 1, True), row.tokens,
                      get_backend(row.backend), CALIBRATION_QUANT, link=link)
    t = plan.recommended.time
    return t.dispatch_us if row.phase == "dispatch" else t.combine_us


def residuals(rows: tuple[PublishedRow, ...] = FITTED_ROWS,
              link: LinkModel = LINK_PRESETS["h800-cx7"]
              ) -> list[tuple[PublishedRow, float, float, float]]:
    """(row, published us, predicted us, relative residual) for each of ``rows``."""
    out = []
    for row in rows:
        pub, pred = published_us(row, link.gpus_per_node), predict_us(row, link)
        out.append((row, pub, pred, pred / pub - 1))
    return out
