"""Metrics: summed on every rank (`distqa.meter`), all-reduced, then written by rank 0 alone.

Rank 0 appends one JSON object per logged step to `metrics.jsonl` and mirrors it to TensorBoard
(`tb/`); the other ranks construct the same object but write nothing, so calling code never
branches on the rank.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
from torch.utils.tensorboard import SummaryWriter

from distqa.dist import DistInfo
from distqa.durable import open_append, write_atomically
from distqa.rank0 import fix_for, raise_on_every_rank, reason


def _record(raw: bytes) -> dict[str, Any] | None:
    """The object on one line of metrics.jsonl, or None when the line is damaged: not UTF-8, not
    JSON, not an object, or without a finite number as its step (a bool is not a step, nor an int of
    hundreds of digits, which no run reaches and math.isfinite cannot take)."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    if not isinstance(record, dict):
        return None
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        return None
    if abs(step) >= 2**63 if isinstance(step, int) else not math.isfinite(step):
        return None
    return record


def read_metrics(path: Path) -> tuple[list[tuple[bytes, dict[str, Any]]], list[int]]:
    """The good lines of `path` in order (raw bytes without the newline, and the parsed object), and
    the 1-based numbers of the damaged ones, which are reported in one warning line.

    Lines are split on b"\\n" alone, as they are written, so a kept line is kept byte for byte."""
    good: list[tuple[bytes, dict[str, Any]]] = []
    damaged: list[int] = []
    pieces = path.read_bytes().split(b"\n")
    if pieces[-1] == b"":
        pieces.pop()  # the empty piece after the final newline is not a line
    for number, raw in enumerate(pieces, start=1):
        record = _record(raw)
        if record is None:
            damaged.append(number)
        else:
            good.append((raw, record))
    if damaged:
        shown = ", ".join(str(n) for n in damaged[:10]) + (", ..." if len(damaged) > 10 else "")
        print(f"warning: {path}: skipped {len(damaged)} damaged line(s) (lines {shown})", flush=True)
    return good, damaged


def _after_newest_event_file(tb_dir: Path) -> None:
    """Wait, at most a second, until this second is later than the newest event file's. TensorBoard
    reads a folder's files in name order, `events.out.tfevents.<second>.<host>.<pid>.<count>`, and a
    file's purge step drops what the files before it hold from that step on: within one second the
    order came from the pid and a counter compared as text (99 after 100), so a resume's files were
    read before the first run's, whose purge at step 1 dropped them (one evaluation point of four)."""
    newest = 0
    with contextlib.suppress(OSError):
        for path in tb_dir.glob("events.out.tfevents.*"):
            stamp = path.name.split(".")[3]
            newest = max(newest, int(stamp)) if stamp.isdigit() else newest
    now = time.time()
    if int(now) == newest:  # (a file from a later second, another machine's clock: no wait helps)
        time.sleep(newest + 1 - now)


class MetricsWriter:
    """metrics.jsonl + TensorBoard on rank 0; a silent stand-in elsewhere."""

    def __init__(self, output_dir: Path, info: DistInfo, *, resume_step: int = 0) -> None:
        """Every rank must construct it (rank 0's failure to open the records, a full disk, is one
        line on every rank)."""
        self.enabled = info.is_main
        self.path, self.tb_dir = output_dir / "metrics.jsonl", output_dir / "tb"
        self._tb: SummaryWriter | None = None
        problem = None
        if self.enabled:
            try:
                self._truncate_after(resume_step)
            except OSError as err:
                problem = _cannot_write(f"rewrite {self.path}", err)
            if problem is None:
                problem = self._open_tb(resume_step)
        raise_on_every_rank(problem)

    def _open_tb(self, resume_step: int) -> str | None:
        _quiet_writer_thread()
        try:
            # purge_step drops TensorBoard events past the resume point, as _truncate_after does
            # for the JSON lines: a resumed run's curves continue instead of doubling back.
            # Step 0 too: evaluate_again replaces step 1's line so (its events doubled step 1's points).
            _after_newest_event_file(self.tb_dir)
            self._tb = SummaryWriter(str(self.tb_dir), purge_step=resume_step + 1)
        except OSError as err:
            return _cannot_write(f"write {self.tb_dir}", err)
        return None

    def _truncate_after(self, step: int) -> None:
        """Keep the lines of steps <= `step` (the checkpoint we resume from), byte for byte; drop the
        rest. A damaged line is dropped with a warning: it must not stop every later resume."""
        if not self.path.exists():
            return
        lines, damaged = read_metrics(self.path)
        kept = [raw for raw, record in lines if record["step"] <= step]
        if len(kept) == len(lines) and not damaged and self.path.read_bytes().endswith(b"\n"):
            return  # nothing to drop: leave the file alone
        # Written aside and renamed over: a crash during the rewrite keeps the old file whole.
        write_atomically(self.path, b"".join(raw + b"\n" for raw in kept))

    def log(self, record: dict[str, Any]) -> None:
        """Rank 0 appends the record; every rank calls it and learns whether that worked (a rank 0
        that stopped alone would leave the others waiting in their next collective)."""
        raise_on_every_rank(self._write(record) if self.enabled else None)

    def _write(self, record: dict[str, Any]) -> str | None:
        # JSON has no infinity: a threshold that keeps nothing is written as null.
        clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        line = (json.dumps(clean) + "\n").encode("utf-8")
        try:
            # O_NOFOLLOW: a link planted as metrics.jsonl after the run claimed the folder is refused,
            # not appended through.
            fd = open_append(self.path)
            try:
                view = memoryview(line)
                while view:  # a short write (a filling disk) goes on where it stopped, or raises
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
        except OSError as err:
            if self.path.is_symlink():
                return f"cannot append to {self.path} (it is a symbolic link): remove the link and {_AGAIN}"
            return _cannot_write(f"append to {self.path}", err)
        assert self._tb is not None
        step = int(record["step"])
        try:
            # (TensorBoard's writer thread keeps a write's error until the next call: flush raises it.)
            for key, value in record.items():
                # A non-finite value (a threshold that keeps nothing) is null in the JSON: no point here.
                if key not in ("step", "epoch") and isinstance(value, (int, float)) and math.isfinite(value):
                    tag = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
                    self._tb.add_scalar(tag, value, step)
            self._tb.flush()
        except OSError as err:
            return _cannot_write(f"write {self.tb_dir}", err)
        return None

    def close(self) -> None:
        """At the end of the steps: every rank must call it (rank 0's last write to tb/ may fail)."""
        problem = None
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError as err:
                problem = _cannot_write(f"write {self.tb_dir}", err)
            self._tb = None
        raise_on_every_rank(problem)

    def abandon(self) -> None:
        """After an error (or a stop) on the way out, on each rank alone: no collective, no error of its own."""
        if self._tb is not None:
            with contextlib.suppress(OSError):
                self._tb.close()
            self._tb = None


_AGAIN = "run the same command again to resume"


def _quiet_writer_thread() -> None:
    """TensorBoard's writer thread keeps a write's error for the next call (reported in one line
    then) and also raises it in the thread, whose traceback Python would print first: that one
    is left out. Any other thread's error is printed as before."""
    previous = threading.excepthook
    if getattr(previous, "distqa_quiet", False):
        return

    def hook(args: Any) -> None:
        if not (isinstance(args.thread, _AsyncWriterThread) and isinstance(args.exc_value, OSError)):
            previous(args)

    hook.distqa_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def _cannot_write(what: str, err: OSError) -> str:
    """One line for a write of the records that failed (`what`: "append to PATH")."""
    return f"cannot {what} ({reason(err)}): {fix_for(err)} and {_AGAIN}"


def _number(value: Any) -> float:
    # A field of the wrong type in an otherwise good line is a gap in its curve, not a crash.
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


_TRAIN_PANELS = (("loss", "training loss"), ("lr", "learning rate"), ("samples_per_s", "samples/s (all ranks)"))
# Drawn when the records have it (metrics.jsonl of runs before it was logged do not).
_GRAD_NORM_PANEL = ("grad_norm", "gradient norm\n(before clipping)")


def plot_metrics(metrics_path: Path, png_path: Path, *, title: str | None = None) -> bool:
    """Loss, learning rate, throughput, gradient norm and each validation metric against step, from
    metrics.jsonl, as one PNG titled `title` (default: the folder of metrics.jsonl); also the PNG's
    Title field. False: nothing to draw, no file written."""
    # A bare Figure on the Agg canvas: no display on training machines, and no pyplot (its
    # import and global figure registry cost every run about half a second for one picture).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = [record for _, record in read_metrics(metrics_path)[0]]
    if not records:
        return False  # nothing to draw; a figure of empty axes would only mislead
    # Every validation metric a task logs (`eval_*`), whatever the task: a panel each, as their
    # scales differ (a loss near 3, an F1 near 0.6, a count of thousands).
    eval_keys = sorted(
        {k for r in records for k, v in r.items() if k.startswith("eval_") and not math.isnan(_number(v))}
    )
    norms = [_GRAD_NORM_PANEL] if any(not math.isnan(_number(r.get("grad_norm"))) for r in records) else []
    panels = [*_TRAIN_PANELS, *norms, *((key, f"validation {key[len('eval_') :]}") for key in eval_keys)]
    fig = Figure(figsize=(8, 1.1 + 1.9 * len(panels)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True)
    for ax, (key, label) in zip(axes, panels):
        points = [(r["step"], _number(r.get(key))) for r in records]
        if key.startswith("eval_") or key == "grad_norm":  # some steps only: the points, joined
            points = [(step, value) for step, value in points if not math.isnan(value)]
        sparse = key.startswith("eval_") or len(points) < 50
        ax.plot(*zip(*points), marker="o" if key.startswith("eval_") else "." if sparse else None)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    title = title or str(metrics_path.parent)
    # Wrapped to the figure's width: a run's title (task, model, data, batch, ...) is often longer,
    # and suptitle centres one line, cut at both edges.
    fig.suptitle("\n".join(textwrap.fill(line, width=80, break_on_hyphens=False) for line in title.splitlines()))
    fig.tight_layout()
    return _save_png(fig, png_path, title)


def _save_png(fig: Any, png_path: Path, title: str) -> bool:
    """Rendered in memory, then written without following a link planted at png_path."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, metadata={"Title": title})
    try:
        write_atomically(png_path, buffer.getvalue())
    except OSError as err:  # a full disk: the plot is a convenience, the run's results are not lost
        print(f"warning: cannot write {png_path} ({err.strerror or err}): metrics.jsonl holds the same", flush=True)
        return False
    return True
