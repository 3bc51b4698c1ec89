"""A pretrained model on the DummyDataset says so, in one line, on rank 0 only (issue 26): a config
that names no data must not fine-tune real weights on noise for hours without a word."""

from __future__ import annotations

from pathlib import Path

import pytest

from distqa.nq.task import NQTask
from distqa.registry import load_config

WARNING = "trains on the DummyDataset (data.train=dummy), synthetic data"


def build_train_data(capsys: pytest.CaptureFixture[str], model: str) -> list[str]:
    cfg = load_config(None, [f"model.name={model}", "data.train=dummy", "task.max_seq_len=32", "task.dummy_size=4"])
    task = NQTask(cfg)
    task.build_model()
    assert len(task.build_train_dataset()) == 4  # type: ignore[arg-type]
    return [line for line in capsys.readouterr().out.splitlines() if "DummyDataset" in line]


def test_a_pretrained_model_on_the_dummy_dataset_warns_once(capsys, monkeypatch, minilm_dir: Path):
    monkeypatch.setenv("RANK", "0")
    assert build_train_data(capsys, str(minilm_dir)) == [
        f"warning: the pretrained model {minilm_dir} {WARNING}: set data.train to Natural Questions data for a real run"
    ]
    monkeypatch.setenv("RANK", "1")  # the other ranks build the same data silently
    assert build_train_data(capsys, str(minilm_dir)) == []


def test_a_random_model_on_the_dummy_dataset_is_the_quick_start(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    assert build_train_data(capsys, "tiny") == []
