"""The import structure, read from the source (no module is imported): no circle among distqa's
modules, imports inside functions included (they are circles too, only later); the core (every
module outside a task's package) imports no task and names no Natural Questions key; the
configuration imports nothing above it. Imports under `if TYPE_CHECKING:` are for hints only and
do not count."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

from conftest import ROOT

SRC = ROOT / "src"
TASK_PACKAGES = ("distqa.nq", "distqa.textcls")
# The configuration sits below everything: the registry hands it a task's settings class.
CONFIG_MODULES = {
    "distqa.config",
    "distqa.config_checks",
    "distqa.config_layers",
    "distqa.config_yaml",
    "distqa.errors",
}


def module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_modules(path: Path, name: str, known: set[str]) -> set[str]:
    """The known modules `path` imports anywhere (top level, in functions, in try blocks), except
    under `if TYPE_CHECKING:`. `from pkg import mod` counts as importing pkg.mod when that is a module."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                for other in child.orelse:
                    visit_node(other)
            else:
                visit_node(child)

    def visit_node(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else base)
        else:
            visit(node)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m in known and m != name}


def module_paths(src: Path) -> dict[str, Path]:
    return {module_name(p, src): p for p in src.rglob("*.py")}


def import_graph(src: Path) -> dict[str, set[str]]:
    paths = module_paths(src)
    return {name: imported_modules(path, name, set(paths)) for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := walk(nxt)) is not None:
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := walk(start)) is not None:
            return cycle
    return None


def is_core(name: str) -> bool:
    return not any(name == pkg or name.startswith(f"{pkg}.") for pkg in TASK_PACKAGES)


def _class_var(node: ast.AnnAssign) -> bool:
    """`name: ClassVar[...] = ...`: what a settings class tells the core (renamed_keys,
    missing_data_hints), no key."""
    annotation = node.annotation.value if isinstance(node.annotation, ast.Subscript) else node.annotation
    return (isinstance(annotation, ast.Name) and annotation.id == "ClassVar") or (
        isinstance(annotation, ast.Attribute) and annotation.attr == "ClassVar"
    )


def nq_only_keys(src: Path) -> set[str]:
    """The `task.*` keys of Natural Questions that no other built-in task has (max_seq_len is
    textcls's too): the words a core module must not use."""

    def fields(path: Path) -> set[str]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        return {
            node.target.id
            for cls in ast.walk(tree)
            if isinstance(cls, ast.ClassDef)
            for node in cls.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and not _class_var(node)
        }

    nq = fields(src / "distqa" / "nq" / "settings.py")
    return nq - fields(src / "distqa" / "textcls" / "settings.py")


def words(path: Path) -> set[str]:
    """Identifiers, and the words of strings and comments, of a source file."""
    found: set[str] = set()
    for token in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
        if token.type in (tokenize.NAME, tokenize.STRING, tokenize.COMMENT):
            found.update("".join(c if c.isalnum() or c == "_" else " " for c in token.string).split())
    return found


def test_there_is_no_import_circle():
    cycle = find_cycle(import_graph(SRC))
    assert cycle is None, " -> ".join(cycle or [])


def test_the_core_imports_no_task_and_names_no_natural_questions_key():
    graph = import_graph(SRC)
    into_tasks = {n: sorted(m for m in deps if not is_core(m)) for n, deps in graph.items() if is_core(n)}
    assert {n: deps for n, deps in into_tasks.items() if deps} == {}
    keys = nq_only_keys(SRC)
    assert {"doc_stride", "dummy_size", "keep_unknown"} <= keys  # the list is read, not empty
    named = {name: sorted(keys & words(path)) for name, path in module_paths(SRC).items() if is_core(name)}
    assert {n: k for n, k in named.items() if k} == {}


def test_the_configuration_imports_nothing_above_it():
    graph = import_graph(SRC)
    assert {n: sorted(graph[n] - CONFIG_MODULES) for n in CONFIG_MODULES if graph[n] - CONFIG_MODULES} == {}


@pytest.mark.parametrize("lazy", [True, False])
def test_a_circle_through_an_import_in_a_function_is_found_and_type_checking_is_not(tmp_path, lazy):
    """The checker itself: an import inside a function closes a circle; one under TYPE_CHECKING does not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text(
        "def f():\n    from pkg import high\n"
        if lazy
        else "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import H\n"
    )
    (pkg / "high.py").write_text("from pkg import low\n")
    cycle = find_cycle(import_graph(tmp_path))
    assert cycle == (["pkg.high", "pkg.low", "pkg.high"] if lazy else None)
