# shellcheck shell=bash
# The set-up stages of the GPU scripts, as functions (sourced, not run): h200.sh, nixl_ep.sh,
# flashinfer.sh and ep_matrix.sh call them, so none of them holds a copy. Each function
# prints its stage line, does its step, and returns non-zero on failure (the caller decides
# whether to stop). They set up the offline kit on a GPU host with Python 3.12, a CUDA torch
# and nvcc (CUDA 13 as written: /usr/local/cuda, sm_90) and none of vLLM / DeepEP / NIXL /
# flashinfer; the kit is made on a machine with network access by scripts/gpu/prepare.sh
# (.gpu/) and scripts/gpu/prepare17.sh (.gpu17/). DeepEP's build takes CUDA_HOME,
# TORCH_CUDA_ARCH_LIST and MAX_JOBS from the environment (defaults /usr/local/cuda, 9.0, 16).
#
#   setup_vllm_py        .gpu/whl/*.whl -> /tmp/site, .gpu/vllm_py-$VLLM_VERSION.tgz -> /tmp/vsrc
#                        (kept where an earlier run set up the same kit)
#                        (VLLM_VERSION: by default the newest release checked, scripts/vllm_versions.py; that release's Python
#                        without its compiled extension; benchmarks/vllm_stand_ins.py)
#   setup_deepep         .gpu/deepep-567632d.tgz with its patches, built in /tmp/deepep by
#                        scripts/deepep/build.sh (kept between runs on the same host: a second
#                        run skips the build)
#   setup_moe_plugins    pip install -e . (the entry points the registry reads)
#   setup_nixl           .gpu17/nixl: NIXL EP's extension built against this torch into
#                        /tmp/nixl_site/nixl_ep (nixl_ep.sh's stages 1-4; log nixl_build.log)
#   setup_flashinfer [PATH]  .gpu17/flashinfer -> /tmp/fisite (FI_VERSION), its all-to-alls
#                        JIT-built (flashinfer.sh's stages 2-3; log fi_jit.log); without the kit,
#                        the version an earlier run set up in /tmp/fisite is used. PATH: what the
#                        jobs put on PYTHONPATH before /tmp/fisite (vLLM's kit: its pin of
#                        apache-tvm-ffi is then the one the modules are built against, as the
#                        jobs load them; a module built against another is rebuilt by the jobs)
#   gpu_pythonpath PARTS...   the PYTHONPATH for the parts set up (deepep vllm nixl flashinfer)
#
# OUT must be set (logs go there). Stage lines: "== HH:MM:SS <what>".

stage() { echo "== $(date +%T) $*"; }

setup_vllm_py() {
  stage "install the kit's wheels and vLLM's Python"
  local v=${VLLM_VERSION:-$(python3 "$(dirname "${BASH_SOURCE[0]}")/../vllm_versions.py" newest)}
  # the same kit set up by an earlier run on this host is kept (with the bytecode its imports
  # compiled: a first import of vLLM's modules by 4 ranks at once takes over a minute)
  local kit
  kit="$v $(cat .gpu/whl/*.whl ".gpu/vllm_py-$v.tgz" | md5sum | cut -c1-32)"
  if [ -f /tmp/vsrc/.kit ] && [ "$(cat /tmp/vsrc/.kit)" = "$kit" ]; then
    echo "vLLM $v's Python and the kit's wheels as an earlier run set them up (/tmp/vsrc, /tmp/site)"
    return 0
  fi
  rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .gpu/whl/*.whl || return 1
  rm -rf /tmp/vsrc && mkdir -p /tmp/vsrc && tar -xzf ".gpu/vllm_py-$v.tgz" -C /tmp/vsrc || return 1
  mkdir -p "/tmp/vsrc/vllm-$v.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$v" > "/tmp/vsrc/vllm-$v.dist-info/METADATA"
  echo "$kit" > /tmp/vsrc/.kit
  echo "vLLM $v's Python in /tmp/vsrc"
}

setup_deepep() {
  stage "build DeepEP V1 567632d with the patches of scripts/deepep/build.sh (/tmp/deepep, kept for the next run; DEEPEP_TIMEOUT_S: its timeouts)"
  DEEPEP_SRC=.gpu/deepep-567632d.tgz bash scripts/deepep/build.sh /tmp/deepep > /tmp/deepep_build.log 2>&1 \
    || { cp /tmp/deepep_build.log "$OUT/"; tail -40 /tmp/deepep_build.log; return 1; }
  tail -2 /tmp/deepep_build.log
}

setup_moe_plugins() {
  stage "install moe-plugins (entry points)"
  python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip_install.log 2>&1 \
    || { tail -20 /tmp/pip_install.log; cp /tmp/pip_install.log "$OUT/" 2>/dev/null; return 1; }
}

# NIXL EP: our setup.py around nixl's sources (CUDAExtension, C++20, sm_90,
# UCX's GDAKI device headers removed so only the cuda_ipc device path is compiled; nixl_ep's
# configs.cuh include of <infiniband/mlx5dv.h> dropped where the host lacks rdma-core headers).
# See scripts/gpu/nixl_ep.sh for the why of each step. Sets NIXL_SITE, NIXL_LIBS.
setup_nixl() {
  local SITE=/tmp/nixl_site BUILD=/tmp/nixl_build
  export PATH=/usr/local/cuda/bin:$PATH CUDA_HOME=/usr/local/cuda
  stage "nixl 1/4 unpack the stripped wheel, nixl_ep sources and UCX headers into /tmp"
  rm -rf "$SITE" "$BUILD" && mkdir -p "$SITE" "$BUILD"
  tar -xzf .gpu17/nixl/nixl_min.tgz -C "$SITE" || { echo "unpack wheel failed"; return 1; }
  tar -xzf .gpu17/nixl/nixl_ep_src.tgz -C "$BUILD" || { echo "unpack nixl source failed"; return 1; }
  tar -xzf .gpu17/nixl/ucx_headers.tgz -C "$BUILD" || { echo "unpack UCX headers failed"; return 1; }
  local LIBS=$SITE/.nixl_cu13.mesonpy.libs DEPLIBS=$SITE/nixl_cu13.libs
  NIXL_SITE=$SITE NIXL_LIBS=$LIBS
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -2
  ls /usr/include/infiniband/mlx5dv.h 2>/dev/null && echo "host has rdma-core headers" || echo "host has no rdma-core headers"
  echo "(the wheel's prebuilt nixl_ep .so files, torch 2.12-2.14 ABI, were left out)"

  stage "nixl 2/4 prepare the build tree (changes to the /tmp copy are listed)"
  local EP=$BUILD/nixl/examples/device/ep
  rm -fv "$BUILD"/ucx/uct/ib/mlx5/gdaki/gdaki.cuh "$BUILD"/ucx/uct/ib/mlx5/gdaki/d2p.cuh
  if [ ! -f /usr/include/infiniband/mlx5dv.h ]; then
    sed -i 's|^#include <infiniband/mlx5dv.h>|// (nixl_ep.sh) dropped: #include <infiniband/mlx5dv.h>|' \
      "$EP/csrc/kernels/configs.cuh"
    grep -n "dropped" "$EP/csrc/kernels/configs.cuh"
  fi
  local MM UCP UCT UCS UCM
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

  stage "nixl 3/4 build nixl_ep_cpp_torch$MM (log: nixl_build.log)"
  local T0 rc SO
  T0=$(date +%s)
  (cd "$EP" && CPATH=/usr/local/cuda/include/cccl${CPATH:+:$CPATH} MAX_JOBS=16 \
    TORCH_CUDA_ARCH_LIST=9.0 python3 setup_gpu17.py build_ext --inplace > "$OUT/nixl_build.log" 2>&1)
  rc=$?
  echo "build rc=$rc in $(( $(date +%s) - T0 )) s"
  if [ $rc -ne 0 ]; then
    grep -n -m 20 -E "error|fatal|undefined" "$OUT/nixl_build.log"; tail -40 "$OUT/nixl_build.log"
    return 1
  fi
  SO=$(ls "$EP"/nixl_ep_cpp_torch"$MM"*.so) || { echo "no .so produced"; return 1; }
  readelf -d "$SO" | grep -E "NEEDED|RPATH|RUNPATH" | tee "$OUT/nixl_ep_so_deps.txt"

  stage "nixl 4/4 assemble the nixl_ep package (the wheel's Python + the new extension) and import it"
  mkdir -p "$SITE/nixl_ep" && cp "$SITE"/nixl_ep_cu13/*.py "$SITE/nixl_ep/" && cp "$SO" "$SITE/nixl_ep/"
  export NIXL_PLUGIN_DIR=$LIBS/plugins
  # One GPU, no RDMA NIC: UCX over shared memory, CUDA copy/IPC and TCP (logged, not required).
  export UCX_LOG_LEVEL=${UCX_LOG_LEVEL:-warn}
  PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} python3 - <<'PY' 2>&1 | tee "$OUT/nixl_import.log" || true
import torch, nixl_ep
print("nixl_ep", nixl_ep.__file__, "topk_idx_t", getattr(nixl_ep, "topk_idx_t", None),
      "sm90", nixl_ep._nixl_ep_cpp.is_sm90_compiled())
PY
  PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} python3 -c "import nixl_ep" || { echo "import nixl_ep failed"; return 1; }
}

# flashinfer FI_VERSION (default 0.7.2.post1; or 0.7.4): the stripped wheel of that version and
# the wheels it imports, then its two-sided all-to-all module JIT-built with the host's nvcc
# (0.7.2.post1: MnnvlMoe's "comm"; 0.7.4: moe_ep's "nvlink_two_sided_alltoall"), and its
# one-sided module (0.7.2.post1: comm's MoeAlltoAll; 0.7.4: "nvlink_one_sided_alltoall"; a
# failure there is logged, not fatal). Install
# moe-plugins before PYTHONPATH holds these wheels (flashinfer.sh: pip itself must not see them).
setup_flashinfer() {
  local v=${FI_VERSION:-0.7.2.post1} kit=.gpu17/flashinfer
  stage "install flashinfer $v (stripped) and its missing dependencies into /tmp/fisite"
  if [ -f "$kit/flashinfer_python-$v-py3-none-any.whl" ]; then
    rm -rf /tmp/fisite
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fisite \
      "$kit/flashinfer_python-$v-py3-none-any.whl" \
      $(ls "$kit"/*.whl | grep -v '/flashinfer_python-') > "$OUT/fi_pip.log" 2>&1 \
      || { tail -30 "$OUT/fi_pip.log"; return 1; }
  elif [ -d "/tmp/fisite/flashinfer_python-$v.dist-info" ]; then
    # no kit in this checkout, but an earlier run on this host set this version up: use it
    echo "no $kit/flashinfer_python-$v-py3-none-any.whl: flashinfer $v as an earlier run set it up in /tmp/fisite"
  else
    echo "no $kit/flashinfer_python-$v-py3-none-any.whl (scripts/gpu/prepare17.sh makes it) and none set up in /tmp/fisite"
    return 1
  fi
  export FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
  export PATH=/usr/local/cuda/bin:$PATH CUDA_HOME=/usr/local/cuda
  nvidia-smi -q | grep -iE "fabric|clique|imex" | head -8 || true

  stage "import flashinfer and JIT-build the all-to-all module (build log: fi_jit.log)"
  local rc
  # flashinfer's JIT cache is keyed by the build's flags, which name the include directory of
  # the apache-tvm-ffi imported: build with the path the jobs will have
  PYTHONPATH=${1:+$1:}/tmp/fisite${PYTHONPATH:+:$PYTHONPATH} python3 - > "$OUT/fi_jit.log" 2>&1 <<'PY'
import time, torch, flashinfer, tvm_ffi
print("torch", torch.__version__, "flashinfer", flashinfer.__version__, flashinfer.__file__,
      "apache-tvm-ffi", getattr(tvm_ffi, "__version__", "?"), tvm_ffi.__file__)
t = time.time()
try:  # 0.7.2.post1: MnnvlMoe (its moe_ep runs on the same module)
    from flashinfer.comm.trtllm_alltoall import get_comm_alltoall_module as build
    name = "comm"
except ImportError:  # 0.7.4: moe_ep's NVLinkTwoSidedAlltoAll only
    from flashinfer.moe_ep.backends.split.comm.nvlink_two_sided.kernels import (
        get_nvlink_two_sided_alltoall_module as build)
    name = "nvlink_two_sided_alltoall"
build()
print(f"{name} module built and loaded in {time.time() - t:.1f} s")
t = time.time()
try:  # the one-sided module too (its ranks would each wait on one JIT build otherwise)
    try:  # 0.7.4: moe_ep's own module
        from flashinfer.moe_ep.backends.split.comm.nvlink_one_sided.kernels import (
            get_nvlink_one_sided_alltoall_module as build_one_sided)
    except ImportError:  # 0.7.2.post1: the class wraps flashinfer.comm's MoeAlltoAll
        from flashinfer.comm.trtllm_moe_alltoall import (
            get_moe_alltoall_module as build_one_sided)
    build_one_sided()
    print(f"one-sided module built and loaded in {time.time() - t:.1f} s")
except Exception as e:  # the one-sided jobs then fail with the same error; the others run
    print(f"!! one-sided module not built: {type(e).__name__}: {e}")
PY
  rc=$?; tail -25 "$OUT/fi_jit.log"
  if [ $rc -ne 0 ]; then
    find /tmp/fi_ws -name '*.log' -o -name 'build.ninja' 2>/dev/null | head -5
    cp "$(find /tmp/fi_ws -name build.ninja | head -1)" "$OUT/fi_build.ninja" 2>/dev/null
    echo "JIT build failed (see fi_jit.log)"; return 1
  fi
}

gpu_pythonpath() {
  local parts=() p
  for p in "$@"; do
    case $p in
      deepep) parts+=(/tmp/deepep) ;;
      vllm) parts+=(/tmp/vsrc /tmp/site) ;;
      nixl) parts+=(/tmp/nixl_site) ;;
      flashinfer) parts+=(/tmp/fisite) ;;
    esac
  done
  local IFS=:
  echo "${parts[*]}"
}
