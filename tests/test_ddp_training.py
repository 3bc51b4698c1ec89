"""Integration through torchrun with 2 CPU processes (gloo): the launch users run.

(a) 2 processes x batch 4 and 1 process x batch 8 reach the same weights, and the comparison is
    sharp enough to tell 2 steps from 3;
(b) a stop, then a resume from an earlier checkpoint at an epoch's start, ends with the weights of
    the straight run bit for bit (dropout on, AdamW, gradient accumulation, DataLoader workers on),
    and the later steps' metrics are rewritten, not repeated.
"""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import FAULT_RUN, SGD, checkpoint_weights, load_weights, max_abs_diff, metrics_rows, run_train
from distqa.checkpoint import list_checkpoints
from distqa.config import load_config
from distqa.trainer import train

pytestmark = pytest.mark.slow

EQUIVALENCE = [*SGD, "data.num_workers=2"]


def test_two_by_four_equals_one_by_eight(tmp_path):
    # 2 x 4 to step 4, with a checkpoint at step 3 to compare with 1 x 8's 3 steps.
    run_train(EQUIVALENCE + [f"output_dir={tmp_path / 'w2'}", "train.batch_size=4", "train.max_steps=4",
                             "train.checkpoint_every=3"], nproc=2)  # fmt: skip
    # One process is the same code path under torchrun or not (WORLD_SIZE=1: no process group), so
    # the 1-process runs go in-process and save two launches.
    for name, steps in [("w1", 3), ("w1s2", 2)]:
        cfg = [*EQUIVALENCE, f"output_dir={tmp_path / name}", "train.batch_size=8", f"train.max_steps={steps}"]
        train(load_config(None, cfg))
    two, one = checkpoint_weights(tmp_path / "w2", 3), checkpoint_weights(tmp_path / "w1", 3)
    assert max_abs_diff(two, one) <= 1e-5
    # A step apart is visible at this tolerance.
    assert max_abs_diff(one, checkpoint_weights(tmp_path / "w1s2", 2)) > 1e-3

    # Both runs logged the same global figures: loss all-reduced over ranks, samples counted globally.
    m2, m1 = metrics_rows(tmp_path / "w2"), metrics_rows(tmp_path / "w1")
    assert [r["step"] for r in m2] == [1, 2, 3, 4]
    for a, b in zip(m2, m1, strict=False):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert {"step", "epoch", "loss", "lr", "samples_per_s", "tokens_per_s"} <= a.keys()

    # The 1-process checkpoint continues on 2 processes (same global batch): rank 1 has no saved
    # RNG, is seeded afresh and says so, and the run reaches the same weights as 2 x 4 throughout
    # (dropout is off, so no RNG enters the result).
    proc = run_train(
        EQUIVALENCE + [f"output_dir={tmp_path / 'w1'}", "train.batch_size=4", "train.max_steps=4"], nproc=2
    )
    assert "rank 1 has no RNG state" in proc.stdout and "at step 3" in proc.stdout
    assert max_abs_diff(load_weights(tmp_path / "w2"), load_weights(tmp_path / "w1")) <= 1e-5


def tensorboard_losses(output_dir) -> list[tuple[int, float]]:
    """The loss curve as TensorBoard shows it (its reader drops events a resume purged)."""
    events = EventAccumulator(str(output_dir / "tb"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("train/loss")]


def test_stop_and_resume_from_an_earlier_checkpoint_at_an_epoch_start_equals_straight_run(tmp_path, fault_straight):
    """FAULT_RUN's 20 steps have 8 per epoch. Stop at 18, then resume from step-16, the first step of
    the third epoch: steps 17 and 18 are trained again, and their metrics are replaced, not repeated.
    (The SIGTERM tests resume inside the second epoch, the SIGKILL test from its first step.)"""
    resumed = tmp_path / "resumed"
    run_train([*FAULT_RUN, f"output_dir={resumed}", "train.max_steps=18"], nproc=2)
    ckpts = resumed / "checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)][-2:] == ["step-16", "step-18"]
    proc = run_train([*FAULT_RUN, f"output_dir={resumed}", f"train.resume={ckpts / 'step-16'}"], nproc=2)
    assert "step-16 at step 16" in proc.stdout, proc.stdout[-2000:]

    straight, b = load_weights(fault_straight), load_weights(resumed)
    assert all((straight[k] == b[k]).all() for k in straight), f"max diff {max_abs_diff(straight, b)}"
    # The checkpoint really captured a mid-run state (the test would pass trivially otherwise).
    assert max_abs_diff(checkpoint_weights(resumed, 16), checkpoint_weights(resumed, 20)) > 1e-4
    # metrics.jsonl and TensorBoard: each step once, with the straight run's losses.
    ms = metrics_rows(fault_straight)
    assert [(r["step"], r["loss"]) for r in metrics_rows(resumed)] == [(r["step"], r["loss"]) for r in ms]
    shown = tensorboard_losses(resumed)
    assert [step for step, _ in shown] == [r["step"] for r in ms]
    assert [loss for _, loss in shown] == pytest.approx([r["loss"] for r in ms], abs=1e-6)  # float32 in events
    # A rank's RNG file exists for each of the 2 ranks: both dropout streams were saved.
    assert {p.name for p in (ckpts / "step-20").glob("rng-rank*.pt")} == {"rng-rank0.pt", "rng-rank1.pt"}
