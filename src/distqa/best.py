"""The best checkpoint by an evaluation metric (`train.best_metric`, `train.best_mode`), as HF
Trainer's `metric_for_best_model` and Lightning's `ModelCheckpoint(monitor=...)` keep it.

The trainer records the best value so far in its state (trainer_state.json: `best`, so a resume
keeps it), saves a checkpoint at every evaluation that improves on it, and never prunes that one.
`output_dir/checkpoints/best` points at it: a relative symbolic link to `step-N` (or, on a file
system without links, a small file naming `step-N`). It is written after the checkpoint is whole
and renamed into place (`os.replace`), so it names a complete checkpoint, the previous best or the
new one, whenever a run is killed. Resume's listing of `step-N` folders does not see it; what
reads it (`resolve_checkpoint`, for `distqa export`) verifies the checkpoint it names.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distqa.checkpoint_verify import MANIFEST_FILE, folder_step, read_trainer_state, step_folders, verify_checkpoint
from distqa.dist import print0
from distqa.durable import fsync_path, write_atomically
from distqa.errors import ConfigError, DistqaError
from distqa.rank0 import on_rank0, reason

if TYPE_CHECKING:
    from distqa.config import TrainConfig
    from distqa.dist import DistInfo
    from distqa.task import Task

BEST_NAME = "best"
_STEP_NAME = re.compile(r"^step-(\d+)$")


def is_better(value: float, best: dict[str, Any] | None, mode: str) -> bool:
    """Whether `value` beats the record so far (none: any finite value does; NaN never does)."""
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    return value > best["value"] if mode == "max" else value < best["value"]


def new_best(record: dict[str, Any], metric: str, mode: str, best: dict[str, Any] | None) -> dict[str, Any] | None:
    """Rank 0, after an evaluation: the new record when `record` (the step's metrics line) improves
    on `best`, else None. A metric the evaluation did not report is the user's mistake: one line."""
    if metric not in record:
        reported = sorted(k for k in record if k.startswith("eval_"))
        what = f"it reported {', '.join(reported)}" if reported else "it reported nothing (is data.valid set?)"
        raise DistqaError(f"train.best_metric={metric!r} is not a metric of this task's evaluation: {what}")
    value = float(record[metric])
    if not math.isfinite(value):  # never a best: said, or a run whose every value is NaN ends without one silently
        step = record["step"]
        print0(f"warning: train.best_metric={metric} is {value} at step {step}: no candidate for the best checkpoint")
    if not is_better(value, best, mode):
        return None
    return {"metric": metric, "mode": mode, "value": value, "step": int(record["step"])}


def require_evaluation(task: Task, train: TrainConfig) -> None:
    """At set-up: train.best_metric needs an evaluation, the task's own `evaluate` or its validation
    data (whether the task reports that metric is known at its first evaluation: `new_best`); and
    train.eval_every without one is said, not silently ignored."""
    from distqa.task import Task

    valid = task.eval_dataset()
    if valid is not None and hasattr(valid, "__len__") and len(valid) == 0:
        # Found by the task's compute_metrics, on [], after a step was trained (a review).
        raise ConfigError(
            f"the validation set (data.valid={task.cfg.data.valid!r}) has no examples: an evaluation would score "
            "nothing; give it examples, or leave data.valid unset"
        )
    if type(task).evaluate is not Task.evaluate or valid is not None:
        return
    if train.best_metric:
        raise ConfigError(
            f"train.best_metric={train.best_metric!r} needs an evaluation, and this task evaluates nothing: set "
            "data.valid (or leave train.best_metric unset)"
        )
    if train.eval_every > 0:
        print0(f"warning: train.eval_every={train.eval_every}, but this task evaluates nothing (no data.valid)")


def best_after_evaluation(
    record: dict[str, Any] | None, train: TrainConfig, best: dict[str, Any] | None, info: DistInfo, root: Path
) -> dict[str, Any] | None:
    """Every rank, after an evaluation: the new record if `record` sets one (rank 0 holds the
    metrics and decides; every rank learns it, as every rank saves), else None."""
    if not train.best_metric or record is None:
        return None
    found = on_rank0(info, lambda: new_best(record, train.best_metric, train.best_mode, best))  # type: ignore[arg-type]
    if found is not None:
        print0(f"new best {found['metric']}={found['value']:.4g} at step {found['step']}: {root / BEST_NAME}")
    return found


def pointed(root: Path) -> Path | None:
    """The `step-N` folder `root/best` names, or None (no pointer, or not one this module wrote)."""
    link = root / BEST_NAME
    try:
        if link.is_symlink():
            name = os.readlink(link)
        elif link.is_file() and link.stat().st_size < 64:
            name = link.read_text().strip()
        else:
            return None
    except (OSError, UnicodeDecodeError):
        return None
    return root / name if _STEP_NAME.match(name) else None


def point_at(root: Path, step: int) -> None:
    """Rank 0: make `root/best` name `step-N`, atomically (a link, or a file where links fail)."""
    tmp, name = root / f".tmp-{BEST_NAME}", f"step-{step}"
    _remove_copied_best(root)
    tmp.unlink(missing_ok=True)
    try:
        os.symlink(name, tmp)  # relative: the run's folder may be moved or mounted elsewhere
    except OSError:  # a file system without symbolic links (some network and object stores)
        write_atomically(root / BEST_NAME, (name + "\n").encode())
    else:
        os.replace(tmp, root / BEST_NAME)  # replaces a link or a file by that name, never writes through it
    fsync_path(root)


def unpoint(root: Path) -> None:
    """Rank 0: remove `root/best` when it is a pointer this module wrote (a link or its file)."""
    if pointed(root) is not None:
        (root / BEST_NAME).unlink(missing_ok=True)
        fsync_path(root)


def _remove_copied_best(root: Path) -> None:
    """A `best` that is a folder: the link, copied by a tool that follows links (`cp -rL`, an object
    store's sync). Nothing can replace a folder by a link in one step, and every resume stopped at
    it. A copy of one of the run's checkpoints (the same manifest) goes; anything else is named."""
    best = root / BEST_NAME
    if best.is_symlink() or not best.is_dir():
        return
    try:
        copied = (best / MANIFEST_FILE).read_bytes()
        same = any((step / MANIFEST_FILE).read_bytes() == copied for step in step_folders(root))
    except OSError:
        same = False
    if not same:
        raise DistqaError(
            f"{best} is a folder, not the link to the best checkpoint distqa writes (a copy that followed the link "
            "holds one of the checkpoints' files): move it away, then run again"
        )
    shutil.rmtree(best)


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint folder `path` names (a `step-N` folder, or a `best` pointer), verified."""
    folder = path
    if path.name == BEST_NAME and (path.is_symlink() or path.is_file()):
        target = pointed(path.parent)
        if target is None:
            raise DistqaError(f"{path} is not a best-checkpoint pointer distqa wrote: name a step-N folder instead")
        folder = target
    if not folder.is_dir():
        raise DistqaError(f"checkpoint {folder} does not exist: name a folder OUTPUT/checkpoints/step-N or .../best")
    damage = verify_checkpoint(folder)
    if damage is not None:
        raise DistqaError(f"checkpoint {folder} cannot be used ({damage}): name another step-N folder")
    try:
        best = read_trainer_state(folder).get("best")
    except OSError as err:  # verified a moment ago: a live run pruned it, or moved its run aside
        raise DistqaError(
            f"checkpoint {folder} disappeared as it was read ({reason(err)}): a run still writing there pruned it "
            "(train.keep_checkpoints) or set it aside (train.resume=never); name another step-N folder"
        ) from None
    if folder != path and not (isinstance(best, dict) and best.get("step") == folder_step(folder)):
        raise DistqaError(f"{path} names {folder.name}, whose trainer state records another best: name a step-N folder")
    return folder
