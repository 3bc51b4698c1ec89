"""What a fork commonly gets wrong, that trained wrong with exit 0 (found by a review playing a
forker): a loss that bypasses DDP, a parameter unfrozen mid-run, BatchNorm's per-rank statistics in
the evaluation. Each is now refused in one line, or made right. Run with the defaults a user has:
train.check_replicas off."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import load_weights, run_train
from distqa.control import after_step
from distqa.errors import DistqaError
from distqa.registry import load_config
from distqa.trainer import train
from toy_task import BlobsDataset, NormClassifier

TOY = ["task.size=64", "train.batch_size=4", "data.num_workers=0", "train.log_every=1", "train.lr=0.05"]


def test_whole_replicas_are_compared_on_each_step_that_logs_or_saves_by_default():
    train_cfg = load_config(None, ["train.checkpoint_every=4", "train.log_every=3"]).train
    assert train_cfg.check_replicas is False  # the default, which the runs below keep
    plans = {step: after_step(step, 10, train_cfg) for step in range(1, 11)}
    assert [step for step, plan in plans.items() if plan.compares_replicas] == [3, 4, 6, 8, 9, 10]
    assert plans[3].on_stop_request(True).compares_replicas  # a preemption's checkpoint
    assert plans[6].on_new_best().compares_replicas  # train.best_metric's
    fsdp = load_config(None, ["train.parallel=fsdp"]).train  # shards: no whole replicas to compare
    assert not any(after_step(step, 10, fsdp).compares_replicas for step in range(1, 11))


@pytest.mark.safety  # two processes: make test-safety
def test_a_loss_that_bypasses_ddp_stops_before_anything_of_a_step_is_written(tmp_path):
    """Each rank trained alone on its half of the data, and rank 0's weights were exported as the
    run's (0.25 off the one-process run after 6 steps), exit 0: only train.check_replicas=true,
    off by default, said anything."""
    out = tmp_path / "run"
    args = ["task.name=toy_task:BypassTask", *TOY, "train.max_steps=6", f"output_dir={out}"]
    proc = run_train(args, nproc=2, check=False)
    assert proc.returncode != 0
    # Step 1 trains at a learning rate of 0 (warm-up): step 2, the first that moves the weights.
    assert "parameters differ across ranks after step 2 (first: net.0.weight" in proc.stderr, proc.stderr[-3000:]
    assert "the task's loss must call the model it is given" in proc.stderr
    assert not (out / "model").exists() and not (out / "checkpoints").exists()
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]


def test_a_parameter_unfrozen_during_training_is_refused_before_its_step_applies(tmp_path):
    """Gradual unfreezing: the layer was in neither the optimizer nor DDP's all-reduce, so it never
    trained (0.0 from its initial weights), and at two processes its rank-local gradient entered
    the clipping norm, so the ranks drifted apart, exit 0."""
    cfg = load_config(None, ["task.name=toy_task:UnfreezeTask", *TOY, "train.max_steps=6", f"output_dir={tmp_path}"])
    with pytest.raises(DistqaError) as caught:
        train(cfg)
    assert str(caught.value).startswith(
        "parameter net.0.weight was unfrozen during training (its requires_grad changed): the optimizer and DDP "
        "take the parameters that require a gradient when the run starts; set requires_grad in the task's build_model"
    )
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.safety  # two processes: make test-safety
def test_an_evaluation_scores_the_exported_model_s_batchnorm_statistics(tmp_path):
    """Each rank updates BatchNorm's running statistics from its own batch (DDP sends rank 0's
    before each training forward), and each rank scored its share of the validation set with its
    own: the logged eval_loss was not the exported model's (1.1596 logged, 1.1629 for the export)."""
    out = tmp_path / "run"
    args = ["task.name=toy_task:NormTask", *TOY, "train.max_steps=4", "train.eval_every=4", f"output_dir={out}"]
    run_train(args, nproc=2)
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]["eval_loss"]
    model = NormClassifier()
    model.load_state_dict(load_weights(out))
    model.eval()
    data = BlobsDataset(64, seed=11)
    with torch.no_grad():
        losses = [F.cross_entropy(model(data[i]["features"][None]), data[i]["label"][None]).item() for i in range(64)]
    assert logged == pytest.approx(sum(losses) / 64, rel=1e-5, abs=1e-6)
