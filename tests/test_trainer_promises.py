"""What the README and docs promise of the training loop, each checked in-process as one process
(no torchrun): fp16 overflow handling, a non-finite loss, a changed train.max_steps on resume,
gradient accumulation, train.epochs, train.deterministic, train.compile and DISTQA_DEBUG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, SGD, SMALL, load_weights, max_abs_diff, subprocess_env
from distqa.errors import DistqaError
from distqa.registry import load_config
from distqa.trainer import train
from toy_task import StepCounterTask

# The toy task (tests/toy_task.py): a 2-layer classifier, a step takes a millisecond.
TOY = ["data.num_workers=0", "train.log_every=1", "task.size=256", "train.batch_size=8"]


def run(out: Path, *overrides: str) -> Path:
    try:
        train(load_config(None, [f"output_dir={out}", *overrides]))
    finally:
        torch.use_deterministic_algorithms(False)  # train.deterministic sets it process-wide
    return out


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def checkpoint(out: Path, step: int) -> tuple[dict[str, torch.Tensor], dict]:
    folder = out / "checkpoints" / f"step-{step}"
    return load_file(str(folder / "model.safetensors")), torch.load(folder / "training_state.pt", weights_only=True)


# ---------------------------------------------------------------------------- fp16
@pytest.mark.parametrize("clip", ["0", "1.0"])  # without clipping, and with the unscale_ before it
def test_fp16_overflowed_step_is_skipped_and_the_schedule_waits(tmp_path, clip):
    """The trainer's own GradScaler (fp16 runs on the CPU too) sees inf gradients on step 3: that
    step must leave the weights and the LR schedule as they were, and halve the scale; training
    goes on afterwards."""
    bad = StepCounterTask.BAD_STEP
    out = run(
        tmp_path / "fp16",
        "task=toy_task:OverflowTask",
        *TOY,
        "train.precision=fp16",
        "train.optimizer=sgd",
        "train.lr=0.1",
        "train.lr_schedule=linear",
        "train.warmup_ratio=0",
        f"train.max_grad_norm={clip}",
        "train.max_steps=6",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=0",
    )
    states = {step: checkpoint(out, step) for step in range(1, 7)}
    weights = {step: w for step, (w, _) in states.items()}
    last_epoch = [states[step][1]["scheduler"]["last_epoch"] for step in range(1, 7)]
    scale = [states[step][1]["scaler"]["scale"] for step in range(1, 7)]
    assert max_abs_diff(weights[bad - 1], weights[bad]) == 0.0  # the optimizer step was skipped
    for step in (2, bad + 1, 6):  # every other step moved the weights, before and after
        assert max_abs_diff(weights[step - 1], weights[step]) > 1e-4, step
    assert last_epoch == [1, 2, 2, 3, 4, 5]  # the schedule did not advance on step 3
    assert scale[bad - 1] == scale[bad - 2] / 2 and scale[bad - 2] == scale[0]
    # The rate each step used: steps 3 and 4 share one, and the run still ends at step 6.
    lrs = [r["lr"] for r in metrics(out)]
    assert lrs == pytest.approx([0.1 * (6 - e) / 6 for e in (0, 1, 2, 2, 3, 4)])
    assert all(torch.isfinite(t).all() for t in load_weights(out).values())


# ---------------------------------------------------------------------------- non-finite loss
def test_a_non_finite_loss_stops_the_run_with_an_error_naming_it(tmp_path):
    out = tmp_path / "diverged"
    first = r"^loss is inf at step 3: the run diverged: lower train.lr \(now 3e-05\)"
    with pytest.raises(DistqaError, match=first) as caught:
        run(out, "task=toy_task:NonFiniteLossTask", *TOY, "train.max_steps=6")
    assert [r["step"] for r in metrics(out)] == [1, 2]
    assert not (out / "model").exists()  # nothing exported from a diverged run
    # Where the last finite weights are: nowhere before the first save, then the newest checkpoint.
    assert str(caught.value).endswith("; no checkpoint was written, so none holds the last finite weights")
    with pytest.raises(DistqaError) as caught:
        run(
            tmp_path / "saved", "task=toy_task:NonFiniteLossTask", *TOY, "train.max_steps=6", "train.checkpoint_every=2"
        )
    newest = tmp_path / "saved" / "checkpoints" / "step-2"
    assert str(caught.value).endswith(f"; the newest checkpoint, {newest}, holds the last finite weights")


# ---------------------------------------------------------------------------- schedule on resume
def test_a_changed_max_steps_on_resume_rescales_the_schedule(tmp_path):
    """docs/reliability.md: "a changed train.max_steps rescales the LR schedule to the new length"."""
    linear = [
        "task=toy_task:ToyClassificationTask",
        *TOY,
        "train.lr=1e-3",
        "train.lr_schedule=linear",
        "train.warmup_ratio=0",
    ]
    out = run(tmp_path / "run", *linear, "train.max_steps=4", "train.checkpoint_every=2")
    run(out, *linear, "train.max_steps=8")
    # Steps 1-4 decay over 4 steps (their last rate, 0, would be step 5's); from step 5 on the
    # rate follows the 8-step schedule at the step reached: 1e-3 * (8 - 4) / 8 first.
    lrs = [r["lr"] for r in metrics(out)]
    assert lrs == pytest.approx([1e-3 * f for f in (1, 0.75, 0.5, 0.25, 4 / 8, 3 / 8, 2 / 8, 1 / 8)])


# ---------------------------------------------------------------------------- gradient accumulation
def test_gradient_accumulation_equals_the_whole_batch(tmp_path):
    """train.batch_size=4 train.grad_accum=2 is train.batch_size=8, at the weight level, and the
    comparison tells 2 steps from 3."""
    accum = run(tmp_path / "accum", *SGD, "train.batch_size=4", "train.grad_accum=2", "train.max_steps=3")
    whole = run(tmp_path / "whole", *SGD, "train.batch_size=8", "train.max_steps=3")
    shorter = run(tmp_path / "shorter", *SGD, "train.batch_size=8", "train.max_steps=2")
    assert max_abs_diff(load_weights(accum), load_weights(whole)) <= 1e-6
    assert max_abs_diff(load_weights(whole), load_weights(shorter)) > 1e-3
    for a, b in zip(metrics(accum), metrics(whole), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)  # the logged loss: the mean of both halves (float32)


# ---------------------------------------------------------------------------- epochs, determinism
def test_deterministic_run_of_two_epochs(tmp_path):
    """train.max_steps unset: 2 epochs of 16 examples in global batches of 4 are 8 steps."""
    args = ["task=toy_task:ToyClassificationTask", *TOY, "task.size=16", "train.batch_size=4", "train.epochs=2"]
    args.append("train.deterministic=true")
    out = run(tmp_path / "epochs", *args, "train.checkpoint_every=4")
    assert [r["step"] for r in metrics(out)] == list(range(1, 9))
    assert metrics(out)[-1]["epoch"] == 2.0
    state = json.loads((out / "checkpoints" / "step-8" / "trainer_state.json").read_text())
    assert (state["step"], state["epoch"], state["step_in_epoch"]) == (8, 2, 0)
    again = run(tmp_path / "again", *args, "train.checkpoint_every=4")
    assert max_abs_diff(load_weights(out), load_weights(again)) == 0.0


# ---------------------------------------------------------------------------- compile
COMPILED_RUN = """
import sys
from torch._dynamo.utils import counters
from distqa.registry import load_config
from distqa.trainer import train
train(load_config(None, sys.argv[1:]))
print(counters["stats"]["unique_graphs"])
"""


@pytest.mark.launch  # compiling takes 8 s: make test-launch
def test_compiled_model_trains_on_the_cpu(tmp_path):
    """train.compile=true through the same loop (inductor needs a C++ compiler: one is on CI). The
    compiled run has a process of its own: inductor leaves its kernels and a pool of compile
    workers in the process, and a later test's fork (datasets' preparation workers) crashed in them."""
    args = ["task=toy_task:ToyClassificationTask", *TOY, "train.max_steps=2"]
    plain = run(tmp_path / "plain", *args)
    compiled = tmp_path / "compiled"
    cmd = [sys.executable, "-c", COMPILED_RUN, *args, "train.compile=true", f"output_dir={compiled}"]
    proc = subprocess.run(cmd, env=subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip().splitlines()[-1]) >= 1  # Dynamo really captured the model's forward
    assert [r["step"] for r in metrics(compiled)] == [1, 2]
    # The same computation, compiled: equal up to the fused kernels' rounding.
    assert max_abs_diff(load_weights(plain), load_weights(compiled)) < 1e-5


# ---------------------------------------------------------------------------- DISTQA_DEBUG
@pytest.mark.parametrize("debug", [False, True])
def test_distqa_debug_shows_the_traceback_of_an_error(tmp_path, debug):
    """A missing data file fails in the configuration, before torch is imported: one line, or
    with DISTQA_DEBUG=1 the traceback."""
    missing = tmp_path / "missing.jsonl"
    env = subprocess_env(**({"DISTQA_DEBUG": "1"} if debug else {}))
    if not debug:
        env.pop("DISTQA_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "distqa", "train", f"data.train={missing}", f"output_dir={tmp_path / 'out'}"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    message = f"data.train='{missing}' does not exist (use data.train=dummy for synthetic data)"
    if debug:
        assert proc.returncode == 1
        assert proc.stderr.startswith("Traceback (most recent call last):")
        assert f"distqa.errors.ConfigError: {message}" in proc.stderr.splitlines()
    else:
        assert proc.returncode == 2
        assert proc.stderr == f"distqa: error: {message}\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.launch  # about 9 s: make test-launch, for make test's 5 minutes
def test_the_quick_start_loss_falls(tmp_path):
    """The README's quick start (configs/quickstart.yaml, global batch 2 x 8) shortened to 30 steps,
    in one process with the same global batch: the README's loss goes from 3.8 to 2.3 by step 30."""
    out = tmp_path / "quickstart"
    overrides = [f"output_dir={out}", "train.batch_size=16", "train.max_steps=30", "train.log_every=1"]
    train(load_config(str(ROOT / "configs" / "quickstart.yaml"), [*overrides, "data.num_workers=0"]))
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 3.0 and last < 0.8 * first, (first, last)


# ---------------------------------------------------------------------------- evaluation
def test_evaluating_moves_no_random_stream_of_training(tmp_path, minilm_dir):
    """train.eval_every and data.valid change nothing computed (a resume may change them without a
    word), so a run that evaluates must end with the weights of one that does not. Its DataLoader
    drew a base seed from torch's CPU generator at every evaluation, which shifted the dropout
    masks of every later step (a review measured 6.2e-3 after 12 steps). Dropout is on here."""
    from test_nq_input_checks import SHORT, annotated, write

    valid = write(tmp_path / "valid.jsonl", [annotated(line) for line in SHORT[:2]])
    base = [*SMALL, f"model.tokenizer={minilm_dir}", f"task.cache_dir={tmp_path / 'cache'}", "model.dropout=0.1"]
    base += ["train.max_steps=4", "train.batch_size=2"]
    plain = run(tmp_path / "plain", *base)
    evaluated = run(tmp_path / "evaluated", *base, f"data.valid={valid}", "train.eval_every=1")
    assert [row["step"] for row in metrics(evaluated) if "eval_micro_f1" in row] == [1, 2, 3, 4]
    assert max_abs_diff(load_weights(plain), load_weights(evaluated)) == 0.0
