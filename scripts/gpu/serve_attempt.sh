#!/usr/bin/env bash
# `vllm serve` of the tiny Qwen2-MoE checkpoint on one GPU with our backend, without vLLM's
# compiled extension (Triton attention, custom ops off, eager): how far vLLM's Python alone gets.
# Run after scripts/gpu/h200.sh (it installs the kit's vLLM files, DeepEP and moe-plugins).
# Needs the kit's .gpu/tiny-qwen2-moe (examples/vllm/tiny_qwen2_moe.py, 6 MB) and .gpu/whl_serve
# (the wheels vLLM's API server imports beyond the MoE modules' 46: uvicorn, uvloop, aiohttp, ...;
# made by scripts/gpu/prepare.sh, 14 MB). Logs to $OUT/serve.log.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
if ls .gpu/whl_serve/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_serve \
    .gpu/whl_serve/*.whl || echo "!! serving wheels did not install"
fi
# Every Python process vLLM starts (API server, engine core) needs the stand-ins before its
# first vLLM import: a sitecustomize on PYTHONPATH runs in each of them.
mkdir -p /tmp/standins
cat > /tmp/standins/sitecustomize.py <<PY
import sys
sys.path.insert(0, "$PWD/benchmarks")
import vllm_stand_ins
vllm_stand_ins.install(vllm_stand_ins.SERVE_CAPABILITY_QUERIES)
PY
export PYTHONPATH=/tmp/standins:/tmp/deepep:/tmp/vsrc:/tmp/site:/tmp/site_serve PYTHONUNBUFFERED=1
# vLLM 0.33's model runner V2 builds its request state on UVA buffers from a compiled op
# (torch.ops._C.get_cuda_view_from_cpu_tensor, seen on the H200): there, use the V1 runner.
# vLLM 0.34 has no V1 runner (VLLM_USE_V2_MODEL_RUNNER=0 is an error there): it gets V2.
if python3 -c "import sys, importlib.metadata as m; sys.exit(not m.version('vllm').startswith('0.33.'))" \
    2>/dev/null; then
  export VLLM_USE_V2_MODEL_RUNNER=0
fi
python3 -m vllm.entrypoints.cli.main serve .gpu/tiny-qwen2-moe --dtype bfloat16 \
  --enable-expert-parallel --all2all-backend moe_plugins_deepep_ll --enforce-eager \
  --attention-backend TRITON_ATTN --compilation-config '{"custom_ops": ["none"]}' \
  --max-model-len 256 --gpu-memory-utilization 0.2 --port 8123 > "$OUT/serve.log" 2>&1 &
pid=$!
for _ in $(seq 1 90); do
  kill -0 $pid 2>/dev/null || break
  # (the host may lack curl: Python's urllib asks)
  if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8123/health', timeout=2)" 2>/dev/null; then
    python3 - "$OUT/serve_completion.json" <<'PY'
import json, sys, urllib.request as u
req = u.Request("http://127.0.0.1:8123/v1/completions", headers={"Content-Type": "application/json"},
                data=json.dumps({"model": ".gpu/tiny-qwen2-moe", "prompt": "the quick cat",
                                 "max_tokens": 8, "temperature": 0, "logprobs": 1}).encode())
body = u.urlopen(req, timeout=60).read().decode()
open(sys.argv[1], "w").write(body)
print(body)
PY
    break
  fi
  sleep 2
done
kill $pid 2>/dev/null; sleep 2; kill -9 $pid 2>/dev/null
echo "== serve log (tail)"; grep -v "^\s*$" "$OUT/serve.log" | tail -25
