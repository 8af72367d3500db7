#!/usr/bin/env python3
"""Try every install line of moe-plugins' docs against the package index, as a new user would.

    python scripts/check_install_lines.py                 every `pip install` line of the docs
    python scripts/check_install_lines.py --requirements  also: requirements/vllm-*.txt equals its
                                                          vLLM wheel's requirements (one change)

Each line runs as `pip install --dry-run --ignore-installed --report ...` in a fresh venv made
here, with the pip the README's install block upgrades to (`python -m pip install -U pip`;
--venv-pip keeps the pip the venv brings). Nothing is installed; pip still downloads what it
needs to resolve (about 0.5 GB for the vLLM lines). It runs from the checkout's root as a
machine without a pip configuration file would (PIP_CONFIG_FILE=/dev/null, PIP_CONSTRAINT
unset: a constraint file capping torch changes what pip picks, e.g. pip 23.2 then steps back to
vLLM 0.33.0 where it otherwise stops); --pip-config uses this machine's instead. It prints,
per line, the versions pip would install of
vllm, flashinfer-python, nixl, torch and moe-plugins, or pip's error; exit status 1 when a line
fails. Needs network access: not part of the test suite (tests/test_install_lines.py keeps the
lines, the extras and the stack table consistent offline).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The packages whose resolved versions each line reports.
WATCHED = ("moe-plugins", "vllm", "flashinfer-python", "nixl", "nixl-cu12", "nixl-cu13", "torch")
_PIP = re.compile(r"^(?:python3? -m pip|(?:\S*/)?pip) install (.+)$")


def user_docs(root: Path = ROOT) -> list[Path]:
    """The pages a user reads install lines in."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")),
            root / "tests" / "gpu" / "README.md", *sorted((root / "examples").glob("*/README.md"))]


def install_lines(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(page, line number, command) for every `pip install` command of the user docs: each
    line of a fenced block and each inline code span that is one, its trailing comment cut."""
    found = []
    for page in user_docs(root):
        fenced = False
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("```"):
                fenced = not fenced
                continue
            spans = [line] if fenced else re.findall(r"`([^`]+)`", line)
            for span in spans:
                cmd = span.split("  #")[0].split(" # ")[0].strip()
                if _PIP.match(cmd):
                    found.append((str(page.relative_to(root)), n, cmd))
    return found


#: The environment of every pip run (:func:`main` sets it: without this machine's pip
#: configuration unless --pip-config).
_ENV: dict[str, str] = dict(os.environ)


def _pip_env(own_config: bool) -> dict[str, str]:
    """The environment pip runs in: this one, or (``own_config`` False) without a pip
    configuration file or constraint, as a new user's machine."""
    env = dict(os.environ)
    if not own_config:
        env["PIP_CONFIG_FILE"] = os.devnull
        env.pop("PIP_CONSTRAINT", None)
    return env


def _resolve(py: Path, args: str, report: Path) -> tuple[bool, str]:
    cmd = [str(py), "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(report), *shlex.split(args)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_ENV)
    if run.returncode != 0:
        errors = [ln for ln in run.stderr.splitlines() if ln.startswith("ERROR")]
        return False, " | ".join(errors[-2:]) or run.stderr.strip()[-500:]
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    return True, ", ".join(f"{p} {got[p]}" for p in WATCHED if p in got) or "(none watched)"


def _wheel_requirements(py: Path, spec: str, tmp: Path) -> list[str]:
    report = tmp / "wheel.json"
    subprocess.run([str(py), "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                    "--no-deps", "--report", str(report), spec], check=True, env=_ENV)
    meta = json.loads(report.read_text())["install"][0]["metadata"]
    return [r for r in meta.get("requires_dist", []) if "extra ==" not in r]


def check_requirements(py: Path, tmp: Path) -> bool:
    """requirements/vllm-<version>.txt == that wheel's requirements, flashinfer-python's pin
    replaced by the file's own."""
    ok = True
    for path in sorted((ROOT / "requirements").glob("vllm-*.txt")):
        version = path.stem.removeprefix("vllm-")
        ours = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
        theirs = _wheel_requirements(py, f"vllm=={version}", tmp)
        fi = [r for r in ours if r.startswith("flashinfer-python")]
        expected = [fi[0] if r.startswith("flashinfer-python") else r for r in theirs]
        same = ours == expected
        ok &= same
        print(f"{path.relative_to(ROOT)}: {'equals' if same else 'DIFFERS from'} vllm "
              f"{version}'s requirements with {fi[0] if fi else 'no flashinfer-python'}")
        if not same:
            print("  only ours:", sorted(set(ours) - set(expected)))
            print("  only the wheel's:", sorted(set(expected) - set(ours)))
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv-pip", action="store_true",
                   help="keep the pip the new venv brings (do not upgrade it first)")
    p.add_argument("--requirements", action="store_true",
                   help="also check requirements/vllm-*.txt against the vLLM wheels' metadata")
    p.add_argument("--pip-config", action="store_true",
                   help="use this machine's pip configuration (default: none, as a new user's "
                        "machine: PIP_CONFIG_FILE=/dev/null, PIP_CONSTRAINT unset)")
    args = p.parse_args()
    _ENV.clear()
    _ENV.update(_pip_env(args.pip_config))
    seen: dict[str, list[str]] = {}
    for page, n, cmd in install_lines():
        seen.setdefault(cmd, []).append(f"{page}:{n}")
    ok = True
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True)
        py = tmp / "venv" / "bin" / "python"
        if not args.venv_pip:
            subprocess.run([str(py), "-m", "pip", "install", "--quiet", "-U", "pip"], check=True,
                           env=_ENV)
        print("pip", subprocess.run([str(py), "-m", "pip", "--version"], capture_output=True,
                                    text=True, env=_ENV).stdout.split()[1],
              "with this machine's pip configuration" if args.pip_config
              else "without a pip configuration file (PIP_CONFIG_FILE=/dev/null)")
        if any("dist/moe_plugins-" in c for c in seen):  # the README's wheel line needs the wheel
            subprocess.run([str(py), "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", "dist",
                            "."], cwd=ROOT, check=True, env=_ENV)
        for cmd, where in seen.items():
            args_text = _PIP.match(cmd).group(1)  # type: ignore[union-attr]
            good, what = _resolve(py, args_text, tmp / "report.json")
            ok &= good
            print(f"{'ok  ' if good else 'FAIL'} {cmd}\n     {what}\n     ({', '.join(where)})")
        if args.requirements:
            ok &= check_requirements(py, tmp)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
