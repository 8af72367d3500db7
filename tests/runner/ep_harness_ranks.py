"""Rank functions of the harness tests (tests/runner/test_ep_harness.py): steps, results, a
hang in a step or in a collective, a hang beside a process the rank started, a mismatch, a
rank that dies. Plain CPU code."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from tests.gpu.ep_harness import result, step


def steps_and_results(rank: int, world: int, n: int) -> int:
    for i in range(n):
        step(f"step {i}")
        t = torch.tensor([float(rank + i)])
        dist.all_reduce(t)
        result({"i": i, "sum": float(t)})
    return rank * 10


def hang(rank: int, world: int, where: str, pid_dir: Optional[str] = None) -> None:
    """Rank 1 hangs: in a sleep (``where='sleep'``) or in a collective its peers never join
    (``where='collective'``: rank 0 waits for rank 1 in an all_reduce that rank 1 never
    makes). Each rank writes its pid into ``pid_dir`` first (when given)."""
    if pid_dir is not None:
        Path(pid_dir, str(rank)).write_text(str(os.getpid()))
    step("start")
    if where == "sleep":
        if rank == 1:
            step("sleep forever")
            while True:
                time.sleep(1)
        return
    if rank == 0:
        step("all_reduce that rank 1 never joins")
        dist.all_reduce(torch.ones(1))
    else:
        step("sleep instead of the all_reduce")
        while True:
            time.sleep(1)


def hang_beside_a_child(rank: int, world: int, pid_file: str) -> None:
    """Rank 1 starts a process that runs for 5 minutes (as a library's JIT build starts its
    compiler), writes that process's pid into ``pid_file``, and hangs; rank 0 returns."""
    step("start")
    if rank == 1:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        Path(pid_file).write_text(str(child.pid))
        step("wait for the child")
        while True:
            time.sleep(1)


def mismatch(rank: int, world: int) -> None:
    """Rank 1 reports a mismatch as a result, then asserts it (as a numerical check does)."""
    step("compare")
    got, want = torch.ones(3), torch.ones(3) * (1.0 if rank == 0 else 1.5)
    ok = bool(torch.allclose(got, want))
    result({"case": "compare", "ok": ok, "max_abs_err": float((got - want).abs().max())})
    assert ok, f"rank {rank}: output differs from the reference"


def die(rank: int, world: int, how: str) -> str:
    """Rank 1 dies (``exit``: os._exit(3); ``kill``: SIGKILL) after its first step; rank 0
    then waits for it in an all_reduce and reports what the transport raised."""
    step("before the death")
    if rank == 1:
        step(f"dying ({how})")
        time.sleep(0.3)  # let the step reach the parent before the process ends
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    step("all_reduce with the dead rank")
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as e:
        result({"error": type(e).__name__, "seconds": time.monotonic() - t0})
        raise
    return "unreachable"
