"""Typed configuration: nested dataclasses, a YAML file, then `key=value` overrides.

OmegaConf merges the three layers against the dataclass schema, so an unknown key or a value of the
wrong type is caught before anything runs; range and choice checks live in `__post_init__`. Every
field carries a one-line `help` that `distqa train --help` prints, so the schema is the reference.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from distqa.config_checks import check_choice as _check_choice
from distqa.config_checks import check_finite, check_floats, check_min, check_not_a_section, check_sections, suggest
from distqa.config_checks import raise_config_error as _raise_config_error
from distqa.errors import ConfigError


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with its help text attached (read by `describe_keys`)."""
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return field(default_factory=default, metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


# Public names for tasks' own Config dataclasses: `setting(default, help, resume="silent")`.
# `resume` says what a change on resume means: "silent" (nothing computed changes), "applied"
# (takes effect from the resume step, with a warning); without it the change is refused.
# A float setting must be finite unless declared with `finite=False` (then +-inf is allowed).
def setting(default: Any, help: str, **kw: Any) -> Any:
    return _f(default, help, **kw)


@dataclass
class ModelConfig:
    name: str = _f(
        "tiny",
        "'tiny', 'bert-base-random' or 'bert-large-random' (random BERTs built from a config, no "
        "download), a Hugging Face id, or a local folder",
    )
    tokenizer: str | None = _f(None, "tokenizer id or folder (default: model.name; none for 'tiny')")
    dropout: float | None = _f(None, "dropout for every dropout rate of the encoder (default: keep its own)")
    attn_implementation: str | None = _f(
        None, "attention kernel: sdpa | eager | flash_attention_2 (default: SDPA where supported)"
    )

    def __post_init__(self) -> None:
        check_finite("model.dropout", self.dropout)
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")


@dataclass
class DataConfig:
    train: str = _f(
        "dummy",
        "training data, as the task reads it (nq: 'dummy', an NQ JSONL file, or a folder `distqa prepare` wrote)",
    )
    valid: str | None = _f(None, "validation data, as the task reads it (default: none)")
    num_workers: int | None = _f(
        None,
        "DataLoader worker processes per rank (0 = load in the training process; "
        "default: this rank's share of the node's CPUs, less one, at most 8)",
    )

    def __post_init__(self) -> None:
        if self.num_workers is not None:
            check_min("data.num_workers", self.num_workers, 0)
        for key, value in (("data.train", self.train), ("data.valid", self.valid)):
            if value not in (None, "dummy") and not Path(value).exists():
                # Never fall back to dummy data silently: a typo would train on noise for hours.
                raise ConfigError(f"{key}={value!r} does not exist (use data.train=dummy for synthetic data)")


@dataclass
class TrainConfig:
    max_steps: int = _f(-1, "optimizer steps to run; > 0 overrides train.epochs")
    epochs: int = _f(1, "passes over the training data (when train.max_steps <= 0)")
    batch_size: int = _f(8, "examples per micro-batch per process")
    grad_accum: int = _f(1, "micro-batches accumulated per optimizer step")
    global_batch: int = _f(
        0,
        "examples per optimizer step over all processes; when > 0, train.grad_accum is derived from it, "
        "train.batch_size and the process count, so that the data order and the schedule stay the same "
        "when an elastic run loses or gains nodes",
    )
    parallel: str = _f(
        "ddp",
        "ddp (a whole model per process) | fsdp (FSDP2: weights, gradients and optimizer state sharded "
        "over the processes, for models one GPU cannot hold)",
    )
    activation_checkpointing: bool = _f(
        False, "recompute each transformer block's activations in the backward pass instead of keeping them"
    )
    optimizer: str = _f("adamw", "adamw | sgd")
    lr: float = _f(3e-5, "peak learning rate")
    momentum: float = _f(0.0, "SGD momentum (train.optimizer=sgd only)")
    lr_schedule: str = _f("linear", "linear | constant | cosine, after warm-up")
    warmup_ratio: float = _f(0.1, "fraction of the steps spent warming the learning rate up from 0")
    weight_decay: float = _f(0.01, "decoupled weight decay (never on biases and LayerNorm weights)")
    max_grad_norm: float = _f(1.0, "clip the global gradient norm to this (0 = no clipping)")
    precision: str = _f("fp32", "fp32 | bf16 | fp16 (fp16 uses a gradient scaler)")
    compile: bool = _f(False, "torch.compile the model (faster steps on GPU after a compile warm-up)")
    static_graph: bool = _f(
        True, "tell DDP the same parameters get gradients every step (not used with grad_accum > 1 or compile)"
    )
    find_unused_parameters: bool = _f(
        False,
        "let DDP find parameters a step did not use (a model with an unused head); costs a graph walk per step",
    )
    deterministic: bool = _f(False, "use deterministic kernels only (slower on GPU; CPU runs are already)")
    checkpoint_every: int = _f(500, "save a checkpoint every N steps (and always at the end)")
    keep_checkpoints: int = _f(3, "keep the newest N checkpoints (0 = keep all)")
    term_grace_s: float = _f(30.0, "after SIGTERM: seconds the platform allows for the last checkpoint")
    check_replicas: bool = _f(False, "debug: check every step that all ranks hold identical parameters")
    check_finite: bool = _f(
        False,
        "check every step that the weights are finite (by default only on the steps that log, save or export)",
    )
    log_every: int = _f(10, "log metrics every N steps")
    eval_every: int = _f(0, "evaluate on data.valid every N steps (0: only at the end)")
    resume: str = _f(
        "auto",
        "auto (newest usable checkpoint in output_dir) | never (start afresh; an earlier run's files are "
        "moved to output_dir/earlier-runs/) | a checkpoint folder",
    )
    allow_data_change: bool = _f(
        False, "resume even though the training data differs from the checkpoint's (length or fingerprint)"
    )

    def __post_init__(self) -> None:
        for key in ("epochs", "batch_size", "grad_accum", "checkpoint_every", "log_every"):
            check_min(f"train.{key}", getattr(self, key), 1)
        _check_choice("train.parallel", self.parallel, ("ddp", "fsdp"))
        _check_choice("train.optimizer", self.optimizer, ("adamw", "sgd"))
        if self.parallel == "fsdp" and self.check_replicas:
            raise ConfigError(
                "train.check_replicas=true compares the ranks' whole copies of the model, which "
                "train.parallel=fsdp does not keep (each rank holds a different shard): turn one off"
            )
        _check_choice("train.lr_schedule", self.lr_schedule, ("linear", "constant", "cosine"))
        _check_choice("train.precision", self.precision, ("fp32", "bf16", "fp16"))
        check_min("train.lr", self.lr, 0.0, strict=True)
        check_min("train.momentum", self.momentum, 0.0)
        check_min("train.weight_decay", self.weight_decay, 0.0)
        check_min("train.max_grad_norm", self.max_grad_norm, 0.0)
        check_min("train.eval_every", self.eval_every, 0)
        check_min("train.global_batch", self.global_batch, 0)
        if self.global_batch and self.global_batch % self.batch_size:
            raise ConfigError(
                f"train.global_batch={self.global_batch} is not a multiple of train.batch_size={self.batch_size}"
            )
        check_min("train.keep_checkpoints", self.keep_checkpoints, 0)
        check_min("train.term_grace_s", self.term_grace_s, 0.0, strict=True)
        check_finite("train.warmup_ratio", self.warmup_ratio)
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"train.warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        if self.resume not in ("auto", "never") and not Path(self.resume).is_dir():
            raise ConfigError(f"train.resume={self.resume!r} is not auto, never, or an existing checkpoint folder")

    def resolve_global_batch(self, world_size: int) -> None:
        """Derive `grad_accum` from `global_batch` for this many processes (in place; no-op when unset)."""
        if not self.global_batch:
            return
        per_step = self.batch_size * world_size
        if self.global_batch % per_step:
            raise ConfigError(
                f"train.global_batch={self.global_batch} cannot be split over {world_size} process(es) of "
                f"train.batch_size={self.batch_size}: it must be a multiple of {per_step}; pick a batch size "
                "that divides it for every node count the run may have"
            )
        accum = self.global_batch // per_step
        if self.grad_accum not in (1, accum):
            raise ConfigError(
                f"train.grad_accum={self.grad_accum} contradicts train.global_batch={self.global_batch} "
                f"({world_size} process(es) x train.batch_size={self.batch_size} need {accum}): leave "
                "train.grad_accum unset when train.global_batch is set"
            )
        self.grad_accum = accum


@dataclass
class TaskSettings:
    """`task.name`, plus the selected task's own settings: a `Task` subclass declares them as a
    dataclass in its `Config` attribute, and `load_config` merges them in under `task.`."""

    name: str = _f("nq", "'nq', 'textcls' or 'package.module:TaskClass' (see docs/fork.md)")


# numpy's and the DataLoader's seeds are 32-bit: a seed outside fails deep inside the first step.
MAX_SEED = 2**32 - 1


@dataclass
class Config:
    output_dir: str = _f("results/run", "folder for config.yaml, metrics, checkpoints and the final model")
    seed: int = _f(42, f"seed for weights, data order, dropout and synthetic data (0..{MAX_SEED})")
    task: TaskSettings = _f(TaskSettings, "")
    model: ModelConfig = _f(ModelConfig, "")
    data: DataConfig = _f(DataConfig, "")
    train: TrainConfig = _f(TrainConfig, "")

    def __post_init__(self) -> None:
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed={self.seed} must be an integer in [0, {MAX_SEED}]")


def describe_keys(schema: Any = Config, prefix: str = "") -> Iterator[tuple[str, Any, str]]:
    """Yield (dotted key, default, help) for every leaf of a schema (a dataclass or an instance:
    pass `default_config(task)` to include a task's own keys), in declaration order."""
    defaults = schema() if isinstance(schema, type) else schema
    for f in dataclasses.fields(defaults):
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            yield from describe_keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value, f.metadata.get("help", "")


@functools.cache
def task_settings_class(settings: type) -> type:
    """The dataclass of `task.*` for a task whose own settings are `settings` (its `Config`):
    `name` first, then the task's keys. An instance is an instance of the task's `Config`."""
    if not (isinstance(settings, type) and dataclasses.is_dataclass(settings)):
        raise ConfigError(f"the task's Config must be a dataclass, not {settings!r}")
    if issubclass(settings, TaskSettings):
        return settings
    if "name" in {f.name for f in dataclasses.fields(settings)}:
        raise ConfigError("a task's Config may not define 'name': task.name selects the task")
    combined = dataclasses.make_dataclass(settings.__name__, [], bases=(settings, TaskSettings))
    combined.__module__, combined.__qualname__ = settings.__module__, settings.__qualname__  # for reprs
    # A class made here cannot be found by name when unpickled (DataLoader workers started with
    # spawn, broadcasts): rebuild it from the task's own class, which can.
    combined.__reduce__ = lambda self: (_rebuild_settings, (settings, dataclasses.asdict(self)))
    return combined


def _rebuild_settings(settings: type, values: dict[str, Any]) -> Any:
    return task_settings_class(settings)(**values)


def default_config(settings: type | None = None) -> Config:
    """Every default, with the task's own settings under `task.` when `settings` (its Config) is given."""
    cfg = Config()
    if settings is not None:
        cfg.task = task_settings_class(settings)()
    return cfg


def _read_yaml(path: str) -> DictConfig:
    if not Path(path).is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        layer = OmegaConf.load(path)
    except Exception as err:  # yaml's many parser errors: report the file, not the internals
        raise ConfigError(f"config file {path} is not valid YAML: {str(err).splitlines()[0]}") from err
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"config file {path} is not a mapping of settings")
    if isinstance(layer.get("task"), str):  # `task: NAME`, the shorthand of `task: {name: NAME}`
        layer["task"] = {"name": layer["task"]}
    return layer


def _task_name(layer: DictConfig | None, items: list[str]) -> str:
    for item in reversed(items):
        if item.startswith("task.name="):
            return item.partition("=")[2]
    if layer is not None and isinstance(layer.get("task"), DictConfig) and "name" in layer["task"]:
        return str(layer["task"]["name"])
    return TaskSettings().name


def load_config(
    path: str | None = None,
    overrides: tuple[str, ...] | list[str] = (),
    *,
    settings_of: Callable[[str], type] | None = None,
) -> Config:
    """Defaults < YAML file < `key=value` overrides, checked against the schema.

    The task is found first (`task.name`, or the shorthand `task=NAME`), so that its own settings
    (`settings_of(name)`, by default the task's `Config`) are typed and checked like every other key.
    """
    layer = _read_yaml(path) if path is not None else None
    items = []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form KEY=VALUE{suggest(item, [])}")
        key, _, value = item.partition("=")
        items.append(f"task.name={value}" if key == "task" else item)
    if settings_of is None:
        from distqa.tasks import settings_class as settings_of
    defaults = default_config(settings_of(_task_name(layer, items)))
    from distqa.tasks import moved_to_task

    task_keys = {f.name for f in dataclasses.fields(defaults.task)} - {"name"}
    layer, items = moved_to_task(task_keys - {f.name for f in dataclasses.fields(DataConfig)}, layer, items)
    known = [k for k, _, _ in describe_keys(defaults)]
    merged = OmegaConf.structured(defaults)
    if layer is not None:
        check_sections(OmegaConf.to_container(layer), defaults, str(path))
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            _raise_config_error(err, str(path), known)
    for item in items:
        check_not_a_section(item.partition("=")[0], known)
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except ConfigKeyError as err:
            # OmegaConf names only the first unknown part (`trian`); the key as typed says more.
            typed = item.partition("=")[0]
            raise ConfigError(f"unknown config key '{typed}' in the command line{suggest(typed, known)}") from err
        except OmegaConfBaseException as err:
            _raise_config_error(err, "the command line", known)
    try:
        check_floats(OmegaConf.to_container(merged), defaults)
        cfg = OmegaConf.to_object(merged)  # instantiates the dataclasses: runs every __post_init__
    except OmegaConfBaseException as err:
        if isinstance(err.__cause__, ConfigError):
            raise err.__cause__ from None
        _raise_config_error(err, "the configuration", known)
    assert isinstance(cfg, Config)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
