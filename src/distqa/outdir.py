"""The run's folder: claimed by one run at a time, its records written atomically, and the final
model written into it atomically.

Rank 0 does the file work; every rank learns how it went (a broadcast), so that no rank waits in a
collective for a rank 0 that has already failed.

Nothing distqa writes in output_dir goes through a symbolic link: a link planted there
(`config.yaml` -> a file of the user's) would make a run overwrite whatever it points to. `claim`
refuses a folder whose run files are links, and the writes themselves create files without
following one (`distqa.durable`), for a link planted after that check.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError

from distqa.dist import DistInfo, broadcast_object
from distqa.durable import fsync_path, read_no_link, write_atomically
from distqa.errors import DistqaError
from distqa.runlock import LOCK_NAME, RunLock

CONFIG_FILE = "config.yaml"
HISTORY_DIR = "config-history"
# What a run writes in output_dir (and `train.resume=never` moves into earlier-runs/).
RUN_PATHS = (CONFIG_FILE, "metrics.jsonl", LOCK_NAME, "checkpoints", "model", "tb", "metrics.png", HISTORY_DIR)


def _raise_on_every_rank(problem: str | None) -> None:
    """Rank 0's outcome to every rank: each raises the same one line, or none does."""
    problem = broadcast_object(problem)  # type: ignore[assignment]
    if problem:
        raise DistqaError(str(problem))


def linked_run_path(output_dir: Path) -> str | None:
    """The first of the run's files in output_dir that is a symbolic link, as a one-line refusal."""
    for name in (*RUN_PATHS, "earlier-runs"):
        path = output_dir / name
        if path.is_symlink():
            return (
                f"{path} is a symbolic link (to {os.readlink(path)!r}); distqa writes a run's files in "
                "output_dir itself and never through a link: remove the link, or use another output_dir"
            )
    return None


def claim(output_dir: Path, info: DistInfo) -> RunLock | None:
    """Create output_dir and take its run lock (rank 0; None elsewhere). Raises on every rank if
    the folder cannot be written, one of its run files is a symbolic link (checked before the
    lock is taken: run.lock itself may be one), or another run holds it."""
    problem: str | None = None
    lock: RunLock | None = None
    if info.is_main:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            problem = linked_run_path(output_dir)
            if problem is None:
                lock = RunLock(output_dir)
                lock.acquire()
        except OSError as err:
            problem = f"output_dir={str(output_dir)!r} cannot be written: {err.strerror or err}"
        except DistqaError as err:
            problem = str(err)
    _raise_on_every_rank(problem)
    return lock


def write_text(path: Path, text: str, info: DistInfo) -> None:
    """Rank 0 replaces a small file (config.yaml) atomically: written aside, fsynced and renamed
    over it, never through a link; every rank raises if that failed."""
    problem: str | None = None
    if info.is_main:
        try:
            write_atomically(path, text.encode("utf-8"))
        except OSError as err:
            problem = f"output_dir={str(path.parent)!r} cannot be written: {err.strerror or err}"
    _raise_on_every_rank(problem)


def archive_config(output_dir: Path, step: int, info: DistInfo) -> Path | None:
    """Rank 0 keeps the current output_dir/config.yaml as config-history/<step>.yaml before a resume
    at `step` with changed settings rewrites it, so the records still say what trained before
    that step. Nothing to keep (no config.yaml): a no-op. An existing history file is never
    overwritten: the copy takes the next free name (`<step>-2.yaml`, ...). Returns the copy on
    rank 0 (None elsewhere, and when there was nothing to keep); a failure is one line on every rank."""
    problem: str | None = None
    kept: Path | None = None
    if info.is_main:
        source, history = output_dir / CONFIG_FILE, output_dir / HISTORY_DIR
        try:
            try:
                data = read_no_link(source)
            except FileNotFoundError:
                data = None
            if data is not None:
                if history.is_symlink():
                    raise OSError(f"{history} is a symbolic link")
                history.mkdir(exist_ok=True)
                kept, n = history / f"{step}.yaml", 2
                while kept.exists() or kept.is_symlink():  # one writer (the lock's holder): no race
                    kept, n = history / f"{step}-{n}.yaml", n + 1
                write_atomically(kept, data)
        except OSError as err:
            problem = (
                f"cannot keep the earlier {source} as {history / f'{step}.yaml'} ({err.strerror or err}): "
                "free space in output_dir (or remove the link named) and run again"
            )
    _raise_on_every_rank(problem)
    return kept


def _remove(path: Path) -> None:
    """Remove a folder left by an earlier export, or a link planted under its name (rmtree would
    refuse the link, and `save` would then write through it)."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for path in [*sorted(p for p in root.rglob("*") if p.is_file()), root]:
        fsync_path(path)


def export_atomically(save: Callable[[Path], None], directory: Path, info: DistInfo, note: str) -> None:
    """Rank 0 calls `save(folder)` into a hidden folder beside `directory`, fsyncs it and renames
    it into place, so `directory` is always a whole export: the previous one, or the new one. A
    failure (a full disk) leaves the previous export as it was and is one line on every rank;
    `note` says what the user can do then."""
    problem: str | None = None
    if info.is_main:
        tmp = directory.with_name(f".tmp-{directory.name}")
        old = directory.with_name(f".old-{directory.name}")
        try:
            _remove(tmp)
            _remove(old)
            save(tmp)
            _fsync_tree(tmp)
            if directory.exists():
                directory.rename(old)
            tmp.rename(directory)
            shutil.rmtree(old, ignore_errors=True)
        except (OSError, RuntimeError, ValueError, SafetensorError, DistqaError) as err:
            # (DistqaError: a task's save_model, or rebuilding a sharded model, that cannot load
            # what it needs.) Rank 0 alone runs `save`: the others learn of it just below.
            shutil.rmtree(tmp, ignore_errors=True)
            if old.exists() and not directory.exists():
                old.rename(directory)
            reason = getattr(err, "strerror", None) or (str(err).strip().splitlines() or [type(err).__name__])[0]
            problem = f"cannot write {directory} ({reason}): {note}"
    _raise_on_every_rank(problem)
