#!/usr/bin/env bash
# Build DeepEP's V1 line (commit 567632d) with the low-latency combine fence of DeepEP PR #642
# (567632d-combine-fence.patch, beside this script: without it the low-latency combine can return
# wrong results on repeated runs above 256 tokens per rank, DeepEP issue #621). This is the DeepEP
# that moe-plugins' deepep_ll, deepep_ht and deepep_auto backends are verified on.
#
#   scripts/deepep/build.sh [DEST]        clone DeepEP into DEST (default ./DeepEP) and build it
#   DEEPEP_SRC=FILE.tgz scripts/deepep/build.sh [DEST]
#                                         offline: unpack a source archive of 567632d (made on a
#                                         connected machine with `git archive -o FILE.tgz 567632d`
#                                         in a DeepEP clone) into DEST and build it there
#
# Needs a CUDA torch, nvcc and NVSHMEM (NVSHMEM_DIR, or the nvidia-nvshmem-cu12/13 pip package that
# DeepEP's setup.py finds). Environment: CUDA_HOME (default /usr/local/cuda), TORCH_CUDA_ARCH_LIST
# (default 9.0: Hopper; use your GPUs' compute capability), MAX_JOBS (default: the CPU count).
# Idempotent: a DEST that already holds this build is left as it is. Afterwards:
#   export PYTHONPATH=DEST${PYTHONPATH:+:$PYTHONPATH}
# and `moe-plugins list` names the DeepEP it finds (DEST/deep_ep/moe_plugins_build.json records
# the commit and the patch applied).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PATCH=$HERE/567632d-combine-fence.patch
COMMIT=567632d
DEST=$(realpath -m "${1:-DeepEP}")
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
INFO=$DEST/deep_ep/moe_plugins_build.json

if [ -f "$INFO" ] && ls "$DEST"/deep_ep_cpp*.so >/dev/null 2>&1 && grep -q 'pr642' "$INFO"; then
  echo "DeepEP $COMMIT with the PR #642 fence is already built in $DEST"
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
if grep -q fence_view_async_shared csrc/kernels/internode_ll.cu; then
  echo "the PR #642 fence is already applied in $DEST"
else
  git apply "$PATCH" || { echo "error: the PR #642 fence does not apply to $DEST: is it $COMMIT?" >&2; exit 1; }
  grep -q fence_view_async_shared csrc/kernels/internode_ll.cu \
    || { echo "error: the PR #642 fence was not applied in $DEST" >&2; exit 1; }
  echo "applied the PR #642 fence ($(basename "$PATCH"))"
fi

# With CUDA 13 the cuda/std/* headers live in the toolkit's include/cccl, which the host compiler
# must see.
CPATH=$CUDA_HOME/include/cccl${CPATH:+:$CPATH} \
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  python3 setup.py build_ext --inplace
printf '{"line": "v1", "commit": "%s", "patches": ["pr642-combine-fence"]}\n' "$COMMIT" > "$INFO"
echo "DeepEP $COMMIT with the PR #642 fence built in $DEST; use it with:"
echo "  export PYTHONPATH=$DEST\${PYTHONPATH:+:\$PYTHONPATH}"
