#!/usr/bin/env bash
# Stretch (issue 11 section 3): `vllm serve` of the tiny Qwen2-MoE checkpoint on the H200 with
# our backend, without vLLM's compiled extension (Triton attention, custom ops off, eager).
# Run after scripts/gpu/h200.sh (it installs the carried vLLM, DeepEP and moe-plugins).
# Carried: .gpu/tiny-qwen2-moe (examples/vllm/tiny_qwen2_moe.py, 6 MB). Logs to $OUT/serve.log.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
# Every Python process vLLM starts (API server, engine core) needs the stand-ins before its
# first vLLM import: a sitecustomize on PYTHONPATH runs in each of them.
mkdir -p /tmp/standins
cat > /tmp/standins/sitecustomize.py <<PY
import sys
sys.path.insert(0, "$PWD/benchmarks")
import vllm_stand_ins
vllm_stand_ins.install()
PY
export PYTHONPATH=/tmp/standins:/tmp/deepep:/tmp/vsrc:/tmp/site PYTHONUNBUFFERED=1
python3 -m vllm.entrypoints.cli.main serve .gpu/tiny-qwen2-moe --dtype bfloat16 \
  --enable-expert-parallel --all2all-backend moe_plugins_deepep_ll --enforce-eager \
  --attention-backend TRITON_ATTN --compilation-config '{"custom_ops": ["none"]}' \
  --max-model-len 256 --gpu-memory-utilization 0.2 --port 8123 > "$OUT/serve.log" 2>&1 &
pid=$!
for _ in $(seq 1 90); do
  kill -0 $pid 2>/dev/null || break
  if curl -sf localhost:8123/health >/dev/null 2>&1; then
    curl -s localhost:8123/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": ".gpu/tiny-qwen2-moe", "prompt": "the quick cat", "max_tokens": 8, "temperature": 0}' \
      | tee "$OUT/serve_completion.json"; echo
    break
  fi
  sleep 2
done
kill $pid 2>/dev/null; sleep 2; kill -9 $pid 2>/dev/null
echo "== serve log (tail)"; grep -v "^\s*$" "$OUT/serve.log" | tail -25
