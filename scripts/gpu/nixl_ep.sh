#!/usr/bin/env bash
# Build NIXL EP's torch extension against the GPU image's torch (2.11; the
# nixl-cu13 1.5.1 wheel ships it for torch 2.12-2.14 only) and run our nixl_ep backend on one
# H200 (tests/gpu/test_nixl_ep_gpu.py, then benchmarks/deepep_ll_latency.py --backend nixl_ep).
#
# Carried (git-ignored, made by scripts/gpu/prepare17.sh on the CPU machine):
#   .gpu17/nixl/nixl_min.tgz     the nixl-cu13 1.5.1 wheel's libnixl, UCX plugin, UCX libraries
#                                and transports, nixl_ep_cu13/*.py (wheel layout)
#   .gpu17/nixl/nixl_ep_src.tgz  ai-dynamo/nixl examples/device/ep/csrc + nixl headers (main at
#                                8770b655a: the v1.5.1 tag was not readable; see prepare17.sh)
#   .gpu17/nixl/ucx_headers.tgz  UCX v1.22.x headers (device API; the wheel's UCX is 65e342a)
# Device tool: command "bash scripts/gpu/nixl_ep.sh", carry [".gpu17/nixl"].
#
# Build (our own setup.py in /tmp, torch.utils.cpp_extension.CUDAExtension; nixl builds it with
# meson): the four .cu and two .cpp files of examples/device/ep/meson.build, its defines
# (TORCH_EXTENSION_NAME=nixl_ep_cpp_torch<MM>, TOPK_IDX_BITS=32, DISABLE_AGGRESSIVE_PTX_INSTRS,
# --expt-relaxed-constexpr, register-usage-level=10), C++20, sm_90 only, no -rdc (every device
# function nixl_device.cuh defines is a template, so each .cu keeps its own copy). Two changes to
# the copy in /tmp, each printed: UCX's GDAKI (mlx5 GPU-initiated RDMA) device headers are
# removed so UCX compiles the cuda_ipc device path only (GDAKI needs DOCA GPUNetIO headers, which
# are not available; one GPU and no RDMA NIC never take that path), and nixl_ep's
# kernels/configs.cuh #include <infiniband/mlx5dv.h> is dropped when the image has no rdma-core
# headers (nothing in nixl_ep's sources uses it).
# Checked on the CPU machine with pip's nvcc 13.0.88: the four .cu files compile for sm_90 against
# the carried headers (the .cpp files need the image's CUDA/torch headers).
# Stage markers "== HH:MM:SS N/6 ..."; logs under $OUT (nixl_build.log, pytest_nixl.log, ...).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/nixl_run.log") 2>&1
stage() { echo "== $(date +%T) $*"; }
fail() { echo "FAILED at stage: $*"; exit 1; }
SITE=/tmp/nixl_site BUILD=/tmp/nixl_build
export PYTHONUNBUFFERED=1 PATH=/usr/local/cuda/bin:$PATH CUDA_HOME=/usr/local/cuda

stage "1/6 unpack the stripped wheel, nixl_ep sources and UCX headers into /tmp"
rm -rf "$SITE" "$BUILD" && mkdir -p "$SITE" "$BUILD"
tar -xzf .gpu17/nixl/nixl_min.tgz -C "$SITE" || fail "1 unpack wheel"
tar -xzf .gpu17/nixl/nixl_ep_src.tgz -C "$BUILD" || fail "1 unpack nixl source"
tar -xzf .gpu17/nixl/ucx_headers.tgz -C "$BUILD" || fail "1 unpack UCX headers"
LIBS=$SITE/.nixl_cu13.mesonpy.libs DEPLIBS=$SITE/nixl_cu13.libs
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
nvcc --version | tail -2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
ls /usr/include/infiniband/mlx5dv.h 2>/dev/null && echo "image has rdma-core headers" || echo "image has no rdma-core headers"
echo "(the wheel's prebuilt nixl_ep .so files, torch 2.12-2.14 ABI, were left out)"

stage "2/6 prepare the build tree (changes to the /tmp copy are listed)"
EP=$BUILD/nixl/examples/device/ep
rm -fv "$BUILD"/ucx/uct/ib/mlx5/gdaki/gdaki.cuh "$BUILD"/ucx/uct/ib/mlx5/gdaki/d2p.cuh
if [ ! -f /usr/include/infiniband/mlx5dv.h ]; then
  sed -i 's|^#include <infiniband/mlx5dv.h>|// (nixl_ep.sh) dropped: #include <infiniband/mlx5dv.h>|' \
    "$EP/csrc/kernels/configs.cuh"
  grep -n "dropped" "$EP/csrc/kernels/configs.cuh"
fi
MM=$(python3 -c "import torch; print(''.join(torch.__version__.split('.')[:2]))")
UCP=$(basename "$DEPLIBS"/libucp-*.so.0.0.0) UCT=$(basename "$DEPLIBS"/libuct-*.so.0.0.0)
UCS=$(basename "$DEPLIBS"/libucs-*.so.0.0.0) UCM=$(basename "$DEPLIBS"/libucm-*.so.0.0.0)
cat > "$EP/setup_gpu17.py" <<PY
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension
inc = ["csrc", "csrc/kernels"] + ["$BUILD/nixl/src/" + d for d in (
    "api/cpp", "api/cpp/backend", "infra", "core", "core/telemetry", "api/gpu/ucx")] + ["$BUILD/ucx"]
defs = ["-DHAVE_CUDA", "-DTORCH_EXTENSION_NAME=nixl_ep_cpp_torch$MM", "-DTOPK_IDX_BITS=32"]
warn = ["-Wno-deprecated-declarations", "-Wno-unused-variable", "-Wno-sign-compare",
        "-Wno-reorder", "-Wno-attributes"]
setup(name="nixl_ep_gpu17", ext_modules=[CUDAExtension(
    "nixl_ep_cpp_torch$MM",
    ["csrc/nixl_ep.cpp", "csrc/vmm.cpp", "csrc/kernels/nixl_ep_ll.cu", "csrc/kernels/nixl_ep_ht.cu",
     "csrc/kernels/layout.cu", "csrc/kernels/runtime.cu"],
    include_dirs=inc,
    library_dirs=["$LIBS", "$DEPLIBS", "/usr/local/cuda/lib64/stubs"],  # stubs: -lcuda at link
    extra_compile_args={
        "cxx": ["-O3", "-std=c++20"] + defs + warn,
        "nvcc": ["-O3", "-std=c++20", "-gencode", "arch=compute_90,code=sm_90",
                 "-DDISABLE_AGGRESSIVE_PTX_INSTRS", "--expt-relaxed-constexpr",
                 "--ptxas-options=--register-usage-level=10"] + defs
                + [f for w in warn for f in ("-Xcompiler", w)]},
    extra_link_args=["-l:libnixl.so", "-l:$UCP", "-l:$UCT", "-l:$UCS", "-l:$UCM", "-lcuda",
                     "-Wl,-rpath,$LIBS:$DEPLIBS"],
)], cmdclass={"build_ext": BuildExtension})
PY

stage "3/6 build nixl_ep_cpp_torch$MM (log: nixl_build.log)"
T0=$(date +%s)
(cd "$EP" && CPATH=/usr/local/cuda/include/cccl${CPATH:+:$CPATH} MAX_JOBS=16 \
  TORCH_CUDA_ARCH_LIST=9.0 python3 setup_gpu17.py build_ext --inplace > "$OUT/nixl_build.log" 2>&1)
rc=$?
echo "build rc=$rc in $(( $(date +%s) - T0 )) s"
if [ $rc -ne 0 ]; then
  grep -n -m 20 -E "error|fatal|undefined" "$OUT/nixl_build.log"; tail -40 "$OUT/nixl_build.log"
  fail "3 build"
fi
SO=$(ls "$EP"/nixl_ep_cpp_torch"$MM"*.so) || fail "3 no .so produced"
readelf -d "$SO" | grep -E "NEEDED|RPATH|RUNPATH" | tee "$OUT/nixl_ep_so_deps.txt"

stage "4/6 assemble the nixl_ep package (the wheel's Python + the new extension) and import it"
mkdir -p "$SITE/nixl_ep" && cp "$SITE"/nixl_ep_cu13/*.py "$SITE/nixl_ep/" && cp "$SO" "$SITE/nixl_ep/"
export PYTHONPATH=$SITE NIXL_PLUGIN_DIR=$LIBS/plugins
# One GPU, no RDMA NIC: UCX over shared memory, CUDA copy/IPC and TCP (logged, not required).
export UCX_LOG_LEVEL=${UCX_LOG_LEVEL:-warn}
python3 - <<'PY' 2>&1 | tee "$OUT/nixl_import.log" || true
import torch, nixl_ep
print("nixl_ep", nixl_ep.__file__, "topk_idx_t", getattr(nixl_ep, "topk_idx_t", None),
      "sm90", nixl_ep._nixl_ep_cpp.is_sm90_compiled())
PY
python3 -c "import nixl_ep" || fail "4 import nixl_ep"

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
