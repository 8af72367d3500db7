"""A small link model: how long a transfer, an all-to-all or a TP collective takes on GPU nodes.

Two link kinds, each a bandwidth and a per-message latency: NVLink between GPUs of one node and
RDMA between nodes. Ranks ``[k * gpus_per_node, (k + 1) * gpus_per_node)`` share node ``k`` (the
order vLLM and torchrun place ranks in). Bandwidths are in GB/s (1e9 bytes/s) per GPU and
direction, latencies in microseconds.

Defaults, for H100/H200 SXM nodes (DGX/HGX, 8 GPUs):
- ``nvlink_gbps = 450``: NVLink 4, 18 links x 25 GB/s = 450 GB/s per direction (900 GB/s
  bidirectional). All-to-all kernels reach roughly 40-80% of it; pass a measured value.
- ``nvlink_latency_us = 3``: order of magnitude of one small NCCL/NVSHMEM step inside a node.
- ``rdma_gbps = 50``: one 400 Gb/s InfiniBand NDR / RoCE NIC per GPU (ConnectX-7).
- ``rdma_latency_us = 5``: order of magnitude of one small GPU-initiated RDMA message.

Only communication is modelled: no GEMM, no kernel launch, no overlap with the shared expert.
Self-sends are local copies and cost nothing here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["LinkModel"]


@dataclass(frozen=True)
class LinkModel:
    """Bandwidth (GB/s per GPU and direction) and latency (us) of NVLink and RDMA; see the module
    docstring for the defaults and where they come from."""

    nvlink_gbps: float = 450.0
    nvlink_latency_us: float = 3.0
    rdma_gbps: float = 50.0
    rdma_latency_us: float = 5.0
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name, low, unit in (("nvlink_gbps", "> 0", "GB/s"), ("rdma_gbps", "> 0", "GB/s"),
                                ("nvlink_latency_us", ">= 0", "us"),
                                ("rdma_latency_us", ">= 0", "us")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"LinkModel.{name} must be a number ({unit}), got {value!r} "
                                f"({type(value).__name__}); pass an int or float")
            if not math.isfinite(value) or not (value > 0 if low == "> 0" else value >= 0):
                raise ValueError(f"LinkModel.{name} must be {low} {unit} and finite, got "
                                 f"{value!r}; pass the link's measured value (the module "
                                 "docstring has the defaults' sources)")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int):
            raise TypeError(f"LinkModel.gpus_per_node must be an int, got "
                            f"{self.gpus_per_node!r} ({type(self.gpus_per_node).__name__})")
        if self.gpus_per_node < 1:
            raise ValueError(f"LinkModel.gpus_per_node must be >= 1, got {self.gpus_per_node}")

    def same_node(self, a: int, b: int) -> bool:
        return a // self.gpus_per_node == b // self.gpus_per_node

    def link(self, ranks: Sequence[int]) -> str:
        """'nvlink' when all ``ranks`` share a node, else 'rdma' (the slowest hop bounds a ring)."""
        nodes = {r // self.gpus_per_node for r in ranks}
        return "nvlink" if len(nodes) <= 1 else "rdma"

    def transfer_us(self, num_bytes: float, link: str) -> float:
        """One message of ``num_bytes`` over ``link`` ('nvlink' | 'rdma'); 0 for no bytes."""
        if num_bytes <= 0:
            return 0.0
        if link == "nvlink":
            return self.nvlink_latency_us + num_bytes / (self.nvlink_gbps * 1e3)
        return self.rdma_latency_us + num_bytes / (self.rdma_gbps * 1e3)

    def all_to_all_us(self, bytes_matrix: Sequence[Sequence[float]]) -> float:
        """``bytes_matrix[s][d]``: bytes rank s sends rank d. Each rank sends (and receives) over
        NVLink and RDMA at once; a rank is done when both its sends and its receives are; the
        all-to-all ends with the slowest rank."""
        n = len(bytes_matrix)
        worst = 0.0
        for r in range(n):
            for direction in ((bytes_matrix[r][d], d) for d in range(n)), \
                             ((bytes_matrix[s][r], s) for s in range(n)):
                nv = rd = 0.0
                for b, peer in direction:
                    if peer == r:
                        continue
                    if self.same_node(r, peer):
                        nv += b
                    else:
                        rd += b
                worst = max(worst, self.transfer_us(nv, "nvlink"), self.transfer_us(rd, "rdma"))
        return worst

    def all_reduce_us(self, num_bytes: float, ranks: Sequence[int]) -> float:
        """Ring all_reduce of a ``num_bytes`` tensor over ``ranks``: 2 (n - 1) steps of
        num_bytes / n each."""
        n = len(ranks)
        if n < 2 or num_bytes <= 0:
            return 0.0
        return 2 * (n - 1) * self.transfer_us(num_bytes / n, self.link(ranks))

    def all_gather_us(self, num_bytes: float, ranks: Sequence[int]) -> float:
        """Ring all_gather where each rank contributes ``num_bytes``: n - 1 steps."""
        n = len(ranks)
        if n < 2 or num_bytes <= 0:
            return 0.0
        return (n - 1) * self.transfer_us(num_bytes, self.link(ranks))

    def reduce_scatter_us(self, num_bytes: float, ranks: Sequence[int]) -> float:
        """Ring reduce_scatter of a ``num_bytes`` input over ``ranks``: n - 1 steps of
        num_bytes / n each (the first half of a ring all_reduce)."""
        n = len(ranks)
        if n < 2 or num_bytes <= 0:
            return 0.0
        return (n - 1) * self.transfer_us(num_bytes / n, self.link(ranks))

    def collective_us(self, kind: str, num_bytes: float, ranks: Sequence[int]) -> float:
        """Time of a ring ``kind`` ('all_reduce', 'all_gather', 'reduce_scatter'); ``num_bytes``
        as :meth:`ring_wire_bytes` takes it."""
        fns = {"all_reduce": self.all_reduce_us, "all_gather": self.all_gather_us,
               "reduce_scatter": self.reduce_scatter_us}
        if kind not in fns:
            raise ValueError(f"unknown collective {kind!r}; expected one of {sorted(fns)}")
        return fns[kind](num_bytes, ranks)

    @staticmethod
    def ring_wire_bytes(kind: str, num_bytes: int, n: int) -> int:
        """Bytes one rank sends in a ring ``kind`` over n ranks: 'all_reduce' of a ``num_bytes``
        tensor, 'reduce_scatter' of a ``num_bytes`` input, or 'all_gather' contributing
        ``num_bytes``."""
        if n < 2:
            return 0
        if kind == "all_reduce":
            return 2 * (n - 1) * num_bytes // n
        if kind == "reduce_scatter":
            return (n - 1) * num_bytes // n
        return (n - 1) * num_bytes
