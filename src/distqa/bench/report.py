"""Turn the workers' measurements into bench.json's figures and bench.png's plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from distqa.flops import ModelShape, peak_tflops
from distqa.steptimer import PHASES

# Repeats of one figure that differ by more than this (max - min over the median) say the machine's
# load changed between them: the median is then no steady-state figure either.
SPREAD_LIMIT = 0.10


def _rate(run: dict[str, Any], key: str) -> float:
    return run[key] / run["seconds"]


def spread(values: list[float]) -> dict[str, float | None]:
    """min, median, max and the relative spread (max - min) / median; one value has no spread (None)."""
    median = statistics.median(values)
    relative = (max(values) - min(values)) / median if len(values) > 1 and median else None
    return {"min": min(values), "median": median, "max": max(values), "relative": relative}


def summarize(
    nproc: int, trainer_runs: list[dict[str, Any]], baseline_runs: list[dict[str, Any]], peak: float | None
) -> dict[str, Any]:
    """One world size's row. Several repeats: the median throughput and its spread, the mean breakdown."""
    first = trainer_runs[0]
    rates = [_rate(r, "samples") for r in trainer_runs]
    samples_per_s = statistics.median(rates)
    tokens_per_s = statistics.median(_rate(r, "tokens") for r in trainer_runs)
    phase_ms = {k: statistics.fmean(r["phase_ms"][k] for r in trainer_runs) for k in PHASES}
    step_ms = sum(phase_ms.values())
    if peak is None and not first["device"].startswith("cpu"):  # no table for CPUs: MFU needs --peak-tflops
        peak = peak_tflops(first["device"], first["precision"], tf32=first.get("fp32_matmul") != "highest")
    # T of the attention term: the tokens a sequence really has (padding is not useful work;
    # with padding to each batch's longest sequence it is a small part of it).
    context = first["tokens"] / first["samples"]
    flops_per_token = achieved = None
    if first["non_embedding_params"] is not None:  # None: the task's model_shape could not tell
        shape = ModelShape(first["non_embedding_params"], first["layers"], first["hidden_size"])
        flops_per_token = shape.flops_per_token(round(context))
        achieved = flops_per_token * tokens_per_s / nproc / 1e12
    row: dict[str, Any] = {
        "nproc": nproc,  # processes; for a train.parallel=dp row, the GPUs its one process spreads over
        "parallel": first.get("parallel", "ddp"),  # ddp | fsdp (the settings' mode) | dp (`distqa bench --dp`)
        "samples_per_s": samples_per_s,
        "tokens_per_s": tokens_per_s,
        "samples_per_s_per_process": samples_per_s / nproc,
        "grad_accum": first.get("grad_accum"),  # each row's own: train.global_batch sets it per process count
        "step_ms": step_ms,
        "step_breakdown_ms": phase_ms,
        "step_breakdown_pct": {k: 100.0 * v / step_ms if step_ms else 0.0 for k, v in phase_ms.items()},
        "mean_tokens_per_sample": context,
        "flops_per_token": flops_per_token,
        "model_tflops_per_process": achieved,
        "peak_tflops_per_process": peak,
        "mfu": achieved / peak if peak and achieved is not None else None,
        "peak_memory_gib": first.get("peak_memory_gib"),
        **state_mib(first.get("state_bytes")),
        "threads_per_process": first["threads_per_process"],
        "repeats": rates,
        "samples_per_s_spread": spread(rates),
    }
    if baseline_runs:
        base_rates = [_rate(r, "samples") for r in baseline_runs]
        base = statistics.median(base_rates)
        row["baseline_samples_per_s"] = base
        row["baseline_repeats"] = base_rates
        row["baseline_samples_per_s_spread"] = spread(base_rates)
        row["trainer_over_baseline"] = samples_per_s / base
        row["baseline_step_breakdown_ms"] = {
            k: statistics.fmean(r["phase_ms"][k] for r in baseline_runs) for k in PHASES
        }
    return row


def state_mib(state: dict[str, int] | None) -> dict[str, Any]:
    """`state_mib_per_rank` (parameters + gradients + optimizer state one rank holds) and its parts."""
    if not state:
        return {"state_mib_per_rank": None, "state_mib_breakdown": None}
    parts = {k: v / 2**20 for k, v in state.items()}
    return {"state_mib_per_rank": sum(parts.values()), "state_mib_breakdown": parts}


def is_dp(row: dict[str, Any]) -> bool:
    return row.get("parallel") == "dp"


def add_scaling(rows: list[dict[str, Any]]) -> None:
    """Scaling efficiency: throughput per process (per GPU, for dp rows) against that of the
    smallest world size of the same kind, DDP's rows against DDP's and DataParallel's against its
    own; each dp row also gets `dp_over_ddp`, its throughput over the DDP row of as many GPUs.

    Its spread pairs the repeats by round: the launcher runs round i of every world size back to
    back, so round i's figures saw about the same machine load and their ratio is the fairest one.
    """
    for kind in (False, True):
        group = [row for row in rows if is_dp(row) == kind]
        if not group:
            continue
        reference = min(group, key=lambda r: r["nproc"])
        per_process = reference["samples_per_s_per_process"]
        for row in group:
            row["scaling_efficiency"] = row["samples_per_s_per_process"] / per_process
            pairs = zip(row["repeats"], reference["repeats"], strict=False)
            rounds = [(mine / row["nproc"]) / (ref / reference["nproc"]) for mine, ref in pairs]
            row["scaling_efficiency_spread"] = {"min": min(rounds), "max": max(rounds)}
    ddp = {row["nproc"]: row for row in rows if not is_dp(row)}
    for row in rows:
        if is_dp(row) and row["nproc"] in ddp:
            row["dp_over_ddp"] = row["samples_per_s"] / ddp[row["nproc"]]["samples_per_s"]


def row_label(row: dict[str, Any]) -> str:
    """A row's name in warnings and the plot: `nproc N` (processes), `dp N` (one process, N GPUs)."""
    return f"dp {row['nproc']}" if is_dp(row) else f"nproc {row['nproc']}"


def implausible(rows: list[dict[str, Any]]) -> list[str]:
    """One warning line per figure that cannot be trusted as it stands."""
    lines = []
    for row in rows:
        where = row_label(row)
        # Per-process throughput cannot grow with more processes sharing the work: above 100 %
        # the reference run was slowed by something else (other load, a cold cache).
        if round(100 * row["scaling_efficiency"], 1) > 100.0:
            lines.append(
                f"{where}: scaling efficiency {100 * row['scaling_efficiency']:.1f} % is above 100 %: more "
                "than linear, which DDP with a fixed batch per process should not reach; the smallest process "
                "count's runs were probably slowed by other load"
            )
        figures = (
            ("samples_per_s_spread", "samples/s"),
            ("baseline_samples_per_s_spread", "hand-written loop samples/s"),
        )
        for key, label in figures:
            figure = row.get(key)
            if figure and figure["relative"] is not None and figure["relative"] > SPREAD_LIMIT:
                lines.append(
                    f"{where}: {label} spread {100 * figure['relative']:.1f} % over its repeats "
                    f"({figure['min']:.1f} to {figure['max']:.1f}) is over {100 * SPREAD_LIMIT:.0f} %: "
                    "the machine's load changed between runs; rerun on a quiet machine or with more --repeats"
                )
    return [f"distqa bench: warning: {line}" for line in lines]


def _bars(rows: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list[float], list[list[float]]]:
    """A figure's medians and matplotlib's asymmetric error bars, from its `KEY_spread`."""
    medians = [scale * r[key] for r in rows]
    low = [max(0.0, m - scale * r[f"{key}_spread"]["min"]) for m, r in zip(medians, rows)]
    high = [max(0.0, scale * r[f"{key}_spread"]["max"] - m) for m, r in zip(medians, rows)]
    return medians, [low, high]


def plot(result: dict[str, Any], png: Path) -> None:
    """Throughput (with ideal linear scaling), scaling efficiency, the step-time breakdown and the
    memory per rank; `distqa bench --dp`'s DataParallel rows as a series of their own beside DDP's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_rows = result["runs"]
    rows, dp_rows = [r for r in all_rows if not is_dp(r)], [r for r in all_rows if is_dp(r)]
    nprocs = sorted({r["nproc"] for r in all_rows})
    fig, (ax_tp, ax_eff, ax_bd, ax_mem) = plt.subplots(1, 4, figsize=(20, 4.5))
    ref = rows[0] if rows else dp_rows[0]
    ideal = [ref["samples_per_s_per_process"] * n for n in nprocs]
    # Medians, the bars spanning the repeats' min to max.
    series = [(rows, "o", "distqa trainer"), (dp_rows, "D", "DataParallel, 1 process (--dp)")]
    for group, marker, label in series:
        if group:
            counts = [r["nproc"] for r in group]
            ax_tp.errorbar(counts, *_bars(group, "samples_per_s"), marker=marker, capsize=4, label=label)
            ax_eff.errorbar(
                counts, *_bars(group, "scaling_efficiency", scale=100.0), marker=marker, capsize=4, label=label
            )
    if rows and all("baseline_samples_per_s" in r for r in rows):
        counts = [r["nproc"] for r in rows]
        ax_tp.errorbar(
            counts, *_bars(rows, "baseline_samples_per_s"), marker="s", capsize=4, label="hand-written DDP loop"
        )
    ax_tp.plot(nprocs, ideal, linestyle="--", color="grey", label="linear scaling")
    ax_tp.set(xlabel="processes (dp: GPUs)", ylabel="samples/s (all processes)", xticks=nprocs)
    ax_tp.set_title("throughput (median; bars: min to max of the repeats)", fontsize="medium")
    ax_tp.legend()
    ax_eff.axhline(100, linestyle="--", color="grey")
    ax_eff.set(xlabel="processes (dp: GPUs)", ylabel="% of linear", title="scaling efficiency", xticks=nprocs)
    ax_eff.set_ylim(bottom=0)
    if dp_rows:
        ax_eff.legend(fontsize="small")
    ordered = rows + dp_rows
    labels = [str(r["nproc"]) if not is_dp(r) else row_label(r) for r in ordered]
    bottom = [0.0] * len(ordered)
    for phase in PHASES:
        values = [r["step_breakdown_ms"][phase] for r in ordered]
        ax_bd.bar(labels, values, bottom=bottom, label=phase.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_bd.set(
        xlabel="processes (dp N: 1 process, N GPUs)", ylabel="ms per step (mean over processes)", title="step time"
    )
    ax_bd.legend(fontsize="small")
    _plot_memory(ax_mem, ordered, labels)
    for ax in (ax_tp, ax_eff, ax_bd, ax_mem):
        ax.grid(alpha=0.3)
    title = f"{result['device']}, {result['model']}, {result.get('parallel', 'ddp')}, {result['precision']}"
    title += f", seq {result['seq_len']}"
    fig.suptitle(f"{title}, batch {result['batch_size']} per process" + (" (dp: per GPU)" if dp_rows else ""))
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def _plot_memory(ax: Any, rows: list[dict[str, Any]], labels: list[str]) -> None:
    """Per rank: the training state as stacked parts and, on CUDA, the peak allocated memory."""
    bottom = [0.0] * len(rows)
    for part in ("parameters", "gradients", "optimizer"):
        values = [(r.get("state_mib_breakdown") or {}).get(part, 0.0) for r in rows]
        ax.bar(labels, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    peaks = [r.get("peak_memory_gib") for r in rows]
    if any(peaks):
        ax.plot(labels, [1024 * (p or 0.0) for p in peaks], "k^", label="peak allocated (CUDA)")
    ax.set(xlabel="processes", ylabel="MiB per rank", title="memory per rank (state between steps)")
    ax.legend(fontsize="small")
