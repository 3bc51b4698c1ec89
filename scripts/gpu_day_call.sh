#!/usr/bin/env bash
# One call of a lent GPU machine: some of scripts/gpu_day.sh's steps in one command, what they
# wrote gathered into $OUT after each step ($OUT is the only folder whose files come back: at most
# 8 files, 2 folders down). Such a machine starts bare (torch, no omegaconf or datasets: the wheels
# in .whl/ travel with the call and are installed first), goes back 30 s after a call, and runs one
# command for at most 10 minutes: so each call is whole in itself, its steps boxed to BUDGET_S.
#
#     OUT=... scripts/gpu_day_call.sh "STEPS" [BUDGET_S]      (e.g. "tests", "bench compile", 500)
#
# STEPS as GPU_DAY_STEPS (tests bench compile profile batches); BUDGET_S (default 500) bounds the
# whole of gpu_day.sh, the wheels' installation included: keep it under what the call may run. The
# wheels: `make gpu-wheels` here, then name `.whl` in the call's carry. Writes into $OUT:
# gpu_day.json, gpu_day.md, gpu_figures.json and gpu_tests.log (when the suite ran), and day.tar.gz
# (every log and bench.json of the day; profile traces left out). Exits as gpu_day.sh does (2: no GPU).
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 || -z ${OUT:-} ]]; then
  echo "usage: OUT=FOLDER scripts/gpu_day_call.sh \"STEPS\" [BUDGET_S]: \$OUT is the folder whose files come back" >&2
  exit 2
fi
budget=${2:-500}
if ! [[ $budget =~ ^[0-9]+$ ]] || ((10#$budget < 60)); then
  echo "gpu_day_call.sh: BUDGET_S='$budget' is not a number of seconds of at least 60" >&2
  exit 2
fi
day=$(realpath -m -- "${GPU_DAY_DIR:-/tmp/gpu-day}")
OUT=$(realpath -m -- "$OUT") # the caller's, before the cd
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
rc=0
# Gathered into $OUT after every step (GPU_DAY_GATHER), not once at the end: a call the machine's
# limit cuts off still returns what its finished steps wrote.
GPU_DAY_STEPS=$1 GPU_DAY_BUDGET_S=$((10#$budget)) GPU_DAY_GATHER=$OUT bash scripts/gpu_day.sh "$day" || rc=$?
echo "gpu_day_call.sh: gpu_day.sh exit status $rc; in \$OUT: $(cd "$OUT" && echo *)"
exit "$rc"
