"""Runs that must not mix: two runs into one output_dir, ranks that see different data, and a
resume on training data that changed. The runs that must be separate processes launch `distqa train`
as users do; the resume checks run in this process."""

from __future__ import annotations

import json
import time

import pytest

from conftest import SMALL, TESTS, launch, run_train, wait_for_step
from distqa.errors import DistqaError
from distqa.registry import load_config
from distqa.trainer import train

pytestmark = pytest.mark.slow

SAMPLE = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"


@pytest.mark.safety  # two launches of seconds: make test-safety, beside make test's 5 minutes
def test_a_second_run_into_a_held_output_dir_stops_and_the_first_is_untouched(tmp_path, capsys):
    """rel-one-run-per-dir, with DataLoader workers on in the first run. The second run is this
    process, which is another process than the first's rank 0, as a second command would be."""
    out = tmp_path / "run"
    args = [*SMALL, "data.num_workers=2", "train.batch_size=2", "train.checkpoint_every=10", f"output_dir={out}"]
    first = launch([*args, "train.max_steps=40"])
    try:
        wait_for_step(first, out, 2)
        start = time.monotonic()
        with pytest.raises(DistqaError) as refused:
            train(load_config(None, [*args, "data.num_workers=0", "train.max_steps=40"]))
        assert time.monotonic() - start < 30 and first.poll() is None  # refused while the first still ran
        message = str(refused.value)
        assert str(out) in message and "in use by another run" in message and "pid" in message, message
        _, stderr = first.communicate(timeout=240)
        assert first.returncode == 0, stderr[-3000:]
    finally:
        first.kill()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 41))  # every step once: the second run wrote nothing
    # The lock went with the first run: a later resume into the same folder works (one rank with 2
    # accumulation steps: the same global batch).
    capsys.readouterr()
    train(load_config(None, [*args, "data.num_workers=0", "train.grad_accum=2", "train.max_steps=42"]))
    assert "step-40 at step 40" in capsys.readouterr().out


@pytest.mark.safety  # two launches of seconds: make test-safety, beside make test's 5 minutes
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
    # One node: rank 1 took local rank 0's fingerprint, which the line says rather than show it as rank 1's own.
    assert "(its node's, hashed by local rank 0)" in proc.stderr.split("rank 1: 4088 examples")[1].split(";")[0]
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.safety  # about 7 s: make test-safety, for make test's 5 minutes
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
