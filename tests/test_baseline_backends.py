"""The bench's hand-written loop sets the trainer's kernel flags, the trainer's way and at its time."""

from __future__ import annotations

import torch
from torch import nn

from distqa.bench import baseline
from distqa.config import Config
from distqa.dist import DistInfo
from distqa.steptimer import StepTimer


class _Task:
    """Only what baseline._build asks of a task; records when the model is built."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def build_model(self) -> nn.Module:
        self.calls.append("build_model")
        return nn.Linear(2, 2)

    def build_train_dataset(self) -> list:
        return []


def test_baseline_configures_backends_as_the_trainer_before_the_model(monkeypatch):
    calls: list = []
    monkeypatch.setattr(baseline, "configure_backends", lambda train, device: calls.append((train, device)))
    cfg = Config()
    cfg.train.deterministic = True  # the setting the hand-copied TF32 line used to ignore
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    baseline._build(cfg, _Task(calls), info, StepTimer(info.device, warmup=0))
    assert calls == [(cfg.train, info.device), "build_model"]


def test_the_baseline_counts_and_moves_a_fork_s_nested_batch_with_strings():
    """The baseline took a batch's first value as its rows (a mapping's key count here) and called
    .to() on every value (a list of ids has none): a fork's bench crashed or counted wrong."""
    from distqa.registry import load_config, load_task

    cfg = load_config(None, ["task.name=toy_seam_tasks:NestedBatchTask", "task.size=64", "data.num_workers=0",
                             "train.batch_size=4", "train.grad_accum=2", "train.max_steps=3"])  # fmt: skip
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    summary, _ = baseline.run_baseline(cfg, load_task(cfg), info, warmup=0)
    assert summary["samples"] == 3 * 2 * 4, summary


def test_the_baseline_runs_the_trainer_s_activation_checkpointing_and_optimizer(monkeypatch, tmp_path):
    """`--baseline` compared a trainer that ran activation checkpointing (a second forward of each
    block) and SGD with a loop that ran neither (AdamW, hard-coded): the ratio said 'trainer
    overhead' of what were other settings, exit 0 (found by a review). Same block forwards, same
    optimizer steps, in both loops."""
    from distqa.parallel import transformer_blocks
    from distqa.registry import load_config, load_task
    from distqa.trainer import Trainer

    cfg = load_config(None, ["model.name=tiny", "task.max_seq_len=64", "task.dummy_size=64", "data.num_workers=0",
                             "train.batch_size=4", "train.max_steps=2", "train.activation_checkpointing=true",
                             "train.optimizer=sgd", f"output_dir={tmp_path}"])  # fmt: skip
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    seen: list[str] = []
    for cls in (torch.optim.SGD, torch.optim.AdamW):
        real = cls.step

        def step(self, *args, _real=real, **kwargs):
            seen.append(f"{type(self).__name__}.step")
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "step", step)

    def counted_task():
        task = load_task(cfg)
        build = task.build_model

        def build_model():
            model = build()
            for block in transformer_blocks(model):  # (called again inside its checkpoint wrapper)
                block.register_forward_pre_hook(lambda *_: seen.append("block"))
            return model

        task.build_model = build_model
        return task

    baseline.run_baseline(cfg, counted_task(), info, warmup=0)
    base, seen[:] = list(seen), []
    Trainer(cfg, counted_task(), info, save_outputs=False).fit()
    blocks = len(transformer_blocks(load_task(cfg).build_model()))
    # Each of 2 steps: every block forward twice (once more in the backward), then SGD's step.
    assert base == seen == (["block"] * 2 * blocks + ["SGD.step"]) * 2, (base, seen)
