"""The end of a training run: model/ from the final weights, recorded with the checkpoint they
come from, and the plot of the run's metrics.

A finished run counts as exported only when model/ says it holds the final checkpoint's weights
(`checkpoint_verify.SOURCE_FILE`). A model/ left by an earlier, shorter run in the same output_dir
(its export failed on a full disk, or the process was killed between the final checkpoint and the
export) would otherwise be reported as this run's model, with exit 0; it is written again.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from torch import nn

from distqa import parallel
from distqa.checkpoint_verify import export_damage, exported_from
from distqa.config import Config
from distqa.console import outputs_summary, run_title
from distqa.dist import DistInfo, print0
from distqa.durable import as_umask_allows
from distqa.errors import DistqaError
from distqa.metrics import plot_metrics
from distqa.outdir import export_atomically, layer_warning
from distqa.rank0 import on_rank0
from distqa.task import Task


def is_exported(out: Path, final: Path, info: DistInfo) -> bool:
    """Whether out/model holds checkpoint `final`'s weights, its files as the export wrote them
    (rank 0 looks; every rank learns it). When it holds other weights, or a file of it was damaged
    since, says that it is written again."""
    model = out / "model"

    def look() -> bool:
        if not model.exists():
            return False
        damage = export_damage(model)  # (its files hashed once: the verdict and the line both need it)
        if damage is not None:  # a file changed since the export wrote it: a rerun must not call it finished
            print(f"distqa: warning: {model} is damaged ({damage}): writing it again", file=sys.stderr, flush=True)
            return False
        if not exported_from(model, final):
            print(f"{model} does not record that it holds the weights of {final}: writing it again", flush=True)
            return False
        return True

    return bool(on_rank0(info, look))


def save_task_model(task: Task, model: nn.Module, folder: Path) -> None:
    """`task.save_model` into `folder`, which must then hold a file of its own (beyond distqa's
    `distqa_*` records): a fork's `torch.save(state, "model.pt")` without the folder wrote the
    weights into the working directory, and the run said "model written to .../model", exit 0."""
    task.save_model(model, folder)
    as_umask_allows(folder.rglob("*"))
    if not any(p.is_file() and not p.name.startswith("distqa_") for p in folder.rglob("*")):
        raise DistqaError(
            f"the task's save_model wrote no file into {folder}: write the model into the directory it is given"
        )


def export_final(
    task: Task, raw_model: nn.Module, out: Path, info: DistInfo, *, final: Path, step: int, sharded: bool
) -> None:
    """out/model from the weights of `raw_model`, those of checkpoint `final` at `step`. A sharded
    model is gathered by every rank first; rank 0 then builds the whole one inside the export,
    whose failures every rank learns of."""
    weights = parallel.full_weights(raw_model) if sharded else None

    def save(folder: Path) -> None:
        task.weights_step = step
        save_task_model(task, parallel.whole_model(raw_model, weights, task.build_model), folder)
        # The task.* settings travel with the model: `distqa predict` builds its inputs alike.
        task.save_settings(folder)

    export_atomically(
        save,
        out / "model",
        info,
        note="the final checkpoint holds the same weights: {fix} and run the same command "
        "again (it only writes model/)",
        source=final,
    )


def plot_run(out: Path, cfg: Config, task: Task, global_batch: int, *, again: bool = True) -> bool:
    """Rank 0: metrics.png, titled with the task and the settings it uses; False without metrics.
    `again=False` (a finished run that only exports): only when metrics.png is missing or older
    than metrics.jsonl, as a run killed between its last checkpoint and its plot leaves it."""
    metrics_path, png = out / "metrics.jsonl", out / "metrics.png"
    if not metrics_path.is_file():
        return False
    if not again:
        with contextlib.suppress(OSError):
            if png.stat().st_mtime_ns >= metrics_path.stat().st_mtime_ns:
                return False
    uses: Any = getattr(task, "core_settings", None)
    return plot_metrics(metrics_path, png, title=run_title(cfg, global_batch, uses=uses))


def summary(out: Path, plotted: bool) -> None:
    print0(outputs_summary(out, plotted=plotted))
    # Said again as the last line: the one a user reads before the container is gone.
    if (warning := layer_warning(out)) is not None:
        print0(warning, file=sys.stderr)
