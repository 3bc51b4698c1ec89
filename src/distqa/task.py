"""The seam between the generic trainer and a task.

The trainer knows nothing of Natural Questions. It asks a `Task` for a model, a training dataset,
a collate function and a loss, and hands the trained model back to it for export. To train another
model or task, subclass `Task` in your own module and run `distqa train task.name=your.module:YourTask`;
`distqa.nq.task.NQTask` is the worked example and `tests/toy_task.py` the smallest one.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn
from torch.utils.data import Dataset, default_collate

from distqa.build_identity import tokenizer_hash
from distqa.data_identity import fingerprint
from distqa.errors import ConfigError, DistqaError
from distqa.evaluation import evaluate_dataset
from distqa.flops import ModelShape, model_shape

if TYPE_CHECKING:  # for hints only: the configuration and the process group know no task
    from distqa.config import Config as RunConfig
    from distqa.dist import DistInfo

# Tensors go to the device; other values (example ids, say) reach `loss` as the collate made them.
Batch = Mapping[str, Any]


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
        """The training DataLoader's collate. Its workers start from a fork server
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
        contiguous share of it, batched with `collate`."""
        return None

    def eval_step(self, model: nn.Module, batch: Batch) -> list[Any]:
        """What one validation batch yields, one small CPU item per example or window (they are
        gathered to rank 0). The trainer calls it with the unwrapped model in eval mode, under
        `torch.no_grad()` and the run's autocast, with the batch's tensors on the device."""
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


# The task settings a model was trained with travel in its export: a command that runs the model
# (`distqa predict`) must build its inputs the same way (windows of task.max_seq_len tokens, ...),
# and a wrong window length gives a plausible, wrong result rather than an error.
SETTINGS_FILE = "distqa_task.json"
SETTINGS_FORMAT = 1
_FIX = f"copy {SETTINGS_FILE} again from the training run's model/ folder"


def _plain(value: Any) -> Any:
    """`value` as strict JSON holds it: a non-finite float as the string OmegaConf reads back into a
    float field ("inf", "-inf", "nan"), an enum by name, dataclasses and containers item by item."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _shown(value: Any) -> str:
    """A value as one would type it after `task.KEY=`."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(_plain(value))


def _warn(line: str) -> None:
    print(f"distqa: warning: {line}", file=sys.stderr, flush=True)


def write_task_settings(settings: Any, directory: Path) -> Path:
    """Write a task's settings (the `task.*` dataclass, `task.name` included) to directory/SETTINGS_FILE."""
    path = Path(directory) / SETTINGS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"format": SETTINGS_FORMAT, "task": _plain(settings)}
    # allow_nan=False: JSON has no Infinity or NaN; a value `_plain` missed fails here, not in a reader.
    path.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def read_task_settings(directory: Path) -> dict[str, Any] | None:
    """The `task.*` settings saved with an exported model; None for an export without them (an older distqa)."""
    path = Path(directory) / SETTINGS_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"), parse_constant=_no_constants)
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise DistqaError(f"{path} cannot be read ({str(err).splitlines()[0]}): {_FIX}") from err
    if not isinstance(record, dict) or not isinstance(record.get("task"), dict):
        raise DistqaError(f"{path} holds no 'task' mapping of settings: {_FIX}")
    if record.get("format") != SETTINGS_FORMAT:
        raise DistqaError(
            f"{path} is of format {record.get('format')!r}, this distqa reads format {SETTINGS_FORMAT}: "
            "run the model with the distqa version that exported it"
        )
    return record["task"]


def given_task_keys(config_path: str | None, overrides: Collection[str]) -> set[str]:
    """The `task.*` keys (without the prefix) that a command's --config file and KEY=VALUE overrides
    set, `task=NAME` included. Call it after `load_config` has accepted both."""
    given: set[str] = set()
    layer = OmegaConf.load(config_path) if config_path is not None else None
    if isinstance(layer, DictConfig):
        task = layer.get("task")
        if isinstance(task, str):  # the shorthand `task: NAME`
            given.add("name")
        elif isinstance(task, DictConfig):
            given.update(str(key) for key in task)
    for item in overrides:
        key = item.partition("=")[0]
        if key == "task":
            given.add("name")
        elif key.startswith("task."):
            given.add(key[5:].split(".")[0])
    return given


def _check_float(key: str, value: Any, field: dataclasses.Field) -> None:
    """A float from the file is a number, as on the command line: never nan, and +-inf only for a
    setting declared `setting(..., finite=False)`."""
    if isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value) or field.metadata.get("finite") is not False:
            raise ConfigError(f"task.{key}={value} is not a finite number")


def with_trained_settings(cfg: RunConfig, directory: Path, given: Collection[str] = ()) -> RunConfig:
    """`cfg` (changed in place) with the `task.*` settings the model in `directory` was trained with,
    for a command that runs an exported model. A key in `given` (set by the user: `given_task_keys`)
    keeps its value, with one warning line when it differs from the trained one. Settings that may
    change on resume (field metadata `resume`: a cache folder, skipping bad lines) are choices of
    this run, not properties of the model: never taken from the file. Without the file (an export
    of an older distqa) `cfg` stays as it is, and one line says so."""
    directory = Path(directory)
    path = directory / SETTINGS_FILE
    fields = {f.name: f for f in dataclasses.fields(cfg.task)}
    model_keys = [name for name, f in fields.items() if name != "name" and "resume" not in f.metadata]
    saved = read_task_settings(directory)
    if saved is None:
        shown = ", ".join(f"task.{key}={_shown(getattr(cfg.task, key))}" for key in model_keys)
        _warn(
            f"{directory} has no {SETTINGS_FILE} (exported by an older distqa): using the given and default "
            f"settings {shown}; give the ones the model was trained with"
        )
        return cfg
    trained_name = saved.get("name", cfg.task.name)
    if trained_name != cfg.task.name:
        if "name" not in given:
            raise DistqaError(
                f"{path}: the model was trained with task.name={trained_name}, not {cfg.task.name}: "
                f"give task.name={trained_name}"
            )
        _warn(f"task.name={cfg.task.name} was given but the model was trained with task.name={trained_name}")
    taken: dict[str, Any] = {}
    for key, value in saved.items():
        if key == "name":
            continue
        if key not in fields:
            _warn(f"{path} holds task.{key}, which task.name={cfg.task.name} does not know: ignored")
        elif key not in model_keys:
            continue
        elif key not in given:
            taken[key] = value
        elif _plain(getattr(cfg.task, key)) != value:
            mine = _shown(getattr(cfg.task, key))
            _warn(
                f"task.{key}={mine} was given but the model in {directory} was trained with "
                f"task.{key}={_shown(value)}: using {mine} (leave task.{key} out to use the trained value)"
            )
    before = cfg.task
    cfg.task = _merged(cfg.task, taken, path)
    changed = [key for key in taken if getattr(cfg.task, key) != getattr(before, key)]
    if changed:  # what the file changed, for a log that explains the run's windows
        print(
            f"trained settings from {path}: " + ", ".join(f"task.{k}={_shown(getattr(cfg.task, k))}" for k in changed)
        )
    return cfg


def _merged(settings: Any, taken: dict[str, Any], path: Path) -> Any:
    """`settings` with the values `taken` from the file at `path`, typed and checked as on the
    command line (OmegaConf reads "inf" into a float field); a bad value names the file and the fix."""
    fields = {f.name: f for f in dataclasses.fields(settings)}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(settings), taken)
        for key in taken:  # before __post_init__, whose range checks nan would pass
            _check_float(key, merged[key], fields[key])
        return OmegaConf.to_object(merged)
    except ConfigError as err:  # a range check of the settings' __post_init__: it names the key
        raise ConfigError(f"{path}: {err}: {_FIX}") from err
    except OmegaConfBaseException as err:
        if isinstance(err.__cause__, ConfigError):
            raise ConfigError(f"{path}: {err.__cause__}: {_FIX}") from err
        where = f"task.{err.full_key}: " if getattr(err, "full_key", None) else ""
        raise ConfigError(f"{path}: {where}{str(err).splitlines()[0]}: {_FIX}") from err
