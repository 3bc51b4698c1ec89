"""The folder `distqa prepare` writes: claimed, written by one process at a time, staged inside
itself, and committed stamp-last.

Everything is staged inside the output folder (`.distqa-partial/`), so a writable output folder is
enough even where its parent is not writable. The fingerprint file is removed before the old files
are replaced and written last, so a folder is complete exactly when it holds that file; a folder
left without it by a crash still holds `.distqa-partial/`, which marks it as ours to rebuild. The
writer holds an flock on `.distqa-prepare.lock` in the folder; a second writer waits for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from distqa.durable import file_in_the_way, fsync_path, held_exclusively
from distqa.errors import DistqaError

FINGERPRINT_FILE = "distqa_fingerprint.json"
STAGING_DIR = ".distqa-partial"
LOCK_FILE = ".distqa-prepare.lock"  # held by the one process writing the folder; never removed


def read_stamp(stamp: Path) -> dict[str, Any] | None:
    """The fingerprint record, or None when it is missing or damaged (then the folder is rebuilt)."""
    try:
        record = json.loads(stamp.read_bytes())
    except (OSError, ValueError, RecursionError):  # absent, unreadable, not UTF-8, not JSON, too deep
        return None
    return record if isinstance(record, dict) else None


def _reason(err: OSError) -> str:
    return err.strerror or str(err)


def claim(target: Path) -> None:
    """Check that `target` can become a features folder: created if missing, else ours or empty.

    Only the output folder itself must be writable: its parent only when it has to be created.
    """
    blocker = file_in_the_way(target)
    if blocker is not None:
        where = "it" if blocker == target else str(blocker)
        raise DistqaError(f"cannot write features to {target}: {where} is a file, not a folder")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DistqaError(f"cannot create the folder {target} ({_reason(err)}): choose another --output") from None
    try:
        ours = (target / FINGERPRINT_FILE).is_file() or (target / STAGING_DIR).is_dir()
        if not ours and any(entry.name != LOCK_FILE for entry in target.iterdir()):
            raise DistqaError(f"{target} exists and is not a distqa features folder: choose another --output")
    except OSError as err:
        raise DistqaError(f"cannot write features to {target}: {_reason(err)}") from None


def open_staging(target: Path) -> Path:
    """An empty staging folder in `target` (claimed, and locked by this process)."""
    try:
        staging = target / STAGING_DIR
        shutil.rmtree(staging, ignore_errors=True)  # left by a run that was killed: never reused
        staging.mkdir()
    except OSError as err:
        raise DistqaError(f"cannot write features to {target}: {_reason(err)}") from None
    return staging


def commit(target: Path, staged: Path, record: str) -> None:
    """Replace the contents of `target` with those of `staged`; the stamp goes first and comes last."""
    for path in staged.rglob("*"):
        if path.is_file():
            fsync_path(path)
    # From here until the new stamp lands, readers (`load_features`, a reuse check) see an
    # incomplete folder and refuse or rebuild it, instead of mixing old and new files.
    (target / FINGERPRINT_FILE).unlink(missing_ok=True)
    fsync_path(target)
    for entry in target.iterdir():
        if entry.name in (STAGING_DIR, LOCK_FILE):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    for entry in staged.iterdir():
        os.replace(entry, target / entry.name)
    pending = target / STAGING_DIR / FINGERPRINT_FILE
    pending.write_text(record)
    fsync_path(pending)
    os.replace(pending, target / FINGERPRINT_FILE)
    fsync_path(target)


@contextlib.contextmanager
def one_writer(target: Path) -> Iterator[None]:
    """The body runs while this process alone writes `target` (claimed); another writer is waited
    for, with one line saying so."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(held_exclusively(target / LOCK_FILE, lambda: _waiting(target)))
        except OSError as err:  # a folder made read-only meanwhile, a link planted as the lock file
            raise DistqaError(f"cannot write features to {target}: {_reason(err)}") from None
        yield


def _waiting(target: Path) -> None:
    print(f"waiting for another process that is preparing features in {target}", flush=True)
