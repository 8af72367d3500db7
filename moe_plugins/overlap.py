"""Shared-expert overlap: one side stream per device, fork / join, and the switches.

The shared expert runs on a side stream while the routed path (dispatch, experts, combine) runs
on the current stream. ``launch_shared`` forks (the side stream waits on the current one) and
returns a :class:`SharedExpertHandle` holding the output and its ready event; ``join`` makes the
current stream wait for it. Every finalize joins through :func:`join` before it touches the
shared-expert buffer, even when its rank owns no rows.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "OverlapConfig", "SharedExpertHandle", "side_stream", "clear_side_streams",
    "launch_shared", "join", "overlap_off_reason",
]

# One side stream per device. Created before any CUDA-graph capture (a stream made during capture
# would not be the one replays use); cleared only through clear_side_streams().
_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}
_WARNED: set[str] = set()


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    if raw.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if raw.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


@dataclass(frozen=True)
class OverlapConfig:
    """The switches, each separate.

    single_collective (env ``MOE_PLUGINS_SINGLE_COLLECTIVE``, default on): allow
        ROW_SCATTER_ALLREDUCE, one TP collective instead of two.
    overlap (``MOE_PLUGINS_OVERLAP``, default on): run the shared expert on a side stream.
    overlap_max_tokens (``MOE_PLUGINS_OVERLAP_MAX_TOKENS``, default 1024): above this many tokens
        per call the shared expert runs inline. The default is the largest size the H200
        benchmark measured a gain at (benchmarks/results/overlap_h200.json: 0.7-1.4% at 1024
        tokens); above it the shared expert is a small, unmeasured share of the layer and the
        side stream only holds memory longer.
    """

    single_collective: bool = True
    overlap: bool = True
    overlap_max_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.overlap_max_tokens < 0:
            raise ValueError(
                f"overlap_max_tokens must be >= 0, got {self.overlap_max_tokens}; "
                "use overlap=False to turn overlap off"
            )

    @classmethod
    def from_env(cls, **overrides: object) -> "OverlapConfig":
        """Env first, then explicit overrides (the engine config the vLLM glue passes)."""
        values: dict[str, object] = {
            "single_collective": _env_flag("MOE_PLUGINS_SINGLE_COLLECTIVE", cls.single_collective),
            "overlap": _env_flag("MOE_PLUGINS_OVERLAP", cls.overlap),
            "overlap_max_tokens": int(
                os.environ.get("MOE_PLUGINS_OVERLAP_MAX_TOKENS", cls.overlap_max_tokens)),
        }
        unknown = set(overrides) - set(values)
        if unknown:
            raise ValueError(f"unknown overlap settings {sorted(unknown)}; known: {sorted(values)}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The side stream of ``device`` (created once, reused by every layer and graph)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = torch.cuda.Stream(device=index)
        _SIDE_STREAMS[index] = stream
    return stream


def clear_side_streams() -> None:
    """Forget the cached side streams (tests, or an engine that tears the device down)."""
    _SIDE_STREAMS.clear()


def overlap_off_reason(config: OverlapConfig, device: torch.device, num_tokens: int) -> str | None:
    """Why the shared expert runs inline for this call, or None when it overlaps."""
    if not config.overlap:
        return "disabled by configuration (MOE_PLUGINS_OVERLAP=0 or engine config)"
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"no CUDA device (activations on {device.type})"
    if num_tokens > config.overlap_max_tokens:
        return f"{num_tokens} tokens > overlap_max_tokens={config.overlap_max_tokens}"
    return None


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)


@dataclass
class SharedExpertHandle:
    """The shared expert's output and when it is ready. Holding the buffer means holding its event.

    output: [num_tokens, hidden] in the activation dtype (None when the layer has no shared expert).
    event: recorded on the side stream after the shared expert; None when it ran inline.
    """

    output: torch.Tensor | None
    event: "torch.cuda.Event | None" = None
    joined: bool = False

    def __post_init__(self) -> None:
        if self.event is None:
            self.joined = True  # ran inline: nothing to wait for

    @property
    def overlapped(self) -> bool:
        return self.event is not None


def launch_shared(
    fn: Callable[[torch.Tensor], torch.Tensor] | None,
    x: torch.Tensor,
    config: OverlapConfig,
) -> SharedExpertHandle:
    """Fork: run ``fn(x)`` (x [num_tokens, hidden]) on the side stream, or inline when overlap is off.

    Requested overlap that cannot run logs one WARNING (per reason), never silently.
    """
    if fn is None:
        return SharedExpertHandle(output=None)
    reason = overlap_off_reason(config, x.device, x.shape[0])
    if reason is not None:
        if config.overlap and not reason.startswith(f"{x.shape[0]} tokens"):
            _warn_once(reason, f"shared-expert overlap was requested but is off: {reason}; "
                               "the shared expert runs inline")
        return SharedExpertHandle(output=fn(x))
    main = torch.cuda.current_stream(x.device)
    side = side_stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn(x)
        event = torch.cuda.Event()
        event.record(side)
    # x is read on the side stream, out is read on the main stream after the join: tell the
    # caching allocator so neither block is reused before its reader is done.
    x.record_stream(side)
    out.record_stream(main)
    return SharedExpertHandle(output=out, event=event)


def join(handle: SharedExpertHandle) -> torch.Tensor | None:
    """Make the current stream wait for the shared expert; idempotent. Returns its output."""
    if not handle.joined:
        assert handle.event is not None
        handle.event.wait()  # the current stream waits; the host does not block
        handle.joined = True
    return handle.output
