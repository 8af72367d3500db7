#!/usr/bin/env bash
# The offline kit's set-up on a GPU host, then the GPU tests (scripts/gpu/README in
# tests/gpu/README.md, "Offline"): installs the kit's wheels and vLLM's Python files, builds DeepEP
# V1 567632d, installs this package, then runs pytest. Written for a host whose torch differs
# from the one vLLM's wheel wants (vLLM's compiled extension is left out; the stand-ins of
# benchmarks/vllm_stand_ins.py take its place); an H200 (sm_90) with CUDA 13 by default:
# CUDA_HOME and TORCH_CUDA_ARCH_LIST override. Logs and results go to $OUT.
#
# The kit (git-ignored, made by scripts/gpu/prepare.sh on a machine with network access, then
# copied with this checkout):
#   .gpu/vllm_py-<version>.tgz  vLLM's .py/.json files (its wheel without the .so files; VLLM_VERSION picks 0.34.0 or 0.33.0)
#   .gpu/whl/*.whl              the 46 small wheels vLLM's MoE modules import (listed in
#                               scripts/gpu/prepare.sh)
#   .gpu/deepep-567632d.tgz     DeepEP's V1 line at commit 567632d (source, built here)
# Usage: bash scripts/gpu/h200.sh [pytest args...]   (default: -m gpu tests/gpu)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
. scripts/gpu/setup_stages.sh  # the set-up stages (shared with nixl_ep.sh, flashinfer.sh, ep_matrix.sh)

setup_vllm_py || exit 1
setup_deepep || exit 1
setup_moe_plugins || exit 1
export PYTHONPATH=/tmp/deepep:/tmp/vsrc:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, deep_ep; print('torch', torch.__version__, 'deep_ep', deep_ep.__file__)"

stage "GPU tests"
if [ $# -eq 0 ]; then set -- -m gpu tests/gpu; fi
timeout "${GPU_TEST_TIMEOUT_S:-300}" python3 -m pytest -q -p no:cacheprovider -rs "$@" 2>&1 | tee "$OUT/pytest_gpu.log"
