#!/usr/bin/env bash
# The GPU memory rows of docs/benchmarks.md ("DDP or FSDP"), on one machine: for BERT-base and
# BERT-large (built from their configs, no download), seq 512, bf16, one process per GPU, DDP and
# FSDP, each without and with activation checkpointing: throughput, state per rank and peak
# allocated memory; then, per set-up, the largest batch per GPU that fits (doubling until out of
# memory), the figure sharding and checkpointing are for.
#   scripts/bench_fsdp_gpu.sh [OUTPUT_DIR] [KEY=VALUE ...]
set -euo pipefail

out=${1:-results/bench-fsdp-gpu}
shift || true
# The GPUs torch sees (CUDA_VISIBLE_DEVICES applied): distqa bench refuses a count it cannot see.
gpus=$("${PYTHON:-python3}" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if (( gpus == 0 )); then
  echo "bench_fsdp_gpu.sh: no GPU visible (torch.cuda.device_count() is 0)" >&2
  exit 2
fi
nproc=1
for (( n = 2; n <= gpus; n *= 2 )); do nproc+=",$n"; done

for model in bert-base-random bert-large-random; do
  for parallel in ddp fsdp; do
    for ac in false true; do
      name="$model-$parallel-ac-$ac"
      common=(model.name="$model" task.max_seq_len=512 train.precision=bf16
              train.parallel="$parallel" train.activation_checkpointing="$ac")
      distqa bench --nproc "$nproc" --output "$out/$name" "${common[@]}" train.batch_size=16 "$@"
      largest=0  # one run per batch size: only whether it fits matters here
      for batch in 16 32 64 128 256 512; do
        if distqa bench --nproc "$gpus" --output "$out/$name-batch-$batch" --warmup 2 --steps 2 --repeats 1 \
            "${common[@]}" train.batch_size="$batch" "$@" > /dev/null; then
          largest=$batch
        else
          break
        fi
      done
      echo "$name: largest batch per GPU that fits on $gpus GPU(s) (of 16, 32, ..., 512): $largest"
    done
  done
done
