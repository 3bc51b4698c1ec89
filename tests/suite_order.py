"""The order `make test` hands test files to its two pytest-xdist workers: the longest first.

make test runs `pytest -n 2 --dist loadfile --no-loadscope-reorder`: every file goes whole to one
worker, in collection order, to whichever worker is about to run out of tests (xdist's loadscope
scheduler hands a worker its next file when two of its tests are left). Longest first (LPT) leaves
the short files to fill the last minutes on both workers instead of one long file running alone
while the other worker idles.

The seconds each file took (setup, call and teardown of its tests, summed) are recorded in
suite_costs.json beside this file. Refresh them after a change that makes a file much longer or
shorter, on a quiet machine (a run of some files updates only theirs):

    DISTQA_RECORD_COSTS=1 make test

A file missing from the record (a new one) is estimated from its tests, so it is placed sensibly
until the next refresh; a stale record only makes the order a little worse, never a test wrong.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

COSTS = Path(__file__).resolve().parent / "suite_costs.json"
RECORD_VAR = "DISTQA_RECORD_COSTS"

# The estimate for a file not in the record: what an unrecorded test takes on average, and what a
# test marked slow (one that launches torchrun) takes.
QUICK_TEST_S, SLOW_TEST_S = 0.3, 10.0


def recorded_costs() -> dict[str, float]:
    """{path relative to the repository: seconds}, or {} without a readable record."""
    try:
        costs = json.loads(COSTS.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return costs if isinstance(costs, dict) else {}


def _file_of(item: pytest.Item, root: Path) -> str:
    """The item's file as the record names it: relative to the repository, as in pytest's node ids."""
    return item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else str(item.path)


def order_longest_first(items: list[pytest.Item], root: Path) -> None:
    """Sort `items` in place: whole files, the costliest first; each file's own order is kept, and
    the order depends only on the collection and the record, the same in every xdist worker."""
    recorded = recorded_costs()
    estimated: dict[str, float] = {}
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        name = _file_of(item, root)
        first_seen.setdefault(name, index)
        estimated[name] = estimated.get(name, 0.0) + (SLOW_TEST_S if item.get_closest_marker("slow") else QUICK_TEST_S)

    def key(item: pytest.Item) -> tuple[float, int]:
        name = _file_of(item, root)
        value = recorded.get(name)
        cost = float(value) if isinstance(value, (int, float)) else estimated[name]
        return (-cost, first_seen[name])

    items.sort(key=key)


class CostRecorder:
    """Sums the reported durations per file and writes them into suite_costs.json at the end of the
    session (the files this session ran; the others keep their record). Registered only in the
    process that sees every report: the xdist controller, or the single process of a run without -n."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        name = report.nodeid.split("::", 1)[0]
        self.seconds[name] = self.seconds.get(name, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus != 0 or not self.seconds:
            return  # a failed or interrupted run's times are not the suite's
        merged = {**recorded_costs(), **{name: round(seconds, 1) for name, seconds in self.seconds.items()}}
        ordered = dict(sorted(merged.items(), key=lambda kv: -kv[1]))
        COSTS.write_text(json.dumps(ordered, indent=1) + "\n", encoding="utf-8")


def register_recorder(config: pytest.Config) -> None:
    """With DISTQA_RECORD_COSTS=1, record this session's costs (not in xdist's workers: their
    reports reach the controller, which records them all)."""
    if os.environ.get(RECORD_VAR) == "1" and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(CostRecorder(), "distqa-cost-recorder")
