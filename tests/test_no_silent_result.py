"""No run ends with a wrong result and exit 0: diverged weights, nodes with other settings, and reruns
of a finished run are stopped in one line, before they write anything (issue: no silent wrong result).

Two processes, DataLoader workers at their default, as users run it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, free_port, run_train, subprocess_env

pytestmark = [pytest.mark.safety, pytest.mark.slow]

# SMALL without its num_workers=0: the DataLoader workers run as they do for users.
RUN = ["model.name=tiny", "task.max_seq_len=64", "task.dummy_size=64", "train.log_every=1", "train.batch_size=4"]


def error_lines(stderr: str) -> list[str]:
    """distqa's own error lines (torchrun, launched here directly, adds its report after them)."""
    return [line for line in stderr.splitlines() if line.startswith("distqa") and "error" in line]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (links as links) and a hash of its bytes."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.mark.parametrize(
    "settings, said",
    [
        # The case: clipped steps of 1e30 keep the weights finite until the loss is NaN.
        (["train.lr=1e30"], "loss is nan"),
        # Unclipped steps of 1e38 overflow the weights on a step that saves but does not log (no
        # loss is looked at): the weights check stops it before the checkpoint is written.
        (
            ["train.lr=1e38", "train.max_grad_norm=0", "train.warmup_ratio=0", "train.log_every=100"],
            "hold NaN or inf after step",
        ),
    ],
)
def test_a_diverging_run_stops_in_one_line_and_saves_nothing_non_finite(tmp_path, settings, said):
    out = tmp_path / "run"
    args = [*RUN, "train.optimizer=sgd", *settings, "train.checkpoint_every=1", "train.max_steps=6"]
    proc = run_train([*args, f"output_dir={out}"], nproc=2, check=False)
    assert proc.returncode != 0, proc.stdout
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and said in lines[0] and "lower train.lr" in lines[0], proc.stderr[-3000:]
    for path in out.rglob("*.safetensors"):
        for name, tensor in load_file(str(path)).items():
            assert torch.isfinite(tensor).all(), f"{path}: {name} is not finite"
    assert not (out / "model").exists()


def test_a_finished_run_rerun_with_other_settings_writes_nothing(tmp_path):
    out = tmp_path / "run"
    run_train([*RUN, "train.max_steps=4", "train.checkpoint_every=2", f"output_dir={out}"], nproc=2)
    before = snapshot(out)
    assert "model/model.safetensors" in before and "config.yaml" in before
    for change in ("train.lr=1e-4", "seed=7"):
        proc = run_train([*RUN, "train.max_steps=4", change, f"output_dir={out}"], nproc=2, check=False)
        assert proc.returncode != 0, proc.stdout
        lines = error_lines(proc.stderr)
        assert len(lines) == 1 and change.split("=")[0] in lines[0], proc.stderr[-3000:]
        assert "train.resume=never" in lines[0], lines[0]
        assert snapshot(out) == before, change
    # The same command again: nothing to do, nothing written, success.
    proc = run_train([*RUN, "train.max_steps=4", "train.checkpoint_every=2", f"output_dir={out}"], nproc=2)
    assert "already finished at step 4" in proc.stdout
    assert snapshot(out) == before


def test_settings_changed_on_resume_keep_the_earlier_config(tmp_path):
    out = tmp_path / "run"
    run_train([*RUN, "train.max_steps=2", f"output_dir={out}"], nproc=2)
    first = (out / "config.yaml").read_text()
    proc = run_train([*RUN, "train.max_steps=4", "train.lr=1e-4", f"output_dir={out}"], nproc=2)
    assert "applied from step 2" in proc.stdout
    assert (out / "config-history" / "2.yaml").read_text() == first
    assert "lr: 0.0001" in (out / "config.yaml").read_text()


def _node(rank: int, port: int, out: Path, extra: list[str]) -> subprocess.Popen:
    env = subprocess_env(
        NNODES="2", NODE_RANK=str(rank), NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        RDZV_TIMEOUT="60",
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    )  # fmt: skip
    return subprocess.Popen(
        [str(ROOT / "scripts" / "worker.sh"), *RUN, "train.max_steps=8", f"output_dir={out}", *extra],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("change", ["train.lr=0.5", "train.max_steps=4"])
def test_nodes_with_other_settings_stop_before_step_one(tmp_path, change):
    """Two worker.sh nodes on one host whose command lines differ in one setting."""
    out, port = tmp_path / "run", free_port()
    start = time.monotonic()
    nodes = [_node(0, port, out, []), _node(1, port, out, [change])]
    try:
        results = [node.communicate(timeout=120) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert time.monotonic() - start < 120
    key = change.split("=")[0]
    for node, (stdout, stderr) in zip(nodes, results, strict=True):
        assert node.returncode != 0, stdout
        named = [line for line in error_lines(stderr) if key in line and "different settings" in line]
        assert len(named) == 1, stderr[-3000:]
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
