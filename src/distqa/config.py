"""Typed configuration: nested dataclasses, a YAML file, then `key=value` overrides.

OmegaConf merges the three layers against the dataclass schema, so an unknown key or a value of the
wrong type is caught before anything runs; range and choice checks live in `__post_init__`. Every
field carries a one-line `help` that `distqa train --help` prints, so the schema is the reference.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from distqa.errors import ConfigError


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with its help text attached (read by `describe_keys`)."""
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return field(default_factory=default, metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}")


def _check_min(key: str, value: float, low: float, *, strict: bool = False) -> None:
    if value < low or (strict and value == low):
        raise ConfigError(f"{key}={value} must be {'>' if strict else '>='} {low}")


@dataclass
class ModelConfig:
    name: str = _f(
        "tiny",
        "'tiny' or 'bert-base-random' (random BERTs built from a config, no download), "
        "a Hugging Face id, or a local folder",
    )
    tokenizer: str | None = _f(None, "tokenizer id or folder (default: model.name; none for 'tiny')")
    dropout: float | None = _f(None, "dropout for every dropout rate of the encoder (default: keep its own)")
    attn_implementation: str | None = _f(
        None, "attention kernel: sdpa | eager | flash_attention_2 (default: SDPA where supported)"
    )

    def __post_init__(self) -> None:
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")


@dataclass
class DataConfig:
    train: str = _f("dummy", "'dummy' (DummyDataset), an NQ JSONL file, or a folder `distqa prepare` wrote")
    valid: str | None = _f(None, "validation data, as data.train (default: none)")
    max_seq_len: int = _f(512, "tokens per input sequence, special tokens included")
    doc_stride: int = _f(128, "document tokens between the starts of two windows (at most a window's length)")
    max_query_len: int = _f(64, "question tokens kept (the rest is cut)")
    keep_unknown: float = _f(0.02, "fraction of training windows without the answer that are kept")
    skip_bad_lines: bool = _f(False, "skip (and count) malformed JSONL lines instead of stopping")
    cache_dir: str | None = _f(None, "where prepared features are cached (default: HF_HOME/distqa/features)")
    dummy_size: int = _f(4096, "number of examples in the DummyDataset")
    num_workers: int | None = _f(
        None,
        "DataLoader worker processes per rank (0 = load in the training process; "
        "default: this rank's share of the node's CPUs, less one, at most 8)",
    )

    def __post_init__(self) -> None:
        _check_min("data.max_seq_len", self.max_seq_len, 8)
        _check_min("data.dummy_size", self.dummy_size, 1)
        if self.num_workers is not None:
            _check_min("data.num_workers", self.num_workers, 0)
        _check_min("data.doc_stride", self.doc_stride, 1)
        _check_min("data.max_query_len", self.max_query_len, 1)
        if not 0.0 <= self.keep_unknown <= 1.0:
            raise ConfigError(f"data.keep_unknown={self.keep_unknown} must be in [0, 1]")
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
    deterministic: bool = _f(False, "use deterministic kernels only (slower on GPU; CPU runs are already)")
    checkpoint_every: int = _f(500, "save a checkpoint every N steps (and always at the end)")
    keep_checkpoints: int = _f(3, "keep the newest N checkpoints (0 = keep all)")
    term_grace_s: float = _f(30.0, "after SIGTERM: seconds the platform allows for the last checkpoint")
    check_replicas: bool = _f(False, "debug: check every step that all ranks hold identical parameters")
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
            _check_min(f"train.{key}", getattr(self, key), 1)
        _check_choice("train.optimizer", self.optimizer, ("adamw", "sgd"))
        _check_choice("train.lr_schedule", self.lr_schedule, ("linear", "constant", "cosine"))
        _check_choice("train.precision", self.precision, ("fp32", "bf16", "fp16"))
        _check_min("train.lr", self.lr, 0.0, strict=True)
        _check_min("train.momentum", self.momentum, 0.0)
        _check_min("train.weight_decay", self.weight_decay, 0.0)
        _check_min("train.max_grad_norm", self.max_grad_norm, 0.0)
        _check_min("train.eval_every", self.eval_every, 0)
        _check_min("train.keep_checkpoints", self.keep_checkpoints, 0)
        _check_min("train.term_grace_s", self.term_grace_s, 0.0, strict=True)
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"train.warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        if self.resume not in ("auto", "never") and not Path(self.resume).is_dir():
            raise ConfigError(f"train.resume={self.resume!r} is not auto, never, or an existing checkpoint folder")


@dataclass
class Config:
    output_dir: str = _f("results/run", "folder for config.yaml, metrics, checkpoints and the final model")
    seed: int = _f(42, "seed for weights, data order, dropout and the DummyDataset")
    task: str = _f("nq", "'nq' or 'package.module:TaskClass' (see README, 'Fork it')")
    model: ModelConfig = _f(ModelConfig, "")
    data: DataConfig = _f(DataConfig, "")
    train: TrainConfig = _f(TrainConfig, "")


def describe_keys(schema: type = Config, prefix: str = "") -> Iterator[tuple[str, Any, str]]:
    """Yield (dotted key, default, help) for every leaf of the schema, in declaration order."""
    defaults = schema()
    for f in dataclasses.fields(schema):
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            yield from describe_keys(type(value), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value, f.metadata.get("help", "")


def _suggest(key: str) -> str:
    known = [k for k, _, _ in describe_keys()]
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _raise_config_error(err: OmegaConfBaseException, source: str) -> None:
    key = getattr(err, "full_key", None) or "?"
    if isinstance(err, ConfigKeyError):
        raise ConfigError(f"unknown config key '{key}' in {source}{_suggest(key)}") from err
    # OmegaConf's own message names the expected type and the value it got; keep its first line.
    detail = str(err).splitlines()[0]
    raise ConfigError(f"bad value for '{key}' in {source}: {detail}") from err


def load_config(path: str | None = None, overrides: tuple[str, ...] | list[str] = ()) -> Config:
    """Defaults < YAML file < `key=value` overrides, checked against the schema."""
    merged = OmegaConf.structured(Config)
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            layer = OmegaConf.load(path)
        except Exception as err:  # yaml's many parser errors: report the file, not the internals
            raise ConfigError(f"config file {path} is not valid YAML: {str(err).splitlines()[0]}") from err
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            _raise_config_error(err, path)
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form KEY=VALUE{_suggest(item)}")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as err:
            _raise_config_error(err, "the command line")
    try:
        cfg = OmegaConf.to_object(merged)  # instantiates the dataclasses: runs every __post_init__
    except OmegaConfBaseException as err:
        if isinstance(err.__cause__, ConfigError):
            raise err.__cause__ from None
        _raise_config_error(err, "the configuration")
    assert isinstance(cfg, Config)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
