"""Which class a `task.name` means, without importing torch where that can be avoided.

Built-in tasks have short names. `moved_to_task` reads the keys that became a task's own under
their old `data.*` names. Their settings classes live in modules that import no torch, so
that `distqa train --check-config` (and any configuration mistake) answers in well under a second;
a fork's `module:Class` task is imported to read its `Config`.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from omegaconf import DictConfig

from distqa.errors import ConfigError

BUILTIN_TASKS = {"nq": "distqa.nq.task:NQTask", "textcls": "distqa.textcls.task:TextClsTask"}
BUILTIN_SETTINGS = {
    "nq": "distqa.nq.settings:NQSettings",
    "textcls": "distqa.textcls.settings:TextClsSettings",
}
# The commands each built-in task adds to `distqa` (its Task.add_commands), importable without torch.
BUILTIN_COMMANDS = {"nq": "distqa.nq.commands:add_commands"}


def _import(name: str, target: str) -> Any:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"task.name={name!r} is neither one of {sorted(BUILTIN_TASKS)} nor 'module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"task.name={name!r}: cannot import module {module_name!r} ({err})") from err
    found = getattr(module, attr, None)
    if found is None:
        raise ConfigError(f"task.name={name!r}: {module_name} has nothing named {attr!r}")
    return found


def task_class(name: str) -> type:
    """The `Task` subclass `name` selects (a built-in short name or 'module:Class')."""
    from distqa.task import Task  # imports torch: only when a task is really built

    found = _import(name, BUILTIN_TASKS.get(name, name))
    if not (isinstance(found, type) and issubclass(found, Task)):
        raise ConfigError(f"task.name={name!r}: {found!r} is not a distqa.task.Task subclass")
    return found


def settings_class(name: str) -> type:
    """The dataclass of the task's own settings (`task.*` keys besides `task.name`)."""
    if name in BUILTIN_SETTINGS:
        return _import(name, BUILTIN_SETTINGS[name])
    return task_class(name).Config


def moved_to_task(moved: set[str], layer: Any, items: list[str]) -> tuple[Any, list[str]]:
    """Natural Questions' data keys became the task's own (`data.max_seq_len` is `task.max_seq_len`).
    Old commands and YAML files keep working: a `data.KEY` with KEY in `moved` (the selected task's
    keys that `data` has not, whichever the task) is read as `task.KEY`, with a warning naming the
    new key (once per run: rank 0 or a single process). Both names in one layer (the command line,
    or the YAML file) are refused; across layers the command line wins, as for any key.
    `layer`: the YAML file's OmegaConf mapping, or None."""
    said: list[str] = []
    in_items = {item.partition("=")[0] for item in items}
    renamed = []
    for item in items:
        key, _, value = item.partition("=")
        if key.startswith("data.") and key[5:] in moved:
            if f"task.{key[5:]}" in in_items:
                raise ConfigError(_both(key[5:], "the command line"))
            said.append(key[5:])
            item = f"task.{key[5:]}={value}"
        renamed.append(item)
    data = layer.get("data") if layer is not None else None
    if isinstance(data, DictConfig) and any(key in moved for key in data):
        if not isinstance(layer.get("task"), DictConfig):
            layer["task"] = {}
        for key in [k for k in data if k in moved]:
            if key in layer["task"]:
                raise ConfigError(_both(str(key), "the config file"))
            said.append(str(key))
            layer["task"][key] = data.pop(key)
    if said and os.environ.get("RANK", "0") == "0":
        names = ", ".join(f"data.{k} is now task.{k}" for k in dict.fromkeys(said))
        print(f"distqa: warning: {names}: read as the new name(s); the old ones will go", file=sys.stderr)
    return layer, renamed


def _both(key: str, where: str) -> str:
    return f"data.{key} is the old name of task.{key}, and {where} sets both: keep task.{key} only"
