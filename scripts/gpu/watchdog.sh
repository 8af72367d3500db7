#!/usr/bin/env bash
# The call bound (moe_plugins.callbound.watchdog) on a CUDA GPU host, from the repository root, with
# moe-plugins installed (pip install -e .) and, for the deepep_ll cases, DeepEP's V1 line
# importable as deep_ep (without it those cases are skipped):
#
#   1. tests/gpu/test_watchdog_gpu.py: progress words written by the GPU, layer calls in a step
#      window sharing its one write, 20 captures in a loop with calls in flight (plain torch and
#      a deepep_ll layer), stuck eager calls and CUDA-graph replays (alone and in step windows)
#      ended within their bound, EP 4 deepep_ll with a peer killed between replays of the
#      captured layer (under expect_replay, and in step windows), EP 4 deepep_ll under vLLM's
#      modular kernel with a shared expert (hook mode) with a peer killed between the
#      combine's send and its receive (needs vLLM's Python, as scripts/gpu/h200.sh installs it);
#   2. benchmarks/watchdog_cost.py --device cuda: host time per watched call, bound on vs off,
#      a mark per call and in step windows;
#   3. benchmarks/host_overhead.py --device cuda --call-timeout-s: the adapter with the bound on
#      (a mark per call, and in step windows) beside it off and vLLM's in-tree class (needs
#      vLLM's Python; skipped where it fails).
#
# Environment: OUT (default ./watchdog-results): logs and JSON results; PYTHON (default
# python3); TEST_TIMEOUT_S (default 900) bounds the tests, BENCH_TIMEOUT_S (default 300) each
# benchmark; CALL_TIMEOUT_S (default 60) the bound the benchmarks time; BACKENDS (default
# "deepep_ll torch") host_overhead.py's --backends; TOKENS (default "1 8 32 64"); SAMPLES
# (default: the benchmark's) its eager samples per path; PARTS (default "tests cost overhead")
# which of 1-3 to run; TESTS_K (default: every test) a pytest -k expression for part 1.
# Exit status: that of the tests, 0 when they are not run (each step's status is printed).
set -uo pipefail
OUT=${OUT:-./watchdog-results}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
echo "== $(date +%T) GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

PARTS=${PARTS:-tests cost overhead}
tests_rc=0
if [[ " $PARTS " == *" tests "* ]]; then
echo "== $(date +%T) tests/gpu/test_watchdog_gpu.py"
timeout -k 10 "${TEST_TIMEOUT_S:-900}" "$PYTHON" -m pytest -q -p no:cacheprovider -rA -m gpu \
  tests/gpu/test_watchdog_gpu.py ${TESTS_K:+-k "$TESTS_K"} --junitxml "$OUT/watchdog_gpu_junit.xml" \
  > "$OUT/watchdog_gpu_tests.log" 2>&1
tests_rc=$?
grep -E "^(PASSED|FAILED|SKIPPED|ERROR|XFAIL)|passed|failed" "$OUT/watchdog_gpu_tests.log" | tail -12
echo "tests rc=$tests_rc"
fi

if [[ " $PARTS " == *" cost "* ]]; then

echo "== $(date +%T) benchmarks/watchdog_cost.py --device cuda"
timeout -k 10 "${BENCH_TIMEOUT_S:-300}" "$PYTHON" benchmarks/watchdog_cost.py --device cuda \
  --json "$OUT/watchdog_cost_cuda.json" 2>&1 | tee "$OUT/watchdog_cost_cuda.log"
echo "watchdog_cost rc=${PIPESTATUS[0]}"
fi

if [[ " $PARTS " == *" overhead "* ]]; then

echo "== $(date +%T) benchmarks/host_overhead.py --device cuda --call-timeout-s ${CALL_TIMEOUT_S:-60}"
# shellcheck disable=SC2086  # BACKENDS and TOKENS are lists
timeout -k 10 "${BENCH_TIMEOUT_S:-300}" "$PYTHON" benchmarks/host_overhead.py --device cuda \
  --backends ${BACKENDS:-deepep_ll torch} --tokens ${TOKENS:-1 8 32 64} --quants bf16 \
  --call-timeout-s "${CALL_TIMEOUT_S:-60}" ${SAMPLES:+--samples "$SAMPLES"} \
  --json "$OUT/host_overhead_bound_cuda.json" \
  > "$OUT/host_overhead_bound_cuda.log" 2>&1
echo "host_overhead rc=$?"
grep -E "^(backend|deepep_ll|torch) " "$OUT/host_overhead_bound_cuda.log" | cut -c1-330
fi
exit $tests_rc
