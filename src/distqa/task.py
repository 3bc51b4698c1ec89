"""The seam between the generic trainer and a task.

The trainer knows nothing of Natural Questions. It asks a `Task` for a model, a training dataset,
a collate function and a loss, and hands the trained model back to it for export. To train another
model or task, subclass `Task` in your own module and run `distqa train task=your.module:YourTask`;
`distqa.nq.task.NQTask` is the worked example and `tests/toy_task.py` the smallest one.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from distqa.config import Config
from distqa.data_identity import fingerprint
from distqa.dist import DistInfo
from distqa.errors import ConfigError
from distqa.flops import ModelShape, model_shape

# Short names for the tasks that ship with distqa; anything else is a "module:Class" path.
BUILTIN_TASKS = {"nq": "distqa.nq.task:NQTask"}

Batch = Mapping[str, torch.Tensor]


class Task(ABC):
    """What a task provides. All methods run on every rank unless their docstring says otherwise."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    @abstractmethod
    def build_model(self) -> nn.Module:
        """Return the model on the CPU. Called after seeding, identically on every rank."""

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

    def evaluate(self, model: nn.Module, info: DistInfo) -> dict[str, float]:
        """Validation metrics, called on every rank with the *unwrapped* model in eval mode.

        Return the metrics on rank 0 (keys prefixed `eval_`; they go to metrics.jsonl and
        TensorBoard) and anything on the others. The default: no validation.
        """
        return {}

    @abstractmethod
    def save_model(self, model: nn.Module, directory: Path) -> None:
        """Export the trained (unwrapped) model to `directory`. Called on rank 0 only."""


def load_task(cfg: Config) -> Task:
    """Instantiate the task named by `cfg.task` ("nq" or "package.module:ClassName")."""
    target = BUILTIN_TASKS.get(cfg.task, cfg.task)
    module_name, _, class_name = target.partition(":")
    if not module_name or not class_name:
        raise ConfigError(f"task={cfg.task!r} is neither one of {sorted(BUILTIN_TASKS)} nor 'module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"task={cfg.task!r}: cannot import module {module_name!r} ({err})") from err
    task_class = getattr(module, class_name, None)
    if not (isinstance(task_class, type) and issubclass(task_class, Task)):
        raise ConfigError(f"task={cfg.task!r}: {module_name} has no Task subclass named {class_name!r}")
    return task_class(cfg)
