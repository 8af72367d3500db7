#!/usr/bin/env bash
# Everything the GPU tests and benchmarks need on the lent H200 (torch 2.11+cu130, CUDA 13, pip
# NVSHMEM; no vLLM, no DeepEP), then run them. Results go to $OUT (logs, JSON; build logs only
# when a build fails: the device tool returns at most 8 files).
#
# Carried from this checkout (git-ignored, made by scripts/gpu/prepare.sh on the CPU machine):
#   .gpu/vllm_py.tgz            vLLM 0.33.0's .py/.json files (its wheel without the .so files)
#   .gpu/whl/*.whl              the 46 small wheels vLLM's MoE modules import (listed in
#                               scripts/gpu/prepare.sh)
#   .gpu/deepep-567632d.tgz     DeepEP's V1 line at commit 567632d (source, built here)
# Usage (device tool): bash scripts/gpu/h200.sh [pytest args...]   (default: -m gpu tests/gpu)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
stage() { echo "== $(date +%T) $*"; }

stage "install carried wheels and vLLM's Python"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/whl/*.whl || exit 1
mkdir -p /tmp/vsrc && tar -xzf .gpu/vllm_py.tgz -C /tmp/vsrc || exit 1
mkdir -p /tmp/vsrc/vllm-0.33.0.dist-info
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n' > /tmp/vsrc/vllm-0.33.0.dist-info/METADATA

stage "build DeepEP V1 567632d (a copy in /tmp: a carried folder is replaced on the next call)"
if [ ! -d /tmp/deepep/deep_ep ] || ! ls /tmp/deepep/deep_ep_cpp*.so >/dev/null 2>&1; then
  rm -rf /tmp/deepep && mkdir -p /tmp/deepep && tar -xzf .gpu/deepep-567632d.tgz -C /tmp/deepep
  (cd /tmp/deepep && CPATH=/usr/local/cuda/include/cccl${CPATH:+:$CPATH} TORCH_CUDA_ARCH_LIST=9.0 \
    MAX_JOBS=16 python3 setup.py build_ext --inplace > /tmp/deepep_build.log 2>&1) \
    || { cp /tmp/deepep_build.log "$OUT/"; tail -40 /tmp/deepep_build.log; exit 1; }
fi

stage "install moe-plugins (entry points)"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip_install.log 2>&1 \
  || { tail -20 /tmp/pip_install.log; exit 1; }
export PYTHONPATH=/tmp/deepep:/tmp/vsrc:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, deep_ep; print('torch', torch.__version__, 'deep_ep', deep_ep.__file__)"

stage "GPU tests"
if [ $# -eq 0 ]; then set -- -m gpu tests/gpu; fi
timeout "${GPU_TEST_TIMEOUT_S:-300}" python3 -m pytest -q -p no:cacheprovider -rs "$@" 2>&1 | tee "$OUT/pytest_gpu.log"
