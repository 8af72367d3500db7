#!/usr/bin/env bash
# The call bound (moe_plugins.watchdog) on a CUDA GPU host, from the repository root, with
# moe-plugins installed (pip install -e .) and, for the deepep_ll cases, DeepEP's V1 line
# importable as deep_ep (without it those cases are skipped):
#
#   1. tests/gpu/test_watchdog_gpu.py: progress words written by the GPU, 20 captures in a loop
#      with calls in flight (plain torch and a deepep_ll layer), a stuck eager call and a stuck
#      CUDA-graph replay ended within their bound, EP 4 deepep_ll with a peer killed between
#      replays of the captured layer;
#   2. benchmarks/watchdog_cost.py --device cuda: host time per watched call, bound on vs off;
#   3. benchmarks/host_overhead.py --device cuda --call-timeout-s: the adapter with the bound on
#      beside it off and vLLM's in-tree class (needs vLLM's Python; skipped where it fails).
#
# Environment: OUT (default ./watchdog-results): logs and JSON results; PYTHON (default
# python3); TEST_TIMEOUT_S (default 900) bounds the tests, BENCH_TIMEOUT_S (default 300) each
# benchmark; CALL_TIMEOUT_S (default 60) the bound the benchmarks time; BACKENDS (default
# "deepep_ll torch") host_overhead.py's --backends; TOKENS (default "1 8 32 64").
# Exit status: that of the tests (each step's status is printed).
set -uo pipefail
OUT=${OUT:-./watchdog-results}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
echo "== $(date +%T) GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

echo "== $(date +%T) tests/gpu/test_watchdog_gpu.py"
timeout -k 10 "${TEST_TIMEOUT_S:-900}" "$PYTHON" -m pytest -q -p no:cacheprovider -rA -m gpu \
  tests/gpu/test_watchdog_gpu.py --junitxml "$OUT/watchdog_gpu_junit.xml" \
  > "$OUT/watchdog_gpu_tests.log" 2>&1
tests_rc=$?
grep -E "^(PASSED|FAILED|SKIPPED|ERROR|XFAIL)|passed|failed" "$OUT/watchdog_gpu_tests.log" | tail -12
echo "tests rc=$tests_rc"

echo "== $(date +%T) benchmarks/watchdog_cost.py --device cuda"
timeout -k 10 "${BENCH_TIMEOUT_S:-300}" "$PYTHON" benchmarks/watchdog_cost.py --device cuda \
  --json "$OUT/watchdog_cost_cuda.json" 2>&1 | tee "$OUT/watchdog_cost_cuda.log"
echo "watchdog_cost rc=${PIPESTATUS[0]}"

echo "== $(date +%T) benchmarks/host_overhead.py --device cuda --call-timeout-s ${CALL_TIMEOUT_S:-60}"
# shellcheck disable=SC2086  # BACKENDS and TOKENS are lists
timeout -k 10 "${BENCH_TIMEOUT_S:-300}" "$PYTHON" benchmarks/host_overhead.py --device cuda \
  --backends ${BACKENDS:-deepep_ll torch} --tokens ${TOKENS:-1 8 32 64} --quants bf16 \
  --call-timeout-s "${CALL_TIMEOUT_S:-60}" --json "$OUT/host_overhead_bound_cuda.json" \
  > "$OUT/host_overhead_bound_cuda.log" 2>&1
echo "host_overhead rc=$?"
grep -E "^(backend|deepep_ll|torch) " "$OUT/host_overhead_bound_cuda.log" | cut -c1-260
exit $tests_rc
