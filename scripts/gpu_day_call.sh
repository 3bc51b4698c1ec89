#!/usr/bin/env bash
# One call of a lent GPU machine: some of scripts/gpu_day.sh's steps in one command, then what
# they wrote gathered into $OUT, the only folder whose files come back (at most 8 files, 2 folders
# down). Such a machine starts bare (torch, no omegaconf or datasets: the wheels in .whl/ travel
# with the call and are installed first), goes back 30 s after a call, and runs one command for at
# most 10 minutes: so each call is whole in itself, its steps boxed to BUDGET_S.
#
#     OUT=... scripts/gpu_day_call.sh "STEPS" [BUDGET_S]      (e.g. "tests", "bench compile", 500)
#
# STEPS as GPU_DAY_STEPS (tests bench compile profile batches); BUDGET_S (default 500) bounds the
# steps, and leaves the installation and the gathering inside a 600 s call. The wheels: `make
# gpu-wheels` here, then name `.whl` in the call's carry. Writes into $OUT: gpu_day.json,
# gpu_day.md, gpu_figures.json and gpu_tests.log (when the suite ran), and day.tar.gz (every log
# and bench.json of the day; profile traces left out). Exits as gpu_day.sh does (2: no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $# -lt 1 || $# -gt 2 || -z ${OUT:-} ]]; then
  echo "usage: OUT=FOLDER scripts/gpu_day_call.sh \"STEPS\" [BUDGET_S]: \$OUT is the folder whose files come back" >&2
  exit 2
fi
budget=${2:-500}
if ! [[ $budget =~ ^[0-9]+$ ]] || ((10#$budget < 60)); then
  echo "gpu_day_call.sh: BUDGET_S='$budget' is not a number of seconds of at least 60" >&2
  exit 2
fi
day=${GPU_DAY_DIR:-/tmp/gpu-day}
mkdir -p "$OUT"
rc=0
GPU_DAY_STEPS=$1 GPU_DAY_BUDGET_S=$((10#$budget)) bash scripts/gpu_day.sh "$day" || rc=$?

# Gathered flat: a folder deeper than two below $OUT would not come back.
for file in "$day/gpu_day.json" "$day/gpu_day.md" "$day/tests/gpu_figures.json" "$day/tests/gpu_tests.log"; do
  [[ ! -f $file ]] || cp "$file" "$OUT/"
done
if [[ -d $day ]]; then
  tar -czf "$OUT/day.tar.gz" --exclude='*trace*' -C "$(dirname "$day")" "$(basename "$day")"
  size=$(stat -c %s "$OUT/day.tar.gz")
  if ((size > 16 * 1024 * 1024)); then # over what comes back: the logs alone
    tar -czf "$OUT/day.tar.gz" -C "$(dirname "$day")" "$(basename "$day")/logs"
    echo "gpu_day_call.sh: day.tar.gz holds the logs alone (the whole day was $size bytes)" >&2
  fi
fi
echo "gpu_day_call.sh: gpu_day.sh exit status $rc; in \$OUT: $(cd "$OUT" && echo *)"
exit "$rc"
