"""The call bound under vLLM, per forward step (:func:`moe_plugins.callbound.watchdog.watch_step`): every
forward pass vLLM runs, eager, through piecewise CUDA graphs or as a full-graph replay, is watched
as one step from its launch on the host to the completion on the GPU of what it enqueued. So the
replays of captured decode steps are bounded (the host runs none of our code during a replay),
and the layer calls of an eager step share the step's one completion mark.

Two hook points, rows of the table in :mod:`moe_plugins.vllm.patches`:

- ``set_forward_context``, vLLM's context around each forward pass: the model runners' steps
  (Model Runner V1 replays its full graphs inside it), the profile and warm-up runs, the
  drafters. Rebound also in the modules that imported it by name.
- ``CudaGraphManager.run_fullgraph``: Model Runner V2 replays a full graph outside that context.

Both pass every call through; the window watches nothing where no layer of ours holds a bound
(another ``--all2all-backend``, or the bound off), nothing during a capture, and nothing inside
another window of the same thread.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from moe_plugins.vllm.patching import (_APPLIED, Patch, _rebind, _rebind_importers,
                                       check_signature, resolve)
from moe_plugins.callbound import replays_in_step_windows, watch_step

__all__ = ["FORWARD_CONTEXT", "FULL_GRAPH_REPLAY", "install_forward_context",
           "install_full_graph_replay"]

FORWARD_CONTEXT = "vllm.forward_context:set_forward_context"
FULL_GRAPH_REPLAY = "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager.run_fullgraph"


def install_forward_context(patch: Patch, names: list[str]) -> None:
    """Each forward pass inside vLLM's ``set_forward_context`` is one step window."""
    owner, attr, original = resolve(patch.symbol)
    check_signature(patch, original)

    @contextmanager
    def set_forward_context(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with original(*args, **kwargs) as context, watch_step(name="vLLM"):
            yield context

    set_forward_context.__wrapped__ = original  # type: ignore[attr-defined]
    set_forward_context.__doc__ = original.__doc__
    _rebind(patch, owner, attr, set_forward_context)
    _rebind_importers(patch, owner, attr, original, set_forward_context)
    _say_replays_bounded(patch)


def install_full_graph_replay(patch: Patch, names: list[str]) -> None:
    """Each full-graph replay of Model Runner V2 is one step window."""
    owner, attr, original = resolve(patch.symbol)
    check_signature(patch, original)

    def run_fullgraph(self: Any, desc: Any) -> Any:
        with watch_step(name="vLLM (a full CUDA-graph replay)"):
            return original(self, desc)

    run_fullgraph.__wrapped__ = original  # type: ignore[attr-defined]
    _rebind(patch, owner, attr, run_fullgraph)
    _say_replays_bounded(patch)


def _say_replays_bounded(patch: Patch) -> None:
    """Once both hook points are installed, every replay vLLM makes runs in a window: a layer
    captured under a bound needs no warning then (undone with the patch)."""
    if FORWARD_CONTEXT in _APPLIED and FULL_GRAPH_REPLAY in _APPLIED:
        replays_in_step_windows("moe-plugins' vLLM glue (set_forward_context, run_fullgraph)")
    _APPLIED[patch.symbol].append(lambda: replays_in_step_windows(""))
