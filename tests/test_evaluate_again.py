"""An evaluation that raised is run again by the resume (distqa.evaluate_again), before training
goes on: its figures land in the step's metrics line (once), train.best_metric sees them, and the
export carries the task state of the final step's evaluation, not an earlier one's. In-process,
one process, on the toy task: seconds."""

from __future__ import annotations

import json
import os

import pytest
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from distqa.errors import DistqaError
from distqa.registry import load_config
from distqa.trainer import train
from toy_task import BlobsDataset, ToyClassificationTask


class FailingEvalTask(ToyClassificationTask):
    """Scripted scores by step; the evaluation of the steps in `FAILS` raises (a fork's metric bug,
    fixed between runs). Its state, as NQ's thresholds, is what its last evaluation chose, and the
    export writes it beside the model."""

    SCORES = {2: 0.5, 4: 0.9, 6: 0.7, 8: 0.6}
    FAILS: set[int] = set()

    def __init__(self, cfg):
        super().__init__(cfg)
        self.chosen_at: int | None = None

    def build_eval_dataset(self):
        return BlobsDataset(4, seed=3)

    def eval_step(self, model, batch):
        return [0] * len(batch["label"])

    def compute_metrics(self, outputs, step):
        if step in self.FAILS:
            raise ZeroDivisionError("division by zero")
        self.chosen_at = step
        return {"eval_score": self.SCORES[step]}

    def state_dict(self):
        return {"chosen_at": self.chosen_at}

    def load_state_dict(self, state):
        self.chosen_at = state.get("chosen_at")

    def save_model(self, model, directory):
        super().save_model(model, directory)
        (directory / "chosen.json").write_text(json.dumps({"chosen_at": self.chosen_at}))


BASE = [
    "task.name=test_evaluate_again:FailingEvalTask",
    "task.size=256",
    "data.num_workers=0",
    "train.batch_size=8",
    "train.lr=1e-2",
    "train.eval_every=2",
    "train.log_every=1",
    "train.checkpoint_every=3",
    "train.best_metric=eval_score",
    "train.best_mode=max",  # a toy task declares no direction for its metrics
]


def run(out, *overrides):
    train(load_config(None, [*BASE, f"output_dir={out}", *overrides]))
    return out


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def without_speed(lines):
    return [{k: v for k, v in row.items() if k not in ("samples_per_s", "tokens_per_s")} for row in lines]


def pending(out, step):
    return json.loads((out / "checkpoints" / f"step-{step}" / "trainer_state.json").read_text())["evaluation_pending"]


def test_a_failed_evaluation_mid_run_is_run_by_the_resume_which_then_trains_on_unchanged(tmp_path, monkeypatch, capsys):
    """Step 4's evaluation (the best score) raised: the resume measures it, step-4 becomes the best,
    step 4's line holds its training figures and its score once, and the weights at the end are
    the uninterrupted run's."""
    out, straight = tmp_path / "run", tmp_path / "straight"
    run(straight, "train.max_steps=8")
    monkeypatch.setattr(FailingEvalTask, "FAILS", {4})
    with pytest.raises(DistqaError, match="evaluation at step 4: .*ZeroDivisionError.*the same command evaluates it"):
        run(out, "train.max_steps=8")
    assert pending(out, 4) is True
    before = rows(out)[-1]
    assert before["step"] == 4 and "eval_score" not in before

    monkeypatch.setattr(FailingEvalTask, "FAILS", set())
    capsys.readouterr()
    run(out, "train.max_steps=8")
    said = capsys.readouterr().out
    assert "evaluation at step 4: it failed before checkpoint step-4 was written; running it now" in said
    assert "new best eval_score=0.9 at step 4" in said

    lines = rows(out)
    assert [row["step"] for row in lines] == list(range(1, 9))  # each step once
    assert lines[3] == {**before, "eval_score": 0.9}  # the training figures as logged, and the score
    assert without_speed(lines) == without_speed(rows(straight))  # losses, rates and scores alike
    root = out / "checkpoints"
    assert os.readlink(root / "best") == "step-4" and pending(out, 4) is False
    final, expected = (
        load_file(out / "model" / "model.safetensors"),
        load_file(straight / "model" / "model.safetensors"),
    )
    assert all((final[k] == expected[k]).all() for k in expected)

    # TensorBoard: step 4's score once, no step written twice.
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/score")] == [2, 4, 6, 8]
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 9))


def test_the_last_step_s_failed_evaluation_is_run_before_the_export_and_again_until_it_passes(
    tmp_path, monkeypatch, capsys
):
    """At the last step the export carried the task state of step 2's evaluation (as NQ's
    thresholds, which predict then refused beside step 4's weights). A resume whose evaluation
    raises again says so and leaves the checkpoint still owing it."""
    out = tmp_path / "run"
    monkeypatch.setattr(FailingEvalTask, "FAILS", {4})
    for _ in range(2):
        with pytest.raises(DistqaError, match="evaluation at step 4") as caught:
            run(out, "train.max_steps=4")
        assert pending(out, 4) is True and not (out / "model").exists()
    assert "run again on resume" in str(caught.value)
    assert [row["step"] for row in rows(out)] == [1, 2, 3, 4] and "eval_score" not in rows(out)[-1]

    monkeypatch.setattr(FailingEvalTask, "FAILS", set())
    assert not (out / "metrics.png").exists()
    run(out, "train.max_steps=4")
    assert (out / "metrics.png").is_file()  # the owed evaluation's record plotted (it was never drawn)
    assert json.loads((out / "model" / "chosen.json").read_text()) == {"chosen_at": 4}
    assert rows(out)[-1]["eval_score"] == 0.9 and pending(out, 4) is False
    state = json.loads((out / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    assert state["task"] == {"chosen_at": 4} and state["best"]["step"] == 4

    capsys.readouterr()
    run(out, "train.max_steps=4")  # complete now: nothing evaluated or written again
    assert "already finished at step 4" in capsys.readouterr().out


def test_step_1_written_again_is_one_point_in_tensorboard_and_infinity_is_none(tmp_path):
    """A failed evaluation at step 1, run again by the resume, wrote step 1 twice into tb/ (its
    writer opened at step 0, where no purge was set); a threshold that keeps nothing, null in
    metrics.jsonl, was inf in tb/."""
    import torch

    from distqa.dist import DistInfo
    from distqa.metrics import MetricsWriter

    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    first = MetricsWriter(tmp_path, info)
    first.log({"step": 1, "loss": 2.0, "eval_threshold": float("inf")})
    first.close()
    again = MetricsWriter(tmp_path, info, resume_step=0)
    again.log({"step": 1, "loss": 2.0, "eval_threshold": 0.5})
    again.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.0)]
    assert [(e.step, e.value) for e in events.Scalars("eval/threshold")] == [(1, 0.5)]
