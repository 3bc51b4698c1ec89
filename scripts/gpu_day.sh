#!/usr/bin/env bash
# A lent GPU's day in one command: what a GPU should run, in order of value, each step in a time
# box (timeout(1)) so that the whole fits GPU_DAY_BUDGET_S (40 minutes) and no command passes 9.5
# minutes (its box, at most 510 s, and GPU_DAY_GRACE_S, 45 s, to stop):
#   1. the GPU acceptance suite (scripts/gpu_check.sh: no .venv or package index needed);
#   2. `distqa bench` rows for BERT-base, seq 512, bf16: 1 process per GPU count (DDP), and
#      DataParallel beside it (--dp) with 2 GPUs or more; samples/s, scaling, MFU;
#   3. the speed-up of train.compile=true over step 2's eager 1-process row;
#   3b. (`profile`) where an eager 1-process step's time goes: `distqa bench --profile`, its
#      trace and table of operators in OUTPUT_DIR/profile/profile-np1/;
#   4. the largest batch per GPU that fits, per set-up of scripts/bench_fsdp_gpu.sh (BERT-base and
#      -large, DDP and FSDP, activation checkpointing off and on), searched from the batch
#      `distqa.bench.memory` names for this GPU's memory: up by 10 % (then 25 %) while it fits,
#      down by 10 % (then 25 %) while it does not, so a formula within 10 % costs two runs.
#      Last: the most runs and the least value per minute, it gets what the day has left.
#
#     scripts/gpu_day.sh OUTPUT_DIR
#
# Writes OUTPUT_DIR/gpu_day.json (versions, the GPUs, each step's status ok/failed/timed-out/skipped
# with its reason and seconds, the figures read from the steps' JSON files) and OUTPUT_DIR/gpu_day.md
# (tables in docs/benchmarks.md's form), rebuilt after every step (scripts/gpu_day_report.py), so a
# day cut short still leaves them; each step's output is in OUTPUT_DIR/logs/. Prints one line per
# step and what it could not do. Exits 2 without a GPU, 1 when a step failed or timed out, else 0.
#
# GPU_DAY_STEPS runs some of the steps (where one command may not run 40 minutes): e.g.
# GPU_DAY_STEPS=tests, then GPU_DAY_STEPS="bench compile" into the same OUTPUT_DIR; the report then
# gathers every call's steps (a step run again replaces its earlier outcome).
#
#   PYTHON            interpreter with torch (default: python3); the `distqa` on PATH, else PYTHON -m distqa
#   WHEELS, SITE      as for scripts/gpu_check.sh (wheels installed by step 1, used by every step)
#   GPU_CHECK         step 1's command (default: scripts/gpu_check.sh)
#   GPU_DAY_BUDGET_S  seconds for the whole day (default: 2400); a step with under
#                     GPU_DAY_MIN_BOX_S (default: 60) left is skipped
#   GPU_DAY_STEPS     which steps, of: tests bench compile profile batches (default: all five, in that order)
#   GPU_DAY_SETUPS    step 4's set-ups, e.g. "bert-base-random-ddp-ac-false bert-large-random-fsdp-ac-true"
#                     (default: all eight, MODEL-PARALLEL-ac-AC)
#   GPU_DAY_BOX_TESTS, GPU_DAY_BOX_BENCH, GPU_DAY_BOX_COMPILE, GPU_DAY_BOX_PROFILE, GPU_DAY_BOX_BATCHES
#                     each step's box in seconds (default: 480, 510, 360, 180, 840; step 4's is shared
#                     among its set-ups, what one leaves going to the next); none over
#                     GPU_DAY_MAX_BOX_S (default: 510)
#   GPU_DAY_REPEATS   timed repeats of steps 2 and 3's rows (default: 2; 1 where a call is short)
#   GPU_DAY_GRACE_S   after a box, seconds between SIGINT (distqa bench then stops its launch's
#                     processes, waiting 30 s for them) and SIGKILL (default: 45)
#   GPU_DAY_GATHER    a folder (a lent machine's $OUT: scripts/gpu_day_call.sh) that gets, after
#                     every step, gpu_day.json, gpu_day.md, the suite's gpu_figures.json and
#                     gpu_tests.log, and day.tar.gz (the rest; traces left out): a call cut off at
#                     its limit still returns the steps that ended
set -euo pipefail

if [[ $# -ne 1 || $1 == -* ]]; then
  echo "usage: scripts/gpu_day.sh OUTPUT_DIR" >&2
  exit 2
fi
began=$SECONDS # the budget counts the GPU count's probe and the wheels' install too
out=$(realpath -m -- "$1") # before the cd below: a relative OUTPUT_DIR is the caller's
gather=${GPU_DAY_GATHER:+$(realpath -m -- "$GPU_DAY_GATHER")}
cd "$(dirname "$0")/.."
steps=" ${GPU_DAY_STEPS:-tests bench compile profile batches} "
for step in $steps; do
  [[ " tests bench compile profile batches " == *" $step "* ]] || {
    echo "gpu_day.sh: GPU_DAY_STEPS names '$step': the steps are tests, bench, compile, profile, batches" >&2
    exit 2
  }
done
all_setups=()
for model in bert-base-random bert-large-random; do
  for parallel in ddp fsdp; do
    for ac in false true; do all_setups+=("$model-$parallel-ac-$ac"); done
  done
done
given=${GPU_DAY_SETUPS:-${all_setups[*]}}
read -ra setups <<< "${given//$'\n'/ }"
((${#setups[@]} > 0)) || {
  echo "gpu_day.sh: GPU_DAY_SETUPS names no set-up: leave it unset for all, or name some of ${all_setups[*]}" >&2
  exit 2
}
for i in "${!setups[@]}"; do
  name=${setups[i]}
  [[ " ${all_setups[*]} " == *" $name "* ]] || {
    echo "gpu_day.sh: GPU_DAY_SETUPS names '$name': the set-ups are ${all_setups[*]}" >&2
    exit 2
  }
  [[ " ${setups[*]:0:i} " != *" $name "* ]] || {
    echo "gpu_day.sh: GPU_DAY_SETUPS names '$name' twice" >&2
    exit 2
  }
done
repeats=${GPU_DAY_REPEATS:-2}
[[ $repeats =~ ^[1-9][0-9]*$ ]] || {
  echo "gpu_day.sh: GPU_DAY_REPEATS='$repeats' is not a number of repeats of at least 1" >&2
  exit 2
}
PYTHON=${PYTHON:-python3}
# The GPUs torch sees (CUDA_VISIBLE_DEVICES applied), not those nvidia-smi lists: `distqa bench
# --nproc 1,2` refuses a count it cannot see. (GPU_DAY_GPUS: the tests' stand-in for a GPU count.)
# (The count is the last line printed: a library may print on import before it.)
gpus=${GPU_DAY_GPUS:-$({ "$PYTHON" -c 'import torch; print(); print(torch.cuda.device_count())' 2> /dev/null || true; } | tail -n 1)}
[[ $gpus =~ ^[0-9]+$ ]] || gpus=0
if ((gpus == 0)); then
  echo "gpu_day.sh: no GPU visible (torch.cuda.device_count() is 0 for $PYTHON): nothing to run, nothing written" >&2
  exit 2
fi

budget=${GPU_DAY_BUDGET_S:-2400}
min_box=${GPU_DAY_MIN_BOX_S:-60}
max_box=${GPU_DAY_MAX_BOX_S:-510}
grace=${GPU_DAY_GRACE_S:-45}
deadline=$((began + budget))
failed=0
mkdir -p "$out/logs"
[[ -n ${GPU_DAY_STEPS:-} ]] || : > "$out/steps.jsonl" # a whole day starts a fresh report
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpus.csv" 2> /dev/null || true
df -h /dev/shm > "$out/logs/shm.txt" 2>&1 || true # the DataLoader workers' batches pass through it

report() { # ACTION ARGS...: one step's outcome into OUTPUT_DIR/steps.jsonl, and the report rebuilt
  # A report that cannot be written must not cost the GPU time still left: said, and the day goes on.
  "$PYTHON" scripts/gpu_day_report.py "$1" "$out" "${@:2}" --gpus "$gpus" --budget "$budget" ||
    echo "gpu_day: warning: scripts/gpu_day_report.py $1 failed (status $?)" >&2
  [[ -z $gather ]] || gather_into "$gather"
}

gather_into() { # FOLDER: what the day has written so far, flat (a folder deeper than 2 would not come back)
  local into=$1 file size
  mkdir -p "$into" || return 0
  # Each file written beside its name, then renamed: a call killed meanwhile keeps the earlier one.
  for file in "$out/gpu_day.json" "$out/gpu_day.md" "$out/tests/gpu_figures.json" "$out/tests/gpu_tests.log"; do
    [[ ! -f $file ]] || { cp "$file" "$into/.partial" && mv "$into/.partial" "$into/${file##*/}"; } || true
  done
  tar -czf "$into/.partial" --exclude='*trace*' -C "$(dirname "$out")" "$(basename "$out")" 2> /dev/null || true
  size=$(stat -c %s "$into/.partial" 2> /dev/null || echo 0)
  if ((size > 16 * 1024 * 1024)); then # over what comes back: the logs alone
    tar -czf "$into/.partial" -C "$(dirname "$out")" "$(basename "$out")/logs" || true
    echo "gpu_day: day.tar.gz holds the logs alone (the whole day was $size bytes)" >&2
  fi
  [[ ! -f $into/.partial ]] || mv "$into/.partial" "$into/day.tar.gz" || true # (a gathering must not stop the day)
}

run_step() { # NAME BOX_S COMMAND...: COMMAND in its box, its output in logs/NAME.log, its outcome recorded
  local name=$1 box=$2 left=$((deadline - SECONDS - grace))
  shift 2
  ((box <= max_box)) || box=$max_box
  ((box <= left)) || box=$left
  if ((box < min_box)); then
    local why="only ${left} s left of the ${budget} s budget"
    ((box == left)) || why="its box of $box s is below GPU_DAY_MIN_BOX_S=$min_box"
    report skip --name "$name" --reason "$why"
    return 0
  fi
  local log="$out/logs/${name//\//-}.log" start=$SECONDS started=${EPOCHREALTIME:-} rc=0
  echo "gpu_day: $name, at most $box s: $*"
  # SIGINT, not SIGTERM: distqa bench turns it into stopping its torchrun (a session of its own,
  # which a signal to this process group would not reach); pytest stops cleanly on it too.
  timeout -s INT -k "$grace" "$box" "$@" > "$log" 2>&1 || rc=$?
  ((rc == 0)) || failed=1
  report record --name "$name" --rc "$rc" --seconds $((SECONDS - start)) --started "${started/,/.}" \
    --box "$box" --log "$log"
}

# shellcheck disable=SC2329  # run by the steps through `bash -c`, which the function's export reaches
largest_batch() { # DIR NPROC FROM KEY=VALUE...: the largest batch per GPU that fits, searched from FROM
  local dir=$1 nproc=$2 batch=$3 fits=0 fails=0 runs=0 pct
  shift 3
  mkdir -p "$dir"
  ((batch >= 1)) || batch=1
  while ((runs < 8)); do
    runs=$((runs + 1))
    if distqa bench --nproc "$nproc" --output "$dir/batch-$batch" --warmup 2 --steps 2 --repeats 1 --timeout 240 \
      "$@" train.batch_size="$batch" > "$dir/batch-$batch.log" 2>&1; then
      fits=$batch
    elif grep -qi 'out of .*memory' "$dir/batch-$batch.log"; then
      fails=$batch
    else # not memory: a fault the search cannot step around
      tail -n 5 "$dir/batch-$batch.log" >&2
      return 1
    fi
    ((fits == 0 || fails == 0)) || return 0 # one that fits beside one that does not: found
    pct=$((runs == 1 ? 10 : 25))
    if ((fails == 0)); then
      batch=$((batch + (batch * pct / 100 > 0 ? batch * pct / 100 : 1)))
    else
      batch=$((batch - (batch * pct / 100 > 0 ? batch * pct / 100 : 1)))
      ((batch >= 1)) || { tail -n 5 "$dir/batch-$fails.log" >&2; return 1; } # not even one sequence
    fi
  done
  # Eight runs and no batch that fits beside one that does not: every one fit (the report says
  # "the largest size tried"), or none did, a failure.
  ((fits > 0)) || { tail -n 5 "$dir/batch-$fails.log" >&2; return 1; }
}
export -f largest_batch

predicted_batch() { # MODEL PARALLEL AC: distqa.bench.memory's largest batch per GPU in this GPU's memory
  local mib
  mib=$(awk -F', *' 'NR == 1 { print $2 + 0 }' "$out/gpus.csv" 2> /dev/null)
  ((${mib:-0} > 0)) || { echo "nvidia-smi gave no memory size (gpus.csv)" >&2; return 1; }
  "$PYTHON" -c '
import sys
from distqa.bench.memory import ENCODERS, largest_batch
model, parallel, ac, gpus, mib = sys.argv[1:]
name = {"bert-base-random": "BERT-base", "bert-large-random": "BERT-large"}[model]
encoder = next(e for e in ENCODERS if e.name == name)
print(largest_batch(encoder, gpus=int(gpus), seq=512, gib=float(mib) / 1024, sharded=parallel == "fsdp",
                    checkpointed=ac == "true"))
' "$1" "$2" "$3" "$gpus" "${mib:-0}"
}

# Without an installed distqa (a lent machine): the checkout's, with the wheels step 1 installs.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WHEELS=${WHEELS-.whl} SITE=${SITE:-/tmp/site}
if ! command -v distqa > /dev/null; then
  shim=$(mktemp -d)
  trap 'rm -rf "$shim"' EXIT
  printf '#!/bin/sh\nexec %q -m distqa "$@"\n' "$PYTHON" > "$shim/distqa"
  chmod +x "$shim/distqa"
  export PATH="$shim:$PATH"
  if [[ -n $WHEELS ]] && compgen -G "$WHEELS/*.whl" > /dev/null; then
    if [[ $steps != *" tests "* ]]; then # step 1 (gpu_check.sh) installs them; without it, the same here
      "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl
    fi
    export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  else
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi

# 1. The acceptance suite; gpu_check.sh writes its log and figures under $OUT.
[[ $steps != *" tests "* ]] ||
  run_step gpu-tests "${GPU_DAY_BOX_TESTS:-480}" env OUT="$out/tests" PYTHON="$PYTHON" bash "${GPU_CHECK:-scripts/gpu_check.sh}"

# 2. Throughput rows: bench_gpu.sh's settings, one process per GPU count, DP beside DDP.
nproc=1
for ((n = 2; n <= gpus; n *= 2)); do nproc+=",$n"; done
common=(model.name=bert-base-random task.max_seq_len=512 train.precision=bf16 train.batch_size=32)
dp=()
if [[ $steps != *" bench "* ]]; then
  :
elif ((gpus < 2)); then
  report note "1 GPU: DP/DDP scaling rows skipped (they need 2 GPUs or more)"
elif distqa bench --help 2> /dev/null | grep -q -- '--dp'; then
  dp=(--dp)
else
  report note "distqa bench has no --dp option here: DP rows skipped, DDP rows only"
fi
[[ $steps != *" bench "* ]] || run_step bench "${GPU_DAY_BOX_BENCH:-510}" \
  distqa bench --nproc "$nproc" --output "$out/bench" --repeats "$repeats" --timeout 300 "${common[@]}" "${dp[@]}"

# 3. Compiled against step 2's eager 1-process row; 10 warm-up steps leave the compilation out.
[[ $steps != *" compile "* ]] || run_step compile "${GPU_DAY_BOX_COMPILE:-360}" \
  distqa bench --nproc 1 --output "$out/compile" --warmup 10 --repeats "$repeats" --timeout 300 "${common[@]}" train.compile=true

# 3b. Where an eager step's time goes (the H100 of 2026-11-27 spent ~27 ms per step that no batch size changed).
[[ $steps != *" profile "* ]] || run_step profile "${GPU_DAY_BOX_PROFILE:-180}" \
  distqa bench --nproc 1 --output "$out/profile" --profile --repeats 1 --steps 5 --timeout 150 "${common[@]}"

# 4. The largest batch per set-up, on every GPU; each set-up gets its share of what is left.
batches_end=$((SECONDS + ${GPU_DAY_BOX_BATCHES:-840}))
for i in "${!setups[@]}"; do
  [[ $steps == *" batches "* ]] || break
  name=${setups[i]}
  [[ $name =~ ^(.+)-(ddp|fsdp)-ac-(true|false)$ ]]
  model=${BASH_REMATCH[1]} parallel=${BASH_REMATCH[2]} ac=${BASH_REMATCH[3]}
  share=$(((batches_end - SECONDS) / (${#setups[@]} - i)))
  if ((share < min_box)); then
    report skip --name "largest-batch/$name" --reason "the set-ups before it used this step's box (GPU_DAY_BOX_BATCHES)"
    continue
  fi
  rm -rf "$out/batches/$name" # an earlier day's runs in the same OUTPUT_DIR would count as this one's
  mkdir -p "$out/batches/$name"
  if ! from=$(predicted_batch "$model" "$parallel" "$ac" 2> "$out/batches/$name/formula.log"); then
    from=""
    report note "largest-batch/$name: no figure of distqa.bench.memory ($(tail -n 1 "$out/batches/$name/formula.log")): the search starts at 16"
  fi
  printf '{"formula_largest_batch": %s}\n' "${from:-null}" > "$out/batches/$name/formula.json"
  # shellcheck disable=SC2016  # "$@" is bash -c's own: the function's arguments follow
  run_step "largest-batch/$name" "$share" bash -c 'largest_batch "$@"' largest_batch "$out/batches/$name" "$gpus" \
    "${from:-16}" model.name="$model" task.max_seq_len=512 train.precision=bf16 train.parallel="$parallel" \
    train.activation_checkpointing="$ac"
done

report build
exit "$failed"
