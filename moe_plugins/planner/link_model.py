"""The links of a GPU system and how long a transfer or a ring TP collective takes on them
(the all-to-alls are timed per transport by :mod:`moe_plugins.planner.transport_time`).

Two link kinds, each a bandwidth and a per-message latency: NVLink between GPUs of one node and
RDMA between nodes. Ranks ``[k * gpus_per_node, (k + 1) * gpus_per_node)`` share node ``k`` (the
order vLLM and torchrun place ranks in). Bandwidths are in GB/s (1e9 bytes/s) per GPU and
direction, latencies in microseconds.

Defaults, for H100/H200 SXM nodes (DGX/HGX, 8 GPUs):
- ``nvlink_gbps = 450``: NVLink 4, 18 links x 25 GB/s = 450 GB/s per direction (900 GB/s
  bidirectional). The time model scales it by fitted efficiencies.
- ``nvlink_latency_us = 3``: order of magnitude of one small NCCL/NVSHMEM step inside a node.
- ``rdma_gbps = 50``: one 400 Gb/s InfiniBand NDR / RoCE NIC per GPU (ConnectX-7).
- ``rdma_latency_us = 5``: order of magnitude of one small GPU-initiated RDMA message.

Three settings shape the all-to-all time model (:mod:`moe_plugins.planner.transport_time`):
- ``ll_nvlink``: low-latency kernels may send to ranks of their own node over NVLink (DeepEP's
  ``allow_nvlink_for_low_latency_mode``, on by default); off, every message goes through the NIC.
- ``sms``: SMs DeepEP's normal mode copies with (DeepEP V1's ``Buffer.num_sms``, 20 by default).
- ``nodes``: how many nodes the system has (None: as many as a layout needs).

Named sets of these values for common systems are in :mod:`moe_plugins.planner.presets`.

Only communication is modelled: no GEMM, no kernel launch, no overlap with the shared expert.
Self-sends are local copies and cost nothing here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

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
    ll_nvlink: bool = True
    sms: int = 20
    nodes: Optional[int] = None
    name: str = ""  # the preset these values come from, if any

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
        if not isinstance(self.ll_nvlink, bool):
            raise TypeError(f"LinkModel.ll_nvlink must be a bool, got {self.ll_nvlink!r} "
                            f"({type(self.ll_nvlink).__name__})")
        for name in ("sms", "nodes"):
            value = getattr(self, name)
            if value is None and name == "nodes":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"LinkModel.{name} must be an int, got {value!r} "
                                f"({type(value).__name__})")
            if value < 1:
                raise ValueError(f"LinkModel.{name} must be >= 1, got {value}")

    def node(self, rank: int) -> int:
        """The node rank ``rank`` sits on."""
        return rank // self.gpus_per_node

    def check_fits(self, num_ranks: int) -> None:
        """ValueError when ``num_ranks`` GPUs need more nodes than the system has."""
        need = -(-num_ranks // self.gpus_per_node)
        if self.nodes is not None and need > self.nodes:
            system = f"preset {self.name!r}" if self.name else "this link model"
            raise ValueError(f"{num_ranks} ranks need {need} nodes of {self.gpus_per_node} GPUs; "
                             f"{system} has {self.nodes}; pick a layout of at most "
                             f"{self.nodes * self.gpus_per_node} ranks or a multi-node preset")

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
