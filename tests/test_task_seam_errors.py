"""A fork's task that breaks the seam ends in one line naming what to change, before anything
wrong is written: a loss that is no scalar with a gradient, a collate that returns no mapping,
metrics that are no numbers (a tensor once crashed metrics.jsonl's writer at the end of the run,
before its last checkpoint), a model part used only for some batches under train.static_graph, and
a loss that is not finite from step 1 (which no learning rate caused)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

import toy_seam_tasks
from conftest import ROOT, subprocess_env
from distqa.errors import ConfigError, DistqaError
from distqa.registry import load_config
from distqa.trainer import train
from toy_task import EvalProbeTask

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
def test_a_metric_that_is_no_number_is_one_line_and_never_written(tmp_path, kind, expected):
    out = tmp_path / "run"
    with pytest.raises(DistqaError, match=f"the task's metric {expected}.*not a number") as caught:
        run(out, "task=toy_seam_tasks:MetricKindTask", f"task.metric_kind={kind}", "train.eval_every=1")
    assert "\n" not in str(caught.value)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1] and not any(key.startswith("eval_") for key in rows[0])


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


@pytest.mark.safety  # about 6 s: make test-safety, for make test's 5 minutes
@pytest.mark.parametrize(
    "kind,expected",
    [
        ("train_key", "the task's metric 'loss' is not named eval_"),
        ("step_key", "the task's metric 'step' is not named eval_"),
        ("raises", "the task's compute_metrics raised ZeroDivisionError: division by zero"),
    ],
)
def test_a_metric_named_as_a_training_figure_or_a_bug_in_it_stops_after_the_step_is_saved(
    tmp_path, monkeypatch, kind, expected
):
    """`loss` or `step` from compute_metrics once overwrote the training figures of the metrics
    line (and `step` the best checkpoint's step); an error in it, at the end of a run with
    train.eval_every=0, cost every step since the last checkpoint. Now: one line, after the
    step's checkpoint is written, and the same command evaluates that step and goes on."""
    out = tmp_path / "run"
    args = ["task=toy_seam_tasks:MetricKindTask", f"task.metric_kind={kind}", "train.checkpoint_every=100"]
    with pytest.raises(
        DistqaError,
        match=f"evaluation at step 2: {expected}.*step-2 written first: the same command evaluates it again",
    ):
        run(out, *args)
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-")] == ["step-2"]
    assert not (out / "model").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # Step 2's training figures are logged; no evaluation figure of it (and none overwrote them).
    assert [(row["step"], row["loss"] != 123) for row in rows] == [(1, True), (2, True)]
    assert not any(key.startswith("eval_") for key in rows[1])
    # The fork fixes its code and runs the same command: step 2 is evaluated, and the run exports.
    monkeypatch.setattr(toy_seam_tasks.MetricKindTask, "compute_metrics", EvalProbeTask.compute_metrics)
    run(out, *args)
    assert (out / "model").is_dir() and sorted(load_file(out / "model" / "model.safetensors")) != []
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2] and rows[1]["eval_step_seen"] == 2.0


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("dict", r"eval_step returned a dict, not a list of one item per example \(or window\) of the batch"),
        ("scalar", "eval_step returned a Tensor, not a list of one item per example"),
        ("meta", "eval_step returned tensors on the GPU"),
        ("meta_in_dicts", "eval_step returned tensors on the GPU"),
    ],
)
def test_an_eval_step_result_that_is_not_a_list_of_cpu_items_is_one_line(tmp_path, kind, expected):
    """A dict was gathered as its keys ('pred', 'labels', ...) and scored without a word."""
    with pytest.raises(DistqaError, match=expected) as caught:
        run(tmp_path / "run", "task=toy_seam_tasks:EvalStepKindTask", f"task.eval_kind={kind}")
    assert "\n" not in str(caught.value)


def test_an_eval_step_may_return_fewer_items_than_the_batch(tmp_path):
    """NQ's eval_step skips a window without document tokens: fewer items than the batch is no error."""
    out = run(tmp_path / "run", "task=toy_seam_tasks:EvalStepKindTask", "task.eval_kind=short")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval_items_in_order"] == 0.0 and (out / "model").is_dir()


def test_evaluation_batches_with_the_task_s_collate_fn(tmp_path):
    """A task that overrides collate_fn() alone (items of different lengths) trained, then its
    final evaluation failed in default_collate, losing the run."""
    out = run(tmp_path / "run", "task=toy_seam_tasks:CollateFnOnlyTask")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval_items_in_order"] == 1.0 and (out / "model").is_dir()


def test_a_training_set_that_is_a_stream_is_one_line(tmp_path):
    with pytest.raises(DistqaError, match=r"build_train_dataset\(\) returned a Stream, not a map-style dataset"):
        run(tmp_path / "run", "task=toy_seam_tasks:StreamTask")


@pytest.mark.safety
def test_an_eval_step_error_on_one_rank_stops_both_ranks_in_one_line_after_the_save(tmp_path):
    """Rank 1 alone fails in eval_step: before, rank 0 waited in the gather for a rank that had left."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "distqa", "train"]
    cmd += [f"output_dir={out}", "task=toy_seam_tasks:EvalStepKindTask", "task.eval_kind=raises_on_rank_1", *TOY]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stderr[-3000:]
    line = "evaluation at step 2: the task's eval_step raised KeyError: 'label_ids'"
    assert proc.stderr.count(line) == 1, proc.stderr[-3000:]  # the same line on both ranks: said once per node
    assert "Traceback" in proc.stderr and (out / "checkpoints" / "step-2").is_dir()


def test_a_save_model_that_writes_nothing_into_its_directory_is_one_line(tmp_path, monkeypatch):
    """It said "model written to .../model", exit 0, with the weights in the working directory."""
    monkeypatch.chdir(tmp_path)
    expected = r"the task's save_model wrote no file into .*: write the model into"
    with pytest.raises(DistqaError, match=expected) as caught:
        run(tmp_path / "run", "task.name=toy_seam_tasks:ElsewhereSaveTask")
    assert "free space" not in str(caught.value)  # it advised freeing space and running again (a review)
    assert not (tmp_path / "run" / "model").exists()


def test_a_collate_that_the_task_s_collate_fn_never_calls_is_refused_at_load():
    from distqa.registry import load_task

    with pytest.raises(ConfigError, match=r"^NQCollateTask.collate is never called: NQTask.collate_fn returns"):
        load_task(load_config(None, ["task.name=toy_seam_tasks:NQCollateTask"]))
    with pytest.raises(ConfigError, match=r"^MaskingMixin.collate is never called: NQTask.collate_fn returns"):
        load_task(load_config(None, ["task.name=toy_seam_tasks:MixinCollateTask"]))
    load_task(load_config(None, ["task.name=toy_seam_tasks:NQCollateUsedTask"]))  # collate_fn returns it
    load_task(load_config(None, ["task.name=toy_seam_tasks:StaticCollateTask"]))  # a static one, returned
    load_task(load_config(None, ["task.name=toy_seam_tasks:CollateFnOnlyTask"]))  # collate_fn alone: fine


def test_a_build_model_that_returns_no_module_is_one_line(tmp_path):
    """It was an AttributeError traceback from the trainer's `.to(device)` (a review)."""
    with pytest.raises(ConfigError, match=r"^the task's build_model\(\) returned a tuple, not a torch.nn.Module"):
        run(tmp_path / "run", "task.name=toy_seam_tasks:TupleModelTask")


def test_a_task_state_that_json_cannot_hold_is_one_line_and_leaves_no_half_checkpoint(tmp_path):
    """A TypeError traceback from the middle of the write, and a `.tmp-step-1` left behind (a review)."""
    out = tmp_path / "run"
    expected = r"^the task's state_dict\(\) returned what JSON cannot hold \(TypeError: .*Tensor"
    with pytest.raises(DistqaError, match=expected):
        run(out, "task.name=toy_seam_tasks:TensorStateTask", "train.checkpoint_every=1")
    assert not (out / "checkpoints").exists() or list((out / "checkpoints").iterdir()) == []


def test_a_collate_that_does_not_pickle_stops_a_run_of_one_process_as_it_would_a_launch(tmp_path):
    """One process forks its loader's workers, which pickles nothing: the run trained, and only a
    launch of two processes (a fork server's workers) stopped on it (a review)."""
    expected = r"^the task's collate_fn \(function\) cannot be pickled .* data.num_workers=0"
    with pytest.raises(ConfigError, match=expected):
        run(tmp_path / "run", "task.name=toy_seam_tasks:LambdaCollateTask", "data.num_workers=1")
    run(tmp_path / "no-workers", "task.name=toy_seam_tasks:LambdaCollateTask")  # TOY: data.num_workers=0


def test_an_empty_validation_set_is_one_line_at_start(tmp_path):
    """It reached the task's compute_metrics as [] at the first evaluation, after a step trained."""
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^the validation set \(data.valid=None\) has no examples"):
        run(out, "task.name=toy_seam_tasks:EmptyValidTask", "train.eval_every=1")
    assert not (out / "metrics.jsonl").exists()
