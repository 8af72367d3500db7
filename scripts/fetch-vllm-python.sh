#!/usr/bin/env bash
# Fetch the Python of published vLLM releases (their wheels' .py/.json files and dist-info) into a
# cache outside the repository, for the tests that check the plugin against every supported
# release without installing it (tests/vllm_glue/test_vllm_releases.py). Idempotent.
#   scripts/fetch-vllm-python.sh [VERSION ...]      default: every release of VLLM_CHECKED in
#                                                   moe_plugins/stack/versions.py
# Cache: $MOE_PLUGINS_VLLM_PYTHON_CACHE, default ~/.cache/moe-plugins/vllm-python/<version>/
# (each a tree to put first on PYTHONPATH: `vllm/` and `vllm-<version>.dist-info/`).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${MOE_PLUGINS_VLLM_PYTHON_CACHE:-$HOME/.cache/moe-plugins/vllm-python}
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || read -ra VERSIONS <<< "$(python3 scripts/vllm_versions.py checked)"
for v in "${VERSIONS[@]}"; do
  dest="$CACHE/$v"
  [ -f "$dest/.complete" ] && continue
  tmp=$(mktemp -d)
  # The wheel is abi3 for manylinux x86_64; only its Python is used, so any host can fetch it.
  "$PY" -m pip --disable-pip-version-check -q download --no-deps --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --python-version 3.12 "vllm==$v" -d "$tmp"
  rm -rf "$dest" && mkdir -p "$dest"
  "$PY" - "$tmp"/vllm-"$v"-*.whl "$dest" <<'PYEOF'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    keep = [n for n in z.namelist()
            if n.endswith((".py", ".json", ".jinja"))
            or (".dist-info/" in n and n.rsplit("/", 1)[1] in ("METADATA", "entry_points.txt"))]
    z.extractall(dest, keep)
print(f"{len(keep)} files of {wheel.rsplit('/', 1)[1]} -> {dest}")
PYEOF
  rm -rf "$tmp"
  touch "$dest/.complete"
done
