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
# Every container and the network are removed at the end, also on Ctrl-C or a failure. The exit
# status is non-zero when any node failed.
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
if [[ -z ${GPUS_PER_NODE:-} ]] && ((host_gpus > 0 && gpus_per_node == 0)); then
  die "$host_gpus GPU(s) cannot be split over $nnodes nodes; use fewer nodes, or GPUS_PER_NODE=0 for the CPU"
fi
if ((gpus_per_node * nnodes > host_gpus)); then
  die "GPUS_PER_NODE=$gpus_per_node x $nnodes nodes needs $((gpus_per_node * nnodes)) GPUs; this host has $host_gpus"
fi

containers=()
created_network=0
logs_pid=""
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  if [[ -n $logs_pid ]]; then kill "$logs_pid" 2>/dev/null || true; fi
  if ((${#containers[@]})); then docker rm -f "${containers[@]}" >/dev/null 2>&1 || true; fi
  if ((created_network)); then docker network rm "$network" >/dev/null 2>&1 || true; fi
  exit "$status"
}
trap cleanup EXIT
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
    -v "$results:/app/results" -e NNODES="$nnodes" -e NODE_RANK="$rank"
    -e MASTER_PORT="${MASTER_PORT:-29500}" -e RDZV_TIMEOUT="${RDZV_TIMEOUT:-600}"
    -e GLOO_SOCKET_IFNAME="$ifname" -e NCCL_SOCKET_IFNAME="$ifname"
  )
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

# Follow node 0's log; the run is over when every container has stopped.
docker logs --follow "$master" &
logs_pid=$!
failed=()
for name in "${containers[@]}"; do
  code=$(docker wait "$name")
  if [[ $code != 0 ]]; then failed+=("$name (exit $code)"); fi
done
wait "$logs_pid" || true
logs_pid=""

if ((${#failed[@]})); then
  for name in "${containers[@]:1}"; do
    echo "---- last lines of $name ----" >&2
    docker logs --tail 20 "$name" >&2 || true
  done
  echo "run_docker_nodes.sh: error: failed: ${failed[*]}" >&2
  exit 1
fi
echo "run_docker_nodes.sh: all $nnodes nodes finished; results in $results" >&2
