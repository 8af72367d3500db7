"""What a :class:`moe_plugins.runner.launch.RankPool` raises when its ranks fail, die or do not
answer, and how it describes a rank process (its state, how it ended)."""
from __future__ import annotations

import signal
from typing import Optional

__all__ = ["RankError", "RankDiedError", "RankTimeoutError", "error_summary", "proc_state",
           "PROC_STATES", "exit_cause", "CONSEQUENCES"]

# Errors that follow from another rank's failure (that rank's own error is the one to read).
CONSEQUENCES = frozenset({"PeerInputError", "CollectiveError", "LayerBrokenError", "OutOfStepError"})


def error_summary(rank: int, exc_type: str, message: str) -> str:
    """One line: the rank, its error type and the first line of its message."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    return f"rank {rank} raised {exc_type}: {first}"


class RankError(RuntimeError):
    """A function raised on some rank. ``rank``/``exc_type``/``message`` are the error to read
    first (a rank's own failure before the errors it caused on its peers); ``errors`` every
    failing rank's (rank, exc_type, message, traceback); ``summary`` one line per rank; ``fix``
    what to do."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str,
                 errors: "list[tuple[int, str, str, str]] | None" = None):
        self.rank, self.exc_type, self.message, self.remote_traceback = rank, exc_type, message, tb
        self.errors = errors or [(rank, exc_type, message, tb)]
        self.summary = "; ".join(error_summary(r, t, m) for r, t, m, _ in self.errors)
        self.fix = (f"Start from rank {rank}'s {exc_type}: a rank's own error leads, the "
                    "errors it caused on its peers follow")
        super().__init__(f"{self.summary}\n--- remote traceback (rank {rank}) ---\n{tb}")


class RankDiedError(RankError):
    """A rank process ended while the pool waited for it: ``cause`` says how (exit code or
    signal); the survivors' own errors, if any, are in ``errors``."""

    def __init__(self, rank: int, cause: str, errors: list[tuple[int, str, str, str]]):
        self.cause = cause
        RuntimeError.__init__(self)
        self.rank, self.exc_type, self.message, self.remote_traceback = rank, "died", cause, ""
        self.errors = errors
        others = "; ".join(error_summary(r, t, m) for r, t, m, _ in errors)
        self.summary = f"rank {rank} died ({cause})" + (f"; {others}" if others else "")
        self.fix = (f"Find why rank {rank}'s process ended (its output; a kill by the kernel's "
                    "out-of-memory killer shows in its log) and run again")
        self.args = (self.summary + "; the pool terminated the other ranks",)

    def __str__(self) -> str:
        return self.args[0]


class RankTimeoutError(RankError, TimeoutError):
    """Ranks did not answer and the pool stopped waiting for them: ``reason`` is ``stopped``
    (a rank process was stopped: state T), ``overdue`` (another rank had raised and these did
    not answer within the grace) or ``deadline`` (the run's wait ran out). ``overdue``: those
    ranks; ``seen``: rank -> what was seen of each (process state, last :func:`report_step`);
    ``errors``: the answered ranks' errors; ``fix``: what to do. The pool ended every rank.
    ``rank``/``exc_type``/``message`` lead with an answered rank's own error if one raised
    one (not a consequence of a peer's failure), else with the first overdue rank."""

    def __init__(self, reason: str, overdue: list[int], seen: dict[int, str], what: str,
                 fix: str, errors: list[tuple[int, str, str, str]]):
        RuntimeError.__init__(self)
        self.reason, self.overdue, self.seen, self.fix = reason, overdue, seen, fix
        own = next((e for e in errors if e[1] not in CONSEQUENCES), None)
        if own is not None:  # a rank's own failure reads first, then the ranks that hung after it
            self.rank, self.exc_type, self.message, self.remote_traceback = own
            errors = [own] + [e for e in errors if e is not own]
            parts = [error_summary(*own[:3]), what] + [error_summary(*e[:3]) for e in errors[1:]]
        else:
            self.rank, self.exc_type, self.message, self.remote_traceback = (
                overdue[0], reason, what, errors[0][3] if errors else "")
            parts = [what] + [error_summary(*e[:3]) for e in errors]
        self.errors = errors
        self.summary = "; ".join(parts)
        self.args = (f"{self.summary}; the pool ended every rank. {fix}",)

    def __str__(self) -> str:
        return self.args[0]


def proc_state(pid: Optional[int]) -> Optional[str]:
    """The state letter of process ``pid`` (Linux /proc/<pid>/stat: R running, S sleeping, D
    in uninterruptible wait, T stopped, t stopped by a tracer, Z zombie); None elsewhere or
    when it cannot be read."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2, in parentheses) may hold spaces and ')': split at the last one
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[0] if fields else None


PROC_STATES = {"R": "running", "S": "sleeping", "D": "in an uninterruptible wait",
           "T": "in state T, stopped by SIGSTOP or SIGTSTP", "t": "stopped by a debugger (state t)",
           "Z": "a zombie"}


def exit_cause(exitcode: Optional[int]) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
