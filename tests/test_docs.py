"""The docs stay true to the code: docs/keys.md equals what `distqa train --help` prints (it is
generated from it), the README stays a short front page, and every link between the pages lands."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _generator():
    """scripts/gen_keys_doc.py, the generator `make docs` runs (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("gen_keys_doc", ROOT / "scripts" / "gen_keys_doc.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_keys_page_equals_train_help():
    """A key, default or meaning changed in the schema changes --help at once; the page must follow."""
    page = (ROOT / "docs" / "keys.md").read_text(encoding="utf-8")
    assert page == _generator().render(), "docs/keys.md differs from `distqa train --help`: run `make docs`"


def test_readme_is_a_short_front_page_without_the_key_table():
    """The key table lives only in --help and docs/keys.md (a copy in the README drifted before)."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines: move details to a page under docs/"
    table_rows = [line for line in lines if re.match(r"\|\s*`(train|model|data|task)\.", line)]
    assert not table_rows, f"README.md repeats key rows of docs/keys.md: {table_rows[:2]}"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # no headings in code
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_every_relative_link_and_anchor_exists():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "broken links: " + "; ".join(broken)


def test_the_checkpoint_table_names_every_file_a_checkpoint_holds(tmp_path):
    """docs/outputs.md's table lacked comm-rank{R}.pt, which every checkpoint holds."""
    from distqa.registry import load_config
    from distqa.trainer import train

    out = tmp_path / "run"
    toy = ["task.name=toy_task:ToyClassificationTask", "task.size=16", "data.num_workers=0", "train.max_steps=1"]
    train(load_config(None, [*toy, f"output_dir={out}"]))
    files = [re.sub(r"rank0", "rank{R}", p.name) for p in (out / "checkpoints" / "step-1").iterdir()]
    table = (ROOT / "docs" / "outputs.md").read_text(encoding="utf-8").partition("## Checkpoints")[2]
    rows = set(re.findall(r"^\| `([^`]+)`", table, flags=re.M))
    assert files and set(files) <= rows, f"not in docs/outputs.md's checkpoint table: {set(files) - rows}"


def test_the_fork_page_names_every_module_of_the_core():
    """docs/fork.md's map of src/distqa/ is where a fork looks first: twelve modules had been added
    without a line there before this test."""
    page = (ROOT / "docs" / "fork.md").read_text(encoding="utf-8")
    names = re.findall(r"^  (\w+(?:, \w+)*)$", page, flags=re.M)  # "  dist, parallel, ..." lines
    listed = {name for line in names for name in line.split(", ")}
    modules = {p.stem for p in (ROOT / "src" / "distqa").glob("*.py")} - {"__init__", "__main__"}
    assert not modules - listed, f"docs/fork.md does not name: {sorted(modules - listed)}"
