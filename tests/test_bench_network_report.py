"""scripts/bench_network.sh's report (`python -m distqa.bench.network report DIR`): one row per rate and
hook, each figure the median of its repeats, from the runs' own result.json and tx counters."""

from __future__ import annotations

import json
from pathlib import Path

from distqa.bench.network import report


def fake_run(runs: Path, name: str, label: str, samples_per_s: float, wire: int) -> None:
    """A run folder as the script leaves it: run.txt, the bench result, each node's tx counter."""
    folder = runs / name
    folder.mkdir(parents=True)
    (folder / "run.txt").write_text(label + "\n")
    steps = 10
    result = {
        "samples": 8 * steps,
        "seconds": 8 * steps / samples_per_s,
        "steps": steps,
        "state_bytes": {"parameters": 4 * 1000},
        "phase_ms": {"allreduce_wait": 1.0},
    }
    (folder / "result.json").write_text(json.dumps(result))
    for node in (0, 1):
        (folder / f"tx-{node}.json").write_text(json.dumps({"bytes": wire * steps // 2}))


def test_repeats_give_one_row_each_with_the_median(tmp_path, capsys):
    runs = tmp_path / "runs"
    for k, speed in enumerate([100.0, 150.0, 110.0], start=1):
        fake_run(runs, f"none-none-r{k}", f"none none {k}", speed, wire=3000)
    for k, speed in enumerate([105.0, 90.0, 104.0], start=1):
        fake_run(runs, f"none-powersgd-r{k}", f"none powersgd {k}", speed, wire=100 + k)
    # A folder of an older script (run.txt without the round) counts as one run.
    fake_run(runs, "1gbit-none", "1gbit none", 50.0, wire=3000)

    rows = report(tmp_path)

    saved = json.loads((tmp_path / "network.json").read_text())["runs"]
    assert saved == rows
    by = {(r["rate"], r["hook"]): r for r in rows}
    assert set(by) == {("none", "none"), ("none", "powersgd"), ("1gbit", "none")}
    assert by["none", "none"]["samples_per_s"] == 110.0 and by["none", "none"]["repeats"] == 3
    assert sorted(by["none", "powersgd"]["samples_per_s_each"]) == [90.0, 104.0, 105.0]
    assert by["none", "powersgd"]["samples_per_s"] == 104.0
    assert by["none", "powersgd"]["wire_bytes_per_step"] == 102.0  # the median of 101, 102, 103
    assert by["none", "none"]["model_params"] == 1000
    assert by["1gbit", "none"]["repeats"] == 1
    assert (tmp_path / "network.png").stat().st_size > 0
    # The table says each hook against none at the same rate: 104 / 110.
    line = next(line for line in capsys.readouterr().out.splitlines() if "powersgd" in line)
    assert "0.945" in line.split()
