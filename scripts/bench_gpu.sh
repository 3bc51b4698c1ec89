#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md, on one machine: BERT-base (built from its config,
# no download), seq 512, bf16, one process per GPU; tokens/s and MFU without and with
# torch.compile, then the largest batch per GPU that fits (doubling until out of memory).
#   scripts/bench_gpu.sh [OUTPUT_DIR] [KEY=VALUE ...]
set -euo pipefail

out=results/bench-gpu
if (($# > 0)) && [[ $1 != *=* ]]; then # a KEY=VALUE first is a setting, not the folder
  out=$1
  shift
fi
# The GPUs torch sees (CUDA_VISIBLE_DEVICES applied): distqa bench refuses a count it cannot see.
gpus=$("${PYTHON:-python3}" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if (( gpus == 0 )); then
  echo "bench_gpu.sh: no GPU visible (torch.cuda.device_count() is 0)" >&2
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
