"""The seam: a second task, nothing like Natural Questions, trained by the same trainer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_train, subprocess_env
from distqa.cli import main
from toy_task import BlobsDataset, ToyClassifier, ToySettings


def test_toy_classifier_trains_through_the_generic_trainer(tmp_path):
    """In this process (one rank, the global batch of 2 x 16): this is about the seam; the toy
    tasks below go through torchrun with 2 processes."""
    from distqa.registry import load_config
    from distqa.trainer import train

    out = tmp_path / "toy"
    train(
        load_config(
            None,
            [
                f"output_dir={out}",
                "task=toy_task:ToyClassificationTask",
                "task.size=1024",
                "data.num_workers=0",
                "train.optimizer=sgd",
                "train.lr=0.1",
                "train.momentum=0.9",
                "train.batch_size=32",
                "train.max_steps=40",
                "train.log_every=5",
                "train.checkpoint_every=20",
            ],
        )
    )
    model = ToyClassifier()
    model.load_state_dict(load_file(str(out / "model" / "model.safetensors")))
    # Held-out points: indices past the training set are fresh draws from the same blobs.
    data = BlobsDataset(2048, seed=42)
    held_out = torch.utils.data.default_collate([data[i] for i in range(1024, 2048)])
    accuracy = (model(held_out["features"]).argmax(-1) == held_out["label"]).float().mean().item()
    assert accuracy > 0.9
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.3 * losses[0]
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-20", "step-40"]


@pytest.mark.launch  # about 8 s: make test-launch, for make test's 5 minutes
def test_core_never_imports_the_nq_task():
    code = (
        "import sys, distqa.trainer, distqa.checkpoint, distqa.metrics, distqa.cli; "
        "leaked = [m for m in sys.modules if m.startswith('distqa.nq')]; "
        "assert not leaked, leaked; "
        # Nor does the NQ task on the DummyDataset load what only real data needs (datasets: about
        # 0.5 s in every process of every launch).
        "import distqa.nq.task; "
        "heavy = [m for m in ('datasets', 'distqa.nq.prepare', 'matplotlib.pyplot') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=subprocess_env(), timeout=120)


def test_task_names_are_checked():
    from distqa.errors import ConfigError
    from distqa.registry import load_config

    for name, message in [
        ("nosuch", "neither"),
        ("no_such_module:Task", "cannot import"),
        ("toy_task:Missing", "has nothing named 'Missing'"),
        ("toy_task:BlobsDataset", "is not a distqa.task.Task subclass"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [f"task.name={name}"])


def test_a_task_owns_typed_settings_listed_saved_and_compared(tmp_path, capsys):
    """task.KEY from the task's Config: typed, checked with a suggestion, in --help and config.yaml,
    and a change on resume is refused like a core key's."""
    from distqa.cli import main
    from distqa.config import to_yaml
    from distqa.errors import ConfigError
    from distqa.registry import load_config
    from distqa.trainer import train

    cfg = load_config(None, ["task=toy_task:ToyClassificationTask", "task.size=64"])
    assert (
        isinstance(cfg.task, ToySettings) and cfg.task.size == 64 and cfg.task.name == "toy_task:ToyClassificationTask"
    )
    assert "size: 64" in to_yaml(cfg)
    with pytest.raises(ConfigError, match=r"unknown config key 'task.sizes' .*\(did you mean task.size\?\)"):
        load_config(None, ["task.name=toy_task:ToyClassificationTask", "task.sizes=3"])
    with pytest.raises(ConfigError, match="bad value for 'task.size'"):
        load_config(None, ["task.name=toy_task:ToyClassificationTask", "task.size=many"])
    with pytest.raises(ConfigError, match="unknown config key 'task.size'"):  # not a key of the default task
        load_config(None, ["task.size=3"])
    with pytest.raises(SystemExit):
        main(["train", "task.name=toy_task:ToyClassificationTask", "--help"])
    assert "task.size = 4096" in capsys.readouterr().out

    args = ["task=toy_task:ToyClassificationTask", "task.size=64", "data.num_workers=0", "train.batch_size=8"]
    out = tmp_path / "run"
    train(load_config(None, [*args, "train.max_steps=2", f"output_dir={out}"]))
    assert "size: 64" in (out / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"task.size \(64 -> 72\)"):
        train(load_config(None, [*args, "task.size=72", "train.max_steps=4", f"output_dir={out}"]))


def test_task_state_is_checkpointed_and_non_tensor_batch_values_reach_the_loss(tmp_path):
    from distqa.registry import load_config
    from distqa.trainer import train

    args = ["task=toy_task:CountingTask", "task.size=64", "data.num_workers=0", "train.batch_size=8"]
    train(load_config(None, [*args, "train.max_steps=3", "train.checkpoint_every=3", f"output_dir={tmp_path / 'a'}"]))
    train(load_config(None, [*args, "train.max_steps=5", f"output_dir={tmp_path / 'a'}"]))  # resumed at 3
    train(load_config(None, [*args, "train.max_steps=5", f"output_dir={tmp_path / 'b'}"]))  # straight
    # A task that forgot its state on resume would have seen only the 2 resumed steps.
    assert json.loads((tmp_path / "a" / "model" / "seen.json").read_text()) == 5
    assert json.loads((tmp_path / "b" / "model" / "seen.json").read_text()) == 5


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    """One 2-process launch of TrainerProbeTask (an unused head, gradient accumulation, evaluation
    every 2 steps) that several tests below read: the launch is the expensive part."""
    out = tmp_path_factory.mktemp("probe") / "run"
    args = ["task=toy_task:TrainerProbeTask", "data.num_workers=0", "train.batch_size=4", "train.grad_accum=2"]
    args += ["train.max_steps=4", "train.optimizer=sgd", "train.lr=0.1", "train.find_unused_parameters=true"]
    proc = run_train([*args, "train.eval_every=2", "train.log_every=1", f"output_dir={out}"], nproc=2)
    return proc, out


@pytest.mark.launch  # about 12 s: make test-launch, for make test's 5 minutes
@pytest.mark.slow
def test_a_model_with_an_unused_head_needs_find_unused_parameters(tmp_path, probe_run):
    args = ["task=toy_task:UnusedHeadTask", "data.num_workers=0", "train.batch_size=4", "train.grad_accum=2"]
    args += ["train.max_steps=3", "train.optimizer=sgd", "train.lr=0.1"]
    proc = run_train([*args, f"output_dir={tmp_path / 'a'}"], nproc=2, check=False)
    assert proc.returncode != 0 and "set train.find_unused_parameters=true" in proc.stderr
    # With it set, the same kind of model (TrainerProbeTask's, an unused head too) trains.
    _, out = probe_run
    assert (out / "model" / "model.safetensors").is_file() and "unused.weight" in load_file(
        str(out / "model" / "model.safetensors")
    )


@pytest.mark.slow
def test_gradients_are_all_reduced_once_per_step_under_accumulation(probe_run):
    """train.grad_accum=2: DDP reduces nothing after the first micro-batch of a step (no_sync) and
    every bucket once after the last, whatever the buckets are."""
    _, out = probe_run
    counts = json.loads((out / "model" / "allreduces.json").read_text())
    before, total = counts[:-1], counts[-1]
    assert len(before) == 4 * 2  # 4 steps of 2 micro-batches
    buckets = total // 4
    assert buckets >= 1 and total == 4 * buckets
    assert before == [step * buckets for step in range(4) for _ in range(2)], counts


@pytest.mark.slow
def test_the_trainer_runs_evaluation_sharded_in_eval_mode_without_gradients(probe_run):
    proc, out = probe_run
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_step_seen" in r]
    assert [r["eval_step_seen"] for r in evals] == [2.0, 4.0] == [float(r["step"]) for r in evals]
    for record in evals:  # every item once, in order, across 2 ranks with shares of 5 and 6
        assert record["eval_items_in_order"] == 1.0
        assert record["eval_any_training_mode"] == 0.0 and record["eval_any_grad"] == 0.0
    assert "eval at step 2: eval_items_in_order=1" in proc.stdout  # one console line per evaluation
    losses = [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    assert len(losses) == 4  # training went on in train mode after each evaluation


def test_a_task_brings_its_own_command(capsys):
    # Through the command line's entry point in this process (a fresh interpreter only added the
    # imports of torch and the toy task, seconds, to what is checked here).
    args = ["toy-count", "task.name=toy_task:CommandTask", "task.size=77"]
    capsys.readouterr()
    assert main(args) == 0
    assert capsys.readouterr().out.strip() == "77 examples"
    # Without the task named, the command does not exist (and argparse says so in one line), also in
    # a fresh interpreter that never imported the task (quick: it fails before the heavy imports).
    cmd = [sys.executable, "-m", "distqa", "toy-count"]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "invalid choice: 'toy-count'" in proc.stderr


def test_help_after_a_config_naming_a_task_shows_that_task_as_task_name(tmp_path, capsys):
    """`distqa train --config configs/my_task.yaml --help` listed `task.name = 'nq'` (the default)
    under a header naming the config's task."""
    config = tmp_path / "fork.yaml"
    config.write_text("task:\n  name: toy_task:ToyClassificationTask\n")
    for argv in (["--config", str(config)], ["task=textcls"]):
        with pytest.raises(SystemExit):
            main(["train", *argv, "--help"])
        listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  task.name = ")]
        expected = "toy_task:ToyClassificationTask" if argv[0] == "--config" else "textcls"
        assert listed == [f"  task.name = {expected!r}"]
