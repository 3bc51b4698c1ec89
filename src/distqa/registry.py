"""The task registry: which class a `task.name` means, without importing torch where that can be avoided.

Built-in tasks have short names. Their settings classes live in modules that import no torch, so
that `distqa train --check-config` (and any configuration mistake) answers in well under a second;
a fork's `module:Class` task is imported to read its `Config`.

The registry sits above the configuration: `distqa.config` and `distqa.config_layers` know no
task, and `load_config` here hands them the lookup of a task's settings (`settings_class`). The
built-in tasks are named by strings and imported on demand, so that no core module imports a
task's package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from distqa import config_layers
from distqa.config import Config
from distqa.errors import ConfigError

if TYPE_CHECKING:
    from distqa.task import Task

BUILTIN_TASKS = {"nq": "distqa.nq.task:NQTask", "textcls": "distqa.textcls.task:TextClsTask"}
BUILTIN_SETTINGS = {
    "nq": "distqa.nq.settings:NQSettings",
    "textcls": "distqa.textcls.settings:TextClsSettings",
}
# The commands each built-in task adds to `distqa`, importable without torch: `add(commands, add_settings)`
# as `Task.add_commands` (which is how a fork's task brings its own).
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


def task_class(name: str) -> type[Task]:
    """The `Task` subclass `name` selects (a built-in short name or 'module:Class')."""
    from distqa.task import Task  # imports torch: only when a task is really built

    found = _import(name, BUILTIN_TASKS.get(name, name))
    if not (isinstance(found, type) and issubclass(found, Task)):
        raise ConfigError(f"task.name={name!r}: {found!r} is not a distqa.task.Task subclass")
    return found


def add_task_commands(name: str, commands: Any, add_settings: Callable[..., None]) -> None:
    """Add task `name`'s own `distqa` commands to `commands` (argparse's subparsers): a built-in
    task's from its commands module (no torch), a fork's from its class (`Task.add_commands`)."""
    if name in BUILTIN_COMMANDS:
        _import(name, BUILTIN_COMMANDS[name])(commands, add_settings)
    elif name not in BUILTIN_TASKS:
        task_class(name).add_commands(commands, add_settings)


def settings_class(name: str) -> type:
    """The dataclass of the task's own settings (`task.*` keys besides `task.name`)."""
    if name in BUILTIN_SETTINGS:
        return _import(name, BUILTIN_SETTINGS[name])
    return task_class(name).Config


def load_config(path: str | None = None, overrides: Sequence[str] = (), *, data_paths: bool = True) -> Config:
    """`distqa.config_layers.load_config` with the task's settings looked up here: defaults < YAML
    file < `key=value` overrides, the selected task's own `task.*` keys typed and checked like the rest
    (`data_paths=False`: whether data.train and data.valid exist is left unchecked)."""
    return config_layers.load_config(path, overrides, settings_of=settings_class, data_paths=data_paths)


def load_task(cfg: Config) -> Task:
    """Instantiate the task named by `cfg.task.name` ("nq", "textcls" or "package.module:ClassName")."""
    from distqa.task import check_collate_used

    task = task_class(cfg.task.name)(cfg)
    check_collate_used(task)
    return task
