#!/usr/bin/env bash
# One node of a training run: the container's entrypoint. It works out the rendezvous from the
# environment and execs torchrun (static rendezvous) with its arguments passed on to `distqa train`.
#
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 scripts/worker.sh --config configs/bert-base.yaml
#
# Variables (an explicit one always wins over what a scheduler set):
#   NNODES          nodes in the run (default 1), or MIN:MAX for an elastic run (c10d rendezvous)
#   NODE_RANK       this node's index, 0..NNODES-1 (default 0)
#   MASTER_ADDR     node 0's address; unset or `self` on node 0 means this host
#   MASTER_PORT     node 0's rendezvous port (default 29500)
#   NPROC_PER_NODE  processes on this node (default: one per GPU, or 1 without GPUs)
#   RDZV_TIMEOUT    seconds to wait for node 0 and for the rendezvous (default 600)
#   MAX_RESTARTS    torchrun --max-restarts (default 0): restart rounds after a lost worker or node
#   RDZV_LAST_CALL, LOCAL_ADDR, RDZV_ID  elastic runs only: see docs/containers.md
#   OMP_NUM_THREADS threads per process (default: the CPUs this node may use / NPROC_PER_NODE)
# Understood from schedulers, in this order after the explicit variables:
#   Kubeflow PyTorchJob  PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT,
#                        PET_NPROC_PER_NODE; then WORLD_SIZE/RANK (pods) of older operators;
#                        elastic jobs: PET_RDZV_ENDPOINT, PET_MAX_RESTARTS, PET_RDZV_ID
#   Slurm                SLURM_NNODES, SLURM_NODEID, first host of SLURM_JOB_NODELIST
#   SkyPilot             SKYPILOT_NUM_NODES, SKYPILOT_NODE_RANK, first of SKYPILOT_NODE_IPS
#   Neu.ro               NEURO_JOB_INTERNAL_HOSTNAME is "this host"
# For tests and debugging: WORKER_DRY_RUN=1 prints the torchrun command line instead of running
# it, TORCHRUN replaces the torchrun command (split on spaces, e.g. "python -m torch.distributed.run"),
# and CGROUP_ROOT the folder the CPU quota is read from (/sys/fs/cgroup).
# Before torchrun starts: the settings are checked (`distqa train --check-config`), and node 0
# checks that MASTER_PORT is free here and that MASTER_ADDR leads to this host (distqa.rdzv_check).
# A variable one letter off one of these (NNODE, MASTER_PROT, nnodes) is refused while that one is unset.
# Exit status: 2 for a missing or contradictory setting, 3 when node 0 does not answer in time,
# 143 after a SIGTERM that distqa answered with a checkpoint (its `distqa: preempted:` line is then
# the last line) or one before torchrun started (nothing to checkpoint yet), 0 when every process finished its training (also when a SIGTERM came after that);
# otherwise torchrun's (128+N when a signal N killed torchrun).
set -euo pipefail

# die MESSAGE [STATUS]
die() {
  echo "worker.sh: error: $1" >&2 || true
  exit "${2:-2}"
}
# `|| true`: a terminal that hung up (EIO) or a pipe nobody reads fails the write, and `set -e` then
# ended this script at once, torchrun's workers still checkpointing (exit 1 for 129; a review).
note() { echo "worker.sh: $*" >&2 || true; }
# A SIGTERM before torchrun starts (the checks, the wait for node 0) finds nothing to checkpoint: stop
# at once. Without a trap, bash as a container's PID 1 would ignore it, and `docker stop` would end
# in SIGKILL after its grace period. Replaced below, once torchrun runs, by the forwarding trap.
# (The store probe, below, runs in the background for this: bash runs a trap only once its
# foreground child ends, and the probe may wait up to RDZV_TIMEOUT; a review saw 117 s.)
probe=""
# shellcheck disable=SC2329  # called by the traps below
stopped_early() {
  note "stopped by $1 before training started: nothing to checkpoint"
  [[ -z $probe ]] || kill "$probe" 2> /dev/null || true
  exit "$2"
}
trap 'stopped_early SIGTERM 143' TERM
trap 'stopped_early SIGINT 130' INT
trap 'stopped_early SIGHUP 129' HUP

# pick TARGET VAR...: set TARGET to the value of the first VAR that is set and not empty, and
# TARGET_FROM to that VAR's name, so that error messages can say where a value came from.
pick() {
  local target=$1 var
  shift
  for var in "$@"; do
    if [[ -n "${!var:-}" ]]; then
      printf -v "$target" '%s' "${!var}"
      case $var in # the derived values below are named after the variable they come from
        KUBEFLOW_WORLD_SIZE) var="WORLD_SIZE (Kubeflow)" ;;
        KUBEFLOW_RANK) var="RANK (Kubeflow)" ;;
        SLURM_FIRST_HOST) var=SLURM_JOB_NODELIST ;;
        SKYPILOT_FIRST_IP) var=SKYPILOT_NODE_IPS ;;
        KUBEFLOW_RDZV_HOST | KUBEFLOW_RDZV_PORT) var=PET_RDZV_ENDPOINT ;;
      esac
      printf -v "${target}_FROM" '%s' "$var"
      return 0
    fi
  done
  return 1
}

# First host of a Slurm node list such as "gpu[01-04,07],cpu1" (-> gpu01). scontrol knows every
# form; without it (inside a container) expand the first element in bash: cut at the first comma
# outside brackets, then replace each [...] group by its first value, keeping zero padding.
first_slurm_host() {
  local list=$1 elem="" depth=0 i c group
  if command -v scontrol >/dev/null 2>&1; then
    local hosts
    if hosts=$(scontrol show hostnames "$list" 2>/dev/null) && [[ -n $hosts ]]; then
      echo "${hosts%%$'\n'*}"
      return
    fi
  fi
  for ((i = 0; i < ${#list}; i++)); do
    c=${list:i:1}
    case $c in
      '[') depth=1 ;;
      ']') depth=0 ;;
      ',') ((depth == 0)) && break ;;
    esac
    elem+=$c
  done
  while [[ $elem == *'['*']'* ]]; do
    group=${elem#*\[}
    group=${group%%\]*}
    group=${group%%,*}
    elem="${elem%%\[*}${group%%-*}${elem#*\]}"
  done
  echo "$elem"
}

gpu_count() {
  # A scheduler that hands out GPUs says which in CUDA_VISIBLE_DEVICES; count those as CUDA does:
  # the entries before the first that names no device (",0", "-1", "none": none visible), and of
  # MIG instances one (a CUDA process enumerates a single MIG device, NVIDIA's MIG user guide).
  if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
    local ids id n=0 mig=0
    IFS=, read -ra ids <<<"$CUDA_VISIBLE_DEVICES"
    for id in "${ids[@]}"; do
      id=${id//[[:space:]]/}
      [[ $id =~ ^[0-9]+$|^(GPU|MIG)- ]] || break
      if [[ $id == MIG-* ]]; then mig=1; else n=$((n + 1)); fi
    done
    echo "$((n + mig))"
    return
  fi
  # nvidia-smi -L: each GPU, with its MIG instances indented under it; the same count.
  nvidia-smi -L 2>/dev/null | awk '/^GPU/ { gpus++ } /^[[:space:]]+MIG/ { if (!(gpus in mig)) split_gpus++; mig[gpus] = 1 }
    END { print gpus - split_gpus + (split_gpus > 0 ? 1 : 0) }' || true
}

gpu_without_smi() {
  # A GPU's device file where nothing counted one: no CUDA_VISIBLE_DEVICES, and no nvidia-smi in
  # this container. Then NPROC_PER_NODE=auto stays torchrun's, one process per GPU it finds.
  [[ -z ${CUDA_VISIBLE_DEVICES+set} ]] && ! command -v nvidia-smi >/dev/null && compgen -G '/dev/nvidia[0-9]*' >/dev/null
}

usable_cpus() {
  # nproc counts the CPUs this process may run on (taskset, cpusets); a cgroup CPU quota
  # (docker --cpus, Kubernetes limits) caps them further. (torchrun's own count, os.cpu_count(),
  # is every CPU of the host.)
  # cgroup v2 says it in cpu.max, v1 (Docker on an older host) in cpu.cfs_quota_us (-1: none).
  local cpus limit quota="" period="" root=${CGROUP_ROOT:-/sys/fs/cgroup}
  cpus=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
  if [[ -r $root/cpu.max ]]; then
    read -r quota period <"$root/cpu.max" || true
  elif [[ -r $root/cpu/cpu.cfs_quota_us && -r $root/cpu/cpu.cfs_period_us ]]; then
    read -r quota <"$root/cpu/cpu.cfs_quota_us" || true
    read -r period <"$root/cpu/cpu.cfs_period_us" || true
  fi
  if [[ $quota =~ ^[0-9]+$ && $period =~ ^[0-9]+$ ]] && ((period > 0)); then
    limit=$(((quota + period - 1) / period))
    if ((limit < cpus)); then cpus=$limit; fi
  fi
  echo "$cpus"
}

# ---- resolve the rendezvous --------------------------------------------------------------------

# Kubeflow's WORLD_SIZE/RANK count pods only when the operator set them for us: only then are they
# a node count (torchrun sets the same names for its children, which never run this script). Under
# Slurm or SkyPilot they are a script's own (torch recipes export MASTER_ADDR and WORLD_SIZE as the
# process count): their node variables count the nodes.
kf_nnodes="" kf_rank=""
if [[ -n ${WORLD_SIZE:-} && -n ${MASTER_ADDR:-}${PET_MASTER_ADDR:-} &&
  -z ${SLURM_JOB_ID:-}${SLURM_NNODES:-}${SKYPILOT_NUM_NODES:-} ]]; then
  kf_nnodes=$WORLD_SIZE
  kf_rank=${RANK:-}
fi
# These derived values are read by name in pick (${!var}).
# shellcheck disable=SC2034
KUBEFLOW_WORLD_SIZE=$kf_nnodes KUBEFLOW_RANK=$kf_rank

slurm_master=""
slurm_list=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}
if [[ -n $slurm_list ]]; then slurm_master=$(first_slurm_host "$slurm_list"); fi
# shellcheck disable=SC2034
SLURM_FIRST_HOST=$slurm_master

sky_master=""
if [[ -n ${SKYPILOT_NODE_IPS:-} ]]; then sky_master=$(awk 'NF { print $1; exit }' <<<"$SKYPILOT_NODE_IPS"); fi
# shellcheck disable=SC2034
SKYPILOT_FIRST_IP=$sky_master

# one_edit A B: A and B (not equal) differ by one letter added, dropped or changed, or two swapped.
one_edit() {
  local a=$1 b=$2 i=0
  while ((i < ${#a} && i < ${#b})) && [[ ${a:i:1} == "${b:i:1}" ]]; do i=$((i + 1)); done
  a=${a:i} b=${b:i}
  [[ ${a:1} == "${b:1}" || ${a:1} == "$b" || $a == "${b:1}" ]] ||
    [[ ${#a} -ge 2 && ${a:0:2} == "${b:1:1}${b:0:1}" && ${a:2} == "${b:2}" ]]
}
# A misspelt variable (`-e NNODE=2`, MASTER_PROT, nnodes) was ignored: each node then trained alone
# as node 0 of 1, exit 0, or waited on a default port. Refused while the name it resembles is unset.
for var in $(compgen -e); do
  for known in NNODES NODE_RANK MASTER_ADDR MASTER_PORT NPROC_PER_NODE RDZV_TIMEOUT MAX_RESTARTS \
    RDZV_LAST_CALL LOCAL_ADDR RDZV_ID OMP_NUM_THREADS; do
    if [[ $var != "$known" && -z ${!known:-} ]] && { [[ ${var^^} == "$known" ]] || one_edit "${var^^}" "$known"; }; then
      die "$var=${!var} is set, but worker.sh reads $known (unset): did you mean $known? (see the list at the top of scripts/worker.sh)"
    fi
  done
done

pick nnodes NNODES PET_NNODES KUBEFLOW_WORLD_SIZE SLURM_NNODES SLURM_JOB_NUM_NODES SKYPILOT_NUM_NODES ||
  { nnodes=1 nnodes_FROM=default; }
pick node_rank NODE_RANK PET_NODE_RANK KUBEFLOW_RANK SLURM_NODEID SKYPILOT_NODE_RANK ||
  { node_rank=0 node_rank_FROM=default; }
# An elastic PyTorchJob names node 0 (worker 0's service) only in PET_RDZV_ENDPOINT=HOST:PORT.
kf_rdzv_host="" kf_rdzv_port=""
if [[ ${PET_RDZV_ENDPOINT:-} == *:* ]]; then kf_rdzv_host=${PET_RDZV_ENDPOINT%:*} kf_rdzv_port=${PET_RDZV_ENDPOINT##*:}; fi
# shellcheck disable=SC2034
KUBEFLOW_RDZV_HOST=$kf_rdzv_host KUBEFLOW_RDZV_PORT=$kf_rdzv_port
pick master_port MASTER_PORT PET_MASTER_PORT KUBEFLOW_RDZV_PORT || { master_port=29500 master_port_FROM=default; }
pick master_addr MASTER_ADDR PET_MASTER_ADDR KUBEFLOW_RDZV_HOST SLURM_FIRST_HOST SKYPILOT_FIRST_IP ||
  { master_addr="" master_addr_FROM=""; }
pick rdzv_timeout RDZV_TIMEOUT || rdzv_timeout=600
pick max_restarts MAX_RESTARTS PET_MAX_RESTARTS || max_restarts=0
pick rdzv_id RDZV_ID PET_RDZV_ID || rdzv_id=distqa
if ! pick nproc NPROC_PER_NODE PET_NPROC_PER_NODE; then
  nproc=$(gpu_count)
  nproc_FROM="GPU count"
  if ((nproc == 0)); then nproc=1 nproc_FROM="default (no GPU)"; fi
fi

# ---- check it before anything starts -----------------------------------------------------------

# in_range VALUE MIN [MAX]: VALUE is an integer in [MIN, MAX].
# (10# so that a leading zero is not read as octal.)
in_range() { [[ $1 =~ ^[0-9]{1,9}$ ]] && ((10#$1 >= $2)) && { [[ -z ${3:-} ]] || ((10#$1 <= $3)); }; }

# NNODES=MIN:MAX: an elastic node count (torchrun's c10d rendezvous, hosted by node 0's torchrun).
min_nodes="" max_nodes=""
if [[ $nnodes == *:* ]]; then
  min_nodes=${nnodes%%:*} max_nodes=${nnodes#*:}
  if ! in_range "$min_nodes" 1 || ! in_range "$max_nodes" "$((10#${min_nodes:-0}))"; then
    die "NNODES=$nnodes (from $nnodes_FROM) is not a node count N or a range MIN:MAX with 1 <= MIN <= MAX"
  fi
  min_nodes=$((10#$min_nodes)) max_nodes=$((10#$max_nodes))
  nnodes="$min_nodes:$max_nodes"
else
  in_range "$nnodes" 1 || die "NNODES=$nnodes (from $nnodes_FROM) is not a positive integer or a range MIN:MAX"
  nnodes=$((10#$nnodes))
fi
in_range "$node_rank" 0 || die "NODE_RANK=$node_rank (from $node_rank_FROM) is not a non-negative integer"
node_rank=$((10#$node_rank))
if ((node_rank >= ${max_nodes:-$nnodes})); then
  die "NODE_RANK=$node_rank (from $node_rank_FROM) must be below NNODES=$nnodes (from $nnodes_FROM)"
fi
in_range "$master_port" 1 65535 || die "MASTER_PORT=$master_port (from $master_port_FROM) is not a port number"
in_range "$rdzv_timeout" 1 || die "RDZV_TIMEOUT=$rdzv_timeout is not a positive number of seconds"
in_range "$max_restarts" 0 || die "MAX_RESTARTS=$max_restarts is not a non-negative integer"
# Decimal from here on: bash reads 010 as octal 8 and 09 as an error in $((...)), which skipped the
# checks and the wait for node 0 below (and torchrun, which reads 10, would disagree).
master_port=$((10#$master_port)) rdzv_timeout=$((10#$rdzv_timeout)) max_restarts=$((10#$max_restarts))
if in_range "$nproc" 1; then
  nproc=$((10#$nproc)) # (010 is ten processes, and the threads per process below divide by it)
elif [[ $nproc != auto && $nproc != gpu && $nproc != cpu ]]; then
  die "NPROC_PER_NODE=$nproc (from $nproc_FROM) is not a positive integer or auto/gpu/cpu"
elif [[ $nproc == gpu ]] && (($(gpu_count) == 0)); then
  die "NPROC_PER_NODE=gpu (from $nproc_FROM), but no GPU is visible here: give a process count, or cpu"
elif [[ $nproc == cpu ]] || { [[ $nproc == auto ]] && (($(gpu_count) == 0)) && ! gpu_without_smi; }; then
  # torchrun would start os.cpu_count() processes: every CPU of the host, not those of this
  # container or cpuset (64 processes on a 4-CPU container). One per CPU this node may use.
  nproc_FROM="NPROC_PER_NODE=$nproc, one per CPU this node may use" nproc=$(usable_cpus)
fi

# An address that is no host: a worker node would wait its whole RDZV_TIMEOUT (600 s) for it, then
# ask whether node 0 runs. Host and port in one (10.0.0.1:29500; an IPv6 address has two colons or
# more), a URL, or a space (a copied value's stray one).
if [[ $master_addr =~ [[:space:]] ]]; then
  die "MASTER_ADDR='$master_addr' (from $master_addr_FROM) holds a space: give node 0's host name or IP address alone"
elif [[ $master_addr == *://* ]]; then
  die "MASTER_ADDR=$master_addr (from $master_addr_FROM) is a URL: give node 0's host name or IP address alone"
elif [[ $master_addr == \[*\]:* || ($master_addr == *:* && $master_addr != *:*:* && $master_addr != \[*) ]]; then
  die "MASTER_ADDR=$master_addr (from $master_addr_FROM) holds a port: give the host alone (${master_addr%:*}), and the port as MASTER_PORT"
fi
if [[ -z $master_addr || $master_addr == self ]]; then
  if ((node_rank > 0)) && [[ -z $master_addr ]]; then
    die "NODE_RANK=$node_rank (from $node_rank_FROM) is a worker node but no master address is set: set MASTER_ADDR to node 0's address"
  elif ((node_rank > 0)); then
    die "MASTER_ADDR=self (from $master_addr_FROM) means this host, but this is node $node_rank: set node 0's address"
  fi
  # Node 0 hosts the rendezvous store (it listens on every interface); the address only has to lead
  # back to this host. Neu.ro names it; elsewhere the loopback address always does.
  if [[ -n ${NEURO_JOB_INTERNAL_HOSTNAME:-} ]]; then
    master_addr=$NEURO_JOB_INTERNAL_HOSTNAME master_addr_FROM=NEURO_JOB_INTERNAL_HOSTNAME
  else
    master_addr=127.0.0.1 master_addr_FROM="this host"
  fi
fi

# ---- threads per process -----------------------------------------------------------------------
# torchrun sets OMP_NUM_THREADS=1 only when it starts several processes, so a node with one process
# would use every CPU and one with two a single thread each: other thread counts give (slightly)
# other float results, and one thread each wastes a large CPU node. Share this node's CPUs instead.
threads_note=""
if [[ -z ${OMP_NUM_THREADS:-} ]] && in_range "$nproc" 1; then
  cpus=$(usable_cpus)
  threads=$((cpus / nproc))
  if ((threads < 1)); then threads=1; fi
  export OMP_NUM_THREADS=$threads
  threads_note="OMP_NUM_THREADS=$threads ($cpus CPU(s) / $nproc process(es))"
elif [[ -n ${OMP_NUM_THREADS:-} ]]; then
  # OpenMP reads a count, or a list of them (nested levels); anything else it ignores with a warning,
  # and the run went on with every CPU's threads (a review).
  [[ $OMP_NUM_THREADS =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] ||
    die "OMP_NUM_THREADS=$OMP_NUM_THREADS is not a thread count (e.g. 4): set it to one, or unset it for CPUs / NPROC_PER_NODE"
  threads_note="OMP_NUM_THREADS=$OMP_NUM_THREADS (set)"
fi

read -ra torchrun <<<"${TORCHRUN:-torchrun}"
# The Python that runs torchrun (TORCHRUN's first word, or torchrun's #! line), so that the checks
# import the same distqa. Neither imports torch: together they take well under a second. (The
# other nodes' store probe, below, does: a few seconds, once.)
python=python3
if [[ ${torchrun[0]##*/} == python* ]]; then
  python=${torchrun[0]}
elif torchrun_path=$(command -v "${torchrun[0]}") && read -r shebang <"$torchrun_path" 2>/dev/null &&
  [[ $shebang == '#!'*python* ]]; then
  read -ra words <<<"${shebang#\#!}"
  python=${words[0]}
  if [[ ${python##*/} == env ]]; then python=${words[1]:-python3}; fi
fi
# How torchrun is started. torch's own torchrun (its console script, or `PY -m torch.distributed.run`)
# runs as `PY -m distqa.torchrun`: the same torchrun in the same process, which leaves out its
# failure report once distqa said why the run stopped. Another TORCHRUN (a stand-in) runs as given.
launcher=("${torchrun[@]}") wrapped=0
if [[ ${#torchrun[@]} -eq 3 && ${torchrun[0]##*/} == python* && ${torchrun[*]:1} == "-m torch.distributed.run" ]]; then
  launcher=("${torchrun[0]}" -m distqa.torchrun) wrapped=1
elif [[ ${#torchrun[@]} -eq 1 && -n ${shebang:-} && $shebang == '#!'*python* ]] &&
  grep -q 'torch.distributed.run' "$torchrun_path" 2>/dev/null; then
  launcher=("$python" -m distqa.torchrun) wrapped=1
fi

if [[ -n $max_nodes ]]; then
  pick last_call RDZV_LAST_CALL || last_call=30
  in_range "$last_call" 0 || die "RDZV_LAST_CALL=$last_call is not a non-negative number of seconds"
  last_call=$((10#$last_call))
fi

# The torchrun command line, in `cmd`. Elastic (NNODES=MIN:MAX): torchrun's c10d rendezvous on
# node 0's address. Node 0 hosts it (is_host), so node 0 must stay; the others may come and go. A
# round starts once MIN nodes are in and no other has joined for RDZV_LAST_CALL seconds (or MAX
# are in); the rank order follows arrival, not NODE_RANK. The node that becomes group rank 0 hosts
# the workers' store at its own address, which torchrun takes from the hostname unless told: this
# takes the address this node reaches node 0 from (a UDP connect sends nothing), which the others
# can reach back; LOCAL_ADDR overrides it. Called once node 0 answers (its name may resolve late).
assemble() {
  if [[ -z $max_nodes ]]; then
    cmd=(
      "${torchrun[@]}"
      --nnodes "$nnodes" --node-rank "$node_rank" --nproc-per-node "$nproc"
      --rdzv-backend static --master-addr "$master_addr" --master-port "$master_port"
      --rdzv-conf "timeout=$rdzv_timeout" --max-restarts "$max_restarts"
      -m distqa train "$@"
    )
    return
  fi
  if ! pick local_addr LOCAL_ADDR; then
    local_addr=$("$python" -c 'import socket, sys
family, kind, proto, _, where = socket.getaddrinfo(sys.argv[1], int(sys.argv[2]), type=socket.SOCK_DGRAM)[0]
with socket.socket(family, kind, proto) as s:
    s.connect(where)
    print(s.getsockname()[0])' "$master_addr" "$master_port" 2>/dev/null) ||
      die "cannot find this node's address towards MASTER_ADDR=$master_addr (from $master_addr_FROM): set LOCAL_ADDR"
  fi
  if [[ $local_addr == 127.* || $local_addr == ::1 ]] && ((max_nodes > 1)); then
    note "warning: other nodes cannot reach this one at $local_addr: set MASTER_ADDR to node 0's address on every node (or LOCAL_ADDR), unless all nodes run on this host"
  fi
  # Each round's rank 0 starts a store of its own for the workers, rather than all rounds sharing
  # the rendezvous store: with the shared one, a node that joins a running run waits, until the
  # join timeout, for keys that group rank 0 writes only in its first round (torch 2.13; seen here).
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  # The rendezvous's store lives as long as node 0's torchrun: the launch's first round notes there
  # that train.resume=never or PATH was carried out, and later rounds continue (distqa.launch_start).
  export DISTQA_LAUNCH_STORE=$master_addr:$master_port
  cmd=(
    "${torchrun[@]}"
    --nnodes "$nnodes" --nproc-per-node "$nproc"
    --rdzv-backend c10d --rdzv-endpoint "$master_addr:$master_port" --rdzv-id "$rdzv_id"
    --rdzv-conf "join_timeout=$rdzv_timeout,last_call_timeout=$last_call,is_host=$((node_rank == 0 ? 1 : 0))"
    --local-addr "$local_addr" --max-restarts "$max_restarts"
    -m distqa train "$@"
  )
}

if [[ ${WORKER_DRY_RUN:-0} == 1 ]]; then
  assemble "$@"
  printf -v line '%q ' "${cmd[@]}"
  echo "${line% }"
  if [[ -n $threads_note ]]; then note "$threads_note"; fi
  exit 0
fi

# Where a count came from when no NODE_RANK or NNODES said it: a WORLD_SIZE that a launcher meant
# as a process count is read as Kubeflow's node count, and the run waits for nodes that never come.
from_note() { case $2 in "$1" | default) ;; *) printf ' (from %s)' "$2" ;; esac; }
note "node $node_rank$(from_note NODE_RANK "$node_rank_FROM") of $nnodes$(from_note NNODES "$nnodes_FROM"), $nproc process(es); master $master_addr:$master_port (from $master_addr_FROM)${threads_note:+; $threads_note}"

# ---- checks before torchrun starts --------------------------------------------------------------

# A settings mistake is then one line here, rather than one per rank and torchrun's report.
# With the process counts this launch may have: each must split the global batch (an elastic run's
# node counts MIN..MAX each), found now rather than when a node joins and every round stops.
# (NPROC_PER_NODE=auto or gpu, GPUs visible: torchrun starts one per GPU; none counted: no sizes.)
per_node=$nproc sizes=""
[[ $per_node =~ ^[0-9]+$ ]] || per_node=$(gpu_count)
for ((n = ${min_nodes:-$nnodes}; per_node > 0 && n <= ${max_nodes:-$nnodes} && n <= ${min_nodes:-0} + 4096; n++)); do
  sizes+="$((per_node * n)) "
done
DISTQA_CHECK_WORLD_SIZES="$sizes|NNODES=$nnodes x NPROC_PER_NODE=$nproc" \
  "$python" -m distqa train --check-config "$@" || exit
for arg in "$@"; do # --help was printed by the check: nothing to launch
  if [[ $arg == -h || $arg == --help ]]; then exit 0; fi
done

# On node 0, torchrun hosts the rendezvous on MASTER_PORT and also connects to MASTER_ADDR. A port
# in use, an address that does not resolve, or one that leads to another host (a second node 0) ends
# in a long traceback after tens of seconds; this says which, at once. DNS names that a scheduler
# publishes a little after the start are waited for up to 10 s.
# On a multi-node run, a node 0 whose rank is only the default is likelier a worker that was not
# given its NODE_RANK than a second node 0: the check's message then says so.
if ((node_rank == 0)); then
  rank_from=$node_rank_FROM
  if [[ $nnodes == 1 ]]; then rank_from=NODE_RANK; fi
  "$python" -m distqa.rdzv_check --prog worker.sh --knows-self --addr "$master_addr" --addr-from "$master_addr_FROM" \
    --rank-from "$rank_from" --port "$master_port" --timeout "$((rdzv_timeout < 10 ? rdzv_timeout : 10))" || exit
fi

# ---- wait for node 0 (PITFALLS #2) -------------------------------------------------------------
# Without this, torchrun on a worker whose master is wrong or down retries and ends in a long
# DistNetworkError traceback. Each attempt is bounded by `timeout`: a connect to an address where
# nothing answers can otherwise hang for minutes.
if ((node_rank > 0)); then
  note "waiting up to ${rdzv_timeout}s for the master to answer"
  deadline=$((SECONDS + rdzv_timeout))
  next_note=$((SECONDS + 30))
  while :; do
    left=$((deadline - SECONDS))
    if ((left <= 0)); then
      die "master $master_addr:$master_port (from $master_addr_FROM) did not answer within RDZV_TIMEOUT=${rdzv_timeout}s: is node 0 running, and is that its address?" 3
    fi
    # shellcheck disable=SC2016  # $1/$2 belong to the inner bash
    if timeout "$((left < 5 ? left : 5))" bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$master_addr" "$master_port" \
      2>/dev/null; then
      break
    fi
    if ((SECONDS >= next_note)); then
      note "still waiting for master $master_addr:$master_port ($((deadline - SECONDS))s left)"
      next_note=$((SECONDS + 30))
    fi
    sleep 1
  done
  # Something accepts there; it must also answer as node 0's store (distqa.store_probe): a program
  # that accepts and never replies held torchrun's rendezvous here for ever, RDZV_TIMEOUT or not.
  # Its seconds count from after torch's import (the probe's own alarm), which a busy CPU can make
  # take minutes; at least 10 of them: node 0's checks answer the first tries while it starts.
  left=$((deadline - SECONDS))
  ((left >= 10)) || left=10
  "$python" -m distqa.store_probe "$master_addr" "$master_port" "$left" 2>/dev/null &
  probe=$! probed=0
  wait "$probe" 2> /dev/null || probed=$? # (without bash's "Alarm clock" line for it)
  probe=""
  if ((probed != 0)); then
    die "master $master_addr:$master_port (from $master_addr_FROM) accepts connections but did not answer as node 0's rendezvous store within ${left}s: is that node 0's address and port, and does another program hold that port there?" 3
  fi
fi

assemble "$@"

# torchrun reads PET_* as defaults for its own flags: Kubeflow's PET_RDZV_ENDPOINT would switch it
# to another rendezvous than the one resolved above, so none of them may reach it.
while read -r var; do unset "$var"; done < <(compgen -e | grep '^PET_' || true)

# torchrun runs as a child, not exec'd, so that its outcome is judged here by what distqa's ranks
# wrote to DISTQA_ERROR_FILE (distqa.outcome): every rank of this node finished (a SIGTERM that came
# after that is no failure), every rank checkpointed on a SIGTERM, or a rank's one-line error, which
# is repeated as the last line when a stand-in TORCHRUN may have printed a failure report after it.
#
# The platform's SIGTERM (to this script, PID 1 in the container, or to its whole process group) is
# passed on to torchrun exactly once; torchrun passes it to the workers, which checkpoint and exit.
# torchrun runs in a session of its own (setsid) for that: a group-wide SIGTERM would otherwise
# reach it twice, directly and forwarded, and a second SIGTERM aborts torchrun's wait for the
# workers' checkpoint. (torchrun starts each worker in a session of its own already.)
# Made here, not by the ranks: where it cannot be (a read-only root file system, no /tmp), a run
# would train on and only misreport its end (a checkpointed preemption as "no checkpoint", exit 1).
DISTQA_ERROR_FILE=$(mktemp "${TMPDIR:-/tmp}/distqa-error.XXXXXX" 2>/dev/null ||
  mktemp /dev/shm/distqa-error.XXXXXX 2>/dev/null) ||
  die "cannot create a file in ${TMPDIR:-/tmp} (TMPDIR) or /dev/shm, where the ranks say how the run ended: set TMPDIR to a writable folder"
export DISTQA_ERROR_FILE
if [[ $DISTQA_ERROR_FILE == /dev/shm/* ]]; then
  # Python finds no temp folder either, and torchrun's `import torch` stopped with a traceback.
  note "${TMPDIR:-/tmp} (TMPDIR) cannot be written (a read-only root file system?): the run's TMPDIR is /dev/shm; set TMPDIR to a writable volume for another"
  export TMPDIR=/dev/shm
fi
# A restart round waits this long for every node's workers (distqa.rounds), then names the missing node.
export DISTQA_RDZV_TIMEOUT=$rdzv_timeout
# Without job control `setsid` execs torchrun in place (this script's children are not group
# leaders), so $! is torchrun itself.
cmd=("${launcher[@]}" "${cmd[@]:${#torchrun[@]}}")
if command -v setsid >/dev/null 2>&1; then setsid "${cmd[@]}" & else "${cmd[@]}" & fi
child=$!
# A pipe nobody reads any more (`worker.sh ... | tee log`, the tee ended) would kill this script at
# its next line, torchrun then running on unwatched: the write fails instead (note's `|| true`).
trap '' PIPE
term_sent=0 stopped_by=TERM stop_status=143
# forward_term SIGNAL: the first SIGTERM, SIGINT (Ctrl-C on an attached `docker run`) or SIGHUP (the
# terminal closed; torchrun, in a session of its own, gets none) goes on to torchrun as a SIGTERM,
# so every rank checkpoints as on a preemption; later ones are ignored.
# shellcheck disable=SC2329  # called by the traps below
forward_term() {
  if ((term_sent)); then
    note "SIG$1 again: ignored, torchrun is already stopping the workers"
    # `return 0`, not `return`: in a trap a bare return gives the status of the command the signal
    # interrupted (wait: 143), and `set -e` would then end this script.
    return 0
  fi
  term_sent=1 stopped_by=$1
  if [[ $1 == INT ]]; then stop_status=130; fi # the shell's status for Ctrl-C
  if [[ $1 == HUP ]]; then stop_status=129; fi
  kill -TERM "$child" 2>/dev/null || true
}
trap 'forward_term TERM' TERM
trap 'forward_term INT' INT
trap 'forward_term HUP' HUP
status=0
while :; do
  # (2>/dev/null: bash's own "Killed" job notice; the line below says it better)
  wait "$child" 2>/dev/null && status=0 || status=$?
  kill -0 "$child" 2>/dev/null || break # `wait` also returns when a trapped signal arrives
done
# The lines of torchrun's last restart round, after the agent's last `distqa: round: K` line
# (distqa.outcome.this_round; all of them without one): an earlier round's preempted line (a node
# joining makes every rank checkpoint) beside a later round's error was read as a preemption, 143.
said=$(awk '$1 == "distqa:" && $2 == "round:" { first = NR + 1 } { line[NR] = $0 }
  END { for (i = first ? first : 1; i <= NR; i++) print line[i] }' "$DISTQA_ERROR_FILE" 2>/dev/null || true)
# every_rank_finished: each local rank wrote `distqa: finished: local rank L of N` (its train returned).
every_rank_finished() {
  awk '$1 == "distqa:" && $2 == "finished:" && $4 == "rank" && $6 == "of" { done[$5] = 1; n = $7 }
    END { for (r = 0; r < n; r++) if (!(r in done)) exit 1; exit n > 0 ? 0 : 1 }' <<<"$said"
}
preempted="" error=""
if ((status != 0)) && [[ -n $said ]]; then
  preempted=$(grep -m 1 '^distqa: preempted: ' <<<"$said" || true)
  error=$(grep -m 1 -E '^distqa( \[rank [0-9]+\])?: error: ' <<<"$said" || true)
fi
if ((status != 0)) && every_rank_finished; then
  # The run completed (train returned on every rank, after its last barrier); torchrun failed only
  # because a SIGTERM reached it or its workers after that. A success: the ordinary last line stays last.
  status=0
elif [[ -n $preempted ]]; then
  # Every rank checkpointed and said so (each writes the line; rank 0 also prints it): the run
  # stopped as asked, whatever torchrun's own status after its SIGTERM. Said here where no rank
  # of this node printed it (nodes other than 0), so that it is the last line on every node.
  if ! grep -q -F -x "# printed: $preempted" <<<"$said"; then echo "$preempted" >&2 || true; fi
  status=$stop_status
elif [[ -n $error ]]; then
  # A rank printed it already; distqa.torchrun then leaves out torchrun's report, a stand-in may not.
  if ((!wrapped)); then echo "$error" >&2 || true; fi
elif ((status != 0 && term_sent)) && ! grep -q '^distqa: training: ' <<<"$said"; then
  # No rank had begun to train (each says so once SIGTERM means a checkpoint to it): the stop
  # came while the model and data were loading, and nothing was lost. A preemption's status, not
  # a failure's, so that a platform restarts the job rather than giving it up.
  note "stopped by SIG$stopped_by before training started: nothing to checkpoint"
  status=$stop_status
elif early=$(grep -m 1 '^distqa: stopped before training: ' <<<"$said") && ((status > 128)); then
  # A signal that reached torchrun itself (not through this script's trap) while every rank was
  # still loading: distqa.torchrun stopped the ranks and said which signal. Nothing was lost.
  note "stopped by ${early##*: } before training started: nothing to checkpoint"
elif ((status > 128)); then
  signal=$(kill -l "$((status - 128))" 2>/dev/null || echo "signal $((status - 128))")
  # Its workers outlive it (each in a session of its own) and stop themselves once they see it gone,
  # checkpointing the step they are in where they still can: their own lines may follow this one.
  note "error: torchrun (pid $child) was killed by SIG${signal#SIG}: its workers stop on their own, each checkpointing its current step if it still can; run the same command again to resume from the newest checkpoint"
  if (($$ == 1)); then
    # PID 1 of a container: once this script returns, the kernel kills every process left, the
    # workers mid-checkpoint among them (they stop within their 10 s grace, distqa.parent_watch).
    # They are this script's children now: wait for them, as long as a checkpoint may take.
    for ((waited = 0; ; waited++)); do
      left=0
      for entry in /proc/[0-9]*; do [[ ${entry#/proc/} == "$$" ]] || left=1; done
      ((left && waited < 120)) || break
      sleep 1
    done
    if ((left)); then
      note "processes left by torchrun still run after ${waited} s: they end with this container"
    else
      note "the workers left by torchrun have ended (waited ${waited} s, as the container's first process)"
    fi
  fi
elif ((status != 0 && term_sent)); then
  note "error: stopped by SIG$stopped_by, but distqa confirmed no checkpoint (torchrun exited $status): the next run resumes from the newest complete checkpoint"
fi
rm -f "$DISTQA_ERROR_FILE"
exit "$status"
