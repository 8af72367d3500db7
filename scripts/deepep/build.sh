#!/usr/bin/env bash
# Build DeepEP's V1 line (commit 567632d) with two fixes of DeepEP's, each a patch beside this
# script named by its source, applied and checked here:
#   567632d-combine-fence.patch  DeepEP PR #642 (merged as d4f41e4): without it the low-latency
#                                combine can return wrong results on repeated runs above 256
#                                tokens per rank (DeepEP issue #621);
#   567632d-rc-qp-assert.patch   DeepEP PR #695 (87d8305): without it the first low-latency
#                                dispatch traps with NVSHMEM 3.6 or later where NVSHMEM's IBGDA
#                                transport does not start (one host without an RDMA NIC, or
#                                peers reached over NVLink only: torch 2.15 brings NVSHMEM 3.7);
#   567632d-timeout-override.patch
#                                DeepEP PR #678 (0f6a826): DeepEP's two watchdog constants can be
#                                set at build time (the options below).
# This is the DeepEP that moe-plugins' deepep_ll, deepep_ht and deepep_auto backends are
# verified on.
#
#   scripts/deepep/build.sh [DEST]        clone DeepEP into DEST (default ./DeepEP) and build it
#   DEEPEP_SRC=FILE.tgz scripts/deepep/build.sh [DEST]
#                                         offline: unpack a source archive of 567632d (made on a
#                                         connected machine with `git archive -o FILE.tgz 567632d`
#                                         in a DeepEP clone) into DEST and build it there
#
# DeepEP's own bound on a wait for a peer (default: DeepEP's, 100 s), two compiled constants:
#   DEEPEP_TIMEOUT_S=N     NUM_CPU_TIMEOUT_SECS: seconds a host thread waits for the peers'
#                          counts in normal-mode dispatch (deepep_ht, deepep_auto), then raises
#                          "DeepEP error: CPU recv timeout"; and, unless DEEPEP_TIMEOUT_CYCLES is
#                          given, NUM_TIMEOUT_CYCLES = N x 2G: GPU clock cycles a kernel spins on a
#                          peer's flag, then traps (or masks the peer, with a mask buffer); at
#                          DeepEP's "200G cycles ~= 100s", about N seconds at 2 GHz
#   DEEPEP_TIMEOUT_CYCLES=C
#                          NUM_TIMEOUT_CYCLES alone (for a GPU whose SM clock is far from 2 GHz)
# Raise them where the first steps legitimately keep peers waiting longer than 100 s (a
# DeepGEMM JIT warm-up of 10-20 minutes: DEEPEP_TIMEOUT_S=1800). The record names both values;
# moe-plugins' call-bound backstop follows the built timeout (docs/faults.md).
#
# Needs a CUDA torch, nvcc and NVSHMEM (NVSHMEM_DIR, or the nvidia-nvshmem-cu12/13 pip package that
# DeepEP's setup.py finds). Environment: CUDA_HOME (default /usr/local/cuda), TORCH_CUDA_ARCH_LIST
# (default 9.0: Hopper; use your GPUs' compute capability), MAX_JOBS (default: the CPU count).
# Idempotent: a DEST that already holds this build is left as it is. Afterwards:
#   export PYTHONPATH=DEST${PYTHONPATH:+:$PYTHONPATH}
# and `moe-plugins list` names the DeepEP it finds (DEST/deep_ep/moe_plugins_build.json records
# the commit and the patches applied).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
COMMIT=567632d
DEST=$(realpath -m "${1:-DeepEP}")
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
INFO=$DEST/deep_ep/moe_plugins_build.json

# Each patch: its file beside this script, the name the build record gives it, the source file
# it changes and a line only the patched source has (how it is verified).
PATCHES=(
  "567632d-combine-fence.patch pr642-combine-fence csrc/kernels/internode_ll.cu fence_view_async_shared"
  "567632d-rc-qp-assert.patch pr695-rc-qp-assert csrc/kernels/internode_ll.cu needs_ibgda"
  "567632d-timeout-override.patch pr678-timeout-override csrc/kernels/configs.cuh ifndef.NUM_CPU_TIMEOUT_SECS"
)
CPU_S=${DEEPEP_TIMEOUT_S:-100}
[[ "$CPU_S" =~ ^[1-9][0-9]{0,6}$ ]] && CYCLES=${DEEPEP_TIMEOUT_CYCLES:-$((CPU_S * 2000000000))}
[[ "$CPU_S" =~ ^[1-9][0-9]{0,6}$ && "${CYCLES:-}" =~ ^[1-9][0-9]{0,15}$ ]] || {
  echo "error: DEEPEP_TIMEOUT_S=$CPU_S, DEEPEP_TIMEOUT_CYCLES=${DEEPEP_TIMEOUT_CYCLES:-}:" \
    "give positive integers (seconds, GPU cycles)" >&2
  exit 1; }
NAMES=$(for p in "${PATCHES[@]}"; do set -- $p; printf '"%s", ' "$2"; done)
RECORD=$(printf '{"line": "v1", "commit": "%s", "patches": [%s], "timeouts": %s}' "$COMMIT" \
  "${NAMES%, }" "{\"NUM_CPU_TIMEOUT_SECS\": $CPU_S, \"NUM_TIMEOUT_CYCLES\": $CYCLES}")

if [ -f "$INFO" ] && ls "$DEST"/deep_ep_cpp*.so >/dev/null 2>&1 \
    && [ "$(cat "$INFO")" = "$RECORD" ]; then
  echo "DeepEP $COMMIT as recorded in $INFO is already built in $DEST"
  exit 0
fi

if [ -n "${DEEPEP_SRC:-}" ]; then
  rm -rf "$DEST" && mkdir -p "$DEST" && tar -xzf "$DEEPEP_SRC" -C "$DEST"
elif [ ! -d "$DEST/.git" ]; then
  git clone https://github.com/deepseek-ai/DeepEP "$DEST"
  git -C "$DEST" checkout -q "$COMMIT"
else
  git -C "$DEST" checkout -q "$COMMIT"
fi
# 567632d is the V1 tree (deep_ep/buffer.py); the V2-era tree (deep_ep/buffers/legacy.py) already
# has the fence and builds differently.
if [ ! -f "$DEST/deep_ep/buffer.py" ] || [ -f "$DEST/deep_ep/buffers/legacy.py" ]; then
  echo "error: $DEST is not DeepEP's V1 tree at $COMMIT (no deep_ep/buffer.py)" >&2
  exit 1
fi

cd "$DEST"
# git must not take a repository above DEST for DEST's own (it would apply nothing, silently)
export GIT_CEILING_DIRECTORIES=$(dirname "$DEST")
for p in "${PATCHES[@]}"; do
  set -- $p  # file, name, source, marker
  if grep -q "$4" "$3"; then
    echo "$2 is already applied in $DEST"
    continue
  fi
  git apply "$HERE/$1" || { echo "error: $1 does not apply to $DEST: is it $COMMIT?" >&2; exit 1; }
  grep -q "$4" "$3" || { echo "error: $1 was not applied in $DEST ($3 lacks $4)" >&2; exit 1; }
  echo "applied $2 ($1)"
done

# The timeouts reach both compilers: 567632d's setup.py takes no flags, so the host compiler
# gets them through CPPFLAGS (setuptools adds it to every C++ compile) and nvcc through
# NVCC_APPEND_FLAGS (nvcc reads it itself). A fresh build folder: ninja does not see a change
# of NVCC_APPEND_FLAGS and would keep objects compiled with other values.
DEFINES="-DNUM_CPU_TIMEOUT_SECS=$CPU_S -DNUM_TIMEOUT_CYCLES=${CYCLES}ull"
rm -rf build
# With CUDA 13 the cuda/std/* headers live in the toolkit's include/cccl, which the host compiler
# must see.
CPATH=$CUDA_HOME/include/cccl${CPATH:+:$CPATH} \
  CPPFLAGS="${CPPFLAGS:+$CPPFLAGS }$DEFINES" \
  NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }$DEFINES" \
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  python3 setup.py build_ext --inplace
# Where torch built with ninja, its build file shows what the host compiler was given.
NINJA=$(ls build/*/build.ninja 2>/dev/null | head -1 || true)
if [ -n "$NINJA" ] && ! grep -q -- "-DNUM_CPU_TIMEOUT_SECS=$CPU_S " "$NINJA"; then
  echo "error: the host compiler did not get $DEFINES (see $NINJA)" >&2
  exit 1
fi
echo "$RECORD" > "$INFO"
echo "DeepEP $COMMIT built in $DEST: $RECORD; use it with:"
echo "  export PYTHONPATH=$DEST\${PYTHONPATH:+:\$PYTHONPATH}"
