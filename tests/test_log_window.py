"""The first loss logged after a resume covers the same steps as an uninterrupted run's: the open
log window (its loss sum and micro-batch count) travels in the checkpoint's trainer state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distqa.meter import ThroughputMeter
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


def test_steps_before_and_after_a_resume_weigh_the_same_when_grad_accum_changes(tmp_path):
    """The window counts micro-batches: resumed with 4 per step instead of 1, the 3 steps before the
    checkpoint weighed 1/4 of a step each (the mean came out 3.414 against 3.413 in a review)."""
    steps = tmp_path / "steps"
    train(load_config(None, [*TOY, f"output_dir={steps}", "train.log_every=1"]))
    per_step = losses(steps)
    out = tmp_path / "run"
    train(load_config(None, [*TOY, f"output_dir={out}"]))
    resumed = [*TOY, f"output_dir={out}", "train.batch_size=2", "train.grad_accum=4"]  # the same global batch
    train(load_config(None, [*resumed, f"train.resume={out / 'checkpoints' / 'step-3'}"]))
    expected = sum(per_step[s] for s in (1, 2, 3, 4)) / 4
    assert losses(out)[4] == pytest.approx(expected, rel=1e-5)


def test_a_saved_window_is_rescaled_to_the_processes_and_micro_batches_of_the_resumed_run():
    from distqa.checkpoint_manager import TrainerState
    from distqa.dist import DistInfo

    cfg = load_config(None, [*TOY, "train.grad_accum=2"])
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    meter = ThroughputMeter(info.device)
    state = TrainerState(cfg, info, meter, global_batch=16, total_steps=6, epoch_steps=16, data_identity={})
    saved_cfg = {"train": {"grad_accum": 1}}
    # Written by 2 processes with 1 micro-batch each: 3 steps of loss 2.0, norms of 5.0 counted twice each.
    state.load_state_dict(
        {"step": 3, "world_size": 2, "config": saved_cfg, "log_window": [12.0, 6.0], "grad_norm_window": [30.0, 6.0]}
    )
    meter.add(torch.tensor(6.0), samples=8, tokens=0)  # step 4: two micro-batches of 6.0 on one process
    meter.add(torch.tensor(6.0), samples=8, tokens=0)
    meter.add_grad_norm(torch.tensor(9.0))
    figures = meter.reduce_and_reset()
    assert figures["loss"] == pytest.approx((2.0 * 3 + 6.0) / 4)
    assert figures["grad_norm"] == pytest.approx((5.0 * 3 + 9.0) / 4)


def test_tensorboard_files_of_one_second_are_read_in_the_order_they_were_written(tmp_path):
    """A resume's event files written in the first run's second were named by a counter compared as
    text (100 before 99): TensorBoard read them first, and the first run's purge at step 1 dropped
    their points (3 of 4 evaluation points lost in CI)."""
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from distqa.dist import DistInfo
    from distqa.metrics import MetricsWriter

    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    started = time.time()
    for first, last in ((1, 2), (3, 4), (5, 6)):  # a run, then two resumes, as fast as they come
        writer = MetricsWriter(tmp_path, info, resume_step=first - 1)
        for step in range(first, last + 1):
            writer.log({"step": step, "loss": float(step)})
        writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    names = sorted(p.name for p in (tmp_path / "tb").iterdir())
    assert len({name.split(".")[3] for name in names}) == 3  # a second each: name order is write order
    assert time.time() - started < 5
