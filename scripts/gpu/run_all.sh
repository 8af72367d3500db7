#!/usr/bin/env bash
# One device call for every GPU test and benchmark of this repo on the lent H200 (each stage is
# bounded so the whole call ends inside the device tool's 10 minutes; a failing stage does not
# stop the next). Carry: .gpu/whl .gpu/vllm_py.tgz .gpu/deepep-567632d.tgz .gpu/tiny-qwen2-moe
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
bash scripts/gpu/h200.sh -m gpu tests/gpu --timeout 150 || echo "!! GPU tests failed"
export PYTHONPATH=/tmp/deepep:/tmp/vsrc:/tmp/site PYTHONUNBUFFERED=1
bench() { local name=$1 limit=$2; shift 2; echo "== $(date +%T) $name"
  timeout "$limit" python3 "$@" > "$OUT/$name.log" 2>&1 || echo "!! $name failed (rc $?)"
  tail -22 "$OUT/$name.log"; }
bench vllm_layer 120 benchmarks/vllm_layer.py --rounds 3 --json "$OUT/vllm_layer_h200.json"
bench host_overhead 150 benchmarks/host_overhead.py --device cuda --json "$OUT/host_overhead_h200.json"
[ "${SERVE:-1}" = 1 ] && { echo "== $(date +%T) serve attempt"; timeout 150 bash scripts/gpu/serve_attempt.sh; }
exit 0
