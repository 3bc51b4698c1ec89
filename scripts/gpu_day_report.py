#!/usr/bin/env python3
"""scripts/gpu_day.sh's bookkeeping: each step's outcome, then OUT/gpu_day.json and OUT/gpu_day.md.

    python scripts/gpu_day_report.py record OUT --name N --rc RC --seconds S --box B --log FILE [--gpus N --budget S]
    python scripts/gpu_day_report.py skip OUT --name N --reason TEXT [...]
    python scripts/gpu_day_report.py note OUT TEXT [...]
    python scripts/gpu_day_report.py build OUT --gpus N --budget S

`record`, `skip` and `note` append one line to OUT/steps.jsonl and rebuild the report, so a day cut
short still leaves one. The figures come from the files the steps wrote (OUT/tests/gpu_figures.json
from scripts/gpu_check.sh, `distqa bench`'s bench.json under OUT/bench, OUT/compile and
OUT/batches/SETUP/batch-N), never from their console text. Standard library only, and no torch
import: it runs between the steps on the GPU machine and in the default test suite.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

from gpu_day_markdown import markdown  # a sibling: scripts/ is on sys.path when run as a script

# timeout(1)'s statuses: 124 when the box ran out and the command then stopped, 137 when it had
# to be killed after the grace period.
TIMED_OUT = (124, 137)
# What a bench.json says of its set-up, kept beside its rows.
BENCH_SETTINGS = ("device", "command", "model", "precision", "seq_len", "batch_size", "warmup_steps", "measured_steps")
# A run out of memory, as gpu_day.sh's search tells it ("out of GPU memory at train.batch_size=...").
OUT_OF_MEMORY = re.compile(r"out of .*memory", re.IGNORECASE)
SETUP = re.compile(r"^(?P<model>.+)-(?P<parallel>ddp|fsdp)-ac-(?P<ac>true|false)$")
PYTEST_LINE = re.compile(
    r"(?:(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\s+)?tests/test_gpu\w*\.py::(\S+)(?:\s+(PASSED|FAILED|SKIPPED|ERROR))?"
)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def reason_of(log: Path) -> str:
    """A failed step's most telling line: its last error line, else its last line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return f"no log ({log})"
    errors = [line for line in lines if re.search(r"\berror\b|Error:|out of memory", line, re.I)]
    line = (errors or lines or ["no output"])[-1]
    return line if len(line) <= 240 else line[:237] + "..."


def _why_not(log: Path) -> str:
    """Why a batch did not fit, short: "out of memory" as a rule, else the failure's line."""
    line = reason_of(log)
    return "CUDA out of memory" if OUT_OF_MEMORY.search(line) else re.sub(r"^distqa( \[rank \d+\])?: error: ", "", line)


def step_entry(name: str, rc: int, seconds: float, box: float, log: Path) -> dict[str, Any]:
    """One run step: ok (status 0), timed-out (timeout's 124/137 once the box was used) or failed."""
    entry: dict[str, Any] = {"name": name, "seconds": seconds, "box_s": box, "exit_status": rc, "log": str(log)}
    if rc == 0:
        entry["status"] = "ok"
    elif rc in TIMED_OUT:
        entry["status"], entry["reason"] = "timed-out", f"stopped after its {box:g} s box"
    else:
        entry["status"], entry["reason"] = "failed", reason_of(log)
    return entry


def test_counts(out: Path) -> dict[str, Any] | None:
    """Outcomes of the GPU suite: gpu_check.sh's JSON, else (a suite cut short) its log's lines."""
    figures = _read_json(out / "tests" / "gpu_figures.json")
    outcomes: dict[str, str] = {}
    if figures and figures.get("tests"):
        names = {"failure": "failed", "error": "error", "skipped": "skipped", "passed": "passed"}
        outcomes = {test: names.get(t["outcome"], t["outcome"]) for test, t in figures["tests"].items()}
    elif (out / "tests" / "gpu_tests.log").is_file():
        for line in (out / "tests" / "gpu_tests.log").read_text(errors="replace").splitlines():
            match = PYTEST_LINE.search(line)
            word = match and (match.group(1) or match.group(3))
            if word:
                outcomes[match.group(2)] = word.lower()
    if not outcomes and not figures:
        return None
    counts = {kind: sum(1 for o in outcomes.values() if o == kind) for kind in ("passed", "failed", "error", "skipped")}
    status = figures.get("pytest_exit_status") if figures else None
    expected = figures.get("expected") if figures else None
    return {
        **counts,
        # Without gpu_check.sh's record the suite was stopped before it wrote one: cut short too.
        "collection_errors": figures.get("collection_errors", 0) if figures else 0,
        "cut_short": bool(figures.get("cut_short")) if figures else True,
        "not_run": max(expected - len(outcomes), 0) if isinstance(expected, int) else None,
        "pytest_exit_status": status,
        "figures": figures.get("figures", {}) if figures else {},
        "not_passed": sorted(t for t, o in outcomes.items() if o in ("failed", "error")),
    }


def bench_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A bench.json's rows: DDP's, then DataParallel's (`--dp`: `"parallel": "dp"`, nproc = GPUs)."""
    rows = []
    for row in result.get("runs") or []:
        phases = row.get("step_breakdown_ms") or {}
        spread = row.get("samples_per_s_spread") or {}
        rows.append({
            "mode": row.get("parallel") or result.get("parallel") or "ddp",
            "nproc": row["nproc"],
            "batch_size": result.get("batch_size"),
            "samples_per_s": row["samples_per_s"],
            "samples_per_s_min": spread.get("min"),
            "samples_per_s_max": spread.get("max"),
            "tokens_per_s": row.get("tokens_per_s"),
            "mfu": row.get("mfu"),
            "scaling_efficiency": row.get("scaling_efficiency"),
            "dp_over_ddp": row.get("dp_over_ddp"),
            "step_ms": row.get("step_ms"),
            "forward_backward_ms": phases.get("forward_backward"),
            "optimizer_ms": phases.get("optimizer"),
            "peak_memory_gib": row.get("peak_memory_gib"),
        })  # fmt: skip
    return rows


def compile_figures(out: Path, eager: list[dict[str, Any]], tests: dict[str, Any] | None) -> dict[str, Any] | None:
    """The compiled 1-process row against step 2's eager one (same settings, minutes apart)."""
    result = _read_json(out / "compile" / "bench.json")
    if not result:
        return None
    row = bench_rows(result)[0]
    base = next((r for r in eager if r["mode"] == "ddp" and r["nproc"] == 1), None)
    figure = (tests or {}).get("figures", {}).get("compile", {})
    return {
        "row": row,
        "eager_samples_per_s": base and base["samples_per_s"],
        "speedup": base and row["samples_per_s"] / base["samples_per_s"],
        "compile_time_s": figure.get("compile_time_s"),  # the GPU suite's compile test measured it
        "warmup_steps": result.get("warmup_steps"),
    }


def largest_batches(out: Path, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per set-up: the largest batch per GPU whose run passed, the smallest above it that did not
    (and why), and the batch distqa.bench.memory named, where the search started."""
    found = []
    status = {s["name"]: s for s in steps if "name" in s}
    for folder in sorted(p for p in (out / "batches").glob("*") if p.is_dir()):
        tried = sorted(int(p.stem.split("-")[1]) for p in folder.glob("batch-*.log"))
        fits = [b for b in tried if (folder / f"batch-{b}" / "bench.json").is_file()]
        at = _read_json(folder / f"batch-{max(fits)}" / "bench.json") if fits else None
        row = bench_rows(at)[0] if at else {}
        # The search ends at a batch out of memory just above one that fits. A box that runs out stops
        # the probe in flight (no bench.json, no such line) and leaves a bound on one side; so does a
        # search whose every run fit; another failure ends it, and its line says why.
        cut = status.get(f"largest-batch/{folder.name}", {}).get("status") == "timed-out"
        largest = max(fits, default=0)
        logs = {b: folder / f"batch-{b}.log" for b in tried if b not in fits}
        oom = sorted(b for b, log in logs.items() if _why_not(log) == "CUDA out of memory")
        above = [b for b in oom if b > largest]
        other = [b for b in logs if b not in oom and not cut]
        stopped = above[0] if above else other[0] if other else None
        match = SETUP.match(folder.name)
        found.append({
            "setup": folder.name,
            "model": match and match["model"],
            "parallel": match and match["parallel"],
            "activation_checkpointing": match and match["ac"] == "true",
            "gpus": row.get("nproc"),
            "largest_batch": largest,
            "tried": tried,
            "stopped_by": None if stopped is None else f"batch {stopped}: {_why_not(logs[stopped])}",
            "lower_bound": not above and bool(fits),  # no batch above the largest failed: it may go higher
            "timed_out": cut,
            "formula_largest_batch": (_read_json(folder / "formula.json") or {}).get("formula_largest_batch"),
            "samples_per_s": row.get("samples_per_s"),
            "peak_memory_gib": row.get("peak_memory_gib"),
        })  # fmt: skip
    return found


def versions(out: Path) -> dict[str, Any]:
    """What ran: the GPU suite's record of the environment, else this interpreter's packages."""
    found: dict[str, Any] = dict((_read_json(out / "tests" / "gpu_figures.json") or {}).get("environment") or {})
    found.setdefault("python", platform.python_version())
    if "torch" not in found:  # the package's metadata says "2.11.0", its build says "2.11.0+cu130" and CUDA's
        found.update(torch_build())
    for name in ("torch", "transformers"):
        if name not in found:
            import importlib.metadata  # 40 ms, paid only when the suite left no record

            try:
                found[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                found[name] = None
    return found


def torch_build(site: Path | None = None) -> dict[str, str]:
    """torch's version and its CUDA from torch/version.py, read, not imported (that takes seconds)."""
    if site is None:
        import importlib.util

        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return {}
        site = Path(next(iter(spec.submodule_search_locations))).parent
    try:
        text = (site / "torch" / "version.py").read_text()
    except OSError:
        return {}
    found = {}
    for key, name in (("__version__", "torch"), ("cuda", "cuda")):
        match = re.search(rf"^{key}(?:: [^=]+)? = '([^']+)'", text, re.MULTILINE)
        if match:
            found[name] = match.group(1)
    return found


def gpus_of(out: Path, count: int) -> dict[str, Any]:
    """From `nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader`."""
    lines = [line for line in _read_text(out / "gpus.csv").splitlines() if line.count(",") >= 2]
    first = [part.strip() for part in lines[0].split(",")] if lines else [None, None, None]
    return {"count": count, "name": first[0], "memory": first[1], "driver": first[2]}


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def build(out: Path, gpus: int, budget: float) -> dict[str, Any]:
    """gpu_day.json's content from OUT's files."""
    lines = [json.loads(line) for line in _read_text(out / "steps.jsonl").splitlines() if line.strip()]
    # A step run again (GPU_DAY_STEPS, into the same OUTPUT_DIR) replaces its earlier outcome, in its place.
    latest = {line["name"]: line for line in lines if "name" in line}
    steps = [latest[name] for name in dict.fromkeys(line["name"] for line in lines if "name" in line)]
    tests = test_counts(out)
    bench = _read_json(out / "bench" / "bench.json")
    rows = bench_rows(bench) if bench else []
    not_done = list(dict.fromkeys(line["note"] for line in lines if "note" in line))
    not_done += [f"{s['name']}: {s['status']}: {s.get('reason', '')}" for s in steps if s["status"] != "ok"]
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(out),
        "gpu": gpus_of(out, gpus),
        "budget_s": budget,
        "seconds": sum(s.get("seconds", 0) for s in steps),
        "steps": steps,
        "tests": tests,
        "bench": {**{k: bench.get(k) for k in BENCH_SETTINGS}, "rows": rows} if bench else None,
        "compile": compile_figures(out, rows, tests),
        "largest_batches": largest_batches(out, steps),
        "not_done": not_done,
    }


def write(out: Path, gpus: int, budget: float) -> dict[str, Any]:
    report = build(out, gpus, budget)
    (out / "gpu_day.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_day.md").write_text(markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("record", "skip", "note", "build"))
    parser.add_argument("out", type=Path)
    parser.add_argument("text", nargs="?", default="")
    for option in ("--name", "--reason", "--log", "--started"):
        parser.add_argument(option, default="")
    for option in ("--rc", "--gpus"):
        parser.add_argument(option, type=int, default=0)
    for option in ("--seconds", "--box", "--budget"):
        parser.add_argument(option, type=float, default=0.0)
    args = parser.parse_args(argv)
    entry: dict[str, Any] | None = None
    if args.action == "record":
        # bash's $EPOCHREALTIME when the step began (bash 5), for tenths of a second; else whole seconds.
        seconds = round(time.time() - float(args.started), 1) if args.started else args.seconds
        entry = step_entry(args.name, args.rc, seconds, args.box, Path(args.log))
        why = f": {entry['reason']}" if "reason" in entry else ""
        print(f"gpu_day: {args.name}: {entry['status']} ({seconds:g} s){why}")
    elif args.action == "skip":
        entry = {"name": args.name, "status": "skipped", "reason": args.reason, "seconds": 0}
        print(f"gpu_day: {args.name}: skipped: {args.reason}")
    elif args.action == "note":
        entry = {"note": args.text}
        print(f"gpu_day: {args.text}")
    if entry is not None:
        with (args.out / "steps.jsonl").open("a") as steps:
            steps.write(json.dumps(entry) + "\n")
    report = write(args.out, args.gpus, args.budget)
    if args.action == "build":
        for line in report["not_done"]:
            print(f"gpu_day: not done: {line}")
        print(f"gpu_day: wrote {args.out / 'gpu_day.json'} and {args.out / 'gpu_day.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
