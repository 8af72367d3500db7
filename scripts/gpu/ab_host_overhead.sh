#!/usr/bin/env bash
# Before/after host overhead on one GPU host: the GPU tests of this checkout, then
# benchmarks/host_overhead.py (deepep_ll) alternately on an earlier commit's code and on this
# checkout's, ROUNDS times each, so host drift hits both alike.
# The earlier code: `git archive <commit> moe_plugins prepare_finalize all2all benchmarks
# pyproject.toml | tar x -C .before` in this checkout (its own sys.path[0] makes its benchmark
# import its own modules; the registry's entry points name modules, not files). Needs the offline
# kit's .gpu/whl .gpu/vllm_py-<version>.tgz .gpu/deepep-567632d.tgz (scripts/gpu/h200.sh sets them up).
# Usage: OUT=$OUT ROUNDS=2 [BACKENDS="deepep_ll torch"] [GPU_TESTS=0] bash scripts/gpu/ab_host_overhead.sh
# (BACKENDS: host_overhead.py's --backends, default deepep_ll; GPU_TESTS=0 skips the tests)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
if [ "${GPU_TESTS:-1}" = 1 ]; then
  GPU_TEST_TIMEOUT_S=${GPU_TEST_TIMEOUT_S:-150} bash scripts/gpu/h200.sh -m gpu tests/gpu \
    --timeout 150 --deselect tests/gpu/test_deepep_ht_gpu.py || echo "!! GPU tests failed"
else  # set up only (h200.sh with a test selection that runs nothing)
  bash scripts/gpu/h200.sh --co -q tests/gpu/test_overlap_gpu.py > /dev/null || echo "!! set-up failed"
fi
export PYTHONPATH=/tmp/deepep:/tmp/vsrc:/tmp/site PYTHONUNBUFFERED=1
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in before after; do
    dir=.; [ "$side" = before ] && dir=.before
    echo "== $(date +%T) host_overhead $side, round $round"
    (cd "$dir" && timeout 150 python3 benchmarks/host_overhead.py --device cuda \
      --backends ${BACKENDS:-deepep_ll} --json "$OUT/host_overhead_${side}_${round}.json") \
      > "$OUT/host_overhead_${side}_${round}.log" 2>&1 || echo "!! $side $round failed"
    tail -14 "$OUT/host_overhead_${side}_${round}.log"
  done
done
exit 0
