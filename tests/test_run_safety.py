"""Runs that must not mix: two runs into one output_dir, ranks that see different data, and a
resume on training data that changed. The runs that must be separate processes launch `distqa train`
as users do; the resume checks run in this process."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import ROOT, SMALL, TESTS, launch, run_train, subprocess_env, wait_for_step
from distqa.config import load_config
from distqa.errors import DistqaError
from distqa.trainer import train

pytestmark = pytest.mark.slow

SAMPLE = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"


def distqa_train(args: list[str], timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """One process, no torchrun: `python -m distqa train ARGS`, with its wall time."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "distqa", "train", *args],
        env=subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - start


def test_a_second_run_into_a_held_output_dir_stops_and_the_first_is_untouched(tmp_path, capsys):
    """rel-one-run-per-dir, with DataLoader workers on in the first run."""
    out = tmp_path / "run"
    args = [*SMALL, "data.num_workers=2", "train.batch_size=2", "train.checkpoint_every=10", f"output_dir={out}"]
    first = launch([*args, "train.max_steps=60"])
    try:
        wait_for_step(first, out, 5)
        second, seconds = distqa_train([*args, "data.num_workers=0", "train.max_steps=60"])
        assert second.returncode != 0 and seconds < 60
        last = second.stderr.strip().splitlines()[-1]
        assert str(out) in last and "in use by another run" in last and "pid" in last, last
        _, stderr = first.communicate(timeout=240)
        assert first.returncode == 0, stderr[-3000:]
    finally:
        first.kill()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 61))  # every step once: the second run wrote nothing
    # The lock went with the first run: a later resume into the same folder works (in this process,
    # one rank with 2 accumulation steps: the same global batch).
    train(load_config(None, [*args, "data.num_workers=0", "train.grad_accum=2", "train.max_steps=62"]))
    assert "step-60 at step 60" in capsys.readouterr().out


def test_ranks_that_see_different_data_stop_at_start_instead_of_hanging(tmp_path):
    start = time.monotonic()
    proc = run_train(
        ["task=toy_task:RankSkewedTask", "data.num_workers=0", "train.max_steps=400", f"output_dir={tmp_path}"],
        nproc=2,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0 and time.monotonic() - start < 90
    assert "the ranks do not see the same training data (rank 0: 4096 examples" in proc.stderr
    assert "rank 1: 4088 examples" in proc.stderr and "data.train='dummy' must be the same data" in proc.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_resume_on_changed_training_data_is_refused(tmp_path, minilm_dir, capsys):
    """rel-data-changed: the JSONL named by data.train lost lines between the runs."""
    data = tmp_path / "train.jsonl"
    lines = SAMPLE.read_text().splitlines(keepends=True)
    data.write_text("".join(lines))
    out = tmp_path / "run"
    args = [
        *SMALL,
        f"model.tokenizer={minilm_dir}",
        "task.max_seq_len=128",
        "task.keep_unknown=0.3",
        f"task.cache_dir={tmp_path / 'cache'}",
        f"data.train={data}",
        "train.batch_size=2",
        "train.checkpoint_every=2",
        f"output_dir={out}",
    ]
    # In this process: what is checked is the trainer's resume logic, not a launch.
    train(load_config(None, [*args, "train.max_steps=2"]))

    data.write_text("".join(lines[: len(lines) // 2]))
    with pytest.raises(DistqaError) as refused:
        train(load_config(None, [*args, "train.max_steps=4"]))
    message = str(refused.value)
    assert f"data.train='{data}' is not the data checkpoint" in message and "train.allow_data_change=true" in message

    # The way to go on anyway, which says what it does.
    capsys.readouterr()
    train(load_config(None, [*args, "train.max_steps=4", "train.allow_data_change=true"]))
    assert "continuing on the new data" in capsys.readouterr().out
