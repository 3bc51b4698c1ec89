"""The shape the next maintainer reads, checked from the source: no function in src/ over 80 lines,
and the trainer's parts (the loop, the step, the after-step decision, the checkpoint manager) none
over 60 — a longer one is a sign that two jobs share it."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

SRC = ROOT / "src" / "distqa"
TRAINER_PARTS = ("trainer.py", "train_step.py", "control.py", "checkpoint_manager.py")


def long_functions(path: Path, limit: int, root: Path = SRC) -> list[str]:
    """`file:function (lines)` for every function or method of `path` longer than `limit` lines."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        f"{path.relative_to(root)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_in_src_is_over_80_lines():
    found = [f for path in sorted(SRC.rglob("*.py")) for f in long_functions(path, 80)]
    assert found == []


def test_the_trainer_s_parts_are_none_over_60_lines():
    assert all((SRC / name).is_file() for name in TRAINER_PARTS)  # renamed parts must be renamed here too
    found = [f for name in TRAINER_PARTS for f in long_functions(SRC / name, 60)]
    assert found == []


def test_the_measure_counts_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n")
    assert long_functions(tmp_path / "m.py", 80, tmp_path) == ["m.py:f (82 lines)"]
    assert long_functions(tmp_path / "m.py", 82, tmp_path) == []
