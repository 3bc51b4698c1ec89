#!/usr/bin/env bash
# A multi-node run on Neu.ro: NNODES jobs of .neuro/live.yml's `distributed_training`, one per node.
# Builds nothing: run steps 1-7 of docs/containers.md#neuro first (the image, the volumes, the
# `download` and `prepare` jobs: configs/bert-base.yaml trains on the split they write).
# Arguments after `--` go to `distqa train` (default: the job's).
#
#   scripts/run_distributed_on_platform.sh 2 -- --config configs/bert-base.yaml output_dir=/app/results/ddp
#
# 1. starts node 0 (master_addr=self), 2. waits until it runs and reads its internal hostname from
# `neuro status`, 3. starts nodes 1..NNODES-1 pointed at that hostname, 4. streams node 0's logs.
# On Ctrl-C, on any failure and at the end it kills every job it started.
#
# Variables:
#   RUN_NAME       prefix of the job names (default distqa-<date+time>; lowercase, digits, '-')
#   MASTER_PORT    rendezvous port on node 0 (default 29500)
#   START_TIMEOUT  seconds to wait for node 0 to be running (default 1800: image pull, GPU queue)
#   POLL_SECONDS   between two status checks (default 10)
#   END_GRACE_SECONDS  how long node 0 may still show as running after its log stream ended
#                  before the script reconnects to the logs (default 60)
#   NEURO_FLOW, NEURO  the commands (default neuro-flow and neuro)
#
# Reading the hostname: `neuro status JOB` prints a two-column table; the script takes the row whose
# first two words are "Internal Hostname" (not "Internal Hostname Named") and the "Status" row.
# COLUMNS is set wide because the table is cut to the terminal width with an ellipsis otherwise.
set -euo pipefail

job=distributed_training
usage() { echo "usage: $0 [NNODES] [-- TRAIN ARGS ...]" >&2; }
die() {
  echo "run_distributed_on_platform.sh: error: $*" >&2
  exit 1
}
say() { echo "run_distributed_on_platform.sh: $*" >&2; }

nnodes=2
if (($#)) && [[ $1 != -- ]]; then
  nnodes=$1
  shift
fi
if (($#)); then
  [[ $1 == -- ]] || { usage; exit 2; }
  shift
fi
[[ $nnodes =~ ^[1-9][0-9]*$ ]] || die "NNODES must be a positive integer, got '$nnodes'"

run=${RUN_NAME:-distqa-$(date +%m%d-%H%M%S)}
# Platform job names: a letter, then lowercase letters and digits in groups joined by single '-'.
[[ $run =~ ^[a-z](-?[a-z0-9])*$ && ${#run} -le 32 ]] ||
  die "RUN_NAME='$run' must be a letter, then lowercase letters and digits joined by single '-', at most 32 characters"
port=${MASTER_PORT:-29500}
start_timeout=${START_TIMEOUT:-1800}
poll=${POLL_SECONDS:-10}
neuro_flow=${NEURO_FLOW:-neuro-flow}
neuro=${NEURO:-neuro}
for tool in "$neuro_flow" "$neuro"; do
  command -v "$tool" >/dev/null || die "'$tool' not found: pip install neuro-flow (it brings neuro as well)"
done

# The training arguments travel as one parameter that neuro-flow splits with shlex: quote every
# word that is not plainly safe, in single quotes (the form shlex and sh both read).
train_args=()
if (($#)); then
  quoted=""
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./=:,@+%-]+$ ]]; then
      quoted+=" $arg"
    else
      escaped=${arg//\'/\'\"\'\"\'} # each ' becomes '"'"'
      quoted+=" '$escaped'"
    fi
  done
  train_args=(--param train_args "${quoted# }")
fi

started=()
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  if ((${#started[@]})); then
    say "stopping ${started[*]}"
    for suffix in "${started[@]}"; do
      "$neuro_flow" kill "$job" "$suffix" >/dev/null 2>&1 || say "could not kill $job $suffix: check \`$neuro_flow ps\`"
    done
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# start_node RANK MASTER_ADDR: one job; its suffix is also its platform job name.
start_node() {
  local rank=$1 addr=$2 name="$run-n$1"
  started+=("$name")
  "$neuro_flow" run "$job" --suffix "$name" --param name "$name" --param nnodes "$nnodes" \
    --param node_rank "$rank" --param master_addr "$addr" --param master_port "$port" \
    ${train_args[@]+"${train_args[@]}"} ||
    die "could not start node $rank ($name)"
}

# field NAME: the value of one row of the status table on stdin. The value is the first word after
# the row name, so "Status  failed (OOMKilled)" gives "failed".
field() {
  sed 's/\x1b\[[0-9;]*m//g' | awk -v key="$1" '
    # No early exit: the writer of the pipe would get SIGPIPE and fail the pipeline under pipefail.
    found { next }
    { line = $0; sub(/^[ \t]+/, "", line) }
    index(line, key) == 1 {
      rest = substr(line, length(key) + 1)
      if (rest ~ /^[ \t]/ && split(rest, words, " ") && words[1] != "Named") { print words[1]; found = 1 }
    }'
}

job_status() { COLUMNS=1000 NO_COLOR=1 TERM=dumb "$neuro" status "$1"; }

master=$run-n0
say "starting node 0 of $nnodes ($master)"
start_node 0 self

deadline=$((SECONDS + start_timeout))
while :; do
  # A failed status call (the new job not listed yet, a network blip) counts as "not yet".
  status_text=$(job_status "$master" 2>&1) || say "\`$neuro status $master\` failed; retrying"
  state=$(field Status <<<"$status_text")
  case $state in
    running) break ;;
    pending | suspended | "") ;;
    *) die "node 0 ($master) is $state before the other nodes started; see \`$neuro_flow logs $job $master\`" ;;
  esac
  ((SECONDS < deadline)) || die "node 0 ($master) is not running after ${start_timeout}s"
  sleep "$poll"
done
host=$(field "Internal Hostname" <<<"$status_text")
[[ -n $host ]] || die "no 'Internal Hostname' in \`$neuro status $master\`"
say "node 0 runs at $host:$port"

for ((rank = 1; rank < nnodes; rank++)); do
  say "starting node $rank of $nnodes ($run-n$rank)"
  start_node "$rank" "$host"
done

# neuro-flow logs follows the job until it ends. The stream can end a moment before the platform
# marks the job finished, or break while it still runs: poll for a final state, and reconnect.
while :; do
  "$neuro_flow" logs "$job" "$master" || say "log stream ended with an error"
  deadline=$((SECONDS + ${END_GRACE_SECONDS:-60}))
  while :; do
    final=$(job_status "$master" | field Status) || final=""
    [[ $final == running || $final == pending || -z $final ]] || break 2
    ((SECONDS < deadline)) || break
    sleep "$poll"
  done
  [[ $final == running ]] || die "cannot tell how node 0 ($master) ended (\`$neuro status $master\`: '${final:-no answer}')"
  say "node 0 still runs; reconnecting to its logs"
  sleep "$poll"
done
[[ $final == succeeded ]] || die "node 0 ($master) ended as '$final'"
say "done: node 0 succeeded"
