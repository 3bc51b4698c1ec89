"""The folder `distqa prepare` writes: claimed, written by one process at a time, staged inside
itself, and committed stamp-last.

Everything is staged inside the output folder (`.distqa-partial/`), so a writable output folder is
enough even where its parent is not writable. The fingerprint file is removed before the old files
are replaced and written last, so a folder is complete exactly when it holds that file; a folder
left without it by a crash still holds `.distqa-partial/`, which marks it as ours to rebuild. The
writer holds an flock on `.distqa-prepare.lock` in the folder; a second writer waits for it.
`PrepareResult` says what a prepare did: counted by its workers, or read from a reused folder's stamp.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from distqa.durable import file_in_the_way, fsync_path, held_exclusively
from distqa.errors import DistqaError
from distqa.nq.reader import LINES_SHOWN, shown_lines

FINGERPRINT_FILE = "distqa_fingerprint.json"
STAGING_DIR = ".distqa-partial"
LOCK_FILE = ".distqa-prepare.lock"  # held by the one process writing the folder; never removed
# Skipped lines whose numbers and reasons the fingerprint file keeps, so that a run reusing the
# features says which lines its data lacks, as the run that prepared them did.
BAD_LINES_KEPT = LINES_SHOWN


def read_stamp(stamp: Path) -> dict[str, Any] | None:
    """The fingerprint record, or None when it is missing or damaged (then the folder is rebuilt)."""
    try:
        record = json.loads(stamp.read_bytes())
    except (OSError, ValueError, RecursionError):  # absent, unreadable, not UTF-8, not JSON, too deep
        return None
    return record if isinstance(record, dict) else None


@dataclasses.dataclass
class PrepareResult:
    path: Path
    reused: bool
    docs: int = 0
    features: int = 0
    # (line number, reason) of the skipped lines: all of them when prepared now, the first
    # BAD_LINES_KEPT when reused (as the fingerprint file recorded them); `skipped` counts them all.
    bad_lines: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    skipped: int = 0

    @property
    def docs_per_s(self) -> float:
        return self.docs / self.seconds if self.seconds else 0.0

    def skipped_note(self, source: str | os.PathLike | None = None) -> str:
        """'skipped N bad line(s) [of FILE]: line 3, 7 (first: reason)', or '' when none was skipped."""
        if not self.skipped:
            return ""
        of = f" of {source}" if source is not None else ""
        shown = [line for line, _ in self.bad_lines[:BAD_LINES_KEPT]]
        if not shown:  # a folder stamped before the lines were recorded
            return (
                f"skipped {self.skipped} bad line(s){of} (which ones was not recorded: "
                f"delete {self.path} to prepare it again and see them)"
            )
        lines = shown_lines(shown, self.skipped)
        return f"skipped {self.skipped} bad line(s){of}: line {lines} (first: {self.bad_lines[0][1]})"


def recorded_result(folder: str | os.PathLike, record: dict[str, Any] | None = None) -> PrepareResult:
    """A reuse of a prepared folder, with the counts its fingerprint record (read if not given) holds."""
    record = (read_stamp(Path(folder) / FINGERPRINT_FILE) or {}) if record is None else record
    count = {k: v for k, v in record.items() if type(v) is int}  # docs, features, bad_lines
    kept = record.get("bad_line_samples")
    samples = [tuple(b) for b in kept if isinstance(b, list) and len(b) == 2] if isinstance(kept, list) else []
    return PrepareResult(
        Path(folder), True, count.get("docs", 0), count.get("features", 0), samples, skipped=count.get("bad_lines", 0)
    )


def summary(target: Path, stats: list[dict[str, Any]]) -> PrepareResult:
    """What a prepare that built the folder now did, from its worker processes' counts."""
    return PrepareResult(
        target,
        reused=False,
        docs=sum(s["docs"] for s in stats),
        features=sum(s["features"] for s in stats),
        bad_lines=sorted(tuple(b) for s in stats for b in s["bad_lines"]),
        seconds=max(s["finished"] for s in stats) - min(s["started"] for s in stats),
        skipped=sum(len(s["bad_lines"]) for s in stats),
    )


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
