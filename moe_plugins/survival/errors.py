"""The errors of a layer that continues after an EP peer's loss (docs/faults.md, "When a peer
dies: continuing")."""
from __future__ import annotations

from moe_plugins.faults import LayerBrokenError, PeerMaskedError

__all__ = ["PeerLostError", "ExpertsLostError", "RankEvictedError"]


class PeerLostError(PeerMaskedError):
    """Retryable: EP peers were lost (died, or did not answer within the detection time) during
    this call. Its result is not returned; every survivor masked them, re-homed their experts
    to surviving replicas and continues on a group of the survivors: call again (the next call
    is exact). ``lost_ranks``: the EP ranks lost; ``lost_experts``: logical experts left without
    any replica (empty unless degraded mode is on)."""

    retryable = True

    def __init__(self, message: str, lost_ranks: tuple[int, ...],
                 lost_experts: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.lost_ranks, self.lost_experts = lost_ranks, lost_experts


class ExpertsLostError(PeerMaskedError):
    """Not retryable: EP peers were lost and some logical expert had no replica on a survivor,
    so no later call could be exact; the layer stops (every later call raises
    :class:`moe_plugins.faults.LayerBrokenError`). ``lost_experts`` names them."""

    retryable = False

    def __init__(self, message: str, lost_ranks: tuple[int, ...],
                 lost_experts: tuple[int, ...]) -> None:
        super().__init__(message)
        self.lost_ranks, self.lost_experts = lost_ranks, lost_experts


class RankEvictedError(LayerBrokenError):
    """This rank's peers declared it lost (it did not answer within their detection time: a
    stopped or starved process) and continue without it; it must not send to them again, so
    its layers on that group never run again."""
