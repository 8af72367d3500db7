"""Checks the tests share: the one element-wise check of multi-rank outputs against the
single-process reference, the counter of torch.distributed collectives, the mode the time model
prices faster for a deepep_auto call, and the command line run as a user runs it."""
from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from moe_plugins.runner.demo import demo_inputs
from moe_plugins.layout import ParallelLayout
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights
from moe_plugins.quant import QuantSpec
from moe_plugins.runner.reference import reference_moe, tolerance_for


def assert_matches_reference(results: list[dict], layout: ParallelLayout, cfg: MoEConfig,
                             num_tokens: Union[int, list[int]], quant: QuantSpec = QuantSpec(),
                             seed: int = 0, weights: Optional[MoEWeights] = None,
                             ranks: Optional[list[int]] = None, key: str = "out") -> None:
    """results[rank][key] [num_tokens, hidden] (cfg.dtype) equals reference_moe on that rank's
    DP-group inputs (moe_plugins.runner.demo.demo_inputs) within moe_plugins.runner.reference.tolerance_for.
    ``num_tokens``: one count for every DP group, or one per DP group."""
    weights = weights or MoEWeights.random(cfg, seed)
    for rank in ranks if ranks is not None else range(len(results)):
        out = results[rank][key]
        dp = layout.dp_rank(rank)
        n = num_tokens if isinstance(num_tokens, int) else num_tokens[dp]
        ref = reference_moe(demo_inputs(cfg, n, dp, seed), weights, quant)
        atol, rtol = tolerance_for(ref, cfg.dtype)
        assert out.dtype == cfg.dtype and out.shape == (n, cfg.hidden), \
            f"rank {rank}: {out.dtype} {tuple(out.shape)}"
        torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol,
                                   msg=lambda m: f"rank {rank}: {m}")


def faster_mode(cfg: MoEConfig, ep: int, rows: int, quant: QuantSpec, link: Any,
                capacity: int) -> str:
    """The mode (``low_latency`` / ``normal``) the time model prices faster for a deepep_auto
    call over ``ep`` ranks whose busiest rank has ``rows`` rows on ``link``: each mode's
    dispatch + combine from its own plan at that batch (no crossover search, ties to the
    low-latency mode); low-latency only within the ``capacity``."""
    from moe_plugins.planner.compare import compare_backends

    if rows > capacity:
        return "normal"
    times = {b.backend: b.total_us for b in compare_backends(
        cfg, ParallelLayout(ep, 1, True), rows, quant, ["deepep_ll", "deepep_ht"], link=link)}
    return "low_latency" if times["deepep_ll"] <= times["deepep_ht"] else "normal"


_COUNTED = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather",
            "reduce_scatter_tensor", "all_to_all_single", "broadcast")


@contextlib.contextmanager
def count_dist_calls(groups: Optional[list[Any]] = None, also: Sequence[Any] = ()
                     ) -> Iterator[list[tuple[str, int]]]:
    """Wrap the real torch.distributed collectives; yields [(name, bytes this rank contributes)]:
    the input tensor (the second argument of all_gather* and reduce_scatter*, else the first).
    ``groups``: also gets each call's ``group`` argument (None: the default group), in order.
    Nested calls (a torch wrapper calling another) are counted once, at the outermost.
    ``ProcessGroup.alltoall_base``, which the torch backend's manager calls directly (the method
    under ``dist.all_to_all_single``), counts as ``all_to_all_single``, its group the process
    group it is called on. ``also``: objects that stand in for torch.distributed with methods of
    the same names and arguments (vLLM's CPU shared-memory communicator, the ``dist_module`` of
    its TP group's communicator), counted the same way while the block runs."""
    calls: list[tuple[str, int]] = []
    saved = {n: getattr(dist, n) for n in _COUNTED if hasattr(dist, n)}
    # the class's own entry (pybind's method descriptor), restored as it was: what attribute
    # access returns is the bare function, which would no longer bind the group
    saved_pg = dist.ProcessGroup.__dict__["alltoall_base"]
    depth = [0]

    def wrap(name: str, fn: Any, method: bool = False) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                # a method's first argument is its process group
                group, tensors = (args[0], args[1:]) if method else (kwargs.get("group"), args)
                two = name.startswith(("all_gather", "reduce_scatter")) and len(tensors) > 1
                t = tensors[1] if two else tensors[0]
                calls.append((name, t.numel() * t.element_size()
                              if isinstance(t, torch.Tensor) else 0))
                if groups is not None:
                    groups.append(group)
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return counted

    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))
    # the stand-ins' methods are wrapped on the instance and the instance's own entries restored
    also_saved = [(obj, n, obj.__dict__.get(n)) for obj in also for n in _COUNTED
                  if callable(getattr(obj, n, None))]
    for obj, n, _ in also_saved:
        setattr(obj, n, wrap(n, getattr(obj, n)))
    dist.ProcessGroup.alltoall_base = wrap("all_to_all_single", dist.ProcessGroup.alltoall_base,
                                           method=True)
    try:
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
        for obj, n, own in also_saved:
            if own is None:
                delattr(obj, n)
            else:
                setattr(obj, n, own)
        dist.ProcessGroup.alltoall_base = saved_pg


@contextlib.contextmanager
def logged(name: str) -> Iterator[list[str]]:
    """The messages logger ``name`` emits (INFO and above) during the block."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger(name)
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


ROOT = Path(__file__).resolve().parents[1]
CLI = Path(sys.executable).parent / "moe-plugins"


def cli_env() -> dict[str, str]:
    """The environment for a subprocess that must import this checkout's moe_plugins: the
    checkout first on PYTHONPATH (an editable install of the venv may point at another checkout,
    and a console script does not put the working directory on sys.path)."""
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """The installed ``moe-plugins`` console script with ``args``, on this checkout's code."""
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=timeout,
                          env=cli_env())
