#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md, on one machine: BERT-base (built from its config,
# no download), seq 512, bf16, one process per GPU; tokens/s and MFU without and with
# torch.compile, then the largest batch per GPU that fits (doubling until out of memory).
#   scripts/bench_gpu.sh [OUTPUT_DIR] [KEY=VALUE ...]
set -euo pipefail

out=${1:-results/bench-gpu}
shift || true
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if (( gpus == 0 )); then
  echo "bench_gpu.sh: no GPU visible (nvidia-smi -L lists none)" >&2
  exit 2
fi
nproc=1
for (( n = 2; n <= gpus; n *= 2 )); do nproc+=",$n"; done

common=(model.name=bert-base-random task.max_seq_len=512 train.precision=bf16 train.batch_size=32)
distqa bench --nproc "$nproc" --output "$out/eager" "${common[@]}" "$@"
distqa bench --nproc "$nproc" --output "$out/compile" --warmup 10 "${common[@]}" train.compile=true "$@"

largest=0  # one run per batch size (--repeats 1): only whether it fits matters here
for batch in 16 32 64 128 256 512; do
  if distqa bench --nproc 1 --output "$out/batch-$batch" --warmup 2 --steps 3 --repeats 1 \
      "${common[@]}" train.batch_size="$batch" "$@"; then
    largest=$batch
  else
    break
  fi
done
echo "largest batch per GPU that fits (of 16, 32, ..., 512): $largest"
