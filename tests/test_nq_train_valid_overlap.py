"""Validation examples that are also training examples are named at start: their scores measure
what the model saw, and `train.best_metric` would pick a checkpoint by them, with nothing said."""

from __future__ import annotations

import json

import pytest

from conftest import SMALL, TESTS
from distqa.nq.split import split_file
from distqa.registry import load_config

SAMPLE = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"
LINES = SAMPLE.read_text().splitlines()


def short(line: str, n_tokens: int = 150) -> str:
    """A real annotated line cut to its first tokens (the answers it keeps stay valid)."""
    obj = json.loads(line)
    obj["document_text"] = " ".join(obj["document_text"].split(" ")[:n_tokens])
    kept = [c for c in obj["long_answer_candidates"] if c["end_token"] <= n_tokens]
    obj["long_answer_candidates"] = kept
    for annotation in obj["annotations"]:
        annotation["long_answer"] = {"start_token": -1, "end_token": -1, "candidate_index": -1}
        annotation["short_answers"], annotation["yes_no_answer"] = [], "NONE"
    return json.dumps(obj)


def start(tmp_path, minilm_dir, train, valid, capsys) -> str:
    """Build the data as a run does at start (rank 0) and return what it printed."""
    from distqa.nq.task import NQTask

    args = [
        *SMALL,
        f"model.tokenizer={minilm_dir}",
        f"task.cache_dir={tmp_path / 'cache'}",
        "task.keep_unknown=1",  # every window kept: these cut lines have no answer left
        f"data.train={train}",
        f"data.valid={valid}",
    ]
    task = NQTask(load_config(None, args))
    task.build_model()
    capsys.readouterr()
    task.build_train_dataset()
    return capsys.readouterr().out


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("same_file", [True, False], ids=["same-file", "a-copy-sharing-two"])
def test_validation_examples_that_are_also_training_examples_are_named(tmp_path, minilm_dir, capsys, same_file):
    lines = [short(line) for line in LINES[:4]]
    train = write(tmp_path / "train.jsonl", lines)
    valid = train if same_file else write(tmp_path / "valid.jsonl", [*lines[2:], short(LINES[5])])
    out = start(tmp_path, minilm_dir, train, valid, capsys)
    shared = lines if same_file else lines[2:]
    first = min(str(json.loads(line)["example_id"]) for line in shared)
    total = 4 if same_file else 3
    assert f"warning: data.train={train} trains on {len(shared)} of the {total} examples of data.valid={valid}" in out
    assert f"(first: {first})" in out


def test_disjoint_files_from_distqa_split_say_nothing_of_it(tmp_path, minilm_dir, capsys):
    source = write(tmp_path / "all.jsonl", [short(line) for line in LINES[:6]])
    split_file(source, tmp_path / "split", 3)
    out = start(tmp_path, minilm_dir, tmp_path / "split" / "train.jsonl", tmp_path / "split" / "valid.jsonl", capsys)
    assert "are also in data.train" not in out
