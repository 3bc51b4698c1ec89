"""Checkpoints that hold everything needed to continue exactly where a run stopped.

Layout of `output_dir/checkpoints/step-N/`:
  model.safetensors     the unwrapped model's weights (train.parallel=ddp)
  training_state.pt     optimizer (ddp), LR scheduler and gradient-scaler state (tensors and numbers only)
  .metadata, __R_0.distcp   train.parallel=fsdp: model and optimizer as every rank's shards, written
                        with torch.distributed.checkpoint (`distqa.sharded`); loads on any process count
  rng-rank{R}.pt        every RNG of rank R: Python, NumPy, torch CPU and CUDA
  trainer_state.json    step, epoch, position in the epoch, global batch, and the resolved config

  manifest.json         size and SHA-256 of every file above, checked before a checkpoint is used

Every rank takes part (the RNG states are gathered to rank 0); rank 0 alone writes, but for the
shards of a sharded model, which each rank writes and hashes itself. A checkpoint is
written to a hidden `.tmp-step-N` folder, fsynced and renamed when complete, so a `step-N` folder is
always whole: a run killed mid-save leaves only a `.tmp-` folder, which resume ignores, and a file
damaged later is caught by the manifest. Files are read back with `weights_only=True` and
safetensors, so loading a checkpoint never unpickles arbitrary objects.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
from torch import nn

from distqa import sharded as sharded_ckpt
from distqa.dist import DistInfo, all_gather_objects, broadcast_object, gather_to_main
from distqa.durable import fsync_path
from distqa.errors import DistqaError

_STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        # NumPy's key array as a plain list: weights_only loading refuses ndarrays.
        "numpy": (name, keys.tolist(), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _entry(path: Path) -> dict[str, Any]:
    """A manifest entry: size and SHA-256."""
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _write(
    tmp: Path, model: nn.Module | None, training_state: dict, rng_states: list, trainer_state: dict, hashed: dict
) -> None:
    """Rank 0's files, then the manifest of every file (`hashed`: the shards, hashed by their writers)."""
    if model is not None:
        save_model(model, str(tmp / "model.safetensors"))
    torch.save(training_state, tmp / "training_state.pt")
    for rank, rng in enumerate(rng_states):
        torch.save(rng, tmp / f"rng-rank{rank}.pt")
    (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2) + "\n")
    files = sorted(p for p in tmp.iterdir() if p.is_file())
    # Shards are listed as their writers hashed them, even where a network file system's listing
    # here lags behind: a shard missing later fails the manifest check, not the resume.
    manifest = dict(sorted({**{p.name: _entry(p) for p in files if p.name not in hashed}, **hashed}.items()))
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    for path in [*files, tmp / MANIFEST_FILE, tmp]:
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
    sharded: bool = False,
) -> Path:
    """Write `root/step-N` (N = trainer_state["step"]) and keep the newest `keep` (0: all).

    Every rank must call it. Rank 0 writes into `.tmp-step-N`, fsyncs every file and a manifest of
    their sizes and hashes, then renames the folder: `step-N` appears whole or not at all. If the
    write fails (a full disk), the temporary folder is removed, the previous checkpoints are left
    as they were, and every rank raises the same one-line error instead of waiting forever.
    """
    step = int(trainer_state["step"])
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    rng_states = gather_to_main(capture_rng_state(info.device), info)
    problem: str | None = None
    if info.is_main:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as err:
            problem = _cannot_write(final, root, err)
    hashed: dict[str, Any] = {}
    if sharded:  # every rank writes its shards into rank 0's folder (shared: checked at start)
        problem = broadcast_object(problem)  # type: ignore[assignment]
        if not problem:
            try:
                hashed = {path.name: _entry(path) for path in sharded_ckpt.write_shards(tmp, model, optimizer, info)}
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
    if info.is_main and not problem:
        try:
            training_state = {
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                **({} if sharded else {"optimizer": optimizer.state_dict()}),
            }
            _write(tmp, None if sharded else model, training_state, rng_states, trainer_state, hashed)
            if final.exists():  # saving the same step again (e.g. a finished run restarted)
                shutil.rmtree(final)
            tmp.rename(final)
            fsync_path(root)
            for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
        except (OSError, RuntimeError, SafetensorError) as err:
            # A full disk surfaces as OSError, as torch.save's RuntimeError or as safetensors' own
            # error, depending on which file was being written.
            problem = _cannot_write(final, root, err)
    if problem and info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    # Replaces a barrier: nobody reads or prunes before rank 0 is done, and all learn how it went.
    problem = broadcast_object(problem)
    if problem:
        raise DistqaError(str(problem))
    return final


def _cannot_write(final: Path, root: Path, err: BaseException) -> str:
    previous = [p.name for p in list_checkpoints(root)]
    reason = getattr(err, "strerror", None) or (str(err).strip().splitlines() or [type(err).__name__])[0]
    with contextlib.suppress(OSError):  # a full disk shows in some writers' errors only as a short write
        reason += f"; {shutil.disk_usage(root).free / 2**20:.1f} MiB free there"
    return (
        f"cannot write checkpoint {final} ({reason[:300]}); "
        + (f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists")
        + ": free space in output_dir (or lower train.keep_checkpoints) and run again to resume"
    )


# Files every checkpoint has; a manifest that does not list them is not one distqa wrote. The
# model is in model.safetensors (ddp) or in DCP's shards, indexed by .metadata (fsdp).
REQUIRED_FILES = ("training_state.pt", STATE_FILE, "rng-rank0.pt")
MODEL_FILES = ("model.safetensors", sharded_ckpt.METADATA_FILE)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _shown(name: object) -> str:
    """A name from a damaged file, safe to print on one line."""
    text = ascii(name)
    return text if len(text) <= 60 else text[:57] + "..."


def verify_checkpoint(directory: Path) -> str | None:
    """None when the checkpoint is whole; else what is wrong, in a few words.

    Survives any content of any file: the manifest must be a JSON object that lists at least the
    files every checkpoint has, each with its size and SHA-256, and every file must match; the
    trainer state must parse and agree with the folder's step. (A manifest of `{}` would
    otherwise vouch for a folder of truncated files.)
    """
    try:
        return _verify(directory)
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"


def _verify(directory: Path) -> str | None:
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        return "no manifest"
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past Python's limit
        return f"{MANIFEST_FILE} is not valid JSON"
    if not isinstance(manifest, dict):
        return f"{MANIFEST_FILE} is not a JSON object"
    for name in REQUIRED_FILES:
        if name not in manifest:
            return f"{MANIFEST_FILE} does not list {name}"
    if not any(name in manifest for name in MODEL_FILES):
        return f"{MANIFEST_FILE} lists no model ({' or '.join(MODEL_FILES)})"
    for name, expected in manifest.items():
        if not name or name != Path(name).name or name in (".", ".."):
            return f"{MANIFEST_FILE} names a file outside the checkpoint: {_shown(name)}"
        size = expected.get("bytes") if isinstance(expected, dict) else None
        digest = expected.get("sha256") if isinstance(expected, dict) else None
        if type(size) is not int or not isinstance(digest, str) or not _SHA256.match(digest):
            return f"{MANIFEST_FILE} has a malformed entry for {_shown(name)}"
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
        if _sha256(path) != digest:
            return f"{name} does not match its hash in the manifest"
    problem = _check_trainer_state(directory)
    return problem


def _check_trainer_state(directory: Path) -> str | None:
    try:
        state = read_trainer_state(directory)
    except (ValueError, RecursionError):
        return f"{STATE_FILE} is not valid JSON"
    if not isinstance(state, dict):
        return f"{STATE_FILE} is not a JSON object"
    for key in ("step", "epoch", "step_in_epoch", "global_batch", "world_size"):
        if type(state.get(key)) is not int or state[key] < 0:
            return f"{STATE_FILE} has no valid {key!r}"
    if not isinstance(state.get("config"), dict):
        return f"{STATE_FILE} has no config"
    match = _STEP_DIR.match(directory.name)
    if match and int(match.group(1)) != state["step"]:
        return f"{STATE_FILE} is for step {state['step']}, not {match.group(1)}"
    return None


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def read_trainer_state(directory: Path) -> dict[str, Any]:
    return json.loads((directory / STATE_FILE).read_bytes())


def step_folders(root: Path) -> list[Path]:
    """Every `step-N` folder under `root`, complete or not (to tell "no run here" from "a run whose
    checkpoints are all unusable")."""
    return sorted(p for p in root.glob("step-*") if _STEP_DIR.match(p.name) and p.is_dir()) if root.is_dir() else []


def load_checkpoint(
    directory: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: torch.amp.GradScaler,
    info: DistInfo,
    sharded: bool = False,
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
    try:
        if sharded:
            sharded_ckpt.read_shards(directory, model, optimizer)
        else:
            load_model(model, str(directory / "model.safetensors"), device=str(info.device))
        training_state = torch.load(directory / "training_state.pt", map_location=info.device, weights_only=True)
        if not sharded:
            optimizer.load_state_dict(training_state["optimizer"])
        scheduler.load_state_dict(training_state["scheduler"])
        # A scaler that was off (fp32, bf16) saved an empty state: with fp16 now, start a fresh one.
        if training_state["scaler"] and scaler.is_enabled():
            scaler.load_state_dict(training_state["scaler"])
    except (RuntimeError, ValueError, KeyError, TypeError, SafetensorError, pickle.UnpicklingError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DistqaError(f"cannot load checkpoint {directory}: {reason[:300]}") from err
    state = read_trainer_state(directory)
    rng_path = directory / f"rng-rank{info.rank}.pt"
    # A run resumed on more processes (same global batch) has ranks the checkpoint never saw;
    # the caller seeds those afresh, and says so.
    state["rng_restored"] = rng_path.is_file()
    if state["rng_restored"]:
        restore_rng_state(torch.load(rng_path, weights_only=True), info.device)
    return state
