#!/usr/bin/env bash
# Two hosts on a capped link: training speed and bytes on the wire per train.ddp_comm_hook.
#
#   scripts/bench_network.sh --rates 1gbit,100mbit --hooks none,fp16,bf16,powersgd --steps 20 \
#       --output DIR [--warmup 5] [--repeats 1] [-- KEY=VALUE ...]
#
# Makes two network namespaces joined by a veth pair (the two "hosts"), caps the link with a tbf
# qdisc on both ends at each rate (`none`: no cap), and for each hook runs a 2-node run with
# scripts/worker.sh on each host (1 process per node), timed as `distqa bench` times (the warm-up
# steps excluded). The bytes on the wire are the veths' tx counters over the measured steps. Writes
# DIR/network.json, DIR/network.png and DIR/runs/RATE-HOOK/ (logs, results); an earlier call's
# files there are first moved to DIR/earlier/<time>-XXXX/. With --repeats N, every
# rate and hook runs N times, the rounds one after the other (RATE-HOOK-rK/), and each figure is the
# median of its N runs: both hosts share the machine's CPUs, and one run varies by about 10 %. Needs root, `ip` and
# `tc`; exits 2 with one line without them. The namespaces go on exit, on Ctrl-C and on failure.
set -euo pipefail

die() {
  echo "bench_network.sh: error: $1" >&2
  exit "${2:-2}"
}

rates="1gbit,100mbit" hooks="none,fp16,bf16,powersgd" steps=20 warmup=5 repeats=1 output=""
while (($#)); do
  case $1 in
    --rates) rates=${2:?}; shift 2 ;;
    --hooks) hooks=${2:?}; shift 2 ;;
    --steps) steps=${2:?}; shift 2 ;;
    --warmup) warmup=${2:?}; shift 2 ;;
    --repeats) repeats=${2:?}; shift 2 ;;
    --output) output=${2:?}; shift 2 ;;
    --) shift; break ;;
    *) die "unknown argument $1 (see the usage at the top of $0)" ;;
  esac
done
[[ -n $output ]] || die "--output DIR is required"
[[ $steps =~ ^[1-9][0-9]*$ && $warmup =~ ^[0-9]+$ ]] || die "--steps and --warmup must be whole numbers (steps >= 1)"
[[ $repeats =~ ^[1-9][0-9]*$ ]] || die "--repeats must be a whole number >= 1, not '$repeats'"
for hook in ${hooks//,/ }; do
  [[ $hook =~ ^(none|fp16|bf16|powersgd)$ ]] || die "--hooks: '$hook' is not one of none, fp16, bf16, powersgd"
done
for rate in ${rates//,/ }; do
  [[ $rate == none || $rate =~ ^[0-9]+(\.[0-9]+)?(kbit|mbit|gbit)$ ]] || die "--rates: '$rate' is not none or a rate such as 100mbit"
done
[[ $(id -u) == 0 ]] || die "needs root (network namespaces and tc qdiscs): run it with sudo"
command -v ip >/dev/null || die "needs the \`ip\` command (iproute2)"
command -v tc >/dev/null || die "needs the \`tc\` command (iproute2)"

here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-$here/../.venv/bin/python}
[[ -x $python ]] || python=python3
ns=(dqnet0 dqnet1) veth=(dqnetv0 dqnetv1) addr=(10.233.7.1 10.233.7.2)
for name in "${ns[@]}"; do
  if ip netns list | grep -qw "$name"; then
    die "network namespace $name exists (another bench_network.sh running?); if not, remove it: ip netns del $name"
  fi
done
if ip link show "${veth[0]}" >/dev/null 2>&1; then die "interface ${veth[0]} exists: remove it: ip link del ${veth[0]}"; fi

pids=()
cleanup() {
  local pid
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  # Deleting a namespace ends its end of the veth pair, and with it the pair.
  for name in "${ns[@]}"; do ip netns del "$name" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for i in 0 1; do ip netns add "${ns[i]}"; done
ip link add "${veth[0]}" type veth peer name "${veth[1]}"
for i in 0 1; do
  ip link set "${veth[i]}" netns "${ns[i]}"
  ip -n "${ns[i]}" addr add "${addr[i]}/30" dev "${veth[i]}"
  ip -n "${ns[i]}" link set "${veth[i]}" up
  ip -n "${ns[i]}" link set lo up
done

# The report reads every run under DIR/runs: an earlier call's (other rates, hooks or steps) were
# reported beside this one's as if measured now. They are moved aside, not deleted.
if [[ -d $output/runs ]] && [[ -n $(ls -A "$output/runs") ]]; then
  mkdir -p "$output/earlier"
  earlier=$(mktemp -d "$output/earlier/$(date +%Y%m%d-%H%M%S)-XXXX")
  mv "$output/runs" "$earlier/runs"
  for file in network.json network.png; do if [[ -e $output/$file ]]; then mv "$output/$file" "$earlier/"; fi; done
  echo "bench_network.sh: $output held an earlier benchmark's runs: moved to $earlier" >&2
fi
mkdir -p "$output/runs"
port=29561
for ((round = 1; round <= repeats; round++)); do
for rate in ${rates//,/ }; do
  for i in 0 1; do
    tc -n "${ns[i]}" qdisc del dev "${veth[i]}" root 2>/dev/null || true
    if [[ $rate != none ]]; then
      tc -n "${ns[i]}" qdisc add dev "${veth[i]}" root tbf rate "$rate" burst 256kb latency 100ms
    fi
  done
  for hook in ${hooks//,/ }; do
    run="$output/runs/$rate-$hook"
    ((repeats == 1)) || run+="-r$round"
    rm -rf "$run" && mkdir -p "$run"
    echo "$rate $hook $round" >"$run/run.txt"
    echo "bench_network.sh: rate $rate, train.ddp_comm_hook=$hook: logs in $run" >&2
    port=$((port + 1))
    pids=()
    for i in 1 0; do
      # A session of its own per node (setsid), so that cleanup stops its torchrun and workers.
      ip netns exec "${ns[i]}" setsid env NNODES=2 NODE_RANK="$i" MASTER_ADDR="${addr[0]}" MASTER_PORT="$port" \
        NPROC_PER_NODE=1 OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME="${veth[i]}" RDZV_TIMEOUT=120 \
        TORCHRUN="$python -m distqa.bench.network launch" \
        DISTQA_BENCH_RESULT="$run/result.json" DISTQA_BENCH_OUTPUT_DIR="$run/out" \
        DISTQA_BENCH_WARMUP="$warmup" DISTQA_BENCH_STEPS="$steps" \
        DISTQA_BENCH_COUNTER="/sys/class/net/${veth[i]}/statistics/tx_bytes" \
        DISTQA_BENCH_COUNTER_OUT="$run/tx-$i.json" \
        "$here/worker.sh" "train.ddp_comm_hook=$hook" "$@" >"$run/node$i.log" 2>&1 &
      pids+=($!)
    done
    failed=0
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    pids=()
    ((failed == 0)) || die "the run at $rate with train.ddp_comm_hook=$hook failed: see $run/node0.log and node1.log" 1
  done
done
done
"$python" -m distqa.bench.network report "$output"
echo "bench_network.sh: $output/network.json and $output/network.png" >&2
