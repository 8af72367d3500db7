"""N processes sharing ONE device, as one EP world: the harness of the one-GPU EP tests.

``run_world(fn, world, *args, device="cuda", timeout_s=...)`` starts ``world`` rank processes
(:class:`moe_plugins.runner.launch.RankPool`: spawned, a gloo process group of ``world`` ranks on
a free TCP port of 127.0.0.1 with a bounded collective timeout, ranks that die with the parent),
each bound to ``cuda:0`` (``torch.cuda.set_device(0)`` before anything else) or left on the CPU
(``device="cpu"``, where the rank functions install the emulated libraries of tests/emulation
themselves), and calls ``fn(rank, world, *args)`` on every rank under one wall-clock bound
(:meth:`RankPool.run_bounded`). A rank function reports each step as it starts
(:func:`step`) and each result as it comes (:func:`result`); the parent keeps them, so where a
rank stopped is known whatever happens to it. The whole run is bounded: at the deadline every
rank is killed and reaped, as on any exception in the parent (KeyboardInterrupt included), and
:class:`WorldRun` says where each rank stopped (:meth:`WorldRun.record`: JSON-ready).

Why gloo and one device: NCCL refuses two ranks on one device, and DeepEP, NIXL EP and
flashinfer only exchange handles over the group (CUDA IPC, NVSHMEM's peer mapping), so a
one-GPU machine runs EP 2, 4 and 8 as processes that time-slice the GPU. No timing from such a
run means anything; none is reported as a latency. Never under CUDA MPS (DeepEP's low-latency
kernels fail there).

How tests use it (:func:`verdict`): a run that did not finish inside its bound is a failure
naming the step where each rank stopped (in a fault run: ranks that must end after a fault and
did not); so is a rank that raised or died, or a numerical mismatch (the rank function reports
it as a result).
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from moe_plugins.runner.launch import BoundedRun, RankOutcome, RankPool, report_result, report_step

__all__ = ["run_world", "WorldRun", "step", "result", "verdict", "write_record", "rank_device",
           "GPU_ENV"]

#: What every rank process on a GPU gets in its environment before torch.distributed or vLLM
#: start (vLLM reads these when it first asks): vLLM's NCCL wrapper (PyNccl) off, since NCCL
#: refuses two ranks on one device and every vLLM group then falls back to its torch.distributed
#: (gloo) group; its symmetric-memory and FlashInfer all-reduces off (one process per GPU).
GPU_ENV = {"VLLM_DISABLE_PYNCCL": "1", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
           "VLLM_ALLREDUCE_USE_FLASHINFER": "0", "PYTHONUNBUFFERED": "1"}

step = report_step
result = report_result


def rank_device(device: str) -> "Any":
    """The torch device a rank of ``run_world(device=...)`` computes on."""
    import torch

    return torch.device("cuda", 0) if device.startswith("cuda") else torch.device("cpu")


def _rank_init(device: str, env: dict[str, str], rank: int) -> None:
    """First thing in every rank process (RankPool's ``init``), before the process group.
    With ``EP_HARNESS_DUMP_S`` and ``EP_HARNESS_DUMP_DIR`` set, every thread's Python stack is
    written to ``<dir>/rank<rank>-<pid>.txt`` every that many seconds (:func:`_dump_stacks`), so
    where a rank that never ends waits is in the run's logs; so are the stacks of a rank that
    crashes (faulthandler's fatal-signal handler: SIGSEGV, SIGABRT)."""
    for k, v in env.items():
        os.environ.setdefault(k, v)
    dump_s, dump_dir = os.environ.get("EP_HARNESS_DUMP_S"), os.environ.get("EP_HARNESS_DUMP_DIR")
    if dump_s and dump_dir:
        import faulthandler

        os.makedirs(dump_dir, exist_ok=True)
        out = open(os.path.join(dump_dir, f"rank{rank}-{os.getpid()}.txt"), "w")  # noqa: SIM115
        _dump_stacks(out, float(dump_s))
        faulthandler.enable(file=out, all_threads=True)  # a crash (SIGSEGV) writes its stacks
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(0)  # every rank on the one GPU


def _dump_stacks(out: Any, every_s: float) -> threading.Thread:
    """Every ``every_s`` seconds, every thread's Python stack into ``out``, from a daemon thread
    that holds the interpreter lock while it reads them (``sys._current_frames``), so no frame
    changes under it. Not faulthandler's timer (``dump_traceback_later``): its C thread reads
    the other threads' frames without the lock, and a frame being pushed or popped meanwhile
    crashes the process (CPython issues #131580, #140815): ranks importing vLLM died of SIGSEGV
    in that dump. The cost: a rank whose thread holds the lock in a C call writes nothing until
    the call returns (scripts/gpu/ep_matrix.sh then takes native stacks with py-spy)."""
    import sys
    import traceback

    def loop() -> None:
        start, n = time.monotonic(), 0
        while True:
            time.sleep(every_s)
            n += 1
            names = {t.ident: t.name for t in threading.enumerate()}
            lines = [f"== dump {n} at {time.monotonic() - start:.1f} s\n"]
            for ident, frame in sys._current_frames().items():
                if ident == threading.get_ident():
                    continue
                name = names.get(ident, "?")
                lines.append(f"Thread {ident:#x} ({name}), most recent call last:\n")
                lines += traceback.format_stack(frame)
            out.write("".join(lines) + "\n")
            out.flush()

    thread = threading.Thread(target=loop, name="ep-harness-stack-dump", daemon=True)
    thread.start()
    return thread


@dataclass
class WorldRun:
    """One bounded run of a rank function on ``world`` processes (see :func:`run_world`).

    ``bounded`` is None when the ranks never started (``start_error`` says why); ``stray``
    lists rank process ids still alive after the run (must be empty)."""

    name: str
    world: int
    device: str
    timeout_s: float
    bounded: Optional[BoundedRun]
    start_error: Optional[str] = None
    stray: list[int] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def outcomes(self) -> list[RankOutcome]:
        return self.bounded.outcomes if self.bounded is not None else []

    @property
    def ok(self) -> bool:
        return self.bounded is not None and self.bounded.ok and not self.stray

    @property
    def timed_out(self) -> bool:
        """The bound ran out (ranks killed), or the ranks did not even start in time."""
        if self.bounded is None:
            return bool(self.start_error and self.start_error.startswith("TimeoutError"))
        return self.bounded.timed_out

    @property
    def values(self) -> list[Any]:
        return [o.value for o in self.outcomes]

    def results(self, rank: int) -> list[Any]:
        return self.outcomes[rank].results if self.bounded is not None else []

    def summary(self) -> str:
        if self.bounded is None:
            return f"{self.name}: the {self.world} ranks did not start: {self.start_error}"
        if self.bounded.timed_out:
            why = (f"no rank reported anything for {self.bounded.stalled_s:g} s"
                   if self.bounded.stalled_s else f"did not finish within {self.timeout_s:g} s")
            text = (f"{self.name}: {why}: "
                    + "; ".join(o.describe() for o in self.outcomes if o.status != "ok"))
        else:
            text = f"{self.name}: {self.bounded.summary()}"
        return text + (f"; STRAY processes {self.stray}" if self.stray else "")

    def record(self) -> dict:
        """Where every rank stopped, JSON-ready: per rank its status, last step, every step with
        its time, the results it sent, its error (type, first line) or how it died."""
        ranks = []
        for o in self.outcomes:
            entry: dict[str, Any] = {
                "rank": o.rank, "status": o.status, "last_step": o.last_step,
                "ended_s": o.ended_s, "steps": [list(s) for s in o.steps],
                "results": [_jsonable(r) for r in o.results]}
            if o.error is not None:
                entry["error"] = {"type": o.error[0], "message": o.error[1][:2000],
                                  "traceback": o.error[2][-4000:]}
            if o.cause is not None:
                entry["cause"] = o.cause
            ranks.append(entry)
        return {"name": self.name, "world": self.world, "device": self.device,
                "timeout_s": self.timeout_s, "elapsed_s": round(self.elapsed_s, 2),
                "timed_out": self.timed_out, "start_error": self.start_error,
                "stalled_s": self.bounded.stalled_s if self.bounded is not None else None,
                "stray": self.stray,
                "exitcodes": self.bounded.exitcodes if self.bounded is not None else None,
                "ranks": ranks}


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        if isinstance(value, dict):
            return {str(k): _jsonable(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_jsonable(v) for v in value]
        return repr(value)


def _alive(pids: Sequence[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        # a zombie still answers kill(0): reaped children of this process are not zombies
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    continue
        except (OSError, IndexError):
            continue
        out.append(pid)
    return out


def run_world(fn: Callable[..., Any], world: int, *args: Any, device: str = "cuda",
              timeout_s: float = 300.0, pg_timeout_s: Optional[float] = None,
              stop_on_death: bool = True, name: Optional[str] = None,
              env: Optional[dict[str, str]] = None, stall_s: Optional[float] = None) -> WorldRun:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes sharing ``device``
    (``cuda``: all on cuda:0; ``cpu``) under one bound of ``timeout_s`` seconds, start-up
    included. ``pg_timeout_s``: the gloo group's collective timeout (and
    ``MOE_PLUGINS_TIMEOUT_S`` in the ranks; default the bound). ``stop_on_death``: end the other
    ranks a second after one dies (False: let them run on to their own error or the bound).
    ``stall_s``: end the run early when no rank reported anything for that long (a hang then
    costs that, not the whole bound). Never raises for what the ranks do; every rank process is gone when it returns."""
    name = name or getattr(fn, "__name__", "run")
    rank_env = dict(GPU_ENV) if device.startswith("cuda") else {}
    # vLLM's CPU communicator names its shared-memory segments after this (its CPU worker sets
    # it from the init method): one value per world, the same on all of its ranks.
    rank_env["VLLM_DIST_IDENT"] = f"ep-harness-{uuid.uuid4().hex[:12]}"
    rank_env.update(env or {})
    start = time.monotonic()
    pool: Optional[RankPool] = None
    run = WorldRun(name, world, device, timeout_s, None)
    pids: list[int] = []
    try:
        try:
            pool = RankPool(world, timeout_s=pg_timeout_s or timeout_s,
                            init=functools.partial(_rank_init, device, rank_env),
                            ready_timeout_s=timeout_s)
        except Exception as e:  # the ranks did not start (or not in time): nothing is left
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            run.start_error = f"{type(e).__name__}: {first}"
            return run
        pids = [p.pid for p in pool._procs if p.pid is not None]
        left = max(1.0, timeout_s - (time.monotonic() - start))
        run.bounded = pool.run_bounded(fn, *args, deadline_s=left, stop_on_death=stop_on_death,
                                       stall_s=stall_s)
        return run
    finally:
        if pool is not None:
            if run.bounded is not None and run.bounded.ok:
                pool.close()
            else:
                pool.terminate()
        run.elapsed_s = time.monotonic() - start
        run.stray = _alive(pids)


def verdict(run: WorldRun, what: str, fault: bool = False) -> None:
    """pytest's answer to a run: a bound that ran out (or ranks that could not start in time)
    is a failure naming where each rank stopped (a run that did not finish did not show what
    it is there for; in a ``fault`` run, one that shows that ranks end after a fault, the
    message says the ranks did not end after it); a rank that raised or died, or a stray
    process, is a failure. Returns when every rank returned."""
    import pytest

    if run.stray:
        pytest.fail(f"{what}: rank processes {run.stray} outlived the run")
    if run.timed_out and fault:
        pytest.fail(f"{what}: ranks did not end within {run.timeout_s:g} s after the fault: "
                    + run.summary())
    if run.timed_out:
        pytest.fail(f"{what} did not finish within {run.timeout_s:g} s: " + run.summary())
    if not run.ok:
        pytest.fail(f"{what}: {run.summary()}")


def write_record(path: "str | Path", key: str, entry: Any) -> None:
    """Put ``entry`` under ``key`` in the JSON object at ``path`` (created if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = entry
    path.write_text(json.dumps(data, indent=2) + "\n")


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
