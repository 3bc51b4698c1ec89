"""The run's folder: claimed by one run at a time, and the final model written into it atomically.

Rank 0 does the file work; every rank learns how it went (a broadcast), so that no rank waits in a
collective for a rank 0 that has already failed.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError

from distqa.dist import DistInfo, broadcast_object
from distqa.durable import fsync_path
from distqa.errors import DistqaError
from distqa.runlock import RunLock


def claim(output_dir: Path, info: DistInfo) -> RunLock | None:
    """Create output_dir and take its run lock (rank 0; None elsewhere). Raises on every rank if
    the folder cannot be written or another run holds it."""
    problem: str | None = None
    lock: RunLock | None = None
    if info.is_main:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            lock = RunLock(output_dir)
            lock.acquire()
        except OSError as err:
            problem = f"output_dir={str(output_dir)!r} cannot be written: {err.strerror or err}"
        except DistqaError as err:
            problem = str(err)
    problem = broadcast_object(problem)  # type: ignore[assignment]
    if problem:
        raise DistqaError(str(problem))
    return lock


def write_text(path: Path, text: str, info: DistInfo) -> None:
    """Rank 0 writes a small file (config.yaml); every rank raises if that failed."""
    problem: str | None = None
    if info.is_main:
        try:
            path.write_text(text)
        except OSError as err:
            problem = f"output_dir={str(path.parent)!r} cannot be written: {err.strerror or err}"
    problem = broadcast_object(problem)  # type: ignore[assignment]
    if problem:
        raise DistqaError(str(problem))


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
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
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
    problem = broadcast_object(problem)  # type: ignore[assignment]
    if problem:
        raise DistqaError(str(problem))
