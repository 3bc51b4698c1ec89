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
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from distqa.build_identity import tokenizer_hash
from distqa.data_identity import fingerprint
from distqa.errors import ConfigError, DistqaError
from distqa.evaluation import evaluate_dataset
from distqa.flops import ModelShape, model_shape

# The exported settings' names, here too: forks import them from the seam's module (the new-task template does).
from distqa.task_settings import (  # noqa: F401
    SETTINGS_FILE,
    SETTINGS_FORMAT,
    given_task_keys,
    read_task_settings,
    with_trained_settings,
    write_task_settings,
)

if TYPE_CHECKING:  # for hints only: the configuration and the process group know no task
    from distqa.config import Config as RunConfig
    from distqa.dist import DistInfo

# Tensors go to the device; other values (example ids, say) reach `loss` as the collate made them.
Batch = Mapping[str, Any]


def batch_rows(batch: Batch) -> int:
    """How many examples a batch holds (samples/s; the rows DataParallel splits): the first dim of
    its first tensor that has one (in a nested mapping too), else the length of its first list. The
    first value alone was read: a 0-dim count or a list of another length first miscounted, or
    stopped with a traceback."""
    rows = _rows(batch)
    if rows is None:
        raise DistqaError(
            f"the task's collate returned a batch with no tensor or list of examples (keys: "
            f"{', '.join(map(str, batch))}): give it a tensor whose first dimension is the batch's examples"
        )
    return rows


def _rows(batch: Mapping[str, Any]) -> int | None:
    listed = None
    for value in batch.values():
        if torch.is_tensor(value):
            if value.dim() >= 1:
                return int(value.shape[0])
        elif isinstance(value, Mapping):  # a nested batch ({"inputs": {...}, "labels": ...})
            if (inner := _rows(value)) is not None:
                return inner
        elif listed is None and isinstance(value, list | tuple):
            listed = len(value)
    return listed


class Task(ABC):
    """What a task provides. All methods run on every rank unless their docstring says otherwise.

    A task's own settings are a dataclass in `Config`: its fields become `task.KEY` settings, typed,
    checked, listed by `distqa train task.name=... --help`, saved with the run and compared on resume
    (declared with `distqa.config.setting(default, help, resume="silent" | "applied")` a change on
    resume is allowed; any other change is refused). In the task they are `self.cfg.task`, an
    instance of `Config`. Optional on that class: `renamed_keys` (a ClassVar mapping an old full
    key to its new one, for the error an old name gets) and `ensure_dummy_examples(count)` (with
    data.train=dummy, hold at least `count` synthetic examples; `distqa bench` calls it).
    """

    @dataclass
    class Config:
        pass

    # Which core settings besides its own the task reads, of `model.name` and `data.train`: the
    # title of metrics.png names those (None: the ones changed from their defaults).
    core_settings: ClassVar[tuple[str, ...] | None] = None

    # The step of the weights `save_model` is about to write, set by whoever exports (the trainer's
    # finish, `distqa export`) just before: state chosen at another step (NQ's thresholds) must
    # not be written beside them as if it were theirs. None: not known.
    weights_step: int | None = None

    @classmethod
    def add_commands(cls, commands: Any, add_settings: Callable[..., None]) -> None:
        """Add the task's own `distqa` commands: `parser = commands.add_parser(NAME, help=...)`,
        its arguments (`add_settings(parser, example="task.x=1")` adds --config and KEY=VALUE, with
        that example in its --help), then `parser.set_defaults(run=function)`, which gets the
        parsed arguments and returns an exit status (None: 0). A fork's commands appear when its
        task is named on the command line (`distqa NAME task.name=module:Class ...`). Default: none."""
        del commands, add_settings  # no commands of its own

    def __init__(self, cfg: RunConfig) -> None:
        """Check settings and load what every command needs (a tokenizer). Read no data here:
        `distqa export` builds the task from a checkpoint's settings with data.train=dummy and
        data.valid=null (the files may be gone), so refuse a data setting where it is read."""
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

    def collate_fn(self) -> Callable[[list[Any]], Batch]:
        """The collate of training's DataLoader and of evaluation. Its workers start from a fork server
        (`distqa.loader_server`) and receive it pickled, once per worker and epoch: `collate`
        itself by default, which pickles the whole task. A task whose collate needs only a few
        settings returns a small function of them (NQ: `pad_collate` with its pad id)."""
        return self.collate

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
        """An identity of a dataset's content, called with the training dataset and with the
        validation one (`build_eval_dataset`'s): stored in checkpoints, compared on resume and across
        ranks. The default hashes every item in order (an Arrow dataset column by column; see
        `distqa.data_identity`); override it with a cheaper exact identity if you have one."""
        return fingerprint(dataset)

    def identity(self) -> dict[str, str]:
        """Hashes of what besides its settings, data and model decides what this task computes, and
        is read from each node's own disk: compared across ranks at start (`distqa.build_identity`,
        which compares the code and the built model itself). Default: the tokenizer, when the task
        keeps one as `self.tokenizer` (a node with another vocabulary would feed other ids)."""
        digest = tokenizer_hash(getattr(self, "tokenizer", None))
        return {} if digest is None else {"tokenizer": digest}

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
        contiguous share of it, batched with `collate_fn()`, as training is."""
        return None

    def eval_step(self, model: nn.Module, batch: Batch) -> list[Any]:
        """What one validation batch yields: a list of small CPU items, one per example or window
        (they are gathered to rank 0; a dict, a scalar or GPU tensors stop the run in one line). The trainer calls
        it with the unwrapped model in eval mode, under `torch.no_grad()` and the run's autocast,
        with the batch's tensors on the device."""
        raise NotImplementedError(f"{type(self).__name__} has a validation set but no eval_step")

    def compute_metrics(self, outputs: list[Any], step: int) -> dict[str, float]:
        """Rank 0: metrics from every rank's `eval_step` outputs, in dataset order, keys `eval_*`
        (metrics.jsonl, TensorBoard, console, metrics.png). A DistqaError stops every rank."""
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
        """Export the trained (unwrapped) model to `directory`. Called on rank 0 only; the trainer
        then adds the task's settings (`save_settings`), so that the task's own commands
        (`distqa predict`) read the settings the model was trained with (`with_trained_settings`)."""

    def save_settings(self, directory: Path) -> Path:
        """Write the `task.*` settings beside the exported model (SETTINGS_FILE): the folder then
        says how its inputs must be built, wherever it is copied."""
        return write_task_settings(self.cfg.task, directory)


def check_collate_used(task: Task) -> None:
    """A `collate` the trainer would never call: NQ's and textcls's `collate_fn` return a function
    of their own (picklable for the loader's workers; their class says `collate_fn_own = True`),
    which training and evaluation call, so a fork of either that overrode `collate` alone, in a
    subclass or a mixin before it, trained without it, exit 0."""
    mro = type(task).__mro__
    collate_owner = next(k for k in mro if "collate" in vars(k))
    fn_owner = next(k for k in mro if "collate_fn" in vars(k))
    if vars(fn_owner).get("collate_fn_own") and mro.index(collate_owner) < mro.index(fn_owner):
        raise ConfigError(
            f"{collate_owner.__name__}.collate is never called: {fn_owner.__name__}.collate_fn returns a collate "
            "of its own, which training and evaluation use; override collate_fn too (return self.collate, or a "
            "small picklable function)"
        )
