"""Integration through torchrun with 2 CPU processes (gloo): the launch users run.

2 processes x batch 4 and 1 process x batch 8 reach the same weights, and the comparison is sharp
enough to tell 3 steps from 4; a 2-process checkpoint continues on 1 process. (The exact resume
from an earlier checkpoint at an epoch's start, with DataLoader workers on, dropout, AdamW and
gradient accumulation, is the SIGKILL test's in test_fault_tolerance.py: its restart is that resume.)
"""

from __future__ import annotations

import pytest

from conftest import SGD, checkpoint_weights, load_weights, max_abs_diff, metrics_rows, run_train
from distqa.registry import load_config
from distqa.trainer import train

pytestmark = pytest.mark.slow

EQUIVALENCE = [*SGD, "data.num_workers=2"]


def test_two_by_four_equals_one_by_eight(tmp_path):
    # 2 x 4 to step 4, with a checkpoint at step 3 to compare with 1 x 8's.
    run_train(EQUIVALENCE + [f"output_dir={tmp_path / 'w2'}", "train.batch_size=4", "train.max_steps=4",
                             "train.checkpoint_every=3"], nproc=2)  # fmt: skip
    # One process is the same code path under torchrun or not (WORLD_SIZE=1: no process group), so
    # the 1-process runs go in-process and save launches.
    one_by_eight = [*EQUIVALENCE, "train.batch_size=8", "train.max_steps=4", "train.checkpoint_every=3"]
    train(load_config(None, [*one_by_eight, f"output_dir={tmp_path / 'w1'}"]))
    assert max_abs_diff(checkpoint_weights(tmp_path / "w2", 3), checkpoint_weights(tmp_path / "w1", 3)) <= 1e-5
    assert max_abs_diff(load_weights(tmp_path / "w2"), load_weights(tmp_path / "w1")) <= 1e-5
    # A step apart is visible at this tolerance.
    assert max_abs_diff(checkpoint_weights(tmp_path / "w1", 3), checkpoint_weights(tmp_path / "w1", 4)) > 1e-3

    # Both runs logged the same global figures: loss all-reduced over ranks, samples counted globally.
    m2, m1 = metrics_rows(tmp_path / "w2"), metrics_rows(tmp_path / "w1")
    assert [r["step"] for r in m2] == [r["step"] for r in m1] == [1, 2, 3, 4]
    for a, b in zip(m2, m1, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert {"step", "epoch", "loss", "lr", "samples_per_s", "tokens_per_s"} <= a.keys()

    # The 2-process checkpoint continues on 1 process (same global batch) to the same weights. (The
    # other way, onto more processes, whose new ranks have no saved RNG state: test_multinode.py.)
    w2 = tmp_path / "w2" / "checkpoints" / "step-3"
    train(load_config(None, [*one_by_eight, f"output_dir={tmp_path / 'w21'}", f"train.resume={w2}"]))
    assert max_abs_diff(load_weights(tmp_path / "w21"), load_weights(tmp_path / "w1")) <= 1e-5
