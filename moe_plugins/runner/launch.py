"""Typed multi-process launcher: CPU ranks on 127.0.0.1 with a gloo process group.

``RankPool(world_size)`` starts the ranks once and runs any number of picklable functions on all
of them (``pool.run(fn, *args, **kwargs)`` calls ``fn(rank, world_size, *args, **kwargs)`` on every rank and returns
the per-rank results in rank order). Tests keep one pool per world size; the demo uses one.
"""
from __future__ import annotations

import ctypes
import datetime
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable, Generic, Optional, TypeVar

import torch

__all__ = ["RankPool", "RankError", "RankDiedError", "run_ranks"]

T = TypeVar("T")


# Errors that follow from another rank's failure (that rank's own error is the one to read).
_CONSEQUENCES = frozenset({"PeerInputError", "CollectiveError", "LayerBrokenError", "OutOfStepError"})
_POLL_S = 0.2  # how often a waiting parent checks that its children are alive
_GRACE_S = 1.0  # after a death, how long survivors get to report their own errors


def _summary(rank: int, exc_type: str, message: str) -> str:
    first = message.strip().splitlines()[0] if message.strip() else ""
    return f"rank {rank} raised {exc_type}: {first}"


class RankError(RuntimeError):
    """A function raised on some rank. ``rank``/``exc_type``/``message`` are the error to read
    first (a rank's own failure before the errors it caused on its peers); ``errors`` every
    failing rank's (rank, exc_type, message, traceback); ``summary`` one line per rank."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str,
                 errors: "list[tuple[int, str, str, str]] | None" = None):
        self.rank, self.exc_type, self.message, self.remote_traceback = rank, exc_type, message, tb
        self.errors = errors or [(rank, exc_type, message, tb)]
        self.summary = "; ".join(_summary(r, t, m) for r, t, m, _ in self.errors)
        super().__init__(f"{self.summary}\n--- remote traceback (rank {rank}) ---\n{tb}")


class RankDiedError(RankError):
    """A rank process ended while the pool waited for it: ``cause`` says how (exit code or
    signal); the survivors' own errors, if any, are in ``errors``."""

    def __init__(self, rank: int, cause: str, errors: list[tuple[int, str, str, str]]):
        self.cause = cause
        RuntimeError.__init__(self)
        self.rank, self.exc_type, self.message, self.remote_traceback = rank, "died", cause, ""
        self.errors = errors
        others = "; ".join(_summary(r, t, m) for r, t, m, _ in errors)
        self.summary = f"rank {rank} died ({cause})" + (f"; {others}" if others else "")
        self.args = (self.summary + "; the pool terminated the other ranks",)

    def __str__(self) -> str:
        return self.args[0]


def _exit_cause(exitcode: Optional[int]) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a killed demo leaves no ranks)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks: "mp.Queue[Any]", results: "mp.Queue[Any]",
            timeout_s: float, init: Optional[Callable[[int], None]]) -> None:
    _die_with_parent()
    import torch.distributed as dist

    if init is not None:
        init(rank)

    from moe_plugins.groups import TIMEOUT_ENV

    torch.set_num_threads(1)  # ranks share few cores; oversubscription makes gloo crawl
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[TIMEOUT_ENV] = f"{timeout_s:g}"  # groups made in this rank get the same bound
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, "ok", fn(rank, world_size, *args, **kwargs)))
        except BaseException as e:  # report, keep serving: the parent decides what is fatal
            results.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))
    dist.destroy_process_group()


class RankPool(Generic[T]):
    """``world_size`` persistent CPU ranks. Not thread-safe; one ``run`` at a time.

    ``timeout_s``: the gloo process group's collective timeout (:func:`moe_plugins.groups.
    timeout_seconds`: argument, else ``$MOE_PLUGINS_TIMEOUT_S``, else 300 s); a ``run`` waits
    at most that plus 30 s for every rank's answer. A rank process that dies is noticed within
    a second: :class:`RankDiedError` names it, how it ended and the survivors' errors, and the
    pool terminates the other ranks. Ranks die with the parent process (Linux)."""

    def __init__(self, world_size: int, timeout_s: Optional[float] = None,
                 init: Optional[Callable[[int], None]] = None):
        """``init(rank)`` (picklable) runs first in every rank process, before it joins the
        process group (environment, logging, thread settings)."""
        from moe_plugins.groups import timeout_seconds

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout_s = world_size, timeout_seconds(timeout_s)
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._results: "mp.Queue[Any]" = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_worker, args=(r, world_size, port, self._tasks[r],
                                                         self._results, self.timeout_s, init),
                                  daemon=True)
                       for r in range(world_size)]
        for p in self._procs:
            p.start()
        self._collect(lambda status: status == "ready")

    def _dead(self) -> list[int]:
        return [r for r, p in enumerate(self._procs) if p.exitcode is not None]

    def _collect(self, accept: Callable[[str], bool]) -> list[Any]:
        got: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + self.timeout_s + 30.0
        while len(got) < self.world_size:
            try:
                rank, status, payload = self._results.get(timeout=_POLL_S)
                got[rank] = (status, payload)
                continue
            except queue.Empty:
                pass
            dead = [r for r in self._dead() if r not in got]
            if dead:
                self._raise_died(dead[0], got)
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(got))
                errors = self._errors(got)
                self.close()
                raise TimeoutError(
                    f"ranks {missing} did not answer in {self.timeout_s + 30:.0f}s (process-group "
                    f"timeout {self.timeout_s:g}s); pool closed"
                    + (f"; {'; '.join(_summary(r, t, m) for r, t, m, _ in errors)}" if errors else ""))
        errors = self._errors(got)
        if errors:
            first = next((e for e in errors if e[1] not in _CONSEQUENCES), errors[0])
            raise RankError(*first, errors=[first] + [e for e in errors if e is not first])
        for rank in range(self.world_size):
            assert accept(got[rank][0]), got[rank][0]
        return [got[r][1] for r in range(self.world_size)]

    @staticmethod
    def _errors(got: dict[int, tuple[str, Any]]) -> list[tuple[int, str, str, str]]:
        return [(r, *got[r][1]) for r in sorted(got) if got[r][0] == "error"]

    def _raise_died(self, rank: int, got: dict[int, tuple[str, Any]]) -> None:
        """A rank died: give the survivors a moment to report, then end them all and raise."""
        cause = _exit_cause(self._procs[rank].exitcode)
        end = time.monotonic() + _GRACE_S
        while time.monotonic() < end and len(got) + len(self._dead()) < self.world_size:
            try:
                r, status, payload = self._results.get(timeout=0.05)
                got[r] = (status, payload)
            except queue.Empty:
                pass
        self.terminate()
        raise RankDiedError(rank, cause, self._errors(got))

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank; results in rank order.
        A raise on any rank becomes :class:`RankError` (every failing rank's error, the rank
        that failed first on its own named first); a rank that dies, :class:`RankDiedError`."""
        if not self.alive:
            raise RuntimeError("rank pool is closed")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(lambda status: status == "ok")

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def terminate(self) -> None:
        """End every rank at once (SIGTERM, then SIGKILL after 2 s)."""
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (ValueError, OSError):
                    pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)

    def __enter__(self) -> "RankPool[T]":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:  # an error or a signal in the parent: do not wait for ranks that may be stuck
            self.terminate()


def run_ranks(world_size: int, fn: Callable[..., T], *args: Any,
              timeout_s: Optional[float] = None) -> list[T]:
    """One-shot: start ``world_size`` ranks, run ``fn`` on each, tear down."""
    with RankPool(world_size, timeout_s) as pool:
        return pool.run(fn, *args)
