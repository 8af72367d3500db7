"""Typed multi-process launcher: CPU ranks on 127.0.0.1 with a gloo process group.

``RankPool(world_size)`` starts the ranks once and runs any number of picklable functions on all
of them (``pool.run(fn, *args, **kwargs)`` calls ``fn(rank, world_size, *args, **kwargs)`` on every rank and returns
the per-rank results in rank order). Tests keep one pool per world size; the demo uses one.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import traceback
from typing import Any, Callable, Generic, TypeVar

import torch

__all__ = ["RankPool", "RankError", "run_ranks"]

T = TypeVar("T")


class RankError(RuntimeError):
    """A function raised on some rank; carries the remote traceback and exception type name."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str):
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n--- remote traceback ---\n{tb}")
        self.rank, self.exc_type, self.message = rank, exc_type, message


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks: "mp.Queue[Any]", results: "mp.Queue[Any]",
            timeout_s: float) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share few cores; oversubscription makes gloo crawl
    os.environ.setdefault("OMP_NUM_THREADS", "1")
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
    """``world_size`` persistent CPU ranks. Not thread-safe; one ``run`` at a time."""

    def __init__(self, world_size: int, timeout_s: float = 120.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout_s = world_size, timeout_s
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._results: "mp.Queue[Any]" = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_worker, args=(r, world_size, port, self._tasks[r],
                                                         self._results, timeout_s), daemon=True)
                       for r in range(world_size)]
        for p in self._procs:
            p.start()
        self._collect(lambda status: status == "ready")

    def _collect(self, accept: Callable[[str], bool]) -> list[Any]:
        got: dict[int, tuple[str, Any]] = {}
        while len(got) < self.world_size:
            try:
                rank, status, payload = self._results.get(timeout=self.timeout_s)
            except queue.Empty:
                self.close()
                missing = sorted(set(range(self.world_size)) - set(got))
                raise TimeoutError(f"ranks {missing} did not answer in {self.timeout_s:.0f}s; "
                                   "pool closed") from None
            got[rank] = (status, payload)
        for rank in range(self.world_size):
            status, payload = got[rank]
            if status == "error":
                raise RankError(rank, *payload)
            assert accept(status), status
        return [got[r][1] for r in range(self.world_size)]

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank; results in rank order.
        A raise on any rank becomes :class:`RankError` (the first rank's, in rank order)."""
        if not self.alive:
            raise RuntimeError("rank pool is closed")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(lambda status: status == "ok")

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

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

    def __enter__(self) -> "RankPool[T]":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_ranks(world_size: int, fn: Callable[..., T], *args: Any, timeout_s: float = 120.0) -> list[T]:
    """One-shot: start ``world_size`` ranks, run ``fn`` on each, tear down."""
    with RankPool(world_size, timeout_s) as pool:
        return pool.run(fn, *args)
