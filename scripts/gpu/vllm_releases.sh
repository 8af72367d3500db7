#!/usr/bin/env bash
# vLLM's path of the EP matrix (our prepare/finalize beside vLLM's in-tree classes in vLLM's own
# MoE kernel: deepep_ll, nixl_ep, deepep_ht at EP 2 and 4, bf16 and FP8, DBO on == off, SP at
# dp 2 x tp 2, a CUDA graph replayed on new inputs) and the vLLM layer benchmark, under one vLLM
# release's Python, on one GPU host with the offline kit (scripts/gpu/prepare.sh, prepare17.sh):
#   VLLM_VERSION=0.34.0 bash scripts/gpu/vllm_releases.sh      kit: .gpu/whl .gpu/vllm_py-<version>.tgz
#                                                            .gpu/deepep-567632d.tgz .gpu17/nixl
# In $OUT: ep_one_gpu_vllm-<version>.json (the rows, each with its "vllm" field),
# ep_logs_vllm-<version>.tgz, vllm_layer_h200_vllm-<version>.json (ours / in-tree, eager and
# graph) and its log. VLLM_VERSION defaults to the newest release checked (scripts/vllm_versions.py).
# Options: MATRIX_S (default 400), LAYER_S (default 150), ONLY (default
# "vllm/": job-name substrings of tests/gpu/ep_matrix.py), LAYER=0 skips the benchmark.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
V=${VLLM_VERSION:-$(python3 "$(dirname "${BASH_SOURCE[0]}")/../vllm_versions.py" newest)}
export VLLM_VERSION=$V OUT
mkdir -p "$OUT"
HALF=A ONLY="${ONLY:-vllm/}" CALL_S=${MATRIX_S:-400} bash scripts/gpu/ep_matrix.sh
[ -f "$OUT/ep_one_gpu_A.json" ] && mv "$OUT/ep_one_gpu_A.json" "$OUT/ep_one_gpu_vllm-$V.json"
[ -f "$OUT/ep_logs_A.tgz" ] && mv "$OUT/ep_logs_A.tgz" "$OUT/ep_logs_vllm-$V.tgz"
if [ "${LAYER:-1}" = 1 ]; then
  . scripts/gpu/setup_stages.sh
  stage "benchmarks/vllm_layer.py under vLLM $V"
  PYTHONPATH=$(gpu_pythonpath deepep vllm) PYTHONUNBUFFERED=1 timeout "${LAYER_S:-150}" \
    python3 benchmarks/vllm_layer.py --rounds 3 --json "$OUT/vllm_layer_h200_vllm-$V.json" \
    > "$OUT/vllm_layer_vllm-$V.log" 2>&1
  echo "vllm_layer rc=$?"; tail -22 "$OUT/vllm_layer_vllm-$V.log"
fi
exit 0
