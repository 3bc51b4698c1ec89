"""Natural Questions end to end on real lines: train with validation under torchrun, predict a
submission, score it; plus the postprocessing rules on their own."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distqa.nq.predict as predict_module
from conftest import ROOT, SMALL, TESTS, run_train, subprocess_env
from distqa.cli import main
from distqa.errors import DistqaError
from distqa.nq.evaluate import window_bests
from distqa.nq.features import LONG, NO, SHORT, YES
from distqa.nq.postprocess import (
    ExamplePrediction,
    WindowBest,
    apply_thresholds,
    best_spans,
    predict_example,
)
from distqa.nq.reader import NQExample, NQReader
from distqa.nq.thresholds import read_chosen, thresholds_json

SAMPLE = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"


def strict_json(text: str) -> Any:
    """json.loads as strict parsers (JavaScript's, jq) read JSON: no Infinity, -Infinity or NaN."""

    def reject(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=reject)


@pytest.mark.slow
def test_train_validate_predict_score(tmp_path, minilm_dir, capsys, monkeypatch):
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
    thresholds = strict_json((out / "model" / "distqa_thresholds.json").read_text())
    assert set(thresholds) == {"long", "short", "step", "precision"} and thresholds["precision"] == "fp32"
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

    # Thresholds chosen on bf16 scores are compared with bf16 scores: predict's forward pass runs in
    # the precision the file records (on the CPU too, as the training's evaluation did), whatever
    # its own train.precision; it ran in predict's own (fp32 by default) on the CPU and on GPUs.
    used: list[torch.dtype | None] = []
    real = predict_module.window_bests
    monkeypatch.setattr(
        predict_module, "window_bests", lambda *a, **k: used.append(k["autocast_dtype"]) or real(*a, **k)
    )
    path = out / "model" / "distqa_thresholds.json"
    path.write_text(json.dumps({**thresholds, "precision": "bf16"}))
    capsys.readouterr()
    assert main([*argv, f"model.tokenizer={minilm_dir}", f"task.cache_dir={cache}"]) == 0
    assert "scores in bf16, the precision the thresholds were chosen in" in capsys.readouterr().out
    path.write_text(json.dumps(thresholds))  # fp32, as trained: predict's own bf16 gives way to it
    assert main([*argv, f"model.tokenizer={minilm_dir}", f"task.cache_dir={cache}", "train.precision=bf16"]) == 0
    assert used == [torch.bfloat16, None]


def test_thresholds_file_is_strict_json_and_old_infinity_files_still_read(tmp_path):
    """+inf ("never answer": chosen when answering lowers F1) is written as null."""
    never = {"long": math.inf, "short": 0.25}
    text = thresholds_json(never)
    assert strict_json(text) == {"long": None, "short": 0.25}
    path = tmp_path / "distqa_thresholds.json"
    path.write_text(text)
    assert read_chosen(path)[0] == never
    path.write_text('{"long": Infinity, "short": -1.5}')  # as exports before this format wrote it
    assert read_chosen(path)[0] == {"long": math.inf, "short": -1.5}
    # What it means: a score never exceeds +inf, so that kind of answer is never given.
    assert apply_thresholds(ExamplePrediction("3:9", "4:5", 1e30), read_chosen(path)[0]) == ("", "4:5")
    path.write_text("[1, 2]")
    with pytest.raises(DistqaError, match="is not a thresholds file"):
        read_chosen(path)[0]


class ModeProbe(torch.nn.Module):
    """Records the mode each forward pass ran in, and answers with the logits best_spans needs."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.seen: list[tuple[bool, bool, bool]] = []

    def forward(self, input_ids, attention_mask, token_type_ids):
        self.seen.append((self.training, torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")))
        logits = input_ids.float() * self.weight
        return {"start_logits": logits, "end_logits": logits, "answer_type_logits": logits[:, :5]}


def test_predict_runs_in_the_trainer_s_evaluation_mode(monkeypatch):
    """`distqa predict`'s forward passes (window_bests) use evaluation's own eval_mode: eval, no
    gradients, the autocast asked for; the model's mode is restored afterwards."""
    import datasets

    rows = {
        "example_id": ["1", "2", "3"],
        "input_ids": [[1, 2, 3, 4, 5, 6]] * 3,
        "token_map": [[-1, 0, 1, 2, 3, 4]] * 3,
    }
    rows |= {"attention_mask": [[1] * 6] * 3, "token_type_ids": [[0] * 6] * 3}
    monkeypatch.setattr("distqa.nq.prepare.load_features", lambda folder: datasets.Dataset.from_dict(rows))
    model = ModeProbe()
    kwargs = {"device": torch.device("cpu"), "batch_size": 2, "pad_id": 0, "max_len": 8, "max_answer_len": 30}
    bests = window_bests(model, Path("unused"), **kwargs, autocast_dtype=torch.bfloat16)
    assert [b.example_id for b in bests] == ["1", "2", "3"]
    assert model.seen == [(False, False, True)] * 2 and model.training
    window_bests(model, Path("unused"), **kwargs)  # no autocast asked for (CPU predict): none
    assert model.seen[2:] == [(False, False, False)] * 2 and model.training


def example(candidates):
    return NQExample("1", "q", [], [{"start_token": a, "end_token": b, "top_level": t} for a, b, t in candidates])


def test_predict_example_picks_the_best_window_and_its_candidate():
    windows = [WindowBest("1", 1.0, 5, 7, SHORT), WindowBest("1", 3.0, 22, 24, SHORT), WindowBest("1", 2.0, 9, 10, YES)]
    pred = predict_example(windows, example([(0, 12, True), (20, 30, True), (21, 25, False)]))
    assert (pred.long, pred.short, pred.score) == ("20:30", "22:24", 3.0)  # top-level preferred to nested
    pred = predict_example([WindowBest("1", 1.0, 40, 41, NO)], example([(0, 12, True)]))
    assert (pred.long, pred.short) == ("", "NO")  # no candidate holds the span: NO names none
    pred = predict_example([WindowBest("1", 2.0, 3, 9, LONG)], example([(0, 12, True)]))
    assert (pred.long, pred.short) == ("0:12", "")  # "a long answer only": its span is no short answer
    assert predict_example([], example([])).score == -math.inf


def test_a_span_outside_every_candidate_is_passed_over_for_one_inside():
    """NQ's short answers lie inside a long-answer candidate: a best span across two paragraphs
    (seen on the real Kaggle test example) was written as a short answer with no long one, a sure
    false positive. The next window's span inside a candidate is taken instead, or none at all."""
    candidates = example([(0, 12, True), (20, 30, True)])
    across = WindowBest("1", 5.0, 10, 22, SHORT)  # starts in one candidate, ends in the next
    inside = WindowBest("1", 2.0, 22, 24, SHORT)
    pred = predict_example([across, inside], candidates)
    assert (pred.long, pred.short, pred.score) == ("20:30", "22:24", 2.0)
    pred = predict_example([across, WindowBest("1", 1.0, 40, 41, SHORT)], candidates)
    assert (pred.long, pred.short, pred.score) == ("", "", -math.inf)


def test_best_spans_respects_document_and_length():
    start = torch.tensor([[5.0, 9.0, 1.0, 4.0, 0.0, 3.0]])
    end = torch.tensor([[5.0, 0.0, 8.0, 1.0, 7.0, 0.0]])
    tmap = torch.tensor([[-1, -1, 10, 11, 12, -1]])  # positions 2..4 are the document
    (best,) = best_spans(start, end, torch.tensor([[0.0, 0, 0, 5, 0]]), tmap, ["e"], max_answer_len=2)
    # start 9.0 sits outside the document; best inside: start at 3 (4.0) + end at 4 (7.0), length 2.
    assert (best.start_token, best.end_token, best.answer_type) == (11, 13, SHORT)
    assert best.score == pytest.approx(4.0 + 7.0 - (5.0 + 5.0))


def pair_by_pair(start, end, types, tmap, ids, max_answer_len, top_k=20):
    """best_spans as it was written first: every top-k pair in turn, the first best kept."""
    doc = tmap >= 0
    ms, me = start.float().masked_fill(~doc, -math.inf), end.float().masked_fill(~doc, -math.inf)
    k = min(top_k, start.shape[1])
    starts, ends = ms.topk(k, dim=1).indices, me.topk(k, dim=1).indices
    null = start[:, 0].float() + end[:, 0].float()
    out = []
    for row, example_id in enumerate(ids):
        best = None
        for s in starts[row].tolist():
            for e in ends[row].tolist():
                if doc[row, s] and doc[row, e] and s <= e and e - s + 1 <= max_answer_len:
                    score = float(ms[row, s] + me[row, e] - null[row])
                    if best is None or score > best[0]:
                        best = (score, s, e)
        if best is not None:
            score, s, e = best
            out.append(
                WindowBest(example_id, score, int(tmap[row, s]), int(tmap[row, e]) + 1, int(types[row].argmax()))
            )
    return out


# Few distinct logits, so that equal best scores are common; now and then -inf, inf or NaN (as a
# model in fp16 may give them), which the batched search leaves to the pair-by-pair one.
LOGIT = st.sampled_from([0.0, 1.0, 2.0, -3.0, 7.25] * 12 + [-math.inf, math.inf, math.nan])


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    batch=st.integers(1, 4),
    seq=st.integers(1, 30),
    max_answer_len=st.integers(1, 6),
    top_k=st.integers(1, 25),
)
def test_best_spans_pick_what_pair_by_pair_picks(data, batch, seq, max_answer_len, top_k):
    """The batched search gives every window the span, score (bit for bit) and type the first
    pair-by-pair search gave, ties and non-finite logits included."""
    logits = st.lists(st.lists(LOGIT, min_size=seq, max_size=seq), min_size=batch, max_size=batch)
    start, end = torch.tensor(data.draw(logits)), torch.tensor(data.draw(logits))
    doc = data.draw(st.lists(st.lists(st.booleans(), min_size=seq, max_size=seq), min_size=batch, max_size=batch))
    tmap = torch.tensor([[10 + i if d else -1 for i, d in enumerate(row)] for row in doc])
    types = torch.tensor(data.draw(st.lists(st.lists(LOGIT, min_size=5, max_size=5), min_size=batch, max_size=batch)))
    ids = [str(i) for i in range(batch)]
    got = best_spans(start, end, types, tmap, ids, max_answer_len=max_answer_len, top_k=top_k)
    want = pair_by_pair(start, end, types, tmap, ids, max_answer_len, top_k)
    key = lambda w: (w.example_id, w.start_token, w.end_token, w.answer_type, repr(w.score))  # noqa: E731
    assert [key(w) for w in got] == [key(w) for w in want]
