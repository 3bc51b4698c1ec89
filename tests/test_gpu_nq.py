"""Natural Questions on a CUDA GPU (marker gpu; skipped without one): the recipe's own task end to end.

The rest of the GPU suite trains on the DummyDataset. Here the NQ pipeline runs on the device:
preparation, training with evaluation, `distqa predict`, and `distqa score`, in bf16 and in fp16.
Its evaluation and predict take model outputs from the GPU, and predict's forward pass runs in the
precision its thresholds were chosen in. The proof is the one tests/test_nq_pipeline.py makes on
the CPU: the submission scores what the last evaluation said, with the thresholds of that
precision. Every step goes through the user's commands and is judged from their files.

A lent GPU machine has no tokenizer files and no network, so the tokenizer is made here: a
WordPiece vocabulary of bert-base-uncased's size (30522 entries, which `model.name=tiny`'s embedding
expects), holding the fixture's own words, padded with unused entries.
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, metrics_rows
from gpu_runs import DRY_RUN, GPUS, launch_env, record, train

pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("nq")]

SAMPLE = ROOT / "tests" / "fixtures" / "nq" / "simplified-nq-sample.jsonl"  # 10 real training examples
VOCAB_SIZE = 30522


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A lower-casing BERT tokenizer whose vocabulary holds every word and character of the fixture."""
    from transformers import BertTokenizer

    counts: collections.Counter[str] = collections.Counter()
    for line in SAMPLE.read_text().splitlines():
        example = json.loads(line)
        counts.update(re.findall(r"\w+|[^\w\s]", f"{example['question_text']} {example['document_text']}".lower()))
    chars = sorted({c for word in counts for c in word})
    words = [w for w, _ in counts.most_common() if w not in chars]
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars), *words]
    tokens = tokens[:VOCAB_SIZE] + [f"[unused{i}]" for i in range(VOCAB_SIZE - len(tokens))]
    folder = tmp_path_factory.mktemp("tokenizer")
    BertTokenizer(vocab={t: i for i, t in enumerate(tokens)}, do_lower_case=True).save_pretrained(str(folder))
    return folder


def distqa(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "distqa", *args], env=launch_env(cpu=False), capture_output=True, text=True,
        timeout=280, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, f"distqa {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_nq_trains_evaluates_and_predicts_on_cuda_and_the_submission_scores_as_evaluated(
    request, tmp_path, tokenizer_dir, precision
):
    if GPUS < 1:  # the test's name in the reason: pytest's summary then gives each skip a line of its own
        pytest.skip(f"{request.node.name}: needs 1 CUDA GPU (torch.cuda.is_available() is False)")
    out, cache = tmp_path / "run", tmp_path / "cache"
    common = [f"model.tokenizer={tokenizer_dir}", "task.max_seq_len=128", f"task.cache_dir={cache}"]
    # As scripts/demo_nq.sh trains, with DataLoader workers on (the default). 40 steps: with this
    # vocabulary every F1 was still 0 at 20 (on the CPU), and the agreement below would be 0 == 0.
    run = train(
        out,
        [
            "model.name=tiny", *common, f"data.train={SAMPLE}", f"data.valid={SAMPLE}", "task.keep_unknown=0.2",
            "train.batch_size=8", "train.max_steps=40", "train.lr=1e-3", "train.eval_every=20",
            "train.checkpoint_every=40", f"train.precision={precision}",
        ],
    )  # fmt: skip
    evals = [row for row in metrics_rows(out) if "eval_micro_f1" in row]
    assert [row["step"] for row in evals] == [20, 40], run.stdout[-2000:]
    thresholds = json.loads((out / "model" / "distqa_thresholds.json").read_text())
    assert thresholds["precision"] == precision and thresholds["step"] == 40

    submission = tmp_path / "submission.csv"
    predicted = distqa("predict", "--input", str(SAMPLE), "--checkpoint", str(out), "--output", str(submission),
                       *common)  # fmt: skip
    # predict's own train.precision is fp32: it gives way to the thresholds' (on the CPU of a dry run too).
    assert f"scores in {precision}, the precision the thresholds were chosen in" in predicted.stdout
    scored = json.loads(distqa("score", "--gold", str(SAMPLE), "--pred", str(submission)).stdout.splitlines()[-1])
    record(
        f"nq_{precision}", seconds=run.seconds, eval_micro_f1=evals[-1]["eval_micro_f1"],
        scored_micro_f1=scored["micro_f1"], dry_run=DRY_RUN,
        # Each evaluation's F1 and loss: a 0 at step 40 then tells a slow start from a broken pipeline.
        evaluations=[{"step": row["step"], "micro_f1": row["eval_micro_f1"], "loss": row.get("loss")} for row in evals],
    )  # fmt: skip
    # Two implementations of the metric over the same weights, windows and thresholds.
    for key in ("micro_f1", "long_f1", "short_f1"):
        assert scored[key] == pytest.approx(evals[-1][f"eval_{key}"]), (key, scored, evals[-1])
    assert scored["micro_f1"] > 0, "0 == 0 proves nothing: the model answered nothing right"
