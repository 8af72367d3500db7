#!/usr/bin/env bash
# DeepEP 567632d with every patch scripts/deepep/build.sh keeps (PR #642's combine fence, PR
# #695's RC QP check, PR #678's timeout override, built with DEEPEP_TIMEOUT_S, default 300), then
# its GPU tests, on one GPU host with the offline kit's .gpu/deepep-567632d.tgz (tests/gpu/README.md,
# "Offline"). Builds DeepEP in /tmp/deepep (a build whose record differs is rebuilt), records
# what was built and what `moe-plugins list` says, then runs the checks of the build record
# (test_deepep_build_gpu.py), deepep_ll on one rank (test_deepep_ll_gpu.py), DeepEP #621's
# repeated combine (test_deepep_ll_combine_repeat.py) and deepep_ht / deepep_auto as two
# processes on one GPU (test_deepep_ht_gpu.py). Logs and results go to $OUT.
# Usage: OUT=/tmp/gpu-out [DEEPEP_TIMEOUT_S=300] bash scripts/gpu/deepep_patches.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export DEEPEP_TIMEOUT_S=${DEEPEP_TIMEOUT_S:-300}
. scripts/gpu/setup_stages.sh  # the set-up stages (shared with h200.sh and the others)

setup_deepep || exit 1
setup_moe_plugins || exit 1
cp /tmp/deepep_build.log /tmp/deepep/deep_ep/moe_plugins_build.json "$OUT/"
export PYTHONPATH=/tmp/deepep PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pip list 2>/dev/null | grep -i nvshmem | tee -a "$OUT/gpu.txt"
python3 -c "from moe_plugins.cli import main; main(['list'])" | tee "$OUT/moe_plugins_list.txt"

stage "GPU tests: the build record, deepep_ll on one rank, the repeated combine"
MOE_PLUGINS_EXPECT_DEEPEP_TIMEOUT_S=$DEEPEP_TIMEOUT_S timeout "${LL_TESTS_S:-330}" \
  python3 -m pytest -q -p no:cacheprovider -p no:xdist -rs -m gpu --timeout 300 \
  tests/gpu/test_deepep_build_gpu.py tests/gpu/test_deepep_ll_gpu.py \
  tests/gpu/test_deepep_ll_combine_repeat.py 2>&1 | tee "$OUT/pytest_ll.log" | tail -15

stage "GPU tests: deepep_ht / deepep_auto, two processes on one GPU"
MOE_PLUGINS_GPU_TIMEOUT_S=${MOE_PLUGINS_GPU_TIMEOUT_S:-100} \
  MOE_PLUGINS_GPU_RECORD="$OUT/deepep_two_ranks_one_gpu.json" timeout "${HT_TESTS_S:-230}" \
  python3 -m pytest -q -p no:cacheprovider -p no:xdist -rxs tests/gpu/test_deepep_ht_gpu.py \
  2>&1 | tee "$OUT/pytest_ht.log" | tail -8
