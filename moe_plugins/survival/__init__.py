"""Continuing after an EP peer's loss: detection (peer_watch), re-homing (rehoming), the
layer's side (continuation) and its errors (errors). docs/faults.md says what a user gets."""
from moe_plugins.survival.continuation import PeerLossOptions
from moe_plugins.survival.errors import ExpertsLostError, PeerLostError, RankEvictedError

__all__ = ["PeerLossOptions", "PeerLostError", "ExpertsLostError", "RankEvictedError"]
