"""The first loss logged after a resume covers the same steps as an uninterrupted run's: the open
log window (its loss sum and micro-batch count) travels in the checkpoint's trainer state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distqa.metrics import ThroughputMeter
from distqa.registry import load_config
from distqa.trainer import train

TOY = [
    "task.name=toy_task:ToyClassificationTask",
    "task.size=256",
    "data.num_workers=0",
    "train.batch_size=8",
    "train.max_steps=6",
    "train.log_every=4",  # the window of step 4 spans the checkpoint at step 3
    "train.checkpoint_every=3",
    "train.keep_checkpoints=0",
]


def losses(out: Path) -> dict[int, float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def test_the_first_loss_after_a_resume_covers_the_whole_log_window(tmp_path):
    out = tmp_path / "run"
    train(load_config(None, [*TOY, f"output_dir={out}"]))
    uninterrupted = losses(out)
    assert sorted(uninterrupted) == [4, 6]
    state = json.loads((out / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    assert state["log_window"][1] == 3  # three micro-batches since the last log line
    # Resume at step 3, which is no log step: steps 4-6 again, over the same records.
    train(load_config(None, [*TOY, f"output_dir={out}", f"train.resume={out / 'checkpoints' / 'step-3'}"]))
    assert losses(out) == pytest.approx(uninterrupted, rel=1e-12)


def test_a_meter_goes_on_with_a_saved_window_on_rank_0_only():
    meter = ThroughputMeter(torch.device("cpu"))
    meter.resume_window([6.0, 3.0], is_main=True)
    meter.add(torch.tensor(2.0), samples=8, tokens=0)
    assert meter.reduce_and_reset()["loss"] == 2.0  # (6 + 2) / 4
    other = ThroughputMeter(torch.device("cpu"))
    other.resume_window([6.0, 3.0], is_main=False)  # the all-reduce adds rank 0's sums once
    assert other.window() == [0.0, 0.0]
    other.resume_window(None, is_main=True)  # a checkpoint from before windows were saved
    assert other.window() == [0.0, 0.0]
