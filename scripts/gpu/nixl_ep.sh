#!/usr/bin/env bash
# Build NIXL EP's torch extension against the host's torch (the nixl-cu13 1.5.1 wheel ships it
# for torch 2.12-2.14 only; this builds it for any, 2.11 included) and run our nixl_ep backend on
# one GPU (tests/gpu/test_nixl_ep_gpu.py, then benchmarks/deepep_ll_latency.py --backend nixl_ep).
# Where torch is 2.12-2.14, `pip install 'nixl>=1.5'` is simpler and this script is not needed.
#
# The offline kit's part (git-ignored, made by scripts/gpu/prepare17.sh on a machine with network
# access):
#   .gpu17/nixl/nixl_min.tgz     the nixl-cu13 1.5.1 wheel's libnixl, UCX plugin, UCX libraries
#                                and transports, nixl_ep_cu13/*.py (wheel layout)
#   .gpu17/nixl/nixl_ep_src.tgz  ai-dynamo/nixl examples/device/ep/csrc + nixl headers (main at
#                                8770b655a, or NIXL_REV=v1.5.1 where the clone has the tag; see
#                                prepare17.sh)
#   .gpu17/nixl/ucx_headers.tgz  UCX v1.22.x headers (device API; the wheel's UCX is 65e342a)
# Usage: bash scripts/gpu/nixl_ep.sh [pytest args...]   (default: tests/gpu/test_nixl_ep_gpu.py)
#
# Build (our own setup.py in /tmp, torch.utils.cpp_extension.CUDAExtension; nixl builds it with
# meson): the four .cu and two .cpp files of examples/device/ep/meson.build, its defines
# (TORCH_EXTENSION_NAME=nixl_ep_cpp_torch<MM>, TOPK_IDX_BITS=32, DISABLE_AGGRESSIVE_PTX_INSTRS,
# --expt-relaxed-constexpr, register-usage-level=10), C++20, sm_90 only, no -rdc (every device
# function nixl_device.cuh defines is a template, so each .cu keeps its own copy). Two changes to
# the copy in /tmp, each printed: UCX's GDAKI (mlx5 GPU-initiated RDMA) device headers are
# removed so UCX compiles the cuda_ipc device path only (GDAKI needs DOCA GPUNetIO headers, which
# are not available; one GPU and no RDMA NIC never take that path), and nixl_ep's
# kernels/configs.cuh #include <infiniband/mlx5dv.h> is dropped when the host has no rdma-core
# headers (nothing in nixl_ep's sources uses it). Hopper (sm_90) only, as written.
# Checked without a GPU with pip's nvcc 13.0.88: the four .cu files compile for sm_90 against
# the kit's headers (the .cpp files need the host's CUDA/torch headers).
# Stage markers "== HH:MM:SS nixl N/4 ..." (scripts/gpu/setup_stages.sh: setup_nixl), then "5/6",
# "6/6"; logs under $OUT (nixl_build.log, pytest_nixl.log, ...).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/nixl_run.log") 2>&1
. scripts/gpu/setup_stages.sh  # stages 1-4: setup_nixl (shared with ep_matrix.sh)
fail() { echo "FAILED at stage: $*"; exit 1; }
export PYTHONUNBUFFERED=1

setup_nixl || fail "1-4 nixl_ep build and import (setup_nixl)"
export PYTHONPATH=$NIXL_SITE

stage "5/6 install moe-plugins; GPU tests (log: pytest_nixl.log)"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip_install.log" 2>&1 \
  || { tail -20 "$OUT/pip_install.log"; fail "5 pip install -e ."; }
if [ $# -eq 0 ]; then set -- tests/gpu/test_nixl_ep_gpu.py; fi
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs -m gpu "$@" 2>&1 | tee "$OUT/pytest_nixl.log"

stage "6/6 raw-vs-ours round trip (eager and CUDA graph), FP8 and bf16, 64 tokens"
for q in "" "--bf16"; do
  timeout 120 python3 benchmarks/deepep_ll_latency.py --backend nixl_ep --tokens 64 --iters 300 $q \
    --json "$OUT/nixl_ep_latency${q:+_bf16}.json" 2>&1 | tail -12
done
stage "done"
