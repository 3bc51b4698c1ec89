"""The three layers of a run's settings: the defaults < a YAML file < `KEY=VALUE` overrides.

OmegaConf merges them against the schema (`distqa.config`), the selected task's own `task.*` keys
included, so an unknown key or a value of the wrong type is caught before anything runs, in one
line naming the key and where it was given. This module knows no task: the caller hands in the
lookup of a task's settings class (`distqa.registry.load_config` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from distqa.config import Config, TaskSettings, default_config
from distqa.config_checks import (
    check_floats,
    check_not_a_section,
    check_sections,
    raise_config_error,
    scalars_in,
    suggest,
    unknown_key,
)
from distqa.config_yaml import (
    bool_keys,
    check_bool,
    check_items,
    check_no_comment,
    check_text,
    check_yaml_number,
    check_yaml_numbers,
    container_of,
    item_keys,
    plain_scalars,
    text_keys,
)
from distqa.errors import ConfigError


def _read_yaml(path: str) -> DictConfig:
    if Path(path).is_dir():
        raise ConfigError(f"config file {path} is a folder: give --config a YAML file (e.g. configs/quickstart.yaml)")
    if Path(path).exists() and not Path(path).is_file():  # /dev/stdin, a pipe: read once, by one process
        raise ConfigError(
            f"config file {path} is not a regular file: every process reads the file (and it is read twice), "
            "so a pipe or a device would give them different settings: write the settings to a file"
        )
    if not Path(path).is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        layer = OmegaConf.load(path)
    except yaml.MarkedYAMLError as err:  # the problem and its place, not the parser's context line
        mark = err.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML: {err.problem or err.context}{where}") from err
    except OSError as err:  # its permissions: not a YAML problem (a review)
        raise ConfigError(f"config file {path} cannot be read ({err.strerror or err})") from err
    except Exception as err:  # yaml's other errors: report the file, not the internals
        raise ConfigError(f"config file {path} is not valid YAML: {str(err).splitlines()[0]}") from err
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"config file {path} is not a mapping of settings")
    if len(layer) == 0:  # a file cut to nothing, an empty ConfigMap: the defaults trained, exit 0
        raise ConfigError(
            f"config file {path} sets no settings (it is empty, or holds only comments): give the file that "
            "holds the run's settings (e.g. configs/bert-base.yaml), or no --config for the defaults"
        )
    dotted = next((key for key in layer if isinstance(key, str) and "." in key), None)
    if dotted is not None:  # `train.lr: 0.5`: YAML keys do not nest by dots
        section, _, rest = dotted.partition(".")
        raise ConfigError(
            f"config file {path} has the key '{dotted}': YAML nests keys by indenting, not by dots: "
            f"write '{section}:' and, indented on the line below it, '{rest}: VALUE'"
        )
    try:  # (task: ${oc.env:TASK}, resolved here, with TASK unset)
        if isinstance(layer.get("task"), str):  # `task: NAME`, the shorthand of `task: {name: NAME}`
            layer["task"] = {"name": layer["task"]}
    except OmegaConfBaseException as err:
        raise ConfigError(f"config file {path}: task: {str(err).splitlines()[0]}") from None
    _refuse_missing(layer, f"config file {path}")
    return layer


def _lookup(values: Any, key: str) -> Any:
    """The value at a dotted key of plain nested dicts, or None where the layer does not set it."""
    for part in key.split("."):
        if not isinstance(values, dict):
            return None
        values = values.get(part)
    return values


_NO_VALUE = ("", "~", "null", "Null", "NULL")


def _command_line_layer(item: str, text: dict[str, bool]) -> DictConfig:
    """One `KEY=VALUE` of the command line as a layer. A text key takes its value as typed, not
    what YAML makes of it: output_dir=010 is not 8, and `output_dir=runs/sweep #2` is not runs/sweep
    (YAML reads ` #2` as a comment: the run went on in another run's folder, exit 0), nor is
    `output_dir=runs/${model.name} #2` runs/tiny; an interpolation is resolved against the whole
    configuration, later. Quoted, the value is YAML's (the quotes go), and a value that opens a
    quote must close it last ('runs/x' #2 was runs/x); null, ~ or nothing is no value."""
    key, _, value = item.partition("=")
    typed = value.strip()
    if typed[:1] in ("'", '"') and (len(typed) < 2 or typed[-1] != typed[0]):
        raise ConfigError(
            f"{key}={value} on the command line starts with a quote and does not end with it: put all of it "
            "in one pair of quotes, or give it without them"
        )
    if key in text and typed[:1] not in ("'", '"'):
        if typed[:1] in ("[", "{"):  # YAML's list or mapping: [neg,pos] would be the texts '[neg' and 'pos]'
            raise ConfigError(
                f"{key}={value} on the command line is a YAML list or mapping, and {key} takes text: "
                "quote the value if it is meant as text"
            )
        layer = OmegaConf.create()
        OmegaConf.update(layer, key, None if typed in _NO_VALUE else typed, merge=False)
        return layer
    try:
        return OmegaConf.from_dotlist([item])
    except yaml.YAMLError as err:  # an unclosed quote or bracket, a stray alias or directive
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(
            f"{key}={value} on the command line is not valid YAML ({problem}): put all of it in one pair of "
            "quotes, or give it without them"
        ) from None


def _expand_home(merged: DictConfig, text: dict[str, bool]) -> None:
    """`~/` at the start of a text setting (a path) is the home folder, as a shell would make it:
    YAML and sh leave it, and the run went into a folder named `~` in the working directory while
    every line it printed read as the home folder (a review)."""
    for key in text:
        value = OmegaConf.select(merged, key, throw_on_resolution_failure=False)  # (a bad one: said below)
        if isinstance(value, str) and value.startswith("~/"):
            OmegaConf.update(merged, key, os.path.expanduser(value), merge=False)


def _refuse_missing(layer: DictConfig, source: str) -> None:
    """`???`, OmegaConf's mark of a value still to be filled in (a template's `data.train: ???`).
    Merged, it left the value before it in place: the defaults trained, on the DummyDataset and into
    results/run, exit 0 (a review)."""
    # (Read unresolved: an interpolation resolves against the whole configuration, later.)
    values = OmegaConf.to_container(layer, resolve=False)
    found = (key for name, value in values.items() for key, item in scalars_in(str(name), value) if item == "???")
    if missing := sorted(found):
        raise ConfigError(
            f"{source} leaves {missing[0]} as ??? (a value still to be filled in): give {missing[0]} a value"
        )


def _task_name(layer: DictConfig | None, items: list[str]) -> str:
    for item in reversed(items):
        if item.startswith("task.name="):  # read as any text key is: task.name='textcls' is textcls
            try:
                given = _command_line_layer(item, {"task.name": False})
                _refuse_missing(given, "the command line")
                name = OmegaConf.select(given, "task.name")
            except OmegaConfBaseException as err:  # task.name=${oc.env:TASK} with TASK unset
                raise ConfigError(f"{item} on the command line: {str(err).splitlines()[0]}") from None
            return "" if name is None else str(name)
    if layer is not None and isinstance(layer.get("task"), DictConfig) and "name" in layer["task"]:
        try:
            return str(layer["task"]["name"])
        except OmegaConfBaseException as err:  # name: ${oc.env:TASK} in the file, with TASK unset
            raise ConfigError(f"task.name in the config file: {str(err).splitlines()[0]}") from None
    return TaskSettings().name


def _check_file(
    layer: DictConfig, path: str, defaults: Config, text: dict[str, bool], switches: set[str], items_of: dict[str, type]
) -> None:
    """What YAML made of the file's values, where OmegaConf's merge would not say: a section that
    is no mapping, a text or a switch read as something else, a number in another base. (`text`,
    `switches`, `items_of`: the schema's text, switch and list-or-mapping keys, `load_config`'s.)"""
    values, source = OmegaConf.to_container(layer), f"config file {path}"
    check_sections(values, defaults, path)
    for key, optional in text.items():
        check_text(key, _lookup(values, key), optional, source)
    for key in switches:
        check_bool(key, _lookup(values, key), source)
    for key, kind in items_of.items():
        check_items(key, _lookup(values, key), kind, source)
    with contextlib.suppress(yaml.YAMLError, OSError, UnicodeDecodeError):  # OmegaConf read it: so does yaml
        for key, raw in plain_scalars(yaml.compose(Path(path).read_text(encoding="utf-8"))):
            if key not in text and container_of(key, items_of) is None:
                check_yaml_number(key, raw, source)


def load_config(
    path: str | None,
    overrides: Sequence[str] = (),
    *,
    settings_of: Callable[[str], type],
    data_paths: bool = True,
) -> Config:
    """Defaults < YAML file < `key=value` overrides, checked against the schema; with `data_paths`,
    data.train and data.valid must exist (a command that reads neither, `distqa prepare`, says False).

    The task is found first (`task.name`, or the shorthand `task=NAME`), so that its own settings
    (`settings_of(name)`: its `Config` dataclass) are typed and checked like every other key. This
    module knows no task: the caller hands the lookup in (`distqa.registry.load_config` does).
    """
    layer = _read_yaml(path) if path is not None else None
    items = []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form KEY=VALUE{suggest(item, [])}")
        key, _, value = item.partition("=")
        items.append(f"task.name={value}" if key == "task" else item)
    defaults = default_config(settings_of(_task_name(layer, items)))
    known = [k for k, _, _ in describe_keys(defaults)]
    renamed = renamed_keys(defaults)
    merged = OmegaConf.structured(defaults)
    text, switches, items_of = text_keys(defaults), bool_keys(defaults), item_keys(defaults)
    if layer is not None:
        _check_file(layer, str(path), defaults, text, switches, items_of)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            raise_config_error(err, str(path), known, renamed)
    for item in items:
        key, _, value = item.partition("=")
        check_not_a_section(key, known)
        if key not in text:  # (a text key's value is taken as typed: output_dir=010 is the folder 010)
            check_no_comment(key, value)
            if container_of(key, items_of) is None:
                check_yaml_numbers(key, value, "the command line", items_of)
        try:
            override = _command_line_layer(item, text)
            _refuse_missing(override, "the command line")
            if key in text and "${" not in value:  # an interpolation resolves later
                check_text(key, OmegaConf.select(override, key), text[key], "the command line")
            if key in switches and "${" not in value:  # an interpolation resolves later
                check_bool(key, OmegaConf.select(override, key), "the command line")
            if (container := container_of(key, items_of)) is not None:  # (each item's interpolation resolves later)
                check_items(
                    key, _lookup(OmegaConf.to_container(override), key), items_of[container], "the command line"
                )
            merged = OmegaConf.merge(merged, override)
        except ConfigKeyError as err:
            # OmegaConf names only the first unknown part (`trian`); the key as typed says more.
            raise unknown_key(item.partition("=")[0], "the command line", known, renamed) from err
        except OmegaConfBaseException as err:
            raise_config_error(err, "the command line", known, renamed)
    try:
        # An interpolation (train.compile=${oc.env:COMPILE}) is checked for what it gives: its text,
        # resolved outside the schema, which would have made a switch of "2" already.
        check_floats(OmegaConf.to_container(merged, resolve=True), defaults)
        given = OmegaConf.to_container(OmegaConf.create(OmegaConf.to_container(merged)), resolve=True)
        for key in switches:
            check_bool(key, _lookup(given, key), "the configuration")
        for key, kind in items_of.items():  # a switch's item that an interpolation gave
            if kind is bool:
                check_items(key, _lookup(given, key), bool, "the configuration")
        _expand_home(merged, text)
        cfg = OmegaConf.to_object(merged)  # instantiates the dataclasses: runs every __post_init__
    except OmegaConfBaseException as err:
        if isinstance(err.__cause__, ConfigError):
            raise err.__cause__ from None
        raise_config_error(err, "the configuration", known, renamed)
    assert isinstance(cfg, Config)
    check_best_metric(cfg)
    if data_paths:
        check_data_paths(cfg)
    return cfg


def check_best_metric(cfg: Config) -> None:
    """train.best_metric is one the task reports, where its settings class says which
    (`metric_names`): a misspelt name would fail at the first evaluation, hours into a run. And
    train.best_mode=auto becomes the direction in which that metric improves (`best_direction`)."""
    names, directions = metric_directions(type(cfg.task))
    metric = cfg.train.best_metric
    if metric is None:
        return
    if names and metric not in names:
        close = difflib.get_close_matches(metric, names, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        reported = ", ".join(names)
        raise ConfigError(f"train.best_metric={metric!r} is not a metric this task reports{hint}: one of {reported}")
    if cfg.train.best_mode == "auto":
        cfg.train.best_mode = best_direction(metric, directions)


def metric_directions(settings: type) -> tuple[tuple[str, ...], dict[str, str | None]]:
    """A task's `metric_names` (a ClassVar of its settings class): the eval_* keys it reports, and
    the direction of those it declares one for. It may map each key to the way it improves, "max"
    or "min" (None: no score, e.g. a threshold the evaluation chose), or be a plain sequence of
    names, whose directions are then unknown."""
    names = getattr(settings, "metric_names", ())
    if not isinstance(names, dict):
        return tuple(names), {}
    for name, direction in names.items():
        if direction not in ("max", "min", None):
            raise ConfigError(
                f"{settings.__name__}.metric_names gives {name!r} the direction {direction!r}: use 'max' "
                "(higher is better), 'min' (lower is better) or None (not a score)"
            )
    return tuple(names), dict(names)


def best_direction(metric: str, directions: dict[str, str | None]) -> str:
    """The direction of train.best_mode=auto. A guess would keep the worst checkpoint as `best`
    (the old default, max, did so for eval_loss, exit 0), so only what is known decides: the
    task's declaration, or a loss (lower is better, as Hugging Face's Trainer also assumes)."""
    if metric in directions:
        direction = directions[metric]
        if direction is None:
            raise ConfigError(
                f"train.best_metric={metric!r} is no score this task improves (its metric_names give it no "
                "direction): pick another metric, or set train.best_mode=max or min if you mean it"
            )
        return direction
    if metric.endswith("loss"):
        return "min"
    raise ConfigError(
        f"train.best_metric={metric!r}: the task does not say whether a higher or a lower value is better "
        "(its settings' metric_names give no direction): set train.best_mode=max or train.best_mode=min"
    )


def check_data_paths(cfg: Config) -> None:
    """data.train and data.valid exist, or the one missing is named with what to do instead, as
    fits the key and the task: synthetic data only where the task has some."""
    # Never fall back to dummy data silently: a typo would train on noise for hours.
    hints = dict(getattr(type(cfg.task), "missing_data_hints", {}))
    if hasattr(cfg.task, "ensure_dummy_examples"):  # the mark of a task with synthetic data
        hints.setdefault("data.train", "use data.train=dummy for synthetic data")
    hints.setdefault("data.train", "check the path: this task has no synthetic data")
    hints.setdefault("data.valid", "set data.valid= (empty) to train without validation")
    for key, value in (("data.train", cfg.data.train), ("data.valid", cfg.data.valid)):
        if value not in (None, "dummy") and not Path(value).exists():  # the task says what dummy means
            # A relative path is looked up from where the command runs, which is not always the project.
            where = "" if Path(value).is_absolute() else f" in {Path.cwd()}"
            raise ConfigError(f"{key}={value!r} does not exist{where} ({hints[key]})")


def check_training_data(cfg: Config) -> None:
    """`distqa train` only (an export builds the task with data.train=dummy and reads no data): the
    default data.train=dummy, for a task whose settings say it has no synthetic data
    (`no_synthetic_data = True`, a ClassVar), is refused here, before any model loads. (Not every
    task without `ensure_dummy_examples` says so: a fork may make its own data whatever data.train.)"""
    if cfg.data.train == "dummy" and getattr(type(cfg.task), "no_synthetic_data", False):
        raise ConfigError(
            f"data.train=dummy: task.name={cfg.task.name} has no synthetic data; give a file of its training data"
        )


def renamed_keys(cfg: Config) -> dict[str, str]:
    """Old full key -> new full key, for keys that were renamed: a task's settings class may say
    `renamed_keys: ClassVar[dict[str, str]] = {"data.max_seq_len": "task.max_seq_len"}`. An old
    name is refused like any unknown key, with the new name in the error."""
    return dict(getattr(type(cfg.task), "renamed_keys", {}))


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


def setting_field(cfg: Config, key: str) -> dataclasses.Field | None:
    """The dataclass field behind a dotted key of `cfg` (its metadata holds the help and the rules
    of `setting`); an entry of a dict setting (task.weights.pos) is its setting's field; None for a
    key `cfg` does not have."""
    node: Any = cfg
    found: dataclasses.Field | None = None
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return found if isinstance(node, dict) else None
        found = next((f for f in dataclasses.fields(node) if f.name == part), None)
        if found is None:
            return None
        node = getattr(node, part, None)
    return found
