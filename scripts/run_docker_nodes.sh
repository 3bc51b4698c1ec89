#!/usr/bin/env bash
# A multi-node run on one Docker host: one container per node on a user-defined network, node 0's
# container name as MASTER_ADDR. Useful to try the multi-node path before a cluster; arguments after
# NNODES go to `distqa train`.
#
#   docker build -t distqa .
#   scripts/run_docker_nodes.sh 2 --config configs/quickstart.yaml output_dir=results/docker2
#
# Variables:
#   IMAGE            image to run (default distqa)
#   RUN_NAME         prefix of the network and container names (default distqa-<pid>)
#   SHM_SIZE         --shm-size of each container (default 8g; DataLoader workers and NCCL need it)
#   GPUS_PER_NODE    GPUs given to each container (default: this host's GPUs split evenly; 0 = CPU)
#   NPROC_PER_NODE   processes per container (default: its GPUs, or 1 on the CPU)
#   RESULTS_DIR      host folder mounted at /app/results in every container (default ./results)
#   DATA_DIR         host folder mounted read-only at /app/data (default ./data)
#   SOCKET_IFNAME    the containers' interface for gloo/NCCL traffic (default eth0)
#   CPUS_PER_NODE    CPUs pinned to each container (--cpuset-cpus; default: the CPUs this script may
#                    use, split evenly; 0 = no pinning). Each container's worker.sh then gives every
#                    process OMP_NUM_THREADS = its CPUs / its processes, so the nodes never put more
#                    threads on the host than it has cores.
#   STOP_TIMEOUT     seconds `docker stop` (of a container, or of this script) waits for a node's
#                    checkpoint before SIGKILL (default 60: docker run --stop-timeout)
# Ctrl-C or SIGTERM stops every node as a platform would (docker stop: each checkpoints and exits
# 143); a second Ctrl-C removes them at once. Every container and the network are removed at the
# end. Exit status: 0 every node finished; 143 every node stopped by SIGTERM with a checkpoint
# (preempted: the same command resumes); 1 a node failed; 2 a usage error.
set -euo pipefail

usage() { echo "usage: $0 NNODES [TRAIN ARGS ...]" >&2; }
die() {
  echo "run_docker_nodes.sh: error: $*" >&2
  exit 2
}

(($# >= 1)) || { usage; exit 2; }
nnodes=$1
shift
[[ $nnodes =~ ^[1-9][0-9]*$ ]] || die "NNODES must be a positive integer, got '$nnodes'"

image=${IMAGE:-distqa}
run=${RUN_NAME:-distqa-$$}
network=$run-net
shm=${SHM_SIZE:-8g}
ifname=${SOCKET_IFNAME:-eth0}
results=$(realpath -m "${RESULTS_DIR:-results}")
data=$(realpath -m "${DATA_DIR:-data}")
mkdir -p "$results"

# GPUs: split this host's GPUs into equal, disjoint sets, one per container. Two nodes sharing a GPU
# would break NCCL ("Duplicate GPU detected"), so too few GPUs is an error, not a silent overlap.
host_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
gpus_per_node=${GPUS_PER_NODE:-$((host_gpus / nnodes))}
[[ $gpus_per_node =~ ^[0-9]+$ ]] || die "GPUS_PER_NODE must be a non-negative integer, got '$gpus_per_node'"
gpus_per_node=$((10#$gpus_per_node)) # decimal: bash reads 08 as a bad octal number, which skipped the GPU check
if [[ -z ${GPUS_PER_NODE:-} ]] && ((host_gpus > 0 && gpus_per_node == 0)); then
  die "$host_gpus GPU(s) cannot be split over $nnodes nodes; use fewer nodes, or GPUS_PER_NODE=0 for the CPU"
fi
if ((gpus_per_node * nnodes > host_gpus)); then
  die "GPUS_PER_NODE=$gpus_per_node x $nnodes nodes needs $((gpus_per_node * nnodes)) GPUs; this host has $host_gpus"
fi

stop_timeout=${STOP_TIMEOUT:-60}
[[ $stop_timeout =~ ^[0-9]+$ ]] || die "STOP_TIMEOUT must be a whole number of seconds, got '$stop_timeout'"
stop_timeout=$((10#$stop_timeout))

# CPUs: the ones this script may run on (a cpuset or taskset of its own is kept), split into equal,
# disjoint sets. Unpinned, every container's worker.sh would see all of the host's CPUs and start
# that many threads per process: N containers put N times the cores' worth of threads on the host,
# and the run crawls (measured: 2 containers on 2 cores, 1 sample/s against 45 in one host run).
expand_cpus() { # "0-3,8" -> "0 1 2 3 8"
  local part out=()
  local -a parts
  IFS=, read -ra parts <<<"$1"
  for part in "${parts[@]}"; do
    if [[ $part == *-* ]]; then
      for ((cpu = ${part%-*}; cpu <= ${part#*-}; cpu++)); do out+=("$cpu"); done
    else
      out+=("$part")
    fi
  done
  echo "${out[*]}"
}
read -ra host_cpus <<<"$(expand_cpus "$(awk '/^Cpus_allowed_list:/ { print $2 }' /proc/self/status)")"
if ((${#host_cpus[@]} == 0)); then read -ra host_cpus <<<"$(expand_cpus "0-$(($(nproc) - 1))")"; fi
cpus_per_node=${CPUS_PER_NODE:-$((${#host_cpus[@]} / nnodes))}
[[ $cpus_per_node =~ ^[0-9]+$ ]] || die "CPUS_PER_NODE must be a non-negative integer, got '$cpus_per_node'"
cpus_per_node=$((10#$cpus_per_node))
if ((cpus_per_node * nnodes > ${#host_cpus[@]})); then
  die "CPUS_PER_NODE=$cpus_per_node x $nnodes nodes needs $((cpus_per_node * nnodes)) CPUs; this host has ${#host_cpus[@]}"
fi
threads_env=()
if [[ -n ${OMP_NUM_THREADS:-} ]]; then
  threads_env=(-e OMP_NUM_THREADS="$OMP_NUM_THREADS") # the user's choice, as worker.sh takes it
elif [[ -z ${CPUS_PER_NODE:-} ]] && ((cpus_per_node == 0)); then
  # More nodes than CPUs: no set to pin, so one thread per process at least keeps them from fighting.
  threads_env=(-e OMP_NUM_THREADS=1)
  echo "run_docker_nodes.sh: warning: $nnodes nodes on ${#host_cpus[@]} CPU(s): not pinned, one thread per process" >&2
fi

containers=()
created_network=0
logs_pid=""
code_file=$(mktemp "${TMPDIR:-/tmp}/run_docker_nodes.XXXXXX")
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  if [[ -n $logs_pid ]]; then kill "$logs_pid" 2>/dev/null || true; fi
  if ((${#containers[@]})); then docker rm -f "${containers[@]}" >/dev/null 2>&1 || true; fi
  if ((created_network)); then docker network rm "$network" >/dev/null 2>&1 || true; fi
  rm -f "$code_file"
  exit "$status"
}
trap cleanup EXIT
# (while the containers start: removed at once, nothing has run long)
trap 'exit 130' INT
trap 'exit 143' TERM

if ! docker network inspect "$network" >/dev/null 2>&1; then
  docker network create "$network" >/dev/null
  created_network=1
fi

master=$run-node0
for ((rank = 0; rank < nnodes; rank++)); do
  name=$run-node$rank
  args=(
    --detach --name "$name" --hostname "$name" --network "$network"
    --shm-size "$shm"
    # The results folder belongs to the host user: write it as that user.
    --user "$(id -u):$(id -g)"
    # The only folder that outlives the container: distqa refuses an output_dir elsewhere.
    -v "$results:/app/results" -e DISTQA_OUTPUT_ROOT=/app/results -e NNODES="$nnodes" -e NODE_RANK="$rank"
    -e MASTER_PORT="${MASTER_PORT:-29500}" -e RDZV_TIMEOUT="${RDZV_TIMEOUT:-600}"
    -e GLOO_SOCKET_IFNAME="$ifname" -e NCCL_SOCKET_IFNAME="$ifname"
    # A plain `docker stop` of a node then allows this long for its checkpoint (Docker's own 10 s is
    # usually enough too: docs/reliability.md), the same as this script's stop.
    --stop-timeout "$stop_timeout" "${threads_env[@]}"
  )
  if ((cpus_per_node > 0)); then
    cpuset=${host_cpus[*]:$((rank * cpus_per_node)):cpus_per_node}
    args+=(--cpuset-cpus "${cpuset// /,}")
  fi
  if [[ -d $data ]]; then args+=(-v "$data:/app/data:ro"); fi
  if ((rank == 0)); then args+=(-e MASTER_ADDR=self); else args+=(-e MASTER_ADDR="$master"); fi
  if [[ -n ${NPROC_PER_NODE:-} ]]; then args+=(-e NPROC_PER_NODE="$NPROC_PER_NODE"); fi
  if ((gpus_per_node > 0)); then
    first=$((rank * gpus_per_node))
    devices=$(seq -s, "$first" "$((first + gpus_per_node - 1))")
    args+=(--gpus "\"device=$devices\"")
  fi
  containers+=("$name")
  docker run "${args[@]}" "$image" "$@" >/dev/null
  echo "run_docker_nodes.sh: started $name (node $rank of $nnodes)" >&2
done

# From here a Ctrl-C or SIGTERM stops the nodes the way a platform does (docker stop: SIGTERM, each
# node checkpoints, SIGKILL after STOP_TIMEOUT) and the outcome is reported as for any end; a second
# one ends this script, and the cleanup removes the containers at once.
stopping=0
# shellcheck disable=SC2329  # called by the trap below
stop_nodes() {
  if ((stopping)); then exit "$1"; fi
  stopping=1
  echo "run_docker_nodes.sh: stopping every node (docker stop, up to ${stop_timeout}s): each checkpoints; again to remove them at once" >&2
  # In a session of its own: a terminal's Ctrl-C reaches the whole foreground group, and must not
  # cut the stop short. Waited for with `wait`, which a second signal interrupts.
  if command -v setsid >/dev/null 2>&1; then
    setsid docker stop -t "$stop_timeout" "${containers[@]}" >/dev/null 2>&1 &
  else
    docker stop -t "$stop_timeout" "${containers[@]}" >/dev/null 2>&1 &
  fi
  wait "$!" || true
}
trap 'stop_nodes 130' INT
trap 'stop_nodes 143' TERM

# Follow node 0's log; the run is over when every container has stopped.
docker logs --follow "$master" &
logs_pid=$!
codes=() waiter=""
for name in "${containers[@]}"; do
  # `docker wait` in the background: the builtin `wait` returns when a trapped signal arrives, a
  # command in the foreground would first have to end.
  if ((!stopping)); then
    docker wait "$name" >"$code_file" 2>/dev/null &
    waiter=$!
    wait "$waiter" || true
  fi
  if ((stopping)); then
    # The trap stopped every node (docker stop returns once it has): their own status is final.
    kill "$waiter" 2>/dev/null || true
    code=$(docker inspect --format '{{.State.ExitCode}}' "$name" 2>/dev/null || true)
  else
    code=$(head -n 1 "$code_file")
  fi
  codes+=("${code:-unknown}")
done
wait "$logs_pid" || true
logs_pid=""

# 0: finished; 143: stopped by SIGTERM after its checkpoint (worker.sh says 143 only then).
failed=() preempted=0
for i in "${!containers[@]}"; do
  case ${codes[$i]} in
    0) ;;
    143) preempted=$((preempted + 1)) ;;
    *) failed+=("${containers[$i]} (exit ${codes[$i]})") ;;
  esac
done
if ((${#failed[@]})); then
  for name in "${containers[@]:1}"; do
    echo "---- last lines of $name ----" >&2
    docker logs --tail 20 "$name" >&2 || true
  done
  echo "run_docker_nodes.sh: error: failed: ${failed[*]}" >&2
  exit 1
fi
if ((preempted)); then
  # Node 0's own line (the step and the checkpoint) last, as each node's log ends with it.
  line=$(docker logs --tail 5 "$master" 2>&1 | grep '^distqa: preempted: ' | tail -n 1 || true)
  echo "run_docker_nodes.sh: all $nnodes nodes stopped by SIGTERM after a checkpoint (exit 143); results in $results" >&2
  echo "${line:-distqa: preempted: every node checkpointed; run the same command again to resume}" >&2
  exit 143
fi
echo "run_docker_nodes.sh: all $nnodes nodes finished; results in $results" >&2
