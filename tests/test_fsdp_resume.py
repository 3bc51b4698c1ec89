"""train.parallel=fsdp at two processes, continued (test_fsdp.py has the comparison with DDP):
exact resume from sharded checkpoints with AdamW, dropout and accumulation, the SIGTERM checkpoint,
and the memory figure of `distqa bench`. Marker fsdp: `make perf-fsdp`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAULT_RUN, ROOT, launch, load_weights, max_abs_diff, run_train, subprocess_env, wait_for_step
from distqa.bench.memory import state_bytes_per_rank
from test_fsdp import FSDP, sharded_state

pytestmark = [pytest.mark.fsdp, pytest.mark.slow]

# AdamW, dropout, gradient accumulation and DataLoader workers (conftest's fault run), 12 steps:
# one epoch is 8 steps, so the resumes below cross an epoch boundary.
ADAMW_RUN = [*FAULT_RUN, *FSDP, "train.max_steps=12", "train.checkpoint_every=2"]


@pytest.fixture(scope="module")
def adamw_straight(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("adamw") / "straight"
    run_train([*ADAMW_RUN, f"output_dir={out}"], nproc=2)
    return out


def test_two_steps_then_a_resume_to_four_equals_four_straight(adamw_straight, tmp_path):
    out = tmp_path / "resumed"
    run_train([*ADAMW_RUN, "train.max_steps=2", f"output_dir={out}"], nproc=2)
    proc = run_train([*ADAMW_RUN, "train.max_steps=4", f"output_dir={out}"], nproc=2)
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout
    resumed = sharded_state(out / "checkpoints" / "step-4")
    straight = sharded_state(adamw_straight / "checkpoints" / "step-4")
    assert resumed.keys() == straight.keys() and any("exp_avg_sq" in k for k in straight)  # AdamW's moments too
    assert max_abs_diff(resumed, straight) < 1e-6
    before = sharded_state(adamw_straight / "checkpoints" / "step-2")
    assert max_abs_diff(before, straight) > 1e-4  # two steps of AdamW at 1e-3 show


def test_sigterm_checkpoints_a_sharded_model_and_the_resume_ends_with_the_straight_weights(adamw_straight, tmp_path):
    out = tmp_path / "preempted"
    proc = launch([*ADAMW_RUN, f"output_dir={out}"])
    wait_for_step(proc, out, 5)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-3000:]
    line = next(x for x in stderr.splitlines() if x.startswith("distqa: preempted:"))
    step = int(line.split("at step ")[1].split()[0])
    assert 5 <= step < 12
    run_train([*ADAMW_RUN, f"output_dir={out}"], nproc=2)
    assert max_abs_diff(load_weights(out), load_weights(adamw_straight)) < 1e-6


def bench(tmp_path: Path, parallel: str) -> dict:
    out = tmp_path / parallel
    args = [
        *("--nproc", "2", "--output", str(out), "--warmup", "2", "--steps", "1", "--repeats", "1"),
        # The command, with task.max_seq_len (its data.max_seq_len is refused since the key moved).
        *("model.name=bert-base-random", "task.max_seq_len=64", "train.batch_size=2", f"train.parallel={parallel}"),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "distqa", "bench", *args],
        env=subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((out / "bench.json").read_text())


def test_bench_records_that_fsdp_holds_about_half_the_state_per_rank_of_ddp(tmp_path):
    results = {p: bench(tmp_path, p) for p in ("ddp", "fsdp")}
    assert {r["seq_len"] for r in results.values()} == {64}
    rows = {p: r["runs"] for p, r in results.items()}
    ddp, fsdp = (next(r for r in rows[p] if r["nproc"] == 2) for p in ("ddp", "fsdp"))
    # bert-base: 110M parameters, AdamW: 16 bytes each (weights, gradients, two moments) in DDP.
    assert 1600 < ddp["state_mib_per_rank"] < 1750
    assert fsdp["state_mib_per_rank"] <= 0.6 * ddp["state_mib_per_rank"]
    # docs/benchmarks.md's formula (16 bytes per parameter, 1/N of it sharded) is the measured figure.
    parameters = ddp["state_mib_breakdown"]["parameters"] * 2**20 / 4
    assert parameters == pytest.approx(108.9e6, rel=0.01)
    for row, sharded in ((ddp, False), (fsdp, True)):
        expected = state_bytes_per_rank(parameters, 2, sharded=sharded)
        assert row["state_mib_per_rank"] * 2**20 == pytest.approx(expected, rel=1e-3)
    assert fsdp["state_mib_breakdown"]["optimizer"] == pytest.approx(ddp["state_mib_breakdown"]["optimizer"] / 2, 0.01)
