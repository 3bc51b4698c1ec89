"""Typed configuration: the schema of every setting, as nested dataclasses.

Each field is declared with `setting`: its one-line help (`distqa train --help` prints it, so the
schema is the reference) and its rules (what a change means on resume, whether +-inf is allowed).
Range and choice checks live in `__post_init__`. `distqa.config_layers` loads the defaults, a YAML
file and `KEY=VALUE` overrides against it; a task's own settings join under `task.`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from distqa.config_checks import (
    check_attention,
    check_choice,
    check_fraction,
    check_fsdp_run,
    check_min,
    check_parallel,
    escaped,
)
from distqa.errors import ConfigError

RESUME_RULES = ("silent", "applied")


def setting(default: Any, help: str, *, resume: str | None = None, finite: bool = True) -> Any:
    """A dataclass field with its help text (printed by `--help`, via `describe_keys`) and its rules.

    `resume` says what a change means when a run resumes from a checkpoint (read by
    `distqa.resume.resume_kind`, for the core's keys and a task's alike): "silent" (how the run is
    operated, nothing computed changes), "applied" (takes effect from the resume step on, with a
    warning); without it the change is refused (it changes the model, the data or the optimizer
    the checkpoint holds). A float setting must be finite unless declared `finite=False` (then
    +-inf is allowed, never nan). A dataclass as `default` is a section of settings; a list or a
    dict is copied for each instance.
    """
    if resume not in (None, *RESUME_RULES):
        raise ValueError(f"setting(resume={resume!r}): use one of {RESUME_RULES} or leave it out (refused)")
    metadata: dict[str, Any] = {"help": help}
    if resume is not None:
        metadata["resume"] = resume
    if not finite:
        metadata["finite"] = False
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return field(default_factory=default, metadata=metadata)
    if isinstance(default, list | dict):  # each instance its own copy (dataclasses refuse a shared one)
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelConfig:
    name: str = setting(
        "tiny",
        "'tiny', 'bert-base-random' or 'bert-large-random' (random BERTs built from a config, no "
        "download), a Hugging Face id, or a local folder",
    )
    tokenizer: str | None = setting(None, "tokenizer id or folder (default: model.name; none for 'tiny')")
    dropout: float | None = setting(
        None, "dropout for every dropout rate of the encoder (default: keep its own)", resume="applied"
    )
    attn_implementation: str | None = setting(
        None,
        "attention kernel: sdpa | eager | flash_attention_2 (default: SDPA where supported)",
        # Applied, not silent: the kernels round differently (eager against SDPA moved the tiny
        # model's weights by 3.7e-9 after a resume), so a resume with another is no exact continuation.
        resume="applied",
    )

    def __post_init__(self) -> None:
        check_fraction("model.dropout", self.dropout)
        check_attention(self.attn_implementation)


@dataclass
class DataConfig:
    # Applied, not refused: the same data at another path is fine (the fingerprint is compared on its own).
    train: str = setting(
        "dummy",
        "training data, as the task reads it: a file or folder (see the task's docs), or 'dummy' for the "
        "task's synthetic data",
        resume="applied",
    )
    valid: str | None = setting(None, "validation data, as the task reads it (default: none)", resume="silent")
    num_workers: int | None = setting(
        None,
        "DataLoader worker processes per rank (0 = load in the training process; "
        "default: this rank's share of the node's CPUs, less one, at most 8)",
        resume="silent",
    )
    timeout_s: float = setting(
        600.0,
        "seconds a rank waits for a batch from its DataLoader workers before it stops, naming the stall (a "
        "worker stuck reading an item: a stale network mount); 0 = wait for ever",
        resume="silent",
    )

    def __post_init__(self) -> None:
        # Whether the paths exist is checked where the task is known (`config_layers.check_data_paths`).
        if self.num_workers is not None:
            check_min("data.num_workers", self.num_workers, 0)
        check_min("data.timeout_s", self.timeout_s, 0)


@dataclass
class TrainConfig:
    # The run's length may change on resume: the schedule is rebuilt for the new length.
    max_steps: int = setting(-1, "optimizer steps to run; > 0 overrides train.epochs", resume="silent")
    epochs: int = setting(1, "passes over the training data (when train.max_steps <= 0)", resume="silent")
    # With the same global batch (compared on its own), another split over processes and micro-batches.
    batch_size: int = setting(
        8, "examples per micro-batch per process (train.parallel=dp: split over its GPUs)", resume="applied"
    )
    grad_accum: int = setting(1, "micro-batches accumulated per optimizer step", resume="applied")
    # Silent: what it changes, the global batch, is compared on its own.
    global_batch: int = setting(
        0,
        "examples per optimizer step over all processes; when > 0, train.grad_accum is derived from it, "
        "train.batch_size and the process count, so that the data order and the schedule stay the same "
        "when an elastic run loses or gains nodes",
        resume="silent",
    )
    parallel: str = setting(
        "ddp",
        "ddp (a whole model per process) | fsdp (FSDP2: weights, gradients and optimizer state sharded "
        "over the processes, for models one GPU cannot hold) | dp (torch.nn.DataParallel: one process "
        "splits each train.batch_size batch over all visible GPUs; CUDA only, one process, no "
        "train.ddp_comm_hook or train.compile; slower than ddp, for comparison)",
    )
    # The same arithmetic, recomputed.
    activation_checkpointing: bool = setting(
        False,
        "recompute each transformer block's activations in the backward pass instead of keeping them",
        resume="silent",
    )
    optimizer: str = setting("adamw", "adamw | sgd")
    lr: float = setting(3e-5, "peak learning rate", resume="applied")
    momentum: float = setting(0.0, "SGD momentum (train.optimizer=sgd only)", resume="applied")
    lr_schedule: str = setting("linear", "linear | constant | cosine, after warm-up", resume="applied")
    warmup_ratio: float = setting(
        0.1, "fraction of the steps spent warming the learning rate up from 0", resume="applied"
    )
    weight_decay: float = setting(
        0.01, "weight decay, decoupled (AdamW) or L2 (SGD); never on biases and LayerNorm weights", resume="applied"
    )
    max_grad_norm: float = setting(1.0, "clip the global gradient norm to this (0 = no clipping)", resume="applied")
    precision: str = setting("fp32", "fp32 | bf16 | fp16 (fp16 uses a gradient scaler)", resume="applied")
    # Applied, not silent: compiled code draws other dropout masks than eager (a resume that turned
    # it on moved the tiny model's weights by 2e-3 in 4 steps).
    compile: bool = setting(
        False, "torch.compile the model (faster steps on GPU after a compile warm-up)", resume="applied"
    )
    static_graph: bool = setting(
        True,
        "tell DDP the same parameters get gradients every step (not used with grad_accum > 1 or compile)",
        resume="silent",
    )
    find_unused_parameters: bool = setting(
        False,
        "let DDP find parameters a step did not use (a model with an unused head); costs a graph walk per step",
        resume="silent",
    )
    # Applied: the reduction's arithmetic changes from the resume step on (PowerSGD's state restarts).
    ddp_comm_hook: str = setting(
        "none",
        "gradient all-reduce: none (DDP's own, fp32) | fp16 | bf16 (16-bit: half the bytes; under "
        "train.parallel=fsdp the reduce-scatter dtype, grad_accum 1) | powersgd (low-rank, with error "
        "feedback; ddp, not fp16)",
        resume="applied",
    )
    powersgd_rank: int = setting(
        4, "rank of PowerSGD's gradient approximation (larger: closer, more bytes)", resume="applied"
    )
    powersgd_start_step: int = setting(
        10, "steps of plain all-reduce before PowerSGD begins (>= 2: DDP rebuilds its buckets first)", resume="applied"
    )
    # Silent: PowerSGD's state is kept per parameter, whatever bucket it lies in.
    bucket_cap_mb: float = setting(25.0, "MB of gradients per DDP all-reduce bucket", resume="silent")
    deterministic: bool = setting(
        False, "use deterministic kernels only (slower on GPU; CPU runs are already)", resume="silent"
    )
    checkpoint_every: int = setting(500, "save a checkpoint every N steps (and always at the end)", resume="silent")
    keep_checkpoints: int = setting(3, "keep the newest N checkpoints (0 = keep all)", resume="silent")
    term_grace_s: float = setting(
        30.0, "after SIGTERM: seconds the platform allows for the last checkpoint", resume="silent"
    )
    check_replicas: bool = setting(
        False,
        "check every step that all ranks hold the same parameters (else the steps that log or save)",
        resume="silent",
    )
    check_finite: bool = setting(
        False,
        "check every step that the weights are finite (by default only on the steps that log, save or export)",
        resume="silent",
    )
    log_every: int = setting(10, "log metrics every N steps", resume="silent")
    eval_every: int = setting(0, "evaluate on data.valid every N steps (0: only at the end)", resume="silent")
    resume: str = setting(
        "auto",
        "auto (newest usable checkpoint in output_dir) | never (start afresh; an earlier run's files are "
        "moved to output_dir/earlier-runs/) | a checkpoint folder",
        resume="silent",
    )
    allow_data_change: bool = setting(
        False,
        "resume even though the training data differs from the checkpoint's (length or fingerprint)",
        resume="silent",
    )
    # Applied: a changed metric starts its record afresh (the trainer compares it with the saved one).
    best_metric: str | None = setting(
        None,
        "keep the checkpoint with the best value of this evaluation metric (eval_KEY, e.g. eval_micro_f1) as "
        "checkpoints/best, never pruned; needs an evaluation (data.valid); default: none",
        resume="applied",
    )
    best_mode: str = setting(
        "auto",
        "auto | max | min: whether a higher or a lower train.best_metric is better; auto: as the task "
        "declares for that metric (metric_names), min for a name ending in 'loss', else refused",
        resume="applied",
    )

    def __post_init__(self) -> None:
        for key in ("epochs", "batch_size", "grad_accum", "checkpoint_every", "log_every"):
            check_min(f"train.{key}", getattr(self, key), 1)
        check_choice("train.parallel", self.parallel, ("ddp", "fsdp", "dp"))
        check_choice("train.optimizer", self.optimizer, ("adamw", "sgd"))
        check_parallel(self)
        check_choice("train.lr_schedule", self.lr_schedule, ("linear", "constant", "cosine"))
        check_choice("train.precision", self.precision, ("fp32", "bf16", "fp16"))
        check_min("train.lr", self.lr, 0.0, strict=True)
        check_fraction("train.momentum", self.momentum)
        if self.momentum and self.optimizer != "sgd":
            # AdamW's moments are its betas: a momentum it does not use would be a setting that
            # silently does nothing.
            raise ConfigError(
                f"train.momentum={self.momentum} applies to train.optimizer=sgd only (this run's is "
                f"{self.optimizer}): drop train.momentum, or set train.optimizer=sgd"
            )
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
        check_choice("train.best_mode", self.best_mode, ("auto", "max", "min"))
        if self.best_metric is not None and not self.best_metric.startswith("eval_"):
            raise ConfigError(
                f"train.best_metric={self.best_metric!r} must name an evaluation metric, eval_KEY (e.g. eval_micro_f1)"
            )
        check_fraction("train.warmup_ratio", self.warmup_ratio)
        if self.resume not in ("auto", "never") and not Path(self.resume).is_dir():
            raise ConfigError(
                f"train.resume={self.resume!r} is not auto, never, or an existing checkpoint folder: name an "
                "existing OUTPUT/checkpoints/step-N, or use train.resume=auto to continue output_dir's newest"
            )

    def resolve_global_batch(self, world_size: int) -> None:
        """Derive `grad_accum` from `global_batch` for this many processes (in place; no-op when
        unset), and check what FSDP makes of it."""
        if not self.global_batch:
            check_fsdp_run(self)
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
        check_fsdp_run(self)


@dataclass
class TaskSettings:
    """`task.name`, plus the selected task's own settings: a `Task` subclass declares them as a
    dataclass in its `Config` attribute, and `load_config` merges them in under `task.`."""

    name: str = setting("nq", "'nq', 'textcls' or 'package.module:TaskClass' (see docs/fork.md)")


# numpy's and the DataLoader's seeds are 32-bit: a seed outside fails deep inside the first step.
MAX_SEED = 2**32 - 1


@dataclass
class Config:
    output_dir: str = setting(
        "results/run", "folder for config.yaml, metrics, checkpoints and the final model", resume="silent"
    )
    seed: int = setting(42, f"seed for weights, data order, dropout and synthetic data (0..{MAX_SEED})")
    task: TaskSettings = setting(TaskSettings, "")
    model: ModelConfig = setting(ModelConfig, "")
    data: DataConfig = setting(DataConfig, "")
    train: TrainConfig = setting(TrainConfig, "")

    def __post_init__(self) -> None:
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed={self.seed} must be an integer in [0, {MAX_SEED}]")
        if not self.output_dir.strip():  # (an empty one wrote the run into the current folder)
            raise ConfigError("output_dir is empty: name the folder for the run (e.g. output_dir=results/run)")


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


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(escaped(dataclasses.asdict(cfg))))
