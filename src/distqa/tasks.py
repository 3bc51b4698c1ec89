"""Which class a `task.name` means, without importing torch where that can be avoided.

Built-in tasks have short names. Their settings classes live in modules that import no torch, so
that `distqa train --check-config` (and any configuration mistake) answers in well under a second;
a fork's `module:Class` task is imported to read its `Config`.
"""

from __future__ import annotations

import importlib
from typing import Any

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
