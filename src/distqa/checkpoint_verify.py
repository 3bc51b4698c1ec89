"""Whether a checkpoint folder can be used, and where a run's checkpoints are.

A checkpoint is usable when its manifest (size and SHA-256 of every file, written last) lists the
files every checkpoint has and every file matches it, its trainer state parses and agrees with the
folder's step, and its model weights are finite. Resume tries the newest checkpoint first and falls
back to the one before when this says why one cannot be used; the check survives any content of
any file.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from safetensors import safe_open

from distqa import sharded as sharded_ckpt
from distqa.dist import DistInfo, all_gather_objects
from distqa.durable import file_digest
from distqa.errors import ConfigError
from distqa.parallel import all_finite

_STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"


def sha256(path: Path) -> str:
    return file_digest(path, hashlib.sha256())


def manifest_entry(path: Path) -> dict[str, Any]:
    """A manifest entry: size and SHA-256."""
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


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
    trainer state must parse and agree with the folder's step (a manifest of `{}` would
    otherwise vouch for a folder of truncated files); the model's weights must be finite, read
    last, and only from files that matched their hashes.
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
        if sha256(path) != digest:
            return f"{name} does not match its hash in the manifest"
    return _check_trainer_state(directory) or _check_weights(directory, manifest)


def _check_weights(directory: Path, manifest: dict[str, Any]) -> str | None:
    """A checkpoint whose weights hold NaN/inf (a run that diverged before it was stopped) is as
    unusable as a damaged one: resuming it would only continue the divergence."""
    sharded = "model.safetensors" not in manifest
    name = sharded_ckpt.METADATA_FILE if sharded else "model.safetensors"
    try:
        bad = sharded_ckpt.first_nonfinite_weight(directory) if sharded else _first_nonfinite(directory / name)
    except Exception as err:  # noqa: BLE001 - files that matched their hashes, yet crafted: report, never raise
        return f"the model in {name} cannot be read ({sharded_ckpt.error_line(err)})"
    return f"the model's weights hold NaN/inf (first: {_shown(bad)})" if bad is not None else None


def _first_nonfinite(path: Path) -> str | None:
    """The first tensor of a safetensors file holding NaN/inf, read one tensor at a time."""
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
            if not all_finite([f.get_tensor(name)]):
                return name
    return None


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
    for key in ("log_window", "grad_norm_window"):  # (absent in checkpoints of before they were kept)
        if state.get(key) is not None and not _two_finite_numbers(state[key]):
            return f"{STATE_FILE} has no valid {key!r} (two finite numbers)"
    if state.get("best") is not None and not _valid_best(state["best"], state["step"]):
        # A NaN value was beaten by nothing (best frozen for good), a text one stopped every evaluation.
        return f"{STATE_FILE} has no valid 'best' (metric, mode, a finite value, a step up to its own)"
    named = folder_step(directory)
    if named is not None and named != state["step"]:
        return f"{STATE_FILE} is for step {state['step']}, not {named}"
    return None


def _valid_best(best: Any, step: int) -> bool:
    """The best record as `distqa.best.new_best` writes it."""
    return (
        isinstance(best, dict)
        and isinstance(best.get("metric"), str)
        and best.get("mode") in ("max", "min")
        and _two_finite_numbers([best.get("value"), 0])
        and type(best.get("step")) is int
        and 0 <= best["step"] <= step
    )


def _two_finite_numbers(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    )


def folder_step(folder: Path) -> int | None:
    """N of a folder named `step-N`, or None for any other name."""
    match = _STEP_DIR.match(folder.name)
    return int(match.group(1)) if match else None


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        step = folder_step(path)
        if step is not None and path.is_dir() and (path / STATE_FILE).is_file():
            found.append((step, path))
    return [path for _, path in sorted(found)]


def read_trainer_state(directory: Path) -> dict[str, Any]:
    return json.loads((directory / STATE_FILE).read_bytes())


def step_folders(root: Path) -> list[Path]:
    """Every `step-N` folder under `root`, complete or not (to tell "no run here" from "a run whose
    checkpoints are all unusable")."""
    return sorted(p for p in root.glob("step-*") if _STEP_DIR.match(p.name) and p.is_dir()) if root.is_dir() else []


# Written into every export (model/, `distqa export`'s folder): which checkpoint's weights it holds.
# A finished run is "already exported" only when model/ says it holds the final checkpoint: a
# model/ left from an earlier, shorter run (its export failed, or the process was killed before
# it) must not pass for the new one.
SOURCE_FILE = "distqa_source.json"


def source_of(checkpoint: Path) -> dict[str, Any]:
    """What an export of `checkpoint` records of it: the folder's name, its step and its manifest's
    SHA-256 (which covers every file of it, so a checkpoint written again at the same step differs)."""
    return {
        "checkpoint": checkpoint.name,
        "step": int(read_trainer_state(checkpoint)["step"]),
        "manifest_sha256": sha256(checkpoint / MANIFEST_FILE),
    }


def recorded_source(export: Path) -> dict[str, Any] | None:
    """The export folder `export`'s SOURCE_FILE, or None: there is none (an older export), or it is
    damaged, and then it vouches for nothing."""
    try:
        recorded = json.loads((export / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) else None


def export_files(folder: Path) -> dict[str, Any]:
    """Size and SHA-256 of every file an export wrote (SOURCE_FILE aside), by path inside it: recorded
    in SOURCE_FILE, so a file damaged since (a truncated copy, a flipped byte) is told from the export."""
    found = sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() != SOURCE_FILE)
    return {p.relative_to(folder).as_posix(): manifest_entry(p) for p in found}


def export_damage(export: Path, names: Collection[str] | None = None, *, removable: Collection[str] = ()) -> str | None:
    """What of the export folder `export` no longer matches the files its SOURCE_FILE records (those
    of them in `names`, when given), in a few words; None when all match, or when it records none
    (an export of an older distqa). A SOURCE_FILE that is there but unreadable is damage: it would
    vouch for nothing, and every check that reads it would pass. `removable`: files that may be
    gone or edited on purpose (whatever reads them checks them); given, every other recorded file
    must be there."""
    source = export / SOURCE_FILE
    recorded = recorded_source(export)
    if recorded is None and (source.exists() or source.is_symlink()):
        return f"{SOURCE_FILE} is damaged"
    if recorded is None:
        return None
    # An older export's record names its checkpoint and no files; one that names neither, or files
    # of no shape, vouched for nothing, and every check passed (a review).
    files = recorded.get("files")
    if ("files" in recorded and (not isinstance(files, dict) or not files)) or not (files or "checkpoint" in recorded):
        return f"{SOURCE_FILE} records no files"
    if not isinstance(files, dict):
        return None
    try:
        for name, expected in files.items():
            if (names is not None and name not in names) or name in removable:
                continue
            size = expected.get("bytes") if isinstance(expected, dict) else None
            path = export / name
            if not path.is_file():
                # Weights and config are the model; another file may be removed on purpose (nq.md:
                # without distqa_thresholds.json every example gets its best answer), unless the
                # caller names those that may (`removable`).
                if name == "config.json" or name.endswith(".safetensors") or removable:
                    return f"{name} is missing"
                continue
            if path.stat().st_size != size:
                return f"{name} has {path.stat().st_size} bytes, {SOURCE_FILE} says {size}"
            if sha256(path) != expected.get("sha256"):
                return f"{name} does not match its hash in {SOURCE_FILE}"
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    return None


def exported_from(export: Path, checkpoint: Path) -> bool:
    """Whether the export folder `export` holds `checkpoint`'s weights, by its SOURCE_FILE (whether
    its files are still those the export wrote is `export_damage`'s to say)."""
    recorded = recorded_source(export)
    try:
        source = source_of(checkpoint)
    except (OSError, ValueError, KeyError, TypeError):  # the checkpoint's own files cannot say
        return False
    return recorded is not None and {key: recorded.get(key) for key in source} == source


def same_on_every_rank(directory: Path, info: DistInfo, *, shared: bool = False) -> None:
    """Raise the same one line on every rank unless every rank will load the checkpoint rank 0
    chose and verified in `directory`. Every rank must call it.

    Each rank reads the checkpoint from its own storage: on nodes that do not share output_dir, a
    node's copy may be another run's, an older one, damaged, or missing, and DDP would then train on
    two sets of weights with exit 0. So every rank compares its manifest's hash with rank 0's, and
    the first process of every other node verifies its files as rank 0 did (once per node: the
    processes of a node share its files), unless it reads rank 0's own (`shared`: it sees the files
    rank 0 writes in output_dir, `sharded.sees_rank0_files`)."""
    if not info.is_distributed:
        return
    try:
        digest: str | None = hashlib.sha256((directory / MANIFEST_FILE).read_bytes()).hexdigest()
        damage = verify_checkpoint(directory) if info.local_rank == 0 and not info.is_main and not shared else None
    except OSError as err:
        digest, damage = None, f"cannot read its {MANIFEST_FILE} ({err.strerror or err})"
    views: list[tuple[str | None, str | None, str]] = all_gather_objects((digest, damage, str(directory)), info)  # type: ignore[assignment]
    problems = []
    for rank, (digest, damage, _) in enumerate(views):
        if digest is None:
            problems.append(f"rank {rank}: {damage}")
        elif views[0][0] is not None and digest != views[0][0]:
            problems.append(f"rank {rank}: another checkpoint (its {MANIFEST_FILE} differs from rank 0's)")
        elif damage is not None:
            problems.append(f"rank {rank}: damaged ({damage})")
    if problems:
        raise ConfigError(
            f"the processes of this run do not all see the checkpoint rank 0 resumes from, {views[0][2]} "
            f"({'; '.join(problems)}): every process must load the same one, so put output_dir on storage "
            "every node shares, or give every node a copy of rank 0's checkpoint at the same place"
        )


def none_on_any_rank(root: Path, info: DistInfo) -> None:
    """Rank 0 found no checkpoint in `root`, and the run starts from step 0: raise the same one
    line on every rank when another rank sees step folders in its own `root`. On nodes that do not
    share output_dir, a relaunch whose rank 0 landed on another host (or an elastic round whose
    rank 0 is a node that joined) started over from step 0 beside the run's checkpoints, exit 0
    (found by a review). Every rank must call it."""
    if not info.is_distributed:
        return
    try:
        newest, problem = [p.name for p in step_folders(root)][-1:], None
    except OSError as err:  # (one rank raising alone would leave the others in the gather)
        newest, problem = [], f"cannot read it ({err.strerror or err})"
    views: list[tuple[list[str], str, str | None]] = all_gather_objects((newest, str(root), problem), info)  # type: ignore[assignment]
    unread = [f"rank {rank}: {where} {problem}" for rank, (_, where, problem) in enumerate(views) if problem]
    if unread:
        raise ConfigError(
            f"rank 0 finds no checkpoint in {views[0][1]}, and not every rank can look for one in its output_dir "
            f"({'; '.join(unread[:3])}): fix that storage, then run again"
        )
    seen = [f"rank {rank} in {where} (newest {found[0]})" for rank, (found, where, _) in enumerate(views) if found]
    if seen:
        raise ConfigError(
            f"rank 0 finds no checkpoint in {views[0][1]}, but {'; '.join(seen[:3])} sees one: this run would "
            "start from step 0 beside them. Put output_dir on storage every node shares, or give rank 0's node "
            "a copy of the newest checkpoint at the same place; train.resume=never on every node starts afresh"
        )
