"""The Python side of scripts/bench_network.sh: the torchrun stand-in each node's worker.sh starts,
and the report of all runs.

    python -m distqa.bench.network launch TORCHRUN-ARGS... -m distqa train KEY=VALUE...
    python -m distqa.bench.network report DIR

`launch` is worker.sh's TORCHRUN: torchrun as worker.sh assembles it (rendezvous, node rank), with
`distqa train` replaced by one `distqa bench` measurement (`distqa.bench.worker --loop trainer`:
the trainer under a StepTimer, warm-up steps excluded), configured by DISTQA_BENCH_* variables.
`report` reads DIR/runs/RATE-HOOK[-rK]/ (the measurement's result.json, each node's tx-NODE.json
written by the StepTimer) and writes DIR/network.json and DIR/network.png: one row per rate and
hook, each figure the median of its repeats (`--repeats`), the single runs' samples/s beside it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any


def launch(args: list[str]) -> None:
    """Exec torchrun with worker.sh's arguments, `-m distqa train` becoming the bench worker."""
    at = next(i for i in range(len(args) - 2) if args[i : i + 3] == ["-m", "distqa", "train"])
    env = os.environ
    worker = [
        "-m",
        "distqa.bench.worker",
        "--loop=trainer",
        f"--result={env['DISTQA_BENCH_RESULT']}",
        f"--output-dir={env['DISTQA_BENCH_OUTPUT_DIR']}",
        f"--warmup={env['DISTQA_BENCH_WARMUP']}",
        f"--steps={env['DISTQA_BENCH_STEPS']}",
    ]
    command = [sys.executable, "-m", "torch.distributed.run", *args[:at], *worker, *args[at + 3 :]]
    os.execv(sys.executable, command)


def _rate_bits(rate: str) -> float:
    """'100mbit' -> 1e8; 'none' (no cap) -> inf, for ordering."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit) and rate[: -len(unit)].replace(".", "", 1).isdigit():
            return float(rate[: -len(unit)]) * scale
    return float("inf")


def run_row(folder: Path, rate: str, hook: str) -> dict[str, Any]:
    result = json.loads((folder / "result.json").read_text())
    counters = [json.loads(p.read_text()) for p in sorted(folder.glob("tx-*.json"))]
    steps = result["steps"]
    return {
        "hook": hook,
        "rate": rate,
        "samples_per_s": result["samples"] / result["seconds"],
        "step_ms": 1000.0 * result["seconds"] / steps,
        # Both hosts' sent bytes over the measured steps: everything on the link, both ways.
        "wire_bytes_per_step": sum(c["bytes"] for c in counters) / steps if counters else None,
        "model_params": (result.get("state_bytes") or {}).get("parameters", 0) // 4,  # fp32 weights
        "steps": steps,
        "allreduce_wait_ms": result["phase_ms"]["allreduce_wait"],
    }


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["rate"] for r in runs}, key=_rate_bits)
    hooks = list(dict.fromkeys(r["hook"] for r in runs))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for hook in hooks:
        by_rate = {r["rate"]: r for r in runs if r["hook"] == hook}
        shown = [rate for rate in rates if rate in by_rate]
        left.plot(shown, [by_rate[rate]["samples_per_s"] for rate in shown], marker="o", label=hook)
    left.set_xlabel("link rate (tbf cap; none = uncapped)")
    left.set_ylabel("samples/s (2 nodes)")
    left.set_yscale("log")
    left.legend(title="train.ddp_comm_hook")
    left.grid(alpha=0.3)
    bytes_per_hook = {}
    for r in runs:
        if r["wire_bytes_per_step"] is not None:
            bytes_per_hook.setdefault(r["hook"], []).append(r["wire_bytes_per_step"])
    names = list(bytes_per_hook)
    right.bar(names, [sum(v) / len(v) / 1e6 for v in bytes_per_hook.values()], color="tab:gray")
    right.set_ylabel("MB on the link per step (both ways)")
    right.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def median_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (rate, hook), in the order first seen: the median of each figure over its repeats
    (the machine's noise), with every run's samples/s kept in `samples_per_s_each`."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["rate"], run["hook"]), []).append(run)
    rows = []
    for same in groups.values():
        row = dict(same[0])
        for key in ("samples_per_s", "step_ms", "wire_bytes_per_step", "allreduce_wait_ms"):
            values = [r[key] for r in same if r[key] is not None]
            row[key] = statistics.median(values) if values else None
        row["repeats"] = len(same)
        row["samples_per_s_each"] = [r["samples_per_s"] for r in same]
        rows.append(row)
    return rows


def report(out: Path) -> list[dict[str, Any]]:
    found = []
    for folder in sorted((out / "runs").iterdir()):
        if (folder / "result.json").is_file() and (folder / "run.txt").is_file():
            rate, hook, *_ = (folder / "run.txt").read_text().split()
            found.append(run_row(folder, rate, hook))
    runs = median_rows(found)
    (out / "network.json").write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    plot(runs, out / "network.png")
    none = {r["rate"]: r["samples_per_s"] for r in runs if r["hook"] == "none"}
    print(f"{'rate':>9} {'hook':>9} {'samples/s':>10} {'x none':>7} {'step ms':>9} {'MB/step':>9} {'runs':>5}")
    for r in runs:
        mb = f"{r['wire_bytes_per_step'] / 1e6:9.2f}" if r["wire_bytes_per_step"] is not None else "        -"
        ratio = f"{r['samples_per_s'] / none[r['rate']]:7.3f}" if r["rate"] in none else "      -"
        figures = f"{r['samples_per_s']:10.2f} {ratio} {r['step_ms']:9.1f} {mb} {r['repeats']:5d}"
        print(f"{r['rate']:>9} {r['hook']:>9} {figures}")
    return runs


if __name__ == "__main__":
    if sys.argv[1:2] == ["launch"]:
        launch(sys.argv[2:])
    elif sys.argv[1:2] == ["report"] and len(sys.argv) == 3:
        report(Path(sys.argv[2]))
    else:
        sys.exit(__doc__)
