"""The seam between the generic trainer and a task.

The trainer knows nothing of Natural Questions. It asks a `Task` for a model, a training dataset,
a collate function and a loss, and hands the trained model back to it for export. To train another
model or task, subclass `Task` in your own module and run `distqa train task.name=your.module:YourTask`;
`distqa.nq.task.NQTask` is the worked example and `tests/toy_task.py` the smallest one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from distqa.config import Config as RunConfig
from distqa.data_identity import fingerprint
from distqa.dist import DistInfo
from distqa.evaluation import evaluate_dataset
from distqa.flops import ModelShape, model_shape
from distqa.tasks import task_class

# Tensors go to the device; other values (example ids, say) reach `loss` as the collate made them.
Batch = Mapping[str, Any]


class Task(ABC):
    """What a task provides. All methods run on every rank unless their docstring says otherwise.

    A task's own settings are a dataclass in `Config`: its fields become `task.KEY` settings, typed,
    checked, listed by `distqa train task.name=... --help`, saved with the run and compared on resume
    (a field's metadata `resume="silent"` or `"applied"` allows a change on resume; any other change
    is refused). In the task they are `self.cfg.task`, an instance of `Config`.
    """

    @dataclass
    class Config:
        pass

    @classmethod
    def add_commands(cls, commands: Any, add_settings: Callable[..., None]) -> None:
        """Add the task's own `distqa` commands: `parser = commands.add_parser(NAME, help=...)`,
        its arguments (`add_settings(parser, example="task.x=1")` adds --config and KEY=VALUE, with
        that example in its --help), then `parser.set_defaults(run=function)`, which gets the
        parsed arguments and returns an exit status (None: 0). A fork's commands appear when its
        task is named on the command line (`distqa NAME task.name=module:Class ...`). Default: none."""
        del commands, add_settings  # no commands of its own

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def build_model(self) -> nn.Module:
        """Return the model on the CPU. Called after seeding, identically on every rank; with
        train.parallel=fsdp once more on rank 0 at the end, to hold the gathered weights for export.
        Repeated blocks belong in an `nn.ModuleList`: they are FSDP's units and what activation
        checkpointing recomputes."""

    @abstractmethod
    def build_train_dataset(self) -> Dataset:
        """A map-style dataset; the trainer shards and orders it, so no sampler logic belongs here."""

    def collate(self, items: list[Any]) -> Batch:
        """Turn a list of dataset items into one batch (a mapping of tensors)."""
        return default_collate(items)

    @abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Forward pass and the scalar loss, averaged over the examples of the batch.

        `model` may be DDP-wrapped: call it, do not reach into its modules, or DDP's gradient
        hooks are bypassed.
        """

    def count_tokens(self, batch: Batch) -> int:
        """Real (non-padding) tokens in a batch, for tokens/s. Override for non-text tasks."""
        if "attention_mask" in batch:
            return int(batch["attention_mask"].sum())
        if "input_ids" in batch:
            return batch["input_ids"].numel()
        return 0

    def data_fingerprint(self, dataset: Dataset) -> str:
        """An identity of the training data's content: stored in checkpoints, compared on resume
        and across ranks. The default hashes the length and evenly spaced items (cheap on any
        dataset; see `distqa.data_identity`); override it with an exact identity if you have one."""
        return fingerprint(dataset)

    def model_shape(self, model: nn.Module) -> ModelShape:
        """Parameters, layers and width for the FLOPs estimate of `distqa bench` (MFU). The
        default reads any Hugging Face config in the model; override it for other models."""
        return model_shape(model)

    def evaluate(self, model: nn.Module, info: DistInfo, step: int = 0) -> dict[str, float]:
        """Validation metrics (keys `eval_*`) on rank 0, anything on the others; called on every rank
        every `train.eval_every` steps and at the end, with the *unwrapped* model in eval mode,
        under `torch.no_grad()` and the run's autocast (the trainer sees to that).

        The default is the common path, with no distributed code in the task: the trainer shards
        `build_eval_dataset()`, runs `eval_step` on each batch and gives rank 0 every output for
        `compute_metrics`. Override this only for what that path cannot express; with
        train.parallel=fsdp the model's forward is a collective, so every rank must call it equally
        often.
        """
        dataset = self.eval_dataset()
        return {} if dataset is None else evaluate_dataset(self, model, dataset, info, step)

    def eval_dataset(self) -> Dataset | None:
        """`build_eval_dataset()`, built once (the trainer asks for it at start, one process per
        node first, so a task may prepare a cache there)."""
        if not hasattr(self, "_eval_dataset"):
            self._eval_dataset = self.build_eval_dataset()
        return self._eval_dataset

    def build_eval_dataset(self) -> Dataset | None:
        """Validation data (map-style), or None for no evaluation (the default). Each rank takes a
        contiguous share of it, batched with `collate`."""
        return None

    def eval_step(self, model: nn.Module, batch: Batch) -> list[Any]:
        """What one validation batch yields, one small CPU item per example or window (they are
        gathered to rank 0). The trainer calls it with the unwrapped model in eval mode, under
        `torch.no_grad()` and the run's autocast, with the batch's tensors on the device."""
        raise NotImplementedError(f"{type(self).__name__} has a validation set but no eval_step")

    def compute_metrics(self, outputs: list[Any], step: int) -> dict[str, float]:
        """Rank 0: metrics from every rank's `eval_step` outputs, in dataset order. Prefix the keys
        `eval_`; they go to metrics.jsonl, TensorBoard, the console and metrics.png."""
        raise NotImplementedError(f"{type(self).__name__} has a validation set but no compute_metrics")

    def state_dict(self) -> dict[str, Any]:
        """What the task carries across a resume besides the model and optimizer (a running
        statistic, a vocabulary grown while training). Called on rank 0 at each checkpoint and saved
        as JSON in its trainer_state.json, so it must be JSON-serialisable (and is read back
        without unpickling anything). Default: nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned, on every rank, when a run resumes."""
        del state  # a task without state has nothing to restore

    @abstractmethod
    def save_model(self, model: nn.Module, directory: Path) -> None:
        """Export the trained (unwrapped) model to `directory`. Called on rank 0 only."""


def load_task(cfg: RunConfig) -> Task:
    """Instantiate the task named by `cfg.task.name` ("nq", "textcls" or "package.module:ClassName")."""
    return task_class(cfg.task.name)(cfg)
