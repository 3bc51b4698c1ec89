"""The task settings a model was trained with, written beside its export and read back by the
commands that run it (`distqa predict`): they must build their inputs the same way (windows of
task.max_seq_len tokens, ...), and a wrong window length gives a plausible, wrong result rather
than an error. `distqa.task` re-exports these names: they are part of the seam forks use."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import sys
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from distqa.config_checks import scalars_in
from distqa.errors import ConfigError, DistqaError

if TYPE_CHECKING:  # for hints only
    from distqa.config import Config as RunConfig

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


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook for files distqa writes: of `{"max_seq_len": 128, "max_seq_len": 64}`
    json keeps the last without a word, and such a file was edited by hand or damaged."""
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"the key {next(k for k in keys if keys.count(k) > 1)!r} is given twice")
    return dict(pairs)


def read_task_settings(directory: Path) -> dict[str, Any] | None:
    """The `task.*` settings saved with an exported model; None for an export without them (an older distqa)."""
    path = Path(directory) / SETTINGS_FILE
    if not path.exists() and not path.is_symlink():  # (a folder or a broken link is read, and refused)
        return None
    try:
        text = path.read_text(encoding="utf-8")
        record = json.loads(text, parse_constant=_no_constants, object_pairs_hook=unique_keys)
    except (OSError, ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise DistqaError(f"{path} cannot be read ({str(err).splitlines()[0]}): {_FIX}") from err
    if not isinstance(record, dict) or not isinstance(record.get("task"), dict):
        raise DistqaError(f"{path} holds no 'task' mapping of settings: {_FIX}")
    if not isinstance(record["task"].get("name", ""), str):
        raise DistqaError(f"{path}: its task name {record['task']['name']!r} is not a name: {_FIX}")
    if record.get("format") != SETTINGS_FORMAT:
        raise DistqaError(
            f"{path} is of format {record.get('format')!r}, this distqa reads format {SETTINGS_FORMAT}: "
            "run the model with the distqa version that exported it"
        )
    return record["task"]


COMMAND_LINE = "the command line"


def given_task_keys(config_path: str | None, overrides: Collection[str]) -> dict[str, str]:
    """The `task.*` keys (without the prefix) that a command's --config file and KEY=VALUE overrides
    set, `task=NAME` included, each with where its value comes from: COMMAND_LINE, or the file's
    path (a key in both takes the command line's value). Call it after `load_config` has accepted
    both."""
    given: dict[str, str] = {}
    layer = OmegaConf.load(config_path) if config_path is not None else None
    if isinstance(layer, DictConfig):
        task = layer.get("task")
        if isinstance(task, str):  # the shorthand `task: NAME`
            given["name"] = str(config_path)
        elif isinstance(task, DictConfig):
            given.update((str(key), str(config_path)) for key in task)
    for item in overrides:
        key = item.partition("=")[0]
        if key == "task":
            given["name"] = COMMAND_LINE
        elif key.startswith("task."):
            given[key[5:].split(".")[0]] = COMMAND_LINE
    return given


def _differs(key: str, mine: str, trained: str, directory: Path, given: Collection[str]) -> None:
    """A given `task.{key}` that is not the trained value: used, with one warning line, when typed
    on the command line (a deliberate choice); refused when it comes from a --config file. Such a
    file is most often the training run's, without the command line's overrides of that run: its
    value would build other windows than training's for a plausible, wrong submission."""
    where = given.get(key, COMMAND_LINE) if isinstance(given, Mapping) else COMMAND_LINE
    if where != COMMAND_LINE:
        raise DistqaError(
            f"task.{key}={mine} in {where} is not the task.{key}={trained} the model in {directory} was "
            f"trained with: leave task.{key} out of the file to use the trained value, or give "
            f"task.{key}={mine} on the command line to use this one"
        )
    _warn(
        f"task.{key}={mine} was given but the model in {directory} was trained with "
        f"task.{key}={trained}: using {mine} (leave task.{key} out to use the trained value)"
    )


def _check_float(key: str, value: Any, field: dataclasses.Field) -> None:
    """A float from the file is a number, as on the command line, a list's or mapping's items too:
    never nan, and +-inf only for a setting declared `setting(..., finite=False)`."""
    for item_key, item in scalars_in(f"task.{key}", value):
        if isinstance(item, float) and not math.isfinite(item):
            if math.isnan(item) or field.metadata.get("finite") is not False:
                raise ConfigError(f"{item_key}={item} is not a finite number")


def with_trained_settings(cfg: RunConfig, directory: Path, given: Collection[str] = ()) -> RunConfig:
    """`cfg` (changed in place) with the `task.*` settings the model in `directory` was trained with,
    for a command that runs an exported model. A key in `given` (set by the user: `given_task_keys`)
    keeps its value, with one warning line when it differs from the trained one, or is refused
    when that value comes from a --config file (`_differs`). Settings that may
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
        _differs("name", cfg.task.name, trained_name, directory, given)
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
            _differs(key, _shown(getattr(cfg.task, key)), _shown(value), directory, given)
    lacking = [key for key in model_keys if key not in saved and key not in given]
    if lacking:  # (an export of a distqa that had fewer settings; or an edited file, refused by its hash)
        _warn(
            f"{path} does not hold "
            + ", ".join(f"task.{k}" for k in lacking)
            + ": using "
            + ", ".join(f"task.{k}={_shown(getattr(cfg.task, k))}" for k in lacking)
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
