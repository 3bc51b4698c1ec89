"""`distqa new-task NAME [--dir DIR]`: write a working task to start a fork from.

    DIR/NAME/{__init__,settings,data,task,metric}.py   the task (a classifier of short texts)
    DIR/NAME/sample_train.csv, sample_valid.csv         its example data
    tests/test_NAME.py                                  2 processes train, resume exactly, export
    configs/NAME.yaml                                   `distqa train --config configs/NAME.yaml`

tests/ and configs/ are those of the current folder, the project's root. DIR defaults to src/, the
folder a project installed with `pip install -e .` imports from, so the task is `NAME.task:...`;
in a package folder (src/distqa) it is that package's subpackage.

The files come from the templates beside this module (`templates/*.tmpl`, plain files with
`{{placeholders}}`, so that the generated code reads as code, not as string literals in a writer).
Every file is new: when any target exists nothing is written, so a NAME typed twice never
overwrites a task, a test or a config. Imports no torch: writing files needs none.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import importlib.util
import io
import keyword
import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from distqa.errors import DistqaError

DEFAULT_DIR = "src"

# The task's package: file written -> template. tests/ and configs/ get one file each.
PACKAGE_FILES = {
    "__init__.py": "package_init.py.tmpl",
    "settings.py": "settings.py.tmpl",
    "data.py": "data.py.tmpl",
    "metric.py": "metric.py.tmpl",
    "task.py": "task.py.tmpl",
}
SAMPLES = {"sample_train.csv": (48, 1), "sample_valid.csv": (16, 2)}  # file -> (rows, seed)


@dataclass(frozen=True)
class NewTask:
    """Where a new task goes and the names it gets."""

    name: str  # NAME: the package's name, test_NAME.py, NAME.yaml
    package: Path  # DIR/NAME
    module: str  # the package's dotted name, as task.name imports it
    test: Path  # ROOT/tests/test_NAME.py
    config: Path  # ROOT/configs/NAME.yaml

    @property
    def camel(self) -> str:
        """NAME in CamelCase, the start of its classes' names (my_task: MyTask)."""
        return "".join(part[:1].upper() + part[1:] for part in self.name.split("_")) or "New"

    @property
    def class_name(self) -> str:
        """The Task subclass: my_task gives MyTask, demo DemoTask."""
        return self.camel if self.camel.endswith("Task") else self.camel + "Task"

    @property
    def command(self) -> str:
        """The task's own `distqa` command, as commands are typed (my_task: my-task-predict)."""
        return (self.name.strip("_") or "task").lower().replace("_", "-") + "-predict"


def import_root(directory: Path) -> Path:
    """The folder that must be on sys.path for `directory`'s modules to import: `directory` itself,
    or, when it is a package (holds __init__.py), the folder above its outermost package."""
    folder = directory.resolve()
    while (folder / "__init__.py").is_file():
        folder = folder.parent
    return folder


def _package_of(directory: Path) -> str:
    """The dotted name of the package `directory` is (src/distqa: "distqa"), or "" for a plain folder
    whose subfolders are top-level packages (src/)."""
    return ".".join(directory.resolve().relative_to(import_root(directory)).parts)


def _existing_module(module: str) -> str | None:
    """Where `module` already comes from when this Python can import it (None: it cannot)."""
    importlib.invalidate_caches()
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a parent package that does not import: nothing to shadow
        return None
    return None if spec is None else str(spec.origin or next(iter(spec.submodule_search_locations or []), module))


MAX_NAME = 100


def plan(name: str, directory: str | Path, root: Path) -> NewTask:
    """Check NAME and the targets; one error line for the first problem, before anything is written."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise DistqaError(
            f"NAME {name!r} is not a Python identifier (letters, digits and _, not a digit first, "
            "not a keyword): it names the task's package; choose one like my_task"
        )
    if len(name) > MAX_NAME:  # file names (test_NAME.py) stop at 255 bytes on most file systems
        raise DistqaError(f"NAME is {len(name)} characters long: at most {MAX_NAME}, as it names files and a package")
    folder = Path(directory)
    if not folder.is_dir():
        raise DistqaError(
            f"--dir {folder} is not a folder: run `distqa new-task` in the project's root (where src/ is) or give --dir"
        )
    prefix = _package_of(folder)
    task = NewTask(
        name=name,
        package=folder / name,
        module=f"{prefix}.{name}" if prefix else name,
        test=root / "tests" / f"test_{name}.py",
        config=root / "configs" / f"{name}.yaml",
    )
    for target in (task.package, folder / f"{name}.py", task.test, task.config):
        if target.exists():
            raise DistqaError(f"{target} exists: new-task never overwrites; choose another NAME or move it away")
    found = _existing_module(task.module)
    if found is not None:
        raise DistqaError(f"NAME {name!r}: module {task.module} already exists ({found}): choose another NAME")
    return task


def _shown(path: Path, root: Path) -> str:
    """`path` as the config and the messages give it: relative to the project's root when inside it."""
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.resolve().as_posix()


def _yaml_scalar(text: str) -> str:
    # A path of plain characters as it is; anything else as a JSON string, which YAML reads alike.
    return text if re.fullmatch(r"[\w./-]+", text) else '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render(template: str, values: dict[str, str]) -> str:
    text = (resources.files(__package__) / "templates" / template).read_text(encoding="utf-8")
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    leftover = re.search(r"\{\{\w+\}\}", text)
    assert leftover is None, f"{template}: no value for {leftover.group()}"  # a template bug, not the user's
    return text


def sample_csv(rows: int, seed: int) -> str:
    """`rows` short reviews, half of each class, the same for every run (a seeded generator): a class
    shows in its words. Data for checking the pipeline, not the model: the random `tiny` model mostly
    memorises 48 rows, and its validation accuracy stays near chance at the config's 24 steps
    (0.69 after 120 steps at train.lr=3e-4 without dropout); a real data set and a pretrained
    model.name are what make the accuracy mean something."""
    words = {
        "positive": ["good", "great", "lovely", "superb", "pleasant", "fine"],
        "negative": ["bad", "awful", "dull", "poor", "boring", "terrible"],
    }
    things = ["film", "book", "meal", "song", "trip", "game", "show", "hotel"]
    shapes = [
        "the {t} was {w}",
        "a truly {w} {t}",
        "{w} {t}, {w2} too",
        "such {w} {t}s overall",
        "really {w}, this {t}",
    ]
    rng = random.Random(seed)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["text", "label"])
    for i in range(rows):
        label = ("negative", "positive")[i % 2]
        text = rng.choice(shapes).format(w=rng.choice(words[label]), w2=rng.choice(words[label]), t=rng.choice(things))
        writer.writerow([text, label])
    return out.getvalue()


def contents(task: NewTask, root: Path) -> dict[Path, str]:
    """Every file of the new task and its text."""
    values = {
        "name": task.name,
        "Name": task.camel,
        "Class": task.class_name,
        "module": task.module,
        "command": task.command,
        "data": _yaml_scalar(_shown(task.package, root)),
    }
    files = {task.package / path: render(template, values) for path, template in PACKAGE_FILES.items()}
    files.update({task.package / path: sample_csv(rows, seed) for path, (rows, seed) in SAMPLES.items()})
    files[task.test] = render("test_task.py.tmpl", values)
    files[task.config] = render("config.yaml.tmpl", values)
    return files


def write_task(name: str, directory: str | Path, root: Path) -> tuple[NewTask, list[Path]]:
    """Write the task NAME's package into `directory`, and its test and config under `root`."""
    task = plan(name, directory, root)
    files = contents(task, root)
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("x", encoding="utf-8") as f:  # "x": fails rather than overwrite, even in a race
            f.write(text)
    return task, list(files)


def importable(task: NewTask) -> bool:
    """Whether this Python imports the new task's module from the files just written."""
    origin = _existing_module(f"{task.module}.task")
    return origin is not None and Path(origin).resolve() == (task.package / "task.py").resolve()


def add_command(commands: argparse._SubParsersAction, add_settings: Callable) -> None:
    """Add `distqa new-task` to the CLI's commands (`add_settings` is unused: it reads no config)."""
    del add_settings
    parser = commands.add_parser(
        "new-task",
        help="write a new task to start from: its package, a test and a config",
        description="Write a small, working text-classification task to change into your own: "
        "DIR/NAME/{__init__,settings,data,task,metric}.py with sample CSVs, tests/test_NAME.py (trains on "
        "2 processes, resumes exactly, exports) and configs/NAME.yaml, in the current folder (the project's "
        "root). Nothing existing is overwritten. Then: distqa train --config configs/NAME.yaml",
    )
    parser.add_argument("name", metavar="NAME", help="the task's name, a Python identifier (e.g. my_task)")
    parser.add_argument(
        "--dir",
        default=DEFAULT_DIR,
        metavar="DIR",
        help=f"the folder the task's package goes in (default: {DEFAULT_DIR}, importable once the project is "
        "installed with pip install -e .)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Write the task, say what was written and what to run next."""
    root = Path.cwd()
    task, written = write_task(args.name, args.dir, root)
    print(f"wrote task {task.name} (task.name={task.module}.task:{task.class_name}):")
    for path in written:
        print(f"  {path.relative_to(root) if path.is_relative_to(root) else path}")
    if not importable(task):
        # The files are right, but this Python cannot find them: say so now, not at the first run.
        print(
            f"distqa: warning: this Python cannot import {task.module}: put {import_root(task.package)} on "
            "PYTHONPATH (pip install -e . puts the project's src/ there)",
            file=sys.stderr,
        )
    print(f"next: distqa train --config configs/{task.name}.yaml; python -m pytest tests/test_{task.name}.py")
    return 0
