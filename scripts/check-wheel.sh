#!/usr/bin/env bash
# Build moe-plugins' sdist and wheel, check their metadata, install the wheel (not editable) into
# a fresh virtual environment and run what a user runs from it: `moe-plugins list`, a small demo
# and the vLLM plugin's entry point. Fails on the first error.
#   scripts/check-wheel.sh          uses .venv (scripts/setup.sh) to build; dist/ is rewritten
# PYTHON: the interpreter of the fresh environment (default python3); TORCH: the torch
# requirement installed there first (default torch==2.13.0, the CPU build: an unpinned torch
# would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
[ -x .venv/bin/python ] || ./scripts/setup.sh
pip() { "$1" -m pip --disable-pip-version-check -q "${@:2}"; }
stage() { echo "== $(date +%T) $*"; }

stage "build the sdist and the wheel"
pip .venv/bin/python install build twine
rm -rf dist
.venv/bin/python -m build --outdir dist . > /dev/null
ls dist
.venv/bin/python -m twine check --strict dist/*

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
stage "install the wheel into a fresh environment ($TORCH first)"
"$PY" -m venv "$WORK/venv"
pip "$WORK/venv/bin/python" install "$TORCH"
pip "$WORK/venv/bin/python" install dist/moe_plugins-*.whl

# from a folder without the sources, so that only the installed wheel can be imported
cd "$WORK"
stage "only moe_plugins is installed at the top level"
"$WORK/venv/bin/python" - <<'PY'
import importlib
import sys
for name in ("all2all", "prepare_finalize"):
    try:
        importlib.import_module(name)
    except ImportError:
        continue
    sys.exit(f"the wheel installs a top-level package {name!r}; it belongs inside moe_plugins")
import moe_plugins.all2all.deepep_ll, moe_plugins.prepare_finalize.torch  # noqa: E401,F401
print("all2all and prepare_finalize import only as moe_plugins.all2all / .prepare_finalize")
PY
stage "moe-plugins list"
"$WORK/venv/bin/moe-plugins" list
stage "moe-plugins demo --ranks 2 --ep"
"$WORK/venv/bin/moe-plugins" demo --ranks 2 --ep --tokens 4
stage "the vLLM plugin's entry point"
"$WORK/venv/bin/python" - "$WORK/venv" <<'PY'
import importlib.util
import sys
from importlib.metadata import entry_points
from pathlib import Path

venv = Path(sys.argv[1]).resolve()
found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "moe_plugins"]
if len(found) != 1 or found[0].value != "moe_plugins.vllm.plugin:register":
    sys.exit(f"entry point vllm.general_plugins/moe_plugins: expected one naming "
             f"moe_plugins.vllm.plugin:register, found {found}")
ep = found[0]
spec = importlib.util.find_spec(ep.module)
if spec is None or not Path(spec.origin).resolve().is_relative_to(venv):
    sys.exit(f"{ep.module} does not resolve inside the fresh environment: {spec}")
try:
    register = ep.load()
except ImportError as e:  # vLLM is not installed here: the module resolved, which is the check
    print(f"{ep.value} resolves to {spec.origin}; loading it needs vLLM: {e}")
else:
    if not callable(register):
        sys.exit(f"{ep.value} is not callable: {register!r}")
    print(f"{ep.value} loads from {spec.origin}")
PY
stage "the wheel installs and runs"
