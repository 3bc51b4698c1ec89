"""Checkpoints that hold everything needed to continue exactly where a run stopped.

Layout of `output_dir/checkpoints/step-N/`:
  model.safetensors     the unwrapped model's weights (train.parallel=ddp)
  training_state.pt     optimizer (ddp), LR scheduler and gradient-scaler state (tensors and numbers only)
  .metadata, __R_0.distcp   train.parallel=fsdp: model and optimizer as every rank's shards, written
                        with torch.distributed.checkpoint (`distqa.sharded`); loads on any process count
  rng-rank{R}.pt        every RNG of rank R: Python, NumPy, torch CPU and CUDA (`distqa.rng_state`)
  comm-rank{R}.pt       rank R's gradient-communication state (train.ddp_comm_hook: PowerSGD's
                        error feedback and memories; `distqa.comm_hooks`)
  trainer_state.json    step, epoch, position in the epoch, global batch, the resolved config, the
                        task's state and the open log window (`distqa.checkpoint_manager.TrainerState`)

  manifest.json         size and SHA-256 of every file above, checked before a checkpoint is used;
                        a file it does not list is never read (an unlisted rng- or comm- file is absent)

Every rank takes part (the RNG states are gathered to rank 0); rank 0 alone writes, but for the
shards of a sharded model, which each rank writes and hashes itself. A checkpoint is
written to a hidden `.tmp-step-N` folder, fsynced and renamed when complete, so a `step-N` folder is
always whole: a run killed mid-save leaves only a `.tmp-` folder, which resume ignores, and a file
damaged later is caught by the manifest (`distqa.checkpoint_verify`, which also refuses weights
holding NaN/inf). Files are read back with `weights_only=True` and safetensors, so loading a
checkpoint never unpickles arbitrary objects, and a file that fails to load is one line naming it.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import re
import shutil
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
from torch import nn

from distqa import sharded as sharded_ckpt
from distqa.best import pointed
from distqa.checkpoint_verify import (
    MANIFEST_FILE,
    STATE_FILE,
    list_checkpoints,
    manifest_entry,
    read_trainer_state,
)
from distqa.checkpoint_verify import REQUIRED_FILES as REQUIRED_FILES  # re-exported: resume and tests use them here
from distqa.checkpoint_verify import step_folders as step_folders
from distqa.checkpoint_verify import verify_checkpoint as verify_checkpoint
from distqa.dist import DistInfo, all_gather_objects, broadcast_object, gather_to_main
from distqa.durable import as_umask_allows, fsync_path
from distqa.errors import DistqaError
from distqa.rank0 import fix_for, raise_on_every_rank, reason, with_free_space
from distqa.rng_state import capture_rng_state, restore_rng_state

# A step's folder, or what an interrupted save leaves: its folder before the rename, the step it replaced.
_LEFTOVER = re.compile(r"^(?:\.(tmp|old)-)?step-(\d+)$")


class _RankZeroFiles(NamedTuple):
    """What rank 0 writes itself; `hashed`: the shards, hashed by their writers."""

    model: nn.Module | None  # None: the model is in the shards
    training_state: dict[str, Any]
    rng_states: list[Any]
    trainer_state: dict[str, Any]
    hashed: dict[str, Any]
    comm_states: list[Any] | None = None  # per rank, as the RNG states


def _write(tmp: Path, files: _RankZeroFiles) -> None:
    """Rank 0's files, then the manifest of every file."""
    if files.model is not None:
        save_model(files.model, str(tmp / "model.safetensors"))
        as_umask_allows([tmp / "model.safetensors"])
    torch.save(files.training_state, tmp / "training_state.pt")
    for rank, rng in enumerate(files.rng_states):
        torch.save(rng, tmp / f"rng-rank{rank}.pt")
    for rank, comm in enumerate(files.comm_states or []):
        torch.save(comm, tmp / f"comm-rank{rank}.pt")
    (tmp / STATE_FILE).write_text(json.dumps(files.trainer_state, indent=2) + "\n")
    written = sorted(p for p in tmp.iterdir() if p.is_file())
    hashed = files.hashed
    # Shards are listed as their writers hashed them, even where a network file system's listing
    # here lags behind: a shard missing later fails the manifest check, not the resume.
    manifest = dict(sorted({**{p.name: manifest_entry(p) for p in written if p.name not in hashed}, **hashed}.items()))
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    for path in [*written, tmp / MANIFEST_FILE, tmp]:
        fsync_path(path)


def save_checkpoint(
    root: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: torch.amp.GradScaler,
    trainer_state: dict[str, Any],
    info: DistInfo,
    keep: int = 0,
    protect: Collection[str] = (),
    sharded: bool = False,
    still_holding: Callable[[], str | None] | None = None,
    comm_state: dict[str, Any] | None = None,
    rng_replicas: Sequence[int] = (),
) -> Path:
    """Write `root/step-N` (N = trainer_state["step"]) and keep the newest `keep` (0: all), and
    the folders named in `protect` (the best checkpoint: `distqa.best`).

    Every rank must call it. Rank 0 writes into `.tmp-step-N`, fsyncs every file and a manifest of
    their sizes and hashes, then renames the folder: `step-N` appears whole or not at all. If the
    write fails (a full disk), the temporary folder is removed, the previous checkpoints are left
    as they were, and every rank raises the same one-line error instead of waiting forever.

    `still_holding` (rank 0: the run lock's `verify`) is asked before the first write and again
    right before the rename: a run whose output_dir was taken over while it wrote (a pause longer
    than the lock's lease) then removes its temporary folder, renames and prunes nothing, and
    every rank raises its message.
    """
    step = int(trainer_state["step"])
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    rng_states = gather_to_main(capture_rng_state(info.device, rng_replicas), info)
    # `comm_state`: this rank's part that is not the same on every rank (`Parts.comm_hook`).
    comm_states = gather_to_main(comm_state, info) if comm_state is not None else None
    problem, created = (_not_json(trainer_state), False) if info.is_main else (None, False)
    if info.is_main and not problem:
        problem, created = _open_folder(tmp, final, root, still_holding)
    hashed: dict[str, Any] = {}
    if sharded:  # every rank writes its shards into rank 0's folder (shared: checked at start)
        problem, hashed = _write_shards(tmp, final, root, model, optimizer, info, problem)
    if info.is_main and not problem:
        training_state = {
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            **({} if sharded else {"optimizer": optimizer.state_dict()}),
        }
        files = _RankZeroFiles(
            None if sharded else model, training_state, rng_states, trainer_state, hashed, comm_states
        )
        problem = _publish(tmp, final, root, files, keep=keep, protect=protect, still_holding=still_holding)
    if problem and created:
        # Ours (only rank 0 creates it); a takeover seen before it was created leaves the folder,
        # maybe the new holder's, alone.
        shutil.rmtree(tmp, ignore_errors=True)
    # Replaces a barrier: nobody reads or prunes before rank 0 is done, and all learn how it went.
    raise_on_every_rank(problem)
    return final


def _not_json(trainer_state: dict[str, Any]) -> str | None:
    """Why the trainer state cannot be written as JSON: a task's `state_dict()` holding a tensor or
    a NumPy number raised a TypeError traceback from the middle of the write, on rank 0 alone, and
    left a half-written `.tmp-step-N` (a review)."""
    try:
        json.dumps(trainer_state)
    except (TypeError, ValueError) as err:
        return (
            f"the task's state_dict() returned what JSON cannot hold ({type(err).__name__}: {err}): return plain "
            "numbers, strings, lists and dicts (e.g. float(x) of a tensor); no checkpoint of this step was written"
        )
    return None


def _open_folder(
    tmp: Path, final: Path, root: Path, still_holding: Callable[[], str | None] | None
) -> tuple[str | None, bool]:
    """Rank 0: a fresh `.tmp-step-N` (problem, whether it is ours to remove on failure)."""
    problem = _not_held(still_holding(), final) if still_holding is not None else None
    if problem:
        return problem, False
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    except OSError as err:
        return _cannot_write(final, root, err), True
    return None, True


def _write_shards(
    tmp: Path,
    final: Path,
    root: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    info: DistInfo,
    problem: str | None,
) -> tuple[str | None, dict[str, Any]]:
    """Every rank: its shards into `tmp`; (the first problem of any rank, every shard's hash)."""
    problem = broadcast_object(problem)  # type: ignore[assignment]
    if problem:
        return problem, {}
    hashed: dict[str, Any] = {}
    try:
        hashed = {path.name: manifest_entry(path) for path in sharded_ckpt.write_shards(tmp, model, optimizer, info)}
    except (OSError, RuntimeError) as err:
        problem = _cannot_write(final, root, err)
    # Every rank learns whether every rank's shards are written, and all their hashes.
    parts = all_gather_objects((problem, hashed), info)
    problem = next((p for p, _ in parts if p), None)
    hashed = {name: e for _, part in parts for name, e in part.items()}
    missing = [name for name in hashed if info.is_main and not (tmp / name).is_file()]
    if missing and not problem:  # written, but not where rank 0 looks: not one shared folder
        problem = (
            f"cannot write checkpoint {final}: {', '.join(missing)} were written where rank 0 cannot "
            "see them; output_dir must be on storage every node shares"
        )
    return problem, hashed


def _publish(
    tmp: Path,
    final: Path,
    root: Path,
    files: _RankZeroFiles,
    *,
    keep: int,
    protect: Collection[str],
    still_holding: Callable[[], str | None] | None,
) -> str | None:
    """Rank 0: its files and the manifest, then `tmp` renamed to `final` and old ones pruned."""
    try:
        _write(tmp, files)
        # Last look before anything outside .tmp-step-N changes: a lock taken over during the
        # write means the folder is another run's now (its step-N, its older checkpoints).
        problem = _not_held(still_holding(), final) if still_holding is not None else None
        if problem:
            return problem
        # Saving the same step again (a finished run restarted, an evaluation owed): the old one is
        # renamed aside, not removed in place, so a kill during its removal cannot leave step-N
        # half deleted; between the two renames there is none, and resume takes the one before.
        old = root / f".old-{final.name}"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        fsync_path(root)
        shutil.rmtree(old, ignore_errors=True)
        prune(root, keep, {final.name, *protect})
        _remove_leftovers(root, {final.name, *protect}, upto=int(files.trainer_state["step"]))
    except (OSError, RuntimeError, SafetensorError) as err:
        # A full disk surfaces as OSError, as torch.save's RuntimeError or as safetensors' own
        # error, depending on which file was being written.
        return _cannot_write(final, root, err)
    return None


def prune(root: Path, keep: int, protect: Collection[str] = ()) -> None:
    """Rank 0: remove all but the newest `keep` checkpoints (0: keep all), those in `protect`, and
    the best checkpoint that each one kept records. A resume that falls back to a kept one (the
    newer ones damaged) goes on with its record and points `best` at it again: pruned, the record
    named weights that were gone, and `best` stayed on the damaged step (found by a review)."""
    if keep <= 0:
        return
    checkpoints = list_checkpoints(root)
    kept = {folder.name for folder in checkpoints[-keep:]} | set(protect)
    kept |= {best for folder in checkpoints if folder.name in kept and (best := _recorded_best(folder))}
    for old in checkpoints[:-keep]:
        if old.name not in kept:
            shutil.rmtree(old, ignore_errors=True)


def _remove_leftovers(root: Path, protect: Collection[str], upto: int) -> None:
    """Rank 0, holding the run, once step `upto` is saved: what kills left at or before it, which
    resume never reads and which stayed for good (a partial bert-large checkpoint is gigabytes: a
    review). A save cut short (`.tmp-step-N`, a step a platform's grace period ended and that was
    not saved again), a removal cut short (`step-N` without its state file); `.old-step-N` only where
    `step-N` is whole again (a kill between a re-save's two renames leaves the one whole copy there).
    Never one in `protect` (the checkpoint this run resumed from), nor one past `upto`."""
    complete = {folder.name for folder in list_checkpoints(root)}
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        match = _LEFTOVER.match(path.name)
        if path.name in protect or path.name in complete or not path.is_dir() or path.is_symlink() or not match:
            continue
        kind, step = match[1] or "", int(match[2])
        if step <= upto and (kind != "old" or f"step-{step}" in complete):
            shutil.rmtree(path, ignore_errors=True)
            print(f"removed {path}: what an interrupted save or removal left (never resumed from)", flush=True)


def _recorded_best(folder: Path) -> str | None:
    """The `step-N` that `folder`'s trainer state records as the best so far (None: no record, or
    a state that cannot be read: such a checkpoint is never resumed from)."""
    try:
        best = read_trainer_state(folder).get("best")
        return f"step-{int(best['step'])}" if isinstance(best, dict) else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _not_held(lost: str | None, final: Path) -> str | None:
    return f"{lost}: checkpoint {final.name} was not written, and this run stops" if lost else None


def _cannot_write(final: Path, root: Path, err: BaseException) -> str:
    previous = [p.name for p in list_checkpoints(root)]
    why = with_free_space(reason(err), root)
    fix = fix_for(err)
    if fix.startswith("free space") and len(previous) > 1:
        # Not "lower train.keep_checkpoints": it prunes only after a save, so the same save fails again.
        # Nor the best model's folder, which pruning keeps too: the advice named it (a review).
        best = pointed(root)
        but = f", but not {best.name}: {root.name}/best names it" if best and best.name in previous[:-1] else ""
        fix += f" (the checkpoints before {previous[-1]} may be removed{but})"
    return (
        f"cannot write checkpoint {final} ({why[:300]}); "
        + (f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists")
        + f": {fix} and run again to resume"
    )


def load_checkpoint(
    directory: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: torch.amp.GradScaler,
    info: DistInfo,
    sharded: bool = False,
    rng_replicas: Sequence[int] = (),
) -> dict[str, Any]:
    """Restore everything `save_checkpoint` wrote, on this rank. Returns the trainer state.

    The settings were checked against the checkpoint first (`distqa.resume`), so a failure here
    means files that passed their manifest but do not fit this model: one line, not a traceback.
    """
    holds_shards = (directory / sharded_ckpt.METADATA_FILE).is_file()
    if holds_shards != sharded:
        kinds = ("sharded (train.parallel=fsdp)", "whole (train.parallel=ddp)")
        raise DistqaError(
            f"checkpoint {directory} holds the model {kinds[not holds_shards]}, and this run has "
            f"train.parallel={'fsdp' if sharded else 'ddp'}: resume with the checkpoint's train.parallel"
        )
    if sharded:
        with _loading(directory / f"{sharded_ckpt.METADATA_FILE} and __*.distcp"):
            sharded_ckpt.read_shards(directory, model, optimizer)
    else:
        with _loading(directory / "model.safetensors"):
            load_model(model, str(directory / "model.safetensors"), device=str(info.device))
    with _loading(directory / "training_state.pt"):
        training_state = torch.load(directory / "training_state.pt", map_location=info.device, weights_only=True)
        if not sharded:
            optimizer.load_state_dict(training_state["optimizer"])
        scheduler.load_state_dict(training_state["scheduler"])
        # A scaler that was off (fp32, bf16) saved an empty state: with fp16 now, start a fresh one.
        if training_state["scaler"] and scaler.is_enabled():
            scaler.load_state_dict(training_state["scaler"])
    state = read_trainer_state(directory)
    listed = _listed(directory)
    rng_path = directory / f"rng-rank{info.rank}.pt"
    # A run resumed on more processes (same global batch) has ranks the checkpoint never saw;
    # the caller seeds those afresh, and says so. A file the manifest does not list is not part of
    # the checkpoint (its hash vouches for nothing): as absent, whatever lies in the folder.
    state["rng_restored"] = rng_path.name in listed
    state["cuda_rng_restored"] = False
    if state["rng_restored"]:
        with _loading(rng_path):
            state["cuda_rng_restored"] = restore_rng_state(
                torch.load(rng_path, weights_only=True), info.device, rng_replicas
            )
    comm_path = directory / f"comm-rank{info.rank}.pt"
    state["comm_hook"] = None  # none saved (another world size, an older checkpoint): the caller says so
    if comm_path.name in listed:
        with _loading(comm_path):
            state["comm_hook"] = torch.load(comm_path, map_location="cpu", weights_only=True)
    return state


def _listed(directory: Path) -> Collection[str]:
    """The files `directory`'s manifest lists: those rank 0 verified before choosing it."""
    path = directory / MANIFEST_FILE
    with _loading(path):
        manifest = json.loads(path.read_bytes())
        if not isinstance(manifest, dict):
            raise ValueError("it is not a JSON object")
    return manifest.keys()


# What loading a file that passed its manifest can still raise: it does not fit this model, or it
# was crafted (a manifest is a checksum, not a signature).
_LOAD_ERRORS = (
    OSError,
    EOFError,
    RuntimeError,
    ValueError,
    KeyError,
    IndexError,
    TypeError,
    AttributeError,
    SafetensorError,
    pickle.UnpicklingError,
)


@contextlib.contextmanager
def _loading(path: Path) -> Iterator[None]:
    """Turn a failure to load or apply `path` into one line naming it."""
    try:
        yield
    except _LOAD_ERRORS as err:
        raise DistqaError(
            f"cannot load checkpoint file {path}: {sharded_ckpt.error_line(err)}; resume from an earlier "
            "checkpoint (train.resume=PATH) or start afresh (train.resume=never)"
        ) from err
