#!/usr/bin/env bash
# flashinfer_nvlink_two_sided against the real flashinfer-python (FI_VERSION: 0.7.2.post1, the
# default, or 0.7.4) on ONE GPU shared by two processes (our backend refuses a single rank).
# flashinfer JIT-compiles its all-to-all kernels with the host's nvcc on first use: 0.7.2.post1's
# MnnvlMoe csrc/trtllm_alltoall*.cu (JIT module "comm"), 0.7.4's moe_ep NVLinkTwoSidedAlltoAll
# csrc/nvlink_two_sided_*.cu (JIT module "nvlink_two_sided_alltoall"). With network access,
# `pip install 'flashinfer-python==0.7.4'` and `pytest -m gpu tests/gpu/test_flashinfer_gpu.py`
# do the same without this script.
#
# The offline kit's part (git-ignored, made by scripts/gpu/prepare17.sh on a machine with network
# access):
#   .gpu17/flashinfer/flashinfer_python-<version>-py3-none-any.whl   re-zipped, stripped (below)
#   .gpu17/flashinfer/*.whl   the wheels `import flashinfer` needs that a plain torch environment
#                             lacks (--deps; the same for both versions)
#
# Left out of the flashinfer wheel (the two-sided all-to-all paths never load them):
#   - flashinfer/data/csrc, data/include, data/cutlass, data/spdlog: every file EXCEPT
#     the #include closure of the two-sided all-to-all's JIT sources that the wheel has
#     (csrc/trtllm_alltoall.cu, trtllm_alltoall_prepare.cu: flashinfer/jit/comm.py's
#     gen_comm_alltoall_module; csrc/nvlink_two_sided_alltoall.cu, nvlink_two_sided_prepare.cu:
#     gen_nvlink_two_sided_alltoall_module), resolved over the JIT include path (data/include, data/csrc, data/cutlass/*, data/spdlog,
#     data/cccl/*); headers outside the wheel (CUDA, tvm_ffi) come from the host / tvm_ffi wheel.
#     data/cccl stays whole (macro includes). Checked without a GPU with pip's nvcc 13.0.88:
#     both .cu files compile for sm_90 from the stripped tree with flashinfer's JIT flags.
#   - flashinfer/experimental's subpackages that `import flashinfer` does not import (it imports
#     cake_nvfp4_per_token in 0.7.2.post1 and 0.7.4, and cake_w8a8_megamoe_ep16 in 0.7.4, seen
#     without a GPU; the two-sided all-to-all imports none), so that each kit stays small.
#   - non-Python kernel sources elsewhere (*.cu, *.cuh, *.c, *.h, *.md under flashinfer/
#     experimental, moe_ep/kernel_src, fused_moe/backends, gdn_kernels, ...): JIT inputs of other
#     kernels. Every *.py and *.json stays: `import flashinfer` imports nearly all modules.
#
# Modes:  flashinfer.sh --strip WHEEL OUTDIR   (the connected machine; used by prepare17.sh)
#         flashinfer.sh --deps                 (prints the extra wheels to download)
#         [FI_VERSION=0.7.4] flashinfer.sh [pytest args...]   (the GPU host, repo root; results
#                                              in $OUT; the kit's wheel of that version)
set -uo pipefail

# import flashinfer.comm.trtllm_alltoall needs tvm_ffi, requests, pynvml, cuda.bindings,
# tabulate (seen without a GPU); the rest are its declared light dependencies.
# Versions: the newest on the index when prepare17.sh runs, except cuda-python/cuda-bindings held
# to 13.0.x (for a driver of the 580 series, CUDA 13.0) and tvm-ffi to flashinfer's <0.2 bound.
DEPS="apache-tvm-ffi>=0.1.11,<0.2 cuda-python>=13.0,<13.1 cuda-bindings>=13.0,<13.1 cuda-pathfinder
requests urllib3 idna certifi charset-normalizer nvidia-ml-py tabulate einops click packaging tqdm
ninja numpy"

if [ "${1:-}" = "--deps" ]; then printf '%s\n' $DEPS; exit 0; fi

if [ "${1:-}" = "--strip" ]; then
  set -e
  python3 - "$2" "$3" <<'PY'
import os, re, sys, zipfile
whl, outdir = sys.argv[1:3]
z = zipfile.ZipFile(whl)
names = set(z.namelist())
D = "flashinfer/data/"
search = [D + "include/", D + "csrc/", D + "spdlog/include/", D + "csrc/nv_internal/",
          D + "csrc/nv_internal/include/"]
search += sorted({n[: n.index("/include/") + 9] for n in names
                  if n.startswith((D + "cutlass/", D + "cccl/")) and "/include/" in n})
search += [D + "cccl/cub/", D + "cccl/thrust/", D + "cccl/libcudacxx/include/"]
inc = re.compile(rb'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)

def resolve(name, here):
    for base in [here] + search:
        p = os.path.normpath(base + name)
        if p in names:
            return p
    return None

# the all-to-alls' JIT sources (flashinfer/jit/comm.py of each release: two-sided; one-sided,
# whose module also compiles TensorRT-LLM's moeAlltoAllKernels.cu and four common .cpp files)
NV = "nv_internal/"
roots = [D + "csrc/" + f for f in (
    "trtllm_alltoall.cu", "trtllm_alltoall_prepare.cu", "nvlink_two_sided_alltoall.cu",
    "nvlink_two_sided_prepare.cu", "trtllm_moe_alltoall.cu", "nvlink_one_sided_alltoall.cu",
    "nvlink_one_sided_lamport.cu",
    NV + "tensorrt_llm/kernels/moe/communication/moeAlltoAllKernels.cu",
    *(NV + "cpp/common/" + c for c in ("envUtils.cpp", "tllmException.cpp", "logger.cpp",
                                       "stringUtils.cpp")))]
keep, todo, outside = set(), [r for r in roots if r in names], set()
assert todo, f"{whl}: none of the all-to-alls' sources {roots}"
todo_roots = list(todo)
while todo:
    f = todo.pop()
    if f in keep:
        continue
    keep.add(f)
    for m in inc.findall(z.read(f)):
        p = resolve(m.decode(), f.rsplit("/", 1)[0] + "/")
        if p is None:
            outside.add(m.decode())
        elif p not in keep:
            todo.append(p)
drop_ext = (".cu", ".cuh", ".c", ".h", ".hpp", ".md", ".cubin")
X = "flashinfer/experimental/"
EXPERIMENTAL_IMPORTED = {"cake_nvfp4_per_token", "cake_w8a8_megamoe_ep16"}
os.makedirs(outdir, exist_ok=True)
out = os.path.join(outdir, os.path.basename(whl))
kept = 0
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as o:
    for n in sorted(names):
        if n.startswith(D):
            # cccl is kept whole: its headers include each other through macros
            # (#include _CCCL_...), which a textual closure misses (seen: cub/cub.cuh then
            # mixed the CTK's libcu++ into the vendored one and failed to compile).
            if n not in keep and not n.endswith(".py") and not n.startswith(D + "cccl/"):
                continue
        elif n.startswith("flashinfer/") and n.endswith(drop_ext):
            continue
        elif (n.startswith(X) and n.count("/") > 2
              and n.split("/")[2] not in EXPERIMENTAL_IMPORTED):
            continue
        o.writestr(z.getinfo(n), z.read(n))  # RECORD is stale; installed with --no-deps only
        kept += 1
print(f"{out}: {kept} of {len(names)} files; JIT sources {[r[len(D):] for r in todo_roots]}; "
      f"data/ closure {len(keep)} files; "
      f"headers from outside the wheel: {sorted(outside)}")
PY
  exit 0
fi

# ---------------------------------------------------------------- on the GPU host
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
. scripts/gpu/setup_stages.sh  # stages 2-3: setup_flashinfer (shared with ep_matrix.sh)
exec > >(tee -a "$OUT/flashinfer_run.log") 2>&1

stage "1/4 install moe-plugins (entry points), before PYTHONPATH holds the kit's wheels"
setup_moe_plugins || exit 1

setup_flashinfer || exit 1
export PYTHONPATH=/tmp/fisite PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

stage "4/4 GPU tests (two processes on cuda:0)"
if [ $# -eq 0 ]; then set -- tests/gpu/test_flashinfer_gpu.py; fi
timeout 420 python3 -m pytest -q -p no:cacheprovider -rs -m gpu "$@" 2>&1 | tee "$OUT/pytest_flashinfer.log"
