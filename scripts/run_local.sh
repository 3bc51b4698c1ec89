#!/usr/bin/env bash
# Train on this machine with torchrun: one process per GPU, or NPROC_PER_NODE CPU processes
# (default 2) where there is no GPU. Arguments go to `distqa train`.
#   scripts/run_local.sh --config configs/quickstart.yaml output_dir=results/run1
#   MASTER_PORT=29600 scripts/run_local.sh ...   # a port of your choice (two users of one host)
# Without MASTER_PORT, torchrun's standalone rendezvous takes a free port. With it, the c10d
# rendezvous is hosted here on MASTER_ADDR:MASTER_PORT (MASTER_ADDR defaults to localhost), after a
# check that the port is free: torchrun would otherwise fail late, or join whatever store holds it.
set -euo pipefail

die() {
  echo "run_local.sh: error: $1" >&2
  exit 2
}

if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if (( gpus > 0 )); then NPROC_PER_NODE=$gpus; else NPROC_PER_NODE=2; fi
elif ! [[ $NPROC_PER_NODE =~ ^[0-9]{1,4}$ ]] || ((10#$NPROC_PER_NODE < 1)); then
  die "NPROC_PER_NODE=$NPROC_PER_NODE is not a positive number of processes: set it, or unset it for one per GPU (2 without)"
fi
NPROC_PER_NODE=$((10#$NPROC_PER_NODE))

# The Python that runs torchrun (its #! line), so the check sees the same distqa and packages.
python=python3
launcher=(torchrun)
if torchrun_path=$(command -v torchrun) && read -r shebang <"$torchrun_path" && [[ $shebang == '#!'*python* ]]; then
  read -ra words <<<"${shebang#\#!}"
  python=${words[0]}
  if [[ ${python##*/} == env ]]; then python=${words[1]:-python3}; fi
  # torch's torchrun runs as `PY -m distqa.torchrun`: the same torchrun in this process, which
  # leaves out its failure report once distqa said why the run stopped, and exits 0 when every
  # process finished its training even if a SIGTERM came after that.
  if grep -q 'torch.distributed.run' "$torchrun_path"; then launcher=("$python" -m distqa.torchrun); fi
fi

if [[ -n "${MASTER_PORT:-}" ]] &&
  { ! [[ $MASTER_PORT =~ ^[0-9]{1,5}$ ]] || ((10#$MASTER_PORT < 1 || 10#$MASTER_PORT > 65535)); }; then
  die "MASTER_PORT=$MASTER_PORT is not a port number (1-65535): set a free port, or unset it for any free one"
fi

# Check the settings once, in a second and without torch: a mistake is then one line instead of
# one per rank followed by torchrun's failure report.
"$python" -m distqa train --check-config "$@" || exit
for arg in "$@"; do # --help was printed by the check: nothing to launch
  if [[ $arg == -h || $arg == --help ]]; then exit 0; fi
done

rendezvous=(--standalone)
if [[ -n "${MASTER_PORT:-}" ]]; then
  addr=${MASTER_ADDR:-localhost}
  # One line if the port is taken or the address is not this host's (no torch import: well under a second).
  "$python" -m distqa.rdzv_check --prog run_local.sh --addr "$addr" --port "$((10#$MASTER_PORT))" --timeout 5 || exit
  # is_host=1: this process hosts the store; if the port was taken meanwhile it fails rather than
  # joining another run's rendezvous as a client.
  rendezvous=(--nnodes 1 --rdzv-backend c10d --rdzv-endpoint "$addr:$((10#$MASTER_PORT))" --rdzv-conf is_host=1)
fi

exec "${launcher[@]}" "${rendezvous[@]}" --nproc-per-node "$NPROC_PER_NODE" -m distqa train "$@"
