"""The call bound's step windows under vLLM (moe_plugins/vllm/step_window.py), in vLLM's own
code paths on CPU: each forward pass inside vLLM's ``set_forward_context`` (as the model runners
enter it, by the name they imported) and each full-graph replay of Model Runner V2 is watched as
one step under the layers' bound, and nothing is watched without a layer bound. On CPU a step
completes when its host part returns; the GPU's completion mark, and the layer calls sharing
it, are tested in tests/contracts/test_watchdog.py and on the GPU in
tests/gpu/test_watchdog_gpu.py."""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import pytest
import torch

from moe_plugins.callbound import watchdog
from moe_plugins.callbound import CallBound

pytestmark = pytest.mark.vllm


def _in_flight(wd) -> list:
    return [c for c in wd.ring if c.seq > 0 and c.what == "forward step" and not c.finished()]


def test_the_glue_says_every_replay_runs_in_a_window(registered):
    assert "set_forward_context" in watchdog._WATCHDOG.replays_bounded_by


@pytest.mark.parametrize("importer", ["vllm.forward_context", "vllm.v1.worker.gpu_model_runner",
                                      "vllm.v1.worker.gpu.model_runner"])
def test_a_forward_pass_in_set_forward_context_is_one_step_window(registered, fresh_watchdog,
                                                                   importer):
    from vllm.config import VllmConfig
    from vllm.forward_context import get_forward_context

    if importlib.util.find_spec(importer) is None:  # Model Runner V1 left vLLM in 0.34
        pytest.skip(f"{importer} is not in this vLLM release")
    set_forward_context = importlib.import_module(importer).set_forward_context
    config = VllmConfig()
    with set_forward_context(None, config):  # no layer has a bound: nothing watched
        assert _in_flight(fresh_watchdog) == []
    bound = CallBound("layer", 30.0, 900.0)
    with set_forward_context(None, config):
        assert get_forward_context().attn_metadata is None  # vLLM's context, as before
        [step] = _in_flight(fresh_watchdog)
        assert step.name == "vLLM" and step.bound == 900.0
        call = bound.watch(1)
        call.end(torch.device("cpu"))
        assert call.finished() and not step.finished()
    assert step.finished() and _in_flight(fresh_watchdog) == []
    fresh_watchdog.check(step.started + 1000.0)
    assert fresh_watchdog.expired == []


@dataclass(frozen=True)
class _Desc:
    """A batch descriptor of a FULL graph (vLLM's are frozen dataclasses too)."""

    cg_mode: object


def test_a_full_graph_replay_of_model_runner_v2_is_one_step_window(registered, fresh_watchdog):
    """vLLM's own ``CudaGraphManager.run_fullgraph`` under our wrapper; the captured graph is a
    stand-in (no CUDA graph can be captured on CPU) whose replay looks at the watchdog."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    seen: list = []

    class Graph:
        def replay(self) -> None:
            seen.append([(c.name, c.bound) for c in _in_flight(fresh_watchdog)])

    desc = _Desc(CUDAGraphMode.FULL)
    manager = type("Manager", (), {"graphs": {desc: Graph()}})()
    bound = CallBound("layer", 30.0, 0)
    CudaGraphManager.run_fullgraph(manager, desc)
    assert seen == [[("vLLM (a full CUDA-graph replay)", 30.0)]]
    assert _in_flight(fresh_watchdog) == [] and bound.timeout_s == 30.0
