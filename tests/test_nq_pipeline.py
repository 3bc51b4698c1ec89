"""Natural Questions end to end on real lines: train with validation under torchrun, predict a
submission, score it; plus the postprocessing rules on their own."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import ROOT, SMALL, TESTS, run_train, subprocess_env
from distqa.cli import main
from distqa.nq.features import NO, SHORT, YES
from distqa.nq.postprocess import WindowBest, best_spans, best_threshold, f1, kind_f1, predict_example
from distqa.nq.reader import NQExample, NQReader

SAMPLE = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"


@pytest.mark.slow
def test_train_validate_predict_score(tmp_path, minilm_dir, capsys):
    out, cache = tmp_path / "run", tmp_path / "cache"
    common = [f"model.tokenizer={minilm_dir}", "task.max_seq_len=128", f"task.cache_dir={cache}"]
    proc = run_train(
        [
            *SMALL,
            *common,
            f"data.train={SAMPLE}",
            f"data.valid={SAMPLE}",
            "task.keep_unknown=0.3",
            "train.batch_size=4",
            "train.max_steps=20",  # at 4 steps every F1 is 0 and the agreement below would be 0 == 0
            "train.eval_every=10",
            "train.lr=1e-3",
            f"output_dir={out}",
        ],
        nproc=2,
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_micro_f1" in r]
    assert [r["step"] for r in evals] == [10, 20]
    thresholds = json.loads((out / "model" / "distqa_thresholds.json").read_text())
    assert set(thresholds) == {"long", "short"}
    # In a log: no progress bars (datasets' preparation, training), a line per logged step, and the
    # last lines name the model, metrics.jsonl and metrics.png.
    assert "\r" not in proc.stdout + proc.stderr and "Generating train split" not in proc.stderr
    assert [line.split(" (")[0] for line in proc.stdout.splitlines() if line.startswith("step ")] == [
        f"step {r['step']}/20" for r in records
    ]
    assert f"model written to {out / 'model'}" in proc.stdout and f"plotted in {out / 'metrics.png'}" in proc.stdout
    prepared = sorted(cache.iterdir())  # the training and the validation features
    assert len(prepared) == 2

    # predict through the command line's entry point, in this process (its output as another
    # program reads it is tests/test_nq_predict_checks.py's). Without task.max_seq_len: the export
    # carries the settings it was trained with (model/distqa_task.json), so the scores below agree.
    submission = tmp_path / "submission.csv"
    capsys.readouterr()
    argv = ["predict", "--input", str(SAMPLE), "--checkpoint", str(out), "--output", str(submission)]
    assert main([*argv, f"model.tokenizer={minilm_dir}", f"task.cache_dir={cache}"]) == 0
    # The validation features are reused (training's keep_unknown does not matter to them), quietly.
    assert sorted(cache.iterdir()) == prepared and "prepared" not in capsys.readouterr().out
    with submission.open(newline="") as f:
        rows = list(csv.reader(f))
    ids = sorted(e.example_id for e in NQReader(SAMPLE))  # as strings: "-25..." < "34..."
    assert rows[0] == ["example_id", "PredictionString"]
    assert [r[0] for r in rows[1:]] == [f"{i}_{kind}" for i in ids for kind in ("long", "short")]

    cmd = [sys.executable, "-m", "distqa", "score", "--gold", str(SAMPLE), "--pred", str(submission)]
    proc = subprocess.run(cmd, check=True, env=subprocess_env(), cwd=ROOT, capture_output=True, text=True)
    scored = json.loads(proc.stdout.strip().splitlines()[-1])
    # The scorer and the in-training evaluation are two implementations of the same metric over the
    # same model and thresholds: they must agree.
    assert scored["micro_f1"] == pytest.approx(evals[-1]["eval_micro_f1"])
    assert scored["long_f1"] == pytest.approx(evals[-1]["eval_long_f1"])
    assert scored["short_f1"] == pytest.approx(evals[-1]["eval_short_f1"])
    # Not 0 == 0: at 20 steps the model answers some questions right (0.235 measured; 0.0 at 4 steps).
    assert scored["micro_f1"] > 0.1 and scored["long_f1"] > 0 and scored["short_f1"] > 0


def example(candidates):
    return NQExample("1", "q", [], [{"start_token": a, "end_token": b, "top_level": t} for a, b, t in candidates])


def test_predict_example_picks_the_best_window_and_its_candidate():
    windows = [WindowBest("1", 1.0, 5, 7, SHORT), WindowBest("1", 3.0, 22, 24, SHORT), WindowBest("1", 2.0, 9, 10, YES)]
    pred = predict_example(windows, example([(0, 12, True), (20, 30, True), (21, 25, False)]))
    assert (pred.long, pred.short, pred.score) == ("20:30", "22:24", 3.0)  # top-level preferred to nested
    pred = predict_example([WindowBest("1", 1.0, 40, 41, NO)], example([(0, 12, True)]))
    assert (pred.long, pred.short) == ("", "NO")  # no candidate holds the span
    assert predict_example([], example([])).score == -math.inf


def test_best_spans_respects_document_and_length():
    start = torch.tensor([[5.0, 9.0, 1.0, 4.0, 0.0, 3.0]])
    end = torch.tensor([[5.0, 0.0, 8.0, 1.0, 7.0, 0.0]])
    tmap = torch.tensor([[-1, -1, 10, 11, 12, -1]])  # positions 2..4 are the document
    (best,) = best_spans(start, end, torch.tensor([[0.0, 0, 0, 5, 0]]), tmap, ["e"], max_answer_len=2)
    # start 9.0 sits outside the document; best inside: start at 3 (4.0) + end at 4 (7.0), length 2.
    assert (best.start_token, best.end_token, best.answer_type) == (11, 13, SHORT)
    assert best.score == pytest.approx(4.0 + 7.0 - (5.0 + 5.0))


rows_strategy = st.lists(
    st.tuples(
        st.sampled_from([-2.0, -0.5, 0.0, 0.5, 1.0, 3.0]),
        st.sampled_from(["", "a", "b", "c"]),
        st.sets(st.sampled_from(["a", "b", "c"]), max_size=2),
    ),
    max_size=15,
)


@given(rows_strategy)
def test_best_threshold_is_the_best_cut(rows):
    cut, value = best_threshold(rows)
    assert f1(*kind_f1(rows, cut)) == pytest.approx(value)
    scores = sorted({r[0] for r in rows})
    for c in [-math.inf, *[s - 1e-6 for s in scores], math.inf]:
        assert f1(*kind_f1(rows, c)) <= value + 1e-12
