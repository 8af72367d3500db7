#!/usr/bin/env bash
# The one-GPU EP matrix: every backend at EP > 1 on its real library, N processes
# sharing cuda:0 over a gloo world (tests/gpu/ep_harness.py), through our layer and through
# vLLM's MoE kernel beside vLLM's in-tree classes, plus faults (tests/gpu/ep_matrix.py says what
# each job checks). Two halves, each set up from its part of the offline kit (scripts/gpu/
# prepare.sh and prepare17.sh, tests/gpu/README.md) and run on its own:
#
#   HALF=A bash scripts/gpu/ep_matrix.sh   kit: .gpu/whl .gpu/vllm_py-<version>.tgz .gpu/deepep-567632d.tgz
#                                                .gpu17/nixl .gpu17/flashinfer (0.7.4; or none,
#                                                after a half B run with FI_VERSION=0.7.4 on
#                                                the same host: the flashinfer it set up)
#          vLLM's path (deepep_ll, nixl_ep, deepep_ht at EP 2/4, SP at dp2 x tp2, DBO, CUDA graph;
#          flashinfer_nvlink_one_sided at EP 2/4 beside vLLM's in-tree one-sided class, on
#          flashinfer FI_VERSION, default 0.7.4 here: vLLM 0.34 calls its dispatch keyword
#          runtime_max_tokens_per_rank, as its pin 0.7.3 does; FLASHINFER=0 leaves flashinfer
#          out and those two jobs fail to import it), nixl_ep through our layer (EP 2/4,
#          masking), nixl_ep faults
#   HALF=B bash scripts/gpu/ep_matrix.sh   kit: .gpu/deepep-567632d.tgz .gpu17/flashinfer
#          deepep_ll / deepep_ht / deepep_auto through our layer at EP 2/4/8 (+ deepep_ll masking),
#          torch over gloo at EP 4, flashinfer two-sided at EP 2/4 (FI_VERSION: 0.7.2.post1, the
#          default, or 0.7.4), faults of torch / DeepEP
#
# Each half builds what it needs with the shared set-up stages (scripts/gpu/setup_stages.sh),
# then runs its jobs in order inside what is left of its time budget CALL_S (default 570 s);
# each job is bounded, a job that cannot get its time is recorded "not_run: not started" (run
# it later with ONLY=), and the record is rewritten after every job. In $OUT:
#   ep_one_gpu_<HALF>.json   the record: rows backend/path/ep/tp/quant/case/status/max_rel_err/
#                            detail, each with from_run.commit (MOE_PLUGINS_COMMIT names it;
#                            else the checkout's git HEAD, +uncommitted where files differ)
#   ep_logs_<HALF>.tgz       this script's log, where every rank of every job stopped
#                            (ep_runs_<HALF>.json), set-up and build logs
# Then: python -m tests.gpu.ep_matrix --merge A.json B.json -o tests/gpu/results/ep_one_gpu.json
# (--earlier OLD.json keeps an earlier record's rows where these have none, marked in from_run)
# and --markdown tests/gpu/results/ep_one_gpu.json for tests/gpu/README.md.
#
# Options (environment): HALF (A|B), ONLY / SKIP (space-separated job-name substrings, e.g.
# ONLY="layer/deepep_ll fault/torch"), CALL_S, MIN_JOB_S (default 45), EP_MATRIX_FAULT_MARGIN_S
# (a fault job's bound beyond the library's own timeout, default 60), FLASHINFER=0 (either half
# without flashinfer's set-up, for ONLY= runs of other jobs), DEEPEP=0 (either half without
# DeepEP's build, half A without NIXL's too, for ONLY= runs of flashinfer's jobs), FI_VERSION
# (flashinfer's release: default 0.7.2.post1 in half B, 0.7.4 in half A), GPU_TESTS_S (> 0: the
# one-rank GPU tests of the half's libraries first, bounded to that many seconds; MATRIX=0:
# only those),
# DEVICE=cpu (no set-up, the emulated libraries: the CPU dry run of this very script),
# DUMP_S (every DUMP_S s, each rank's thread stacks into the logs' stacks/: Python's, and native
# ones where py-spy is installed; for a rank that does not end).
# Never under CUDA MPS (DeepEP's low-latency kernels fail there); no latency is reported.
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-/tmp/gpu-out}
HALF=${HALF:-A}
DEVICE=${DEVICE:-cuda}
CALL_S=${CALL_S:-570}
LOGS=$OUT/ep_logs_$HALF
mkdir -p "$LOGS"
exec > >(tee -a "$LOGS/ep_matrix_$HALF.log") 2>&1
. scripts/gpu/setup_stages.sh
case $HALF in A|B) ;; *) echo "HALF must be A or B, got $HALF"; exit 2 ;; esac

pack() {  # everything but the record into one file
  tar -czf "$OUT/ep_logs_$HALF.tgz" -C "$OUT" "ep_logs_$HALF" && rm -rf "$LOGS"
}

if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader
  if pgrep -f nvidia-cuda-mps >/dev/null 2>&1 || [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
    echo "!! CUDA MPS seems active: DeepEP's low-latency kernels fail under MPS (not changed here)"
  fi
  if [ "$HALF" = A ]; then
    if [ "${DEEPEP:-1}" = 0 ]; then  # vLLM's flashinfer jobs only
      OUT=$LOGS setup_vllm_py && OUT=$LOGS setup_moe_plugins
      ok=$?
      PP=$(gpu_pythonpath vllm)
    else
      OUT=$LOGS setup_vllm_py && OUT=$LOGS setup_deepep && OUT=$LOGS setup_moe_plugins \
        && OUT=$LOGS setup_nixl
      ok=$?
      PP=$(gpu_pythonpath deepep vllm nixl)
    fi
    # flashinfer last, after moe-plugins (pip must not see its wheels), behind vLLM's kit on
    # the path; its ninja on PATH too (vLLM's has_flashinfer() asks for nvcc and ninja)
    if [ $ok -eq 0 ] && [ "${FLASHINFER:-1}" = 1 ]; then
      if FI_VERSION=${FI_VERSION:-0.7.4} OUT=$LOGS setup_flashinfer "$PP"; then
        PP=$PP:$(gpu_pythonpath flashinfer)
        export PATH=/tmp/fisite/bin:$PATH
      else
        echo "!! flashinfer set-up failed: the vllm/flashinfer_one_sided jobs will fail"
      fi
    fi
  else
    # moe-plugins first: pip must not see the kit's flashinfer wheels (flashinfer.sh)
    if [ "${FLASHINFER:-1}" = 1 ] && [ "${DEEPEP:-1}" = 0 ]; then  # flashinfer's jobs only
      OUT=$LOGS setup_moe_plugins && OUT=$LOGS setup_flashinfer
      ok=$?
      PP=$(gpu_pythonpath flashinfer)
    elif [ "${FLASHINFER:-1}" = 1 ]; then
      OUT=$LOGS setup_moe_plugins && OUT=$LOGS setup_deepep && OUT=$LOGS setup_flashinfer
      ok=$?
      PP=$(gpu_pythonpath deepep flashinfer)
    else  # jobs that need DeepEP only (ONLY=...): no flashinfer set-up
      OUT=$LOGS setup_moe_plugins && OUT=$LOGS setup_deepep
      ok=$?
      PP=$(gpu_pythonpath deepep)
    fi
  fi
  if [ $ok -ne 0 ]; then echo "!! set-up failed; nothing ran"; pack; exit 1; fi
  export PYTHONPATH=$PP PYTHONUNBUFFERED=1
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
fi

if [ "$DEVICE" = cuda ] && [ "${GPU_TESTS_S:-0}" -gt 0 ]; then
  # the one-rank GPU tests of this half's libraries first, bounded (the matrix gets the rest)
  stage "one-rank GPU tests (${GPU_TESTS_S} s at most)"
  if [ "$HALF" = A ]; then SEL=(tests/gpu/test_deepep_ll_gpu.py tests/gpu/test_deepep_ht_gpu.py tests/gpu/test_overlap_gpu.py
      tests/gpu/test_vllm_cuda.py tests/gpu/test_vllm_dbo_cuda.py tests/gpu/test_nixl_ep_gpu.py)
  else SEL=(tests/gpu/test_deepep_ll_gpu.py tests/gpu/test_overlap_gpu.py); fi
  # one pytest process per file: each backend's tests set up their own one-rank group
  END=$(( $(date +%s) + GPU_TESTS_S ))
  for f in "${SEL[@]}"; do
    LEFT_T=$(( END - $(date +%s) ))
    [ "$LEFT_T" -gt 10 ] || { echo "$f: not started (GPU_TESTS_S spent)"; continue; }
    timeout -k 10 "$LEFT_T" python3 -m pytest -q -p no:cacheprovider -rs -m gpu "$f" \
      > "$LOGS/pytest_gpu_$HALF.$(basename "$f" .py).log" 2>&1
    echo "$f rc=$? $(tail -1 "$LOGS/pytest_gpu_$HALF.$(basename "$f" .py).log")"
  done
fi
if [ "${MATRIX:-1}" = 0 ]; then pack; exit 0; fi  # the one-rank GPU tests only

stage "EP matrix half $HALF on $DEVICE"
ARGS=()
for p in ${ONLY:-}; do ARGS+=(--only "$p"); done
for p in ${SKIP:-}; do ARGS+=(--skip "$p"); done
LEFT=$(( CALL_S - ($(date +%s) - T0) ))
# every process the matrix starts inherits this: afterwards none may be left
export EP_MATRIX_TAG="ep-matrix-$$-$T0"
# DUMP_S: where a rank that does not end waits: every DUMP_S s each rank writes every thread's
# Python stack (from a thread of its own: tests/gpu/ep_harness.py), and, where py-spy is
# installed, its native stack is taken too
if [ -n "${DUMP_S:-}" ]; then
  export EP_HARNESS_DUMP_S=$DUMP_S EP_HARNESS_DUMP_DIR=$LOGS/stacks
  mkdir -p "$EP_HARNESS_DUMP_DIR"
  if command -v py-spy >/dev/null 2>&1; then
    ( while sleep "$DUMP_S"; do
        for f in $(env -u EP_MATRIX_TAG sh -c 'grep -lsz "^EP_MATRIX_TAG=$1\$" /proc/[0-9]*/environ \
            2>/dev/null' sh "$EP_MATRIX_TAG"); do
          pid=$(echo "$f" | cut -d/ -f3)
          grep -qsz "^EP_HARNESS_DUMP_S=" "/proc/$pid/environ" || continue
          { echo "== $(date +%T) pid $pid: $(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-120)"
            timeout 20 py-spy dump --native --pid "$pid" 2>&1; } >> "$EP_HARNESS_DUMP_DIR/pyspy-$pid.txt"
        done
      done ) &
    DUMPER=$!
  fi
fi
python3 -m tests.gpu.ep_matrix --device "$DEVICE" --half "$HALF" --list "${ARGS[@]}"
# SIGINT first: the harness then kills and reaps every rank; SIGKILL 10 s later at the latest
timeout -k 10 -s INT "$LEFT" python3 -m tests.gpu.ep_matrix --device "$DEVICE" --half "$HALF" \
  --budget-s $(( LEFT - 15 )) --min-job-s "${MIN_JOB_S:-45}" "${ARGS[@]}" \
  --record "$OUT/ep_one_gpu_$HALF.json" --runs "$LOGS/ep_runs_$HALF.json" > "$LOGS/matrix_$HALF.txt" 2>&1
rc=$?
[ -n "${DUMPER:-}" ] && kill "$DUMPER" 2>/dev/null
grep -E "^== |^   (passed|failed|not_run|refused)|^   [0-9.]+ s" "$LOGS/matrix_$HALF.txt" | cut -c1-220
echo "matrix rc=$rc ($(( $(date +%s) - T0 )) s since the call started)"
if [ -f "$OUT/ep_one_gpu_$HALF.json" ]; then
  python3 -m tests.gpu.ep_matrix --markdown "$OUT/ep_one_gpu_$HALF.json" | tail -1
fi
# (the search itself runs without the tag; /proc/PID/environ is a process's start-up env)
left=$(env -u EP_MATRIX_TAG sh -c 'grep -lsz "^EP_MATRIX_TAG=$1\$" /proc/[0-9]*/environ \
  2>/dev/null | cut -d/ -f3 | tr "\n" " "' sh "$EP_MATRIX_TAG")
for pid in $left; do [ -d "/proc/$pid" ] && ps -o pid,ppid,etimes,cmd -p "$pid" | tail -1; done
[ -n "${left// /}" ] && echo "!! processes of the matrix left: $left" || echo "no process of the matrix left"
pack
exit 0
