"""Integration through torchrun with 2 CPU processes (gloo): the launch users run.

(a) 2 processes x batch 4 and 1 process x batch 8 reach the same weights, and the comparison is
    sharp enough to tell 2 steps from 3;
(b) 3 steps, stop, resume to 6 equals 6 straight, bit for bit (dropout on, AdamW, accumulation).
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from conftest import SGD, SMALL, load_weights, max_abs_diff, run_train
from distqa.checkpoint import list_checkpoints

pytestmark = pytest.mark.slow


def test_two_by_four_equals_one_by_eight(tmp_path):
    run_train(SGD + [f"output_dir={tmp_path / 'w2'}", "train.batch_size=4", "train.max_steps=3"], nproc=2)
    run_train(SGD + [f"output_dir={tmp_path / 'w1'}", "train.batch_size=8", "train.max_steps=3"], nproc=1)
    run_train(SGD + [f"output_dir={tmp_path / 'w1s2'}", "train.batch_size=8", "train.max_steps=2"], nproc=1)
    two, one, one_two_steps = (load_weights(tmp_path / d) for d in ("w2", "w1", "w1s2"))
    assert max_abs_diff(two, one) <= 1e-5
    assert max_abs_diff(one, one_two_steps) > 1e-3  # a step apart is visible at this tolerance

    # Both runs logged the same global figures: loss all-reduced over ranks, samples counted globally.
    m2 = [json.loads(line) for line in (tmp_path / "w2" / "metrics.jsonl").read_text().splitlines()]
    m1 = [json.loads(line) for line in (tmp_path / "w1" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in m2] == [1, 2, 3]
    for a, b in zip(m2, m1):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert {"step", "epoch", "loss", "lr", "samples_per_s", "tokens_per_s"} <= a.keys()

    # The 1-process checkpoint continues on 2 processes (same global batch): rank 1 has no saved
    # RNG, is seeded afresh and says so, and the run reaches the same weights as 2 x 4 throughout
    # (dropout is off, so no RNG enters the result).
    run_train(SGD + [f"output_dir={tmp_path / 'w2'}", "train.batch_size=4", "train.max_steps=4"], nproc=2)
    proc = run_train(SGD + [f"output_dir={tmp_path / 'w1'}", "train.batch_size=4", "train.max_steps=4"], nproc=2)
    assert "rank 1 has no RNG state" in proc.stdout and "at step 3" in proc.stdout
    assert max_abs_diff(load_weights(tmp_path / "w2"), load_weights(tmp_path / "w1")) <= 1e-5


ADAMW = SMALL + [
    "model.dropout=0.1",
    "train.lr=1e-3",
    "train.lr_schedule=constant",
    "train.warmup_ratio=0",
    "train.batch_size=2",
    "train.grad_accum=2",
    "train.checkpoint_every=3",
]


def test_stop_and_resume_equals_straight_run(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(ADAMW + [f"output_dir={straight}", "train.max_steps=6"], nproc=2)
    run_train(ADAMW + [f"output_dir={resumed}", "train.max_steps=3"], nproc=2)
    assert [p.name for p in list_checkpoints(resumed / "checkpoints")] == ["step-3"]
    proc = run_train(ADAMW + [f"output_dir={resumed}", "train.max_steps=6"], nproc=2)
    assert "resumed from" in proc.stdout and "step-3 at step 3" in proc.stdout

    a, b = load_weights(straight), load_weights(resumed)
    assert all((a[k] == b[k]).all() for k in a), f"max diff {max_abs_diff(a, b)}"
    # The checkpoint really captured a mid-run state (the test would pass trivially otherwise).
    mid = load_file(str(resumed / "checkpoints" / "step-3" / "model.safetensors"))
    end = load_file(str(resumed / "checkpoints" / "step-6" / "model.safetensors"))
    assert max_abs_diff(mid, end) > 1e-4
    # Metrics continue where they stopped: each step once, the same losses as the straight run.
    ms = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    mr = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in mr] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in mr] == [r["loss"] for r in ms]
    # A rank's RNG file exists for each of the 2 ranks: both dropout streams were saved.
    assert {p.name for p in (resumed / "checkpoints" / "step-6").glob("rng-rank*.pt")} == {
        "rng-rank0.pt",
        "rng-rank1.pt",
    }

    # Resuming with another global batch is refused with a message naming the settings.
    proc = run_train(ADAMW + [f"output_dir={resumed}", "train.max_steps=9", "train.batch_size=4"], nproc=2, check=False)
    assert proc.returncode != 0 and "global batch" in proc.stderr
    # resume=never starts afresh without overwriting anything: the earlier run is moved aside whole.
    proc = run_train(ADAMW + [f"output_dir={resumed}", "train.resume=never", "train.max_steps=1"], nproc=1)
    assert "train.resume=never: the earlier run" in proc.stdout
    (earlier,) = (resumed / "earlier-runs").iterdir()
    assert [p.name for p in list_checkpoints(earlier / "checkpoints")] == ["step-3", "step-6"]
    assert max_abs_diff(load_weights(earlier), b) == 0.0  # the earlier model, intact
    assert [json.loads(line)["step"] for line in (resumed / "metrics.jsonl").read_text().splitlines()] == [1]
