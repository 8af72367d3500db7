"""Typed multi-process launcher: CPU ranks on 127.0.0.1 with a gloo process group.

``RankPool(world_size)`` starts the ranks once and runs any number of picklable functions on all
of them (``pool.run(fn, *args, **kwargs)`` calls ``fn(rank, world_size, *args, **kwargs)`` on every rank and returns
the per-rank results in rank order). Tests keep one pool per world size; the demo uses one.

``pool.run_bounded(fn, *args, deadline_s=...)`` is the same call under a wall-clock bound that
never raises for what the ranks do: it returns a :class:`BoundedRun` saying, per rank, every
step the rank announced (:func:`report_step`), every result it sent on the way
(:func:`report_result`) and how it ended (returned, raised, died, or still running at the
deadline, when every rank is killed and reaped). The GPU harness (tests/gpu/ep_harness.py) runs
its ranks this way.
"""
from __future__ import annotations

import ctypes
import datetime
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Optional, TypeVar

import torch

from moe_plugins.runner.rank_errors import (CONSEQUENCES, PROC_STATES, RankDiedError, RankError,
                                            RankTimeoutError, error_summary, exit_cause,
                                            proc_state)
from moe_plugins.callbound import on_call_timeout

__all__ = ["RankPool", "RankError", "RankDiedError", "RankTimeoutError", "run_ranks",
           "report_step", "report_result", "BoundedRun", "RankOutcome"]

T = TypeVar("T")
logger = logging.getLogger(__name__)


_POLL_S = 0.2  # how often a waiting parent checks that its children are alive
_GRACE_S = 1.0  # after a death, how long survivors get to report their own errors
# A rank seen stopped (SIGSTOP/SIGTSTP) this long, on polls no further apart than _PAUSED_S, is
# given up on: a longer gap means this process did not run either (the whole job was stopped,
# e.g. Ctrl-Z, and continued), so the ranks' state it saw before proves nothing.
_STOPPED_S = 1.5
_PAUSED_S = 1.0
# Once a rank has raised, the run fails whatever the others return; a rank still blocked in a
# collective with the failed one ends within the process-group timeout, so one that has not
# answered within min(that, _OVERDUE_CAP_S) + _OVERDUE_SLACK_S hangs outside the collectives.
_OVERDUE_CAP_S = 10.0
_OVERDUE_SLACK_S = 2.0


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


def _own_process_group() -> None:
    """POSIX: this rank leads a process group of its own, so whatever it starts (a library's
    JIT build: ninja, the compiler) ends with it when the pool kills it (:func:`_signal_rank`);
    a process it started would otherwise outlive it."""
    if hasattr(os, "setpgid"):
        try:
            os.setpgid(0, 0)
        except OSError:
            pass


def _signal_rank(proc: Any, sig: int) -> None:
    """``sig`` to a rank process (``multiprocessing.Process``) and every process of its group
    (:func:`_own_process_group`), also once the rank itself has ended (the group lives while a
    process it started does); to the rank alone before it has its group. Called right after
    the rank ends, never later: its pid then still names only its group."""
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, sig)
        return
    except (OSError, AttributeError):  # no such group (yet, or any more); no killpg
        pass
    if proc.exitcode is None:  # still our unreaped child: the pid is its own
        try:
            os.kill(proc.pid, sig)
        except OSError:
            pass


def _rendezvous_store(timeout_s: float) -> "torch.distributed.TCPStore":
    """The pool's rendezvous: a TCPStore served by this (parent) process on a port the OS
    picks and this process keeps, so two pools starting at once never race for one port (a
    port probed free and then bound by rank 0 could be taken in between)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


# In a rank process: where report_step/report_result send (the pool's result queue) and when the
# current task started; None outside a pool's rank, where both are no-ops.
_REPORT: Optional[Callable[[str, Any], None]] = None
_TASK_T0 = [0.0]


def report_step(name: str) -> None:
    """Tell the parent that this rank starts step ``name`` (recorded with the seconds since the
    task started): where a rank stopped is then known even when it hangs or dies. In a process
    that is not a :class:`RankPool` rank this does nothing."""
    if _REPORT is not None:
        _REPORT("step", (str(name), round(time.monotonic() - _TASK_T0[0], 3)))


def report_result(payload: Any) -> None:
    """Send ``payload`` (picklable) to the parent now, before the task ends: kept even when a
    later step of the task hangs or the rank dies. A no-op outside a :class:`RankPool` rank."""
    if _REPORT is not None:
        _REPORT("result", payload)


def _worker(rank: int, world_size: int, port: int, tasks: "mp.Queue[Any]", results: "mp.Queue[Any]",
            timeout_s: float, init: Optional[Callable[[int], None]]) -> None:
    global _REPORT
    _die_with_parent()
    _own_process_group()
    _REPORT = lambda kind, payload: results.put((rank, kind, payload))  # noqa: E731
    import torch.distributed as dist

    if init is not None:
        init(rank)

    from moe_plugins.groups import TIMEOUT_ENV

    torch.set_num_threads(1)  # ranks share few cores; oversubscription makes gloo crawl
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[TIMEOUT_ENV] = f"{timeout_s:g}"  # groups made in this rank get the same bound
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    results.put((rank, "ready", None))

    def report_call_timeout(error: BaseException) -> None:
        # the watchdog ends this process next: the running task's error must reach the parent
        # first (the queue's feeder thread sends it; closing and joining waits until it has)
        results.put((rank, "error", (type(error).__name__, str(error), "")))
        results.close()
        results.join_thread()

    on_call_timeout(report_call_timeout)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        _TASK_T0[0] = time.monotonic()
        try:
            results.put((rank, "ok", fn(rank, world_size, *args, **kwargs)))
        except BaseException as e:  # report, keep serving: the parent decides what is fatal
            results.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))
    dist.destroy_process_group()


@dataclass
class RankOutcome:
    """How one rank's task of a :meth:`RankPool.run_bounded` ended.

    status: ``ok`` (returned ``value``), ``error`` (raised: ``error`` is (type, message,
    traceback)), ``died`` (its process ended: ``cause``), ``timed_out`` (still running at the
    deadline; killed), ``stopped`` (still running when another rank died; killed).
    steps: (name, seconds since the task started) of every :func:`report_step`, in order;
    results: every :func:`report_result` payload, in order; ended_s: seconds from the start of
    the run to this rank's answer (or to when its death was seen)."""

    rank: int
    status: str = "running"
    value: Any = None
    error: Optional[tuple[str, str, str]] = None
    cause: Optional[str] = None
    steps: list[tuple[str, float]] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)
    ended_s: Optional[float] = None

    @property
    def last_step(self) -> Optional[str]:
        return self.steps[-1][0] if self.steps else None

    def describe(self) -> str:
        """One line: how the rank ended and where."""
        at = f" at step {self.last_step!r}" if self.last_step else " before its first step"
        if self.status == "ok":
            return f"rank {self.rank} returned"
        if self.status == "error":
            assert self.error is not None
            lines = self.error[1].strip().splitlines()
            return f"rank {self.rank} raised{at}: {self.error[0]}: {lines[0] if lines else ''}"
        if self.status == "died":
            return f"rank {self.rank} died{at} ({self.cause})"
        return f"rank {self.rank} {self.status.replace('_', ' ')}{at}"


@dataclass
class BoundedRun:
    """What :meth:`RankPool.run_bounded` saw: one :class:`RankOutcome` per rank, the bound, the
    seconds it ran, whether the deadline ended it, and the exit code of every rank process once
    it was reaped (None: still alive, i.e. the pool still serves)."""

    outcomes: list[RankOutcome]
    deadline_s: float
    elapsed_s: float
    timed_out: bool
    exitcodes: list[Optional[int]]
    stalled_s: Optional[float] = None  # set when the run was ended for reporting nothing

    @property
    def ok(self) -> bool:
        return all(o.status == "ok" for o in self.outcomes)

    @property
    def values(self) -> list[Any]:
        return [o.value for o in self.outcomes]

    def summary(self) -> str:
        if self.ok:
            return f"all {len(self.outcomes)} ranks returned in {self.elapsed_s:.1f} s"
        head = (f"no rank reported anything for {self.stalled_s:g} s" if self.stalled_s
                else f"did not finish within {self.deadline_s:g} s" if self.timed_out
                else f"failed after {self.elapsed_s:.1f} s")
        return head + ": " + "; ".join(o.describe() for o in self.outcomes if o.status != "ok")


class RankPool(Generic[T]):
    """``world_size`` persistent CPU ranks. Not thread-safe; one ``run`` at a time.

    ``timeout_s``: the gloo process group's collective timeout (:func:`moe_plugins.groups.
    timeout_seconds`: argument, else ``$MOE_PLUGINS_TIMEOUT_S``, else 300 s); a ``run`` waits
    at most that plus 30 s for every rank's answer. A rank process that dies is noticed within
    a second: :class:`RankDiedError` names it, how it ended and the survivors' errors, and the
    pool terminates the other ranks. A rank that cannot or does not answer ends the run too,
    every rank terminated, with :class:`RankTimeoutError` naming it and what was seen of it:
    a rank process stopped (Linux state T, SIGSTOP/SIGTSTP) for 1.5 s; a rank that has not
    answered within min(timeout, 10 s) + 2 s after another rank raised; the wait's end. Ranks
    die with the parent process (Linux)."""

    def __init__(self, world_size: int, timeout_s: Optional[float] = None,
                 init: Optional[Callable[[int], None]] = None,
                 ready_timeout_s: Optional[float] = None):
        """``init(rank)`` (picklable) runs first in every rank process, before it joins the
        process group (environment, logging, thread settings, the device). ``ready_timeout_s``:
        how long to wait for every rank to join (default: the collective timeout + 30 s); on
        any failure to start, every rank process is ended before the error is raised."""
        from moe_plugins.groups import timeout_seconds

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout_s = world_size, timeout_seconds(timeout_s)
        ctx = mp.get_context("spawn")
        self._store = _rendezvous_store(self.timeout_s + 30.0)  # lives as long as the pool
        port = self._store.port
        self._results: "mp.Queue[Any]" = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_worker, args=(r, world_size, port, self._tasks[r],
                                                         self._results, self.timeout_s, init),
                                  daemon=True)
                       for r in range(world_size)]
        self._reports: dict[int, dict[str, list[Any]]] = {}
        try:
            for p in self._procs:
                p.start()
            self._collect(lambda status: status == "ready", ready_timeout_s)
        except BaseException:
            self.terminate()  # nothing of a half-started pool outlives the error
            raise

    def _dead(self) -> list[int]:
        return [r for r, p in enumerate(self._procs) if p.exitcode is not None]

    def _note(self, rank: int, status: str, payload: Any) -> bool:
        """Keep a step/result report of a plain :meth:`run` (:attr:`reports`); True if it was
        one (not a rank's answer)."""
        if status not in ("step", "result"):
            return False
        self._reports.setdefault(rank, {"steps": [], "results": []})[status + "s"].append(payload)
        return True

    @property
    def reports(self) -> dict[int, dict[str, list[Any]]]:
        """The :func:`report_step` / :func:`report_result` messages of the last :meth:`run`,
        per rank: ``{"steps": [(name, seconds)], "results": [...]}``."""
        return self._reports

    def _collect(self, accept: Callable[[str], bool],
                 wait_s: Optional[float] = None) -> list[Any]:
        got: dict[int, tuple[str, Any]] = {}
        bound = (f"the process-group timeout ({self.timeout_s:g} s) + 30 s" if wait_s is None
                 else "the wait given")
        wait_s = self.timeout_s + 30.0 if wait_s is None else wait_s
        now = time.monotonic()
        deadline = now + wait_s
        grace = min(self.timeout_s, _OVERDUE_CAP_S) + _OVERDUE_SLACK_S
        first_error: Optional[tuple[int, float]] = None  # (rank, when its error came)
        stopped_since: dict[int, float] = {}
        checked = now
        while len(got) < self.world_size:
            try:
                rank, status, payload = self._results.get(timeout=_POLL_S)
                if not self._note(rank, status, payload):
                    got[rank] = (status, payload)
                    if status == "error" and first_error is None:
                        first_error = (rank, time.monotonic())
            except queue.Empty:
                pass
            now = time.monotonic()
            if now - checked < _POLL_S and len(got) < self.world_size:
                continue  # a stream of reports: check the ranks every _POLL_S, not per message
            if now - checked > _PAUSED_S:
                stopped_since.clear()  # this process did not run meanwhile: start over
            checked = now
            waiting = [r for r in range(self.world_size) if r not in got]
            dead = [r for r in self._dead() if r in waiting]
            if dead:
                self._raise_died(dead[0], got)
            for r in waiting:
                if proc_state(self._procs[r].pid) == "T":
                    stopped_since.setdefault(r, now)
                else:
                    stopped_since.pop(r, None)
            stopped = [r for r, t in sorted(stopped_since.items()) if now - t >= _STOPPED_S]
            if stopped:
                self._raise_overdue("stopped", stopped, got)
            if first_error is not None and now - first_error[1] > grace and waiting:
                self._raise_overdue("overdue", waiting, got, grace=grace, after=first_error[0])
            if now > deadline and waiting:
                self._raise_overdue("deadline", waiting, got, wait=f"{wait_s:g} s, {bound}")
        errors = self._errors(got)
        if errors:
            first = next((e for e in errors if e[1] not in CONSEQUENCES), errors[0])
            raise RankError(*first, errors=[first] + [e for e in errors if e is not first])
        for rank in range(self.world_size):
            assert accept(got[rank][0]), got[rank][0]
        return [got[r][1] for r in range(self.world_size)]

    def _seen(self, rank: int) -> str:
        """What is seen of a rank that has not answered: its process's state and last step."""
        pid = self._procs[rank].pid
        state = proc_state(pid)
        steps = self._reports.get(rank, {}).get("steps")
        at = f", last step {steps[-1][0]!r} at {steps[-1][1]:g} s" if steps else ""
        return f"process {pid} {PROC_STATES.get(state or '', f'in state {state}')}{at}" if state \
            else f"process {pid}{at}"

    def _raise_overdue(self, reason: str, ranks: list[int], got: dict[int, tuple[str, Any]],
                       grace: float = 0.0, after: int = -1, wait: str = "") -> None:
        """End every rank and raise :class:`RankTimeoutError` for ``ranks`` (see its reasons)."""
        seen = {r: self._seen(r) for r in ranks}
        errors = self._errors(got)
        names = ", ".join(map(str, ranks))
        plural = len(ranks) > 1
        if reason == "stopped":
            what = ("; ".join(f"rank {r} is stopped ({seen[r]}, seen for {_STOPPED_S:g} s) and "
                              "cannot answer" for r in ranks)
                    + "; every rank was expected to run its task to an answer")
            fix = (f"Find what stopped rank{'s' if plural else ''} {names} (`kill -STOP`, job "
                   "control, a debugger) and run again; a stopped rank needs SIGCONT to go on, "
                   "and a run waits for every rank")
        elif reason == "overdue":
            what = (f"rank{'s' if plural else ''} {names} did not answer within {grace:g} s after "
                    f"rank {after} raised ({'; '.join(f'rank {r}: {seen[r]}' for r in ranks)}); "
                    f"every rank was expected to answer by then (one blocked in a collective with "
                    f"a failed rank ends within the process-group timeout, {self.timeout_s:g} s)")
            fix = (f"Rank{'s' if plural else ''} {names} hung or ran long outside the collectives "
                   "the others failed in: read the answered ranks' errors, then what "
                   f"rank{'s' if plural else ''} {names} ran (its last step, if reported)")
        else:
            what = (f"rank{'s' if plural else ''} {names} did not answer within the run's wait "
                    f"({'; '.join(f'rank {r}: {seen[r]}' for r in ranks)}); every rank was "
                    f"expected to answer within it ({wait})")
            fix = ("If the ranks are only slow, raise the timeout (the demo's --timeout, "
                   "$MOE_PLUGINS_TIMEOUT_S); else find where they hang (report_step says where "
                   "a rank was)")
        logger.debug("ending the run: %s", what)
        self.terminate()
        raise RankTimeoutError(reason, ranks, seen, what, fix, errors)

    @staticmethod
    def _errors(got: dict[int, tuple[str, Any]]) -> list[tuple[int, str, str, str]]:
        return [(r, *got[r][1]) for r in sorted(got) if got[r][0] == "error"]

    def _raise_died(self, rank: int, got: dict[int, tuple[str, Any]]) -> None:
        """A rank died: give the survivors a moment to report, then end them all and raise."""
        cause = exit_cause(self._procs[rank].exitcode)
        end = time.monotonic() + _GRACE_S
        while time.monotonic() < end and len(got) + len(self._dead()) < self.world_size:
            try:
                r, status, payload = self._results.get(timeout=0.05)
                if not self._note(r, status, payload):
                    got[r] = (status, payload)
            except queue.Empty:
                pass
        self.terminate()
        raise RankDiedError(rank, cause, self._errors(got))

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank; results in rank order.
        A raise on any rank becomes :class:`RankError` (every failing rank's error, the rank
        that failed first on its own named first); a rank that dies, :class:`RankDiedError`; a
        rank stopped or overdue (see the class), :class:`RankTimeoutError`."""
        if not self.alive:
            raise RuntimeError("rank pool is closed")
        self._reports = {}
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(lambda status: status == "ok")

    def run_bounded(self, fn: Callable[..., Any], *args: Any, deadline_s: float,
                    stop_on_death: bool = True, stall_s: Optional[float] = None,
                    **kwargs: Any) -> BoundedRun:
        """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank, for at most
        ``deadline_s`` seconds, and say how each rank's call ended (:class:`BoundedRun`);
        nothing a rank does is raised here. Each rank's :func:`report_step` and
        :func:`report_result` messages are kept as they come.

        Ranks still running at the deadline are killed (their status ``timed_out``), and so
        are all ranks once one died, after a second for the others to report, unless
        ``stop_on_death`` is False: then the survivors run on until they answer or the
        deadline (a fault test that needs the survivors' own errors and times). ``stall_s``:
        also end the run (as at the deadline) when no rank sent anything (a step, a result, an
        answer) for that long: a hang costs that, not the whole bound. Whenever a
        rank was killed or died, the whole pool is ended and every process reaped before this
        returns; an exception in this process (KeyboardInterrupt included) ends it too. If
        every rank answered, the pool keeps serving. :meth:`run`'s stopped and overdue rules do
        not apply: the caller's bound is the contract (a fault test reads how long each rank
        took after a peer failed); ``stall_s`` and the deadline end a stopped or hung rank."""
        if not self.alive:
            raise RuntimeError("rank pool is closed")
        n = self.world_size
        outcomes = [RankOutcome(r) for r in range(n)]
        start = time.monotonic()
        end = start + deadline_s
        pending = set(range(n))
        death_seen: Optional[float] = None
        last_heard = start
        stalled = False
        try:
            for q in self._tasks:
                q.put((fn, args, kwargs))
            while pending:
                now = time.monotonic()
                if now >= end or (death_seen is not None and stop_on_death
                                  and now >= death_seen + _GRACE_S):
                    break
                if stall_s is not None and now - last_heard >= stall_s:
                    stalled = True
                    break
                try:
                    rank, status, payload = self._results.get(timeout=min(_POLL_S, end - now))
                except queue.Empty:
                    for r in sorted(pending):
                        code = self._procs[r].exitcode
                        if code is not None:
                            o = outcomes[r]
                            o.status, o.cause = "died", exit_cause(code)
                            o.ended_s = round(time.monotonic() - start, 3)
                            pending.discard(r)
                            death_seen = death_seen or time.monotonic()
                    continue
                last_heard = time.monotonic()
                o = outcomes[rank]
                if status == "step":
                    o.steps.append(payload)
                elif status == "result":
                    o.results.append(payload)
                elif status in ("ok", "error") and rank in pending:
                    o.status = status
                    if status == "ok":
                        o.value = payload
                    else:
                        o.error = tuple(payload)  # type: ignore[assignment]
                    o.ended_s = round(time.monotonic() - start, 3)
                    pending.discard(rank)
            for r in pending:
                outcomes[r].status = "timed_out" if death_seen is None or not stop_on_death \
                    else "stopped"
            if pending or death_seen is not None:
                self.terminate()
        except BaseException:
            self.terminate()
            raise
        return BoundedRun(outcomes, deadline_s, round(time.monotonic() - start, 3),
                          bool(pending) and (death_seen is None or not stop_on_death),
                          [p.exitcode for p in self._procs], stall_s if stalled else None)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def terminate(self) -> None:
        """End every rank at once, and what each started (its process group): SIGTERM, then
        SIGKILL after 2 s; the group of a rank that ended gets SIGKILL too."""
        for p in self._procs:
            if p.is_alive():
                _signal_rank(p, signal.SIGTERM)
                # a stopped rank acts on SIGTERM only once continued; a running one ignores this
                _signal_rank(p, signal.SIGCONT)
        for p in self._procs:
            p.join(timeout=2)
            # the rank if still running, and what it started (which may outlive its SIGTERM)
            _signal_rank(p, signal.SIGKILL)
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
                _signal_rank(p, signal.SIGKILL)
                p.join(timeout=2)
        self._store = None  # the rendezvous port is free again

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
