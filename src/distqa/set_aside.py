"""Setting an earlier run, or the later line of checkpoints of this one, aside in
output_dir/earlier-runs/, so that a fresh start or a resume from an earlier step overwrites nothing.

A whole run is moved by renames into a hidden `earlier-runs/.moving-<time>`, renamed to `<time>`
once all are in. A kill in between leaves that folder: the next start moves its files back first
(`undo_killed_move`), so each command finds the run whole, never split over two folders or half
left in output_dir for a new run to write into; an error moves them back at once.

A line is set aside in an order that loses nothing whatever stops it (a full disk, a SIGKILL):
1. everything that needs space is written first, into a hidden staging folder that is renamed to
   `earlier-runs/<time>-after-step-N` once whole: the copies of metrics.jsonl and config.yaml (the
   trainer cuts metrics.jsonl back to step N as soon as the set-aside is done), and the settings
   config.yaml is to become. Nothing has moved yet, so a failure here removes the staging folder
   and a second try starts over; a staging folder left by a kill holds copies only.
2. then renames only, which need no space: model/, metrics.png, the exports of later checkpoints
   (`distqa export`'s default `model-step-M`), the config history past step N,
   config.yaml, `best`, and the later checkpoints last. A later checkpoint still in place is what
   makes the next try set the line aside, so a kill before the end leaves one to find, and that
   try moves the rest (its copies of the records are whole: nothing was trained in between). An
   error in this phase moves back what had moved.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from distqa.best import BEST_NAME, pointed
from distqa.checkpoint_verify import folder_step, read_trainer_state, step_folders
from distqa.dist import DistInfo
from distqa.durable import fsync_path, read_no_link, write_atomically
from distqa.errors import ConfigError, DistqaError
from distqa.outdir import CONFIG_FILE, HISTORY_DIR, RUN_PATHS
from distqa.rank0 import fix_for, on_rank0, reason
from distqa.runlock import LOCK_NAME

EARLIER_RUNS = "earlier-runs"
# Files of a run in output_dir that `train.resume=never` moves aside before starting afresh: all
# it writes there but the lock of the run that moves them.
RUN_FILES = tuple(name for name in RUN_PATHS if name != LOCK_NAME)
# What a run leaves in output_dir when its step folders are gone: enough to be a run's records.
RECORDS = ("metrics.jsonl", "model")
# The settings config.yaml becomes, staged inside the set-aside folder until renamed into place.
_NEXT_CONFIG = ".next-config.yaml"
_STAGING = ".tmp-"  # a line's set-aside in the making: copies only
_MOVING = ".moving-"  # a whole run's move in the making: the run's own files


# `distqa export`'s default folder for checkpoint step-N, beside checkpoints/: it goes with its line.
_EXPORT_NAME = re.compile(r"^model-step-(\d+)$")


def step_exports(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the default exports in output_dir (`model-step-N`)."""
    found = (_EXPORT_NAME.match(path.name) for path in output_dir.iterdir()) if output_dir.is_dir() else ()
    return sorted((int(match.group(1)), output_dir / match.group(0)) for match in found if match)


def earlier_run_present(output_dir: Path) -> bool:
    """Whether output_dir holds an earlier run: a step folder, or its records."""
    return bool(step_folders(output_dir / "checkpoints")) or any((output_dir / n).exists() for n in RECORDS)


def set_aside_earlier_run(output_dir: Path) -> Path | None:
    """Move an earlier run's files into output_dir/earlier-runs/<time>/ so that a fresh start
    overwrites nothing. Returns where they went (None: there was no earlier run)."""
    if not earlier_run_present(output_dir):
        return None
    present = [name for name in RUN_FILES if os.path.lexists(output_dir / name)]
    present += [path.name for _, path in step_exports(output_dir)]  # exports of its checkpoints
    staging = _new_folder(output_dir, "", prefix=_MOVING)
    try:
        for name in present:
            os.rename(output_dir / name, staging / name)
        target = staging.with_name(staging.name[len(_MOVING) :])
        os.rename(staging, target)
    except Exception as err:
        undo_killed_move(output_dir, stopped_by_a_kill=False)
        if isinstance(err, OSError) and err.errno == errno.EXDEV:
            raise DistqaError(
                f"cannot move the earlier run in {output_dir} aside: {output_dir / EARLIER_RUNS} or one of the run's "
                "files is on another filesystem (a mount), and a run is moved aside by renames, which stay on one: "
                "nothing was moved; make them plain folders of output_dir, or use another output_dir"
            ) from err
        raise
    fsync_path(target.parent)
    fsync_path(output_dir)
    return target


def undo_killed_move(output_dir: Path, *, stopped_by_a_kill: bool = True) -> list[Path]:
    """Move the files of a whole-run move that a kill (or an error) stopped back into output_dir,
    and remove its folder; returns the folders emptied. Called by rank 0 before it looks for
    checkpoints, under the run lock: nothing has written into output_dir since. Where a file is
    both there and back in output_dir, refuses before moving anything."""
    undone = []
    for staging in sorted((output_dir / EARLIER_RUNS).glob(_MOVING + "*")):
        entries = sorted(staging.iterdir())
        clash = next((output_dir / p.name for p in entries if os.path.lexists(output_dir / p.name)), None)
        if clash is not None:
            raise DistqaError(
                f"{staging} holds a run's files that a stopped move left, and {clash} exists too: nothing "
                f"was moved or lost; move the files of {staging} where they belong, then run again"
            )
        for path in entries:
            os.rename(path, output_dir / path.name)
        staging.rmdir()
        fsync_path(output_dir)
        undone.append(staging)
        if stopped_by_a_kill:
            print(
                f"an earlier move of the run in {output_dir} aside was stopped: its files were moved back", flush=True
            )
    return undone


def _new_folder(output_dir: Path, suffix: str, *, prefix: str = "") -> Path:
    name = time.strftime("%Y%m%d-%H%M%S") + suffix
    target = output_dir / EARLIER_RUNS / (prefix + name)
    while target.exists() or target.with_name(name).exists():
        name += "+"
        target = target.with_name(prefix + name)
    target.mkdir(parents=True)
    return target


def set_aside_other_line(output_dir: Path, resume_from: Path | None, mode: str, info: DistInfo) -> Path | None:
    """With train.resume=PATH, output_dir holds PATH's continuation alone, so that a later
    `auto` resume, the pruning of old checkpoints and `checkpoints/best` never mix two: rank 0 moves
    the checkpoints after PATH's step (another continuation of it; with their `best` and `model/`),
    or for a PATH outside output_dir the whole earlier run there, into earlier-runs/ (one line).
    Called once every check has passed and before anything is written: a refused resume moves
    nothing. Returns where they went (None: nothing to move, or `auto`/`never`)."""
    if resume_from is None or mode in ("auto", "never"):
        return None
    return on_rank0(
        info,
        lambda: _set_aside(output_dir, resume_from, mode),
        failure=lambda err: (
            f"cannot move the checkpoints after train.resume={mode} in {output_dir} aside ({reason(err)}): "
            f"nothing was lost; {fix_for(err)} and run the same command again"
        ),
    )


def _set_aside(output_dir: Path, resume_from: Path, mode: str) -> Path | None:
    root, source = output_dir / "checkpoints", resume_from.resolve()
    if source.parent != root.resolve():
        inside = [name for name in RUN_FILES if (output_dir / name).resolve() in source.parents]
        if inside:  # it would be moved away with the run it lies in
            raise ConfigError(
                f"train.resume={mode} lies in {output_dir / inside[0]}, which holds another run: copy the "
                "checkpoint out of output_dir first, or name one of output_dir/checkpoints/step-N"
            )
        moved = set_aside_earlier_run(output_dir)
        if moved is not None:
            print(
                f"train.resume={mode} is not a checkpoint of {output_dir}: its earlier run was moved to {moved}",
                flush=True,
            )
        return moved
    step = int(read_trainer_state(resume_from)["step"])
    later = [p for p in step_folders(root) if (folder_step(p) or 0) > step]  # (each is a step-N)
    if not later:
        return None
    target = _stage_records(output_dir, step)
    _move_line(output_dir, step, later, target)
    print(
        f"train.resume={mode} is earlier than the newest checkpoint in {root}: "
        f"{', '.join(p.name for p in later)} (another continuation of step {step}) moved to {target} with what "
        "belongs to them (best, model/, their exports, records), so that train.resume=auto goes on with this run",
        flush=True,
    )
    return target


# config-history/<step>.yaml, or <step>-<n>.yaml for the n-th resume at that step (`outdir.archive_config`).
_HISTORY_NAME = re.compile(r"^(\d+)(?:-(\d+))?\.yaml$")


def _history_from(output_dir: Path, step: int) -> list[tuple[int, int, Path]]:
    """The config history at `step` or later, oldest first: (step, n, path)."""
    history, kept = output_dir / HISTORY_DIR, []
    for path in history.iterdir() if history.is_dir() else []:
        match = _HISTORY_NAME.match(path.name)
        if match and int(match.group(1)) >= step:
            kept.append((int(match.group(1)), int(match.group(2) or 1), path))
    return sorted(kept)


def _stage_records(output_dir: Path, step: int) -> Path:
    """Phase 1 (see the module's docstring): copies of metrics.jsonl and config.yaml, and the
    settings that trained up to `step` (what the first resume with changed settings at `step` or
    later kept), in a staging folder renamed into earlier-runs/ once whole. Moves nothing."""
    for stale in (output_dir / EARLIER_RUNS).glob(_STAGING + "*"):
        shutil.rmtree(stale, ignore_errors=True)  # a killed try's: copies only, the originals are in place
    staging = _new_folder(output_dir, f"-after-step-{step}", prefix=_STAGING)
    try:
        for name in ("metrics.jsonl", CONFIG_FILE):
            if (output_dir / name).is_file():
                write_atomically(staging / name, read_no_link(output_dir / name))
        kept = _history_from(output_dir, step)
        if kept:
            write_atomically(staging / _NEXT_CONFIG, read_no_link(kept[0][2]))
        target = staging.with_name(staging.name[len(_STAGING) :])
        staging.rename(target)
        fsync_path(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _move_line(output_dir: Path, step: int, later: list[Path], target: Path) -> None:
    """Phase 2: renames only, the later checkpoints last; on an error, what moved is moved back
    (and `target`, then holding copies only, removed) before the error goes on."""
    root, config = output_dir / "checkpoints", output_dir / CONFIG_FILE
    best = pointed(root)
    moves = [(output_dir / name, target / name) for name in ("model", "metrics.png") if (output_dir / name).exists()]
    moves += [(path, target / path.name) for at, path in step_exports(output_dir) if at > step]  # distqa export's
    if (target / _NEXT_CONFIG).exists():  # before the history it comes from: a retry finds that again
        moves.append((target / _NEXT_CONFIG, config))
    moves += [(path, target / HISTORY_DIR / path.name) for at, _, path in _history_from(output_dir, step) if at > step]
    if best is not None and (folder_step(best) or 0) > step:
        moves.append((root / BEST_NAME, target / "checkpoints" / BEST_NAME))  # relative: still names its step
    moves += [(folder, target / "checkpoints" / folder.name) for folder in later]
    undo: list[Callable[[], object]] = []
    try:
        for source, destination in moves:
            destination.parent.mkdir(exist_ok=True)
            if destination == config:
                source.replace(destination)
                # Moved back: the copy kept in target (none: there was no config.yaml before).
                kept = target / CONFIG_FILE
                undo.append(lambda kept=kept: kept.rename(config) if kept.exists() else config.unlink())
            else:
                source.rename(destination)
                undo.append(lambda source=source, destination=destination: destination.rename(source))
        fsync_path(output_dir)
    except Exception:
        if _moved_back(undo):
            shutil.rmtree(target, ignore_errors=True)  # copies only by now
        raise


def _moved_back(undo: list[Callable[[], object]]) -> bool:
    """Undo the moves, newest first; False when one failed (target then keeps what it holds)."""
    try:
        for move_back in reversed(undo):
            move_back()
    except OSError:
        return False
    return True
