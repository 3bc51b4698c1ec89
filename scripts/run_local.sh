#!/usr/bin/env bash
# Train on this machine with torchrun's standalone rendezvous: one process per GPU, or
# NPROC_PER_NODE CPU processes (default 2) where there is no GPU. Arguments go to `distqa train`.
#   scripts/run_local.sh --config configs/quickstart.yaml output_dir=results/run1
set -euo pipefail

if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if (( gpus > 0 )); then NPROC_PER_NODE=$gpus; else NPROC_PER_NODE=2; fi
fi

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

# Check the settings once, in a second and without torch: a mistake is then one line instead of
# one per rank followed by torchrun's failure report.
"$python" -m distqa train --check-config "$@" || exit

exec "${launcher[@]}" --standalone --nproc-per-node "$NPROC_PER_NODE" -m distqa train "$@"
