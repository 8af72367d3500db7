"""What a layer really did: dispatch traffic per rank and TP collectives, counted where they happen."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["DispatchStats", "CollectiveRecord", "CollectiveLog", "tensor_bytes", "host_count"]


def tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def host_count(t: torch.Tensor) -> int | None:
    """A device scalar as a count for the stats, or None on a GPU: reading it would stall the
    stream on every call (and cannot happen during CUDA-graph capture), so on CUDA only what the
    host knows without a read is counted."""
    if t.is_cuda:
        return None
    return int(t)


@dataclass
class DispatchStats:
    """Sent by this rank, summed over calls (self-sends included: they cross the same all-to-all).

    pairs: (token, expert) pairs dispatched (== tokens given to prepare x num_topk).
    rows: rows sent (a token goes once to each rank holding one of its experts, or once per
        pair for per-expert layouts such as DeepEP LL).
    act_bytes / sf_bytes / meta_bytes: dispatch payload (activations, x_sf, topk ids+weights).
    combine_bytes: expert outputs sent back in combine.
    modes (an attribute, not a field: ``asdict`` keeps the byte and row counts only): calls per
        transport mode, for backends that pick one per call (deepep_auto: ``low_latency`` /
        ``normal``); empty for the others.
    A backend whose row counts exist only on the GPU leaves rows and bytes uncounted there rather
    than read them back (a device-to-host read per call would stall the stream); calls and pairs
    are always counted.
    """

    calls: int = 0
    pairs: int = 0
    rows: int = 0
    act_bytes: int = 0
    sf_bytes: int = 0
    meta_bytes: int = 0
    combine_bytes: int = 0

    def __post_init__(self) -> None:
        self.modes: dict[str, int] = {}

    @property
    def dispatch_bytes(self) -> int:
        return self.act_bytes + self.sf_bytes + self.meta_bytes

    @classmethod
    def total(cls, parts: "list[DispatchStats]") -> "DispatchStats":
        """The field-wise sum of ``parts`` (e.g. one backend object per micro-batch)."""
        return cls(**{name: sum(getattr(p, name) for p in parts)
                      for name in cls.__dataclass_fields__})

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)
        self.modes = {}


@dataclass(frozen=True)
class CollectiveRecord:
    """One TP collective: kind ('all_reduce' | 'all_gather') and the bytes this rank contributed."""

    kind: str
    bytes: int


@dataclass
class CollectiveLog:
    records: list[CollectiveRecord] = field(default_factory=list)

    def add(self, kind: str, t: torch.Tensor) -> None:
        self.records.append(CollectiveRecord(kind, tensor_bytes(t)))

    def reset(self) -> None:
        self.records.clear()
