"""gpu_day.md from scripts/gpu_day_report.py's report: a heading and tables in the form of
docs/benchmarks.md's GPU sections, ready to paste, then what the day did not do and its steps.

Standard library only, like the report builder that imports it (it runs between the steps on the GPU
machine and in the default test suite).
"""

from __future__ import annotations

from typing import Any


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{suffix}"


def _bench_line(label: str, row: dict[str, Any], note: str = "") -> str:
    """One row as docs/benchmarks.md's GPU tables have them."""
    samples = _fmt(row["samples_per_s"], ",.1f")
    low, high = row.get("samples_per_s_min"), row.get("samples_per_s_max")
    if low is not None and high is not None and high > low:
        samples += f" ({low:,.1f}..{high:,.1f})"
    step = _fmt(row.get("step_ms"), ".1f")
    if step and row.get("forward_backward_ms") is not None and row.get("optimizer_ms") is not None:
        step += f" ({row['forward_backward_ms']:.1f} / {row['optimizer_ms']:.1f})"
    mfu = _fmt(row["mfu"] and 100 * row["mfu"], ".1f", " %")
    cells = [label, samples, _fmt(row.get("tokens_per_s"), ",.0f"), mfu, step, _fmt(row.get("peak_memory_gib"), ".1f")]
    return "| " + " | ".join([*cells, note]) + " |"


def _speed_table(report: dict[str, Any]) -> list[str]:
    lines = [
        "| set-up | samples/s | tokens/s | MFU | step ms (fwd+bwd / optimizer) | peak GiB | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in (report["bench"] or {}).get("rows", []):
        batch = f"batch {row['batch_size']}"
        if row["nproc"] == 1 and row["mode"] == "ddp":
            lines.append(_bench_line(f"eager, {batch}", row))
        else:
            scaling = _fmt(row["scaling_efficiency"] and 100 * row["scaling_efficiency"], ".1f", " %")
            notes = [f"scaling efficiency {scaling}"] if scaling else []
            if row["dp_over_ddp"] is not None:
                notes.append(f"{row['dp_over_ddp']:.2f}× DDP at as many GPUs")
            gpus = f"{row['nproc']} GPU{'s' if row['nproc'] > 1 else ''}"
            label = f"{row['mode'].upper()}, {gpus}, eager, {batch} per GPU"
            lines.append(_bench_line(label, row, "; ".join(notes)))
    figures = report["compile"]
    if figures:
        row = figures["row"]
        notes = [f"{figures['speedup']:.2f}× eager (measured minutes apart on the same GPU)" if figures["speedup"] else
                 "no eager row to compare with"]  # fmt: skip
        if figures["compile_time_s"] is not None:
            seconds = figures["compile_time_s"]
            notes.append(f"compiling took about {seconds:.0f} s (the tiny model, in the GPU suite's compile test)")
        lines.append(_bench_line(f"`train.compile=true`, batch {row['batch_size']}", row, "; ".join(notes)))
    return lines if len(lines) > 2 else []


def _batch_table(report: dict[str, Any]) -> list[str]:
    if not report["largest_batches"]:
        return []
    head = ["set-up", "GPUs", "largest batch per GPU", "the formula's", "samples/s at it", "peak GiB at it",
            "what ended the search"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for entry in report["largest_batches"]:
        label = entry["setup"]
        if entry["model"]:
            ac = "on" if entry["activation_checkpointing"] else "off"
            label = f"{entry['model']}, {entry['parallel']}, activation checkpointing {ac}"
        largest = f"{'≥ ' if entry['lower_bound'] else ''}{entry['largest_batch']}"
        if not entry["largest_batch"] and entry["stopped_by"]:  # none fit: below the smallest that failed
            largest = "< " + entry["stopped_by"].split(":")[0].removeprefix("batch ")
        ended = entry["stopped_by"] or ("the time box" if entry.get("timed_out") else "the largest size tried")
        cells = [label, _fmt(entry["gpus"], "d"), largest, _fmt(entry.get("formula_largest_batch"), "d"),
                 _fmt(entry["samples_per_s"], ",.1f"), _fmt(entry["peak_memory_gib"], ".1f"),
                 ended.replace("|", "/")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    """gpu_day.md: a heading and tables in docs/benchmarks.md's form, then what was not done."""
    gpu, v, bench = report["gpu"], report["versions"], report["bench"] or {}
    card = f"{gpu['count']}× {gpu['name'] or 'GPU'}" + (f" ({gpu['memory']})" if gpu["memory"] else "")
    out = [f"### GPU: {card} (measured {report['date'][:10]})", ""]
    out.append(
        f"Measured by `scripts/gpu_day.sh` on {card}, driver {gpu['driver'] or '?'}, torch {v.get('torch')} "
        f"(CUDA {v.get('cuda') or '?'}), transformers {str(v.get('transformers')).split(' ')[0]}; `distqa bench` "
        f"on the DummyDataset, `model.name={bench.get('model', 'bert-base-random')}`, seq {bench.get('seq_len', 512)}, "
        f"{bench.get('precision', 'bf16')} autocast, AdamW (fused), median of the repeats (min..max)."
    )
    tests = report["tests"]
    if tests:
        counts = ", ".join(f"{tests[k]} {k}" for k in ("passed", "failed", "error", "skipped") if tests[k])
        missed = f" (not passed: {', '.join(tests['not_passed'])})" if tests["not_passed"] else ""
        short = ""
        if tests.get("collection_errors"):
            count = tests["collection_errors"]
            short = f" {count} test file(s) could not be collected (the log says why): nothing ran."
        elif tests.get("cut_short"):
            unrun = f"{tests['not_run']} never ran" if tests.get("not_run") is not None else "the rest never ran"
            short = f" Cut short (its box ran out, or it was stopped): {unrun}."
        out.append(f"GPU acceptance suite (`make test-gpu`): {counts or 'no test ran'}{missed}.{short}")
    for table in (_speed_table(report), _batch_table(report)):
        if table:
            out += ["", *table]
    if report["not_done"]:
        out += ["", "Not done on this day:", "", *[f"- {line}" for line in report["not_done"]]]
    out += ["", "<!-- the steps of this run, not for docs/benchmarks.md -->", ""]
    out += ["| step | status | seconds | reason |", "|---|---|---|---|"]
    for step in report["steps"]:
        out.append(
            f"| {step['name']} | {step['status']} | {step['seconds']:g} | {step.get('reason', '').replace('|', '/')} |"
        )
    return "\n".join(out) + "\n"
