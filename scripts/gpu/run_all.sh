#!/usr/bin/env bash
# The GPU tests and benchmarks of this repository on one GPU host with the offline kit, one stage
# after another (each bounded in time; a failing stage does not stop the next). Needs the kit's
# .gpu/whl .gpu/vllm_py-<version>.tgz .gpu/deepep-567632d.tgz, and for the serve stage .gpu/tiny-qwen2-moe
# .gpu/whl_serve (tests/gpu/README.md, "Offline"). Stages can be left out: VLLM_LAYER=0
# HOST_OVERHEAD=0 MULTI_GPU=0 HT=0 SERVE=0 (PROFILE=1 adds op tables).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
# the one-rank GPU tests (the two-process DeepEP normal-mode test has its own stage below)
GPU_TEST_TIMEOUT_S=${GPU_TEST_TIMEOUT_S:-150} bash scripts/gpu/h200.sh -m gpu tests/gpu \
  --timeout 150 --deselect tests/gpu/test_deepep_ht_gpu.py || echo "!! GPU tests failed"
export PYTHONPATH=/tmp/deepep:/tmp/vsrc:/tmp/site PYTHONUNBUFFERED=1
bench() { local name=$1 limit=$2; shift 2; echo "== $(date +%T) $name"
  timeout "$limit" python3 "$@" > "$OUT/$name.log" 2>&1 || echo "!! $name failed (rc $?)"
  tail -30 "$OUT/$name.log"; }
# PROFILE=1: also torch.profiler's op tables of every path (where the host time goes)
[ "${HOST_OVERHEAD:-1}" = 1 ] && bench host_overhead 200 benchmarks/host_overhead.py --device cuda \
  --json "$OUT/host_overhead_h200.json" \
  ${PROFILE:+--profile "$OUT/host_overhead_profile_h200.txt"}
[ "${MULTI_GPU:-1}" = 1 ] && bench multi_gpu 150 benchmarks/multi_gpu.py --gpus 1 \
  --out "$OUT/multi_gpu_h200x1.json"
[ "${VLLM_LAYER:-1}" = 1 ] && bench vllm_layer 120 benchmarks/vllm_layer.py --rounds 3 \
  --json "$OUT/vllm_layer_h200.json"
if [ "${HT:-1}" = 1 ]; then
  echo "== $(date +%T) deepep_ht / deepep_auto, two processes on one GPU"
  MOE_PLUGINS_GPU_TIMEOUT_S=${MOE_PLUGINS_GPU_TIMEOUT_S:-100} \
  MOE_PLUGINS_GPU_RECORD="$OUT/deepep_two_ranks_one_gpu.json" timeout 230 python3 -m pytest -q \
    -p no:cacheprovider -rxs tests/gpu/test_deepep_ht_gpu.py > "$OUT/pytest_ht.log" 2>&1
  tail -8 "$OUT/pytest_ht.log"
fi
[ "${SERVE:-1}" = 1 ] && { echo "== $(date +%T) serve attempt"; timeout 120 bash scripts/gpu/serve_attempt.sh; }
exit 0
