"""The run's folder: claimed by one run at a time, its records written atomically, and the final
model written into it atomically.

Rank 0 does the file work; every rank learns how it went (`distqa.rank0.on_rank0`), so that no
rank waits in a collective for a rank 0 that has already failed.

Nothing distqa writes in output_dir goes through a symbolic link: a link planted there
(`config.yaml` -> a file of the user's) would make a run overwrite whatever it points to. `claim`
refuses a folder whose run files are links, and the writes themselves create files without
following one (`distqa.durable`), for a link planted after that check.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from distqa.checkpoint_verify import SOURCE_FILE, export_files, manifest_entry, recorded_source, source_of
from distqa.config_checks import check_output_root
from distqa.dist import DistInfo
from distqa.durable import fsync_path, held_exclusively, read_no_link, write_atomically
from distqa.errors import DistqaError
from distqa.rank0 import fix_for, on_rank0, reason
from distqa.runlock import LOCK_NAME, RunLock

CONFIG_FILE = "config.yaml"
HISTORY_DIR = "config-history"
# What a run writes in output_dir (and `train.resume=never` moves into earlier-runs/).
RUN_PATHS = (CONFIG_FILE, "metrics.jsonl", LOCK_NAME, "checkpoints", "model", "tb", "metrics.png", HISTORY_DIR)


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


# The file systems a container's own writable layer is made of (Docker's overlay2, containerd's
# overlayfs, rootless fuse-overlayfs, old aufs): what is written there is removed with the container.
CONTAINER_LAYERS = frozenset({"overlay", "fuse.fuse-overlayfs", "fuse-overlayfs", "aufs"})
MOUNTINFO = Path("/proc/self/mountinfo")


def _unescape(field: str) -> str:
    """A mountinfo path: the kernel writes space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def in_container_layer(path: Path, mountinfo: str | None = None) -> bool:
    """Whether `path` would be written into the container's own root file system (its writable
    layer) rather than a mounted folder: the mount that holds it is "/" and an overlay. A plain
    `docker run --rm distqa` with no `-v` trains into that layer; its results go with the
    container, exit 0. False where /proc/self/mountinfo cannot be read (not Linux)."""
    if mountinfo is None:
        try:
            mountinfo = MOUNTINFO.read_text()
        except OSError:
            return False
    where, holder, kind = Path(path).resolve(), None, ""
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not tail:
            continue
        point = Path(_unescape(parts[4]))
        # The longest mount point above `where` holds it (a later mount over the same point wins).
        if where.is_relative_to(point) and (holder is None or len(point.parts) >= len(holder.parts)):
            holder, kind = point, tail.split()[0]
    return holder == Path("/") and kind in CONTAINER_LAYERS


def layer_warning(output_dir: Path) -> str | None:
    """One line for a run whose output_dir is in the container's own layer (None elsewhere)."""
    if not in_container_layer(output_dir):
        return None
    return (
        f"distqa: warning: output_dir={str(output_dir)!r} ({Path(output_dir).resolve()}) is in this container's "
        "own file system, not a mounted folder: its checkpoints and model are removed with the container; "
        'mount a folder there to keep them (docker run -v "$PWD/results:/app/results" ...)'
    )


def claim(output_dir: Path, info: DistInfo) -> RunLock | None:
    """Create output_dir and take its run lock (rank 0; None elsewhere). Raises on every rank if
    the folder cannot be written, one of its run files is a symbolic link (checked before the
    lock is taken: run.lock itself may be one), another run holds it, or (check_output_root, the
    same verdict on every rank) it is or lies under a file or outside the launch's DISTQA_OUTPUT_ROOT."""
    check_output_root(output_dir)
    lock: RunLock | None = None

    def take() -> None:
        nonlocal lock  # rank 0's alone: a lock does not travel to the other ranks
        output_dir.mkdir(parents=True, exist_ok=True)
        linked = linked_run_path(output_dir)
        if linked is not None:
            raise DistqaError(linked)
        lock = RunLock(output_dir)
        lock.acquire()
        if (warning := layer_warning(output_dir)) is not None:
            print(warning, file=sys.stderr, flush=True)

    def failure(err: BaseException) -> str:
        # The file it failed on, when not output_dir itself (a folder named run.lock, say).
        name = getattr(err, "filename", None)
        inside = f" ({name})" if name and Path(name) != output_dir else ""
        return f"output_dir={str(output_dir)!r} cannot be written: {reason(err)}{inside}{_owner_note(err, name)}"

    on_rank0(info, take, failure=failure)
    return lock


def _owner_note(err: BaseException, name: str | None) -> str:
    """Who may write there, where permission was refused: a `docker run -v` folder the engine made
    (root's) for a container running as uid 1000 said only "Permission denied" (a review)."""
    if not isinstance(err, PermissionError) or not name:
        return ""
    folder = next((p for p in (Path(name), *Path(name).parents) if p.exists()), None)
    owner = folder.stat().st_uid if folder is not None else os.getuid()
    if owner == os.getuid():
        return ""
    return (
        f": {folder} belongs to uid {owner} and this process runs as uid {os.getuid()}; make it "
        "writable for this uid (chown), or run as its owner (docker run --user)"
    )


def write_text(path: Path, text: str, info: DistInfo) -> None:
    """Rank 0 replaces a small file (config.yaml) atomically: written aside, fsynced and renamed
    over it, never through a link; every rank raises if that failed."""
    on_rank0(
        info,
        lambda: write_atomically(path, text.encode("utf-8")),
        failure=lambda err: f"output_dir={str(path.parent)!r} cannot be written: {reason(err)}",
    )


def archive_config(output_dir: Path, step: int, info: DistInfo) -> Path | None:
    """Rank 0 keeps the current output_dir/config.yaml as config-history/<step>.yaml before a resume
    at `step` with changed settings rewrites it, so the records still say what trained before
    that step. Nothing to keep (no config.yaml): a no-op. An existing history file is never
    overwritten: the copy takes the next free name (`<step>-2.yaml`, ...). Returns the copy on
    rank 0 (None elsewhere, and when there was nothing to keep); a failure is one line on every rank."""
    source, history = output_dir / CONFIG_FILE, output_dir / HISTORY_DIR

    def keep() -> Path | None:
        try:
            data = read_no_link(source)
        except FileNotFoundError:
            return None
        if history.is_symlink():
            raise OSError(f"{history} is a symbolic link")
        history.mkdir(exist_ok=True)
        kept, n = history / f"{step}.yaml", 2
        while kept.exists() or kept.is_symlink():  # one writer (the lock's holder): no race
            kept, n = history / f"{step}-{n}.yaml", n + 1
        write_atomically(kept, data)
        return kept

    kept = on_rank0(
        info,
        keep,
        failure=lambda err: (
            f"cannot keep the earlier {source} as {history / f'{step}.yaml'} ({reason(err)}): "
            f"{fix_for(err)} (or remove the link named) and run again"
        ),
    )
    return kept if info.is_main else None


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


class Stale(DistqaError):
    """What an export was made of is no longer there: said as it is, not as a write that failed."""


def _changed_by_hand(previous: Path) -> str | None:
    """What a replaced export holds that its export did not write, or that was edited since (a
    user's notes, a submission, an edited config.json), in a few words; None when it is as written,
    its weights aside (damaged weights are written again, not kept), or when there is no folder. A
    rerun that found it "damaged" wrote the model again and removed all of it, the user's files too."""
    if previous.is_symlink() or not previous.is_dir():
        return None
    there = {p.relative_to(previous).as_posix() for p in previous.rglob("*") if p.is_file()} - {SOURCE_FILE}
    recorded = (recorded_source(previous) or {}).get("files")
    if not isinstance(recorded, dict):  # an export of an older distqa, or an empty folder
        return "files no export record lists" if there else None
    extra = sorted(there - set(recorded))
    try:  # (the weights are not read: damaged weights are written again, not kept)
        edited = sorted(
            name for name, entry in recorded.items()
            if name in there and not name.endswith((".safetensors", ".bin"))
            and manifest_entry(previous / name) != entry
        )  # fmt: skip
    except OSError as err:  # a file it cannot read (another user's): kept, not judged
        return f"a file it cannot read ({reason(err)})"
    parts = []
    for what, names in (("files it did not write", extra), ("files edited since", edited)):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            parts.append(f"{what} ({', '.join(names[:3])}{more})")
    return "; ".join(parts) or None


def _export_failed(err: BaseException, directory: Path, note: str) -> DistqaError:
    """`export_atomically`'s one line for `err`. A DistqaError (a task's save_model that wrote
    nothing) says what to change itself: "free space and run again" would not help (a review)."""
    if isinstance(err, DistqaError):
        return DistqaError(f"cannot write {directory}: {err}")
    fix = note.replace("{fix}", fix_for(err, str(directory.parent)))  # (not format: a path may hold braces)
    return DistqaError(f"cannot write {directory} ({reason(err)}): {fix}")


def export_atomically(
    save: Callable[[Path], None],
    directory: Path,
    info: DistInfo,
    note: str,
    source: Path | dict[str, Any] | None = None,
    still_valid: Callable[[], str | None] | None = None,
) -> None:
    """Rank 0 calls `save(folder)` into a hidden folder beside `directory`, fsyncs it and renames
    it into place, so `directory` is always a whole export: the previous one, or the new one. A
    failure (a full disk) leaves the previous export as it was and is one line on every rank;
    `note` says what the user can do then, its `{fix}` what the error calls for (`rank0.fix_for`:
    free space, permissions, or what the error names). `source`, the checkpoint the weights come
    from (or what `source_of` read of it), is recorded in the export (`checkpoint_verify.SOURCE_FILE`)
    with the size and SHA-256 of every file written. `still_valid`, asked last before the rename,
    says what no longer holds (the checkpoint was removed meanwhile): nothing is renamed, one line."""
    tmp = directory.with_name(f".tmp-{directory.name}")
    old = directory.with_name(f".old-{directory.name}")

    def export() -> None:
        with contextlib.ExitStack() as held:
            try:
                directory.parent.mkdir(parents=True, exist_ok=True)
                # Two exports to one folder at once (`distqa export` twice, or beside the trainer's)
                # share the hidden names: one removed the other's while it was written. One waits.
                waiting = f"waiting for another export to {directory}"
                held.enter_context(held_exclusively(directory.parent, lambda: print(waiting, flush=True)))
            except OSError as err:
                raise _export_failed(err, directory, note) from err
            _export()

    def keep_aside(folder: Path, changed: str) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        names = (
            directory.with_name(f"{directory.name}.replaced-{stamp}{f'-{n}' if n else ''}") for n in itertools.count()
        )
        kept = next(path for path in names if not path.exists())
        folder.rename(kept)
        print(f"distqa: the {directory.name}/ it replaces held {changed}: kept as {kept}", flush=True)

    def _export() -> None:
        try:
            _remove(tmp)
            # A previous export a kill left between its two renames: the user's files in it are kept.
            if source is not None and (changed := _changed_by_hand(old)) is not None:
                keep_aside(old, changed)
            _remove(old)
            save(tmp)
            if source is not None:
                # What it holds, with the size and hash of every file: a damaged export is written again.
                record = {**(source if isinstance(source, dict) else source_of(source)), "files": export_files(tmp)}
                (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
            _fsync_tree(tmp)
            if still_valid is not None and (gone := still_valid()):
                shutil.rmtree(tmp, ignore_errors=True)
                raise Stale(gone)
            # Read before anything moves: what of the folder it replaces is the user's (an export
            # that records its files alone can tell; moved aside, not removed).
            changed = _changed_by_hand(directory) if source is not None else None
            if directory.exists():
                directory.rename(old)
            tmp.rename(directory)
            if changed is not None:
                keep_aside(old, changed)
            else:
                _remove(old)  # the previous export, or the link `directory` was (unlinked: rmtree refuses links)
        except Stale:
            raise
        except (OSError, RuntimeError, ValueError, SafetensorError, DistqaError) as err:
            # (DistqaError: a task's save_model, or rebuilding a sharded model, that cannot load
            # what it needs.) Rank 0 alone runs `save`: the others learn of it from on_rank0.
            shutil.rmtree(tmp, ignore_errors=True)
            if old.exists() and not directory.exists():
                old.rename(directory)
            raise _export_failed(err, directory, note) from err

    on_rank0(info, export)
