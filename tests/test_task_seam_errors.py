"""A fork's task that breaks the seam ends in one line naming what to change, before anything of
that step is written: a loss that is no scalar with a gradient, a collate that returns no mapping,
metrics that are no numbers (a tensor once crashed metrics.jsonl's writer at the end of the run,
before its last checkpoint), a model part used only for some batches under train.static_graph, and
a loss that is not finite from step 1 (which no learning rate caused)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env
from distqa.errors import DistqaError
from distqa.registry import load_config
from distqa.trainer import train

TOY = ["data.num_workers=0", "train.log_every=1", "task.size=64", "train.batch_size=8", "train.max_steps=2"]


def run(out: Path, *overrides: str) -> Path:
    train(load_config(None, [f"output_dir={out}", *TOY, *overrides]))
    return out


@pytest.mark.parametrize(
    "kind,expected",
    [
        (
            "vector",
            r"the task's loss must be a floating-point scalar with a gradient; it returned a tensor of shape \[8\]",
        ),
        ("float", r"the task's loss returned a float: return the loss tensor itself"),
        ("detached", r"it returned a tensor of torch.float32, requires_grad=False: take the mean"),
        ("tuple_batch", r"the task's collate returned a tuple, not a mapping of names to tensors"),
        ("nan_first", r"loss is nan at step 1: the first step's loss, before any update: it comes from the data"),
    ],
)
def test_a_broken_loss_or_batch_is_one_line_and_nothing_is_written(tmp_path, kind, expected):
    with pytest.raises(DistqaError, match=expected) as caught:
        run(tmp_path / "run", "task=toy_seam_tasks:BrokenLossTask", f"task.loss_kind={kind}")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_metrics_as_tensors_and_numpy_numbers_are_written_as_numbers(tmp_path):
    out = run(tmp_path / "run", "task=toy_seam_tasks:MetricKindTask", "train.eval_every=1")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [{k: v for k, v in row.items() if k.startswith("eval_")} for row in rows]
    assert evals == [{"eval_tensor": 0.5, "eval_numpy": 0.25, "eval_count": 11}] * 2
    assert (out / "model").is_dir()


@pytest.mark.parametrize(
    "kind,expected", [("text", "'eval_verdict' is str 'good'"), ("nested", "'eval_per_class' is dict")]
)
def test_a_metric_that_is_no_number_is_one_line_before_anything_is_written(tmp_path, kind, expected):
    out = tmp_path / "run"
    with pytest.raises(DistqaError, match=f"the task's metric {expected}.*not a number") as caught:
        run(out, "task=toy_seam_tasks:MetricKindTask", f"task.metric_kind={kind}", "train.eval_every=1")
    assert "\n" not in str(caught.value)
    assert not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").read_text() == ""


@pytest.mark.safety
def test_a_part_used_for_some_batches_under_a_static_graph_is_one_line_on_two_processes(tmp_path):
    """DDP's paragraph ('Your training graph has changed in this iteration ...') was a traceback,
    raised in the backward pass outside the loss's own translation."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "distqa", "train"]
    cmd += [f"output_dir={out}", "task=toy_seam_tasks:SometimesUnusedTask", *TOY, "train.max_steps=20"]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "a step used other parameters than the steps before it" in proc.stderr, proc.stderr[-3000:]
    assert "train.static_graph=false train.find_unused_parameters=true" in proc.stderr
    fixed = [*cmd, "train.static_graph=false", "train.find_unused_parameters=true"]
    done = subprocess.run(fixed, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
