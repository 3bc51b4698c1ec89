"""`distqa export`: a model/ folder from any checkpoint, e.g. the best one (`checkpoints/best`).

The end of a training run exports its final weights (`Trainer._finish`); this writes the same
folder from an earlier checkpoint, in one process without a GPU: the task is rebuilt from the
settings the checkpoint holds, its state restored (what its `save_model` may write beside the
weights), the weights loaded (whole, or gathered from a sharded checkpoint's files) and the model
saved by the task's own `save_model` and `save_settings`, written aside and renamed into place.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors import SafetensorError
from safetensors.torch import load_model
from torch import nn

from distqa import sharded
from distqa.best import BEST_NAME, resolve_checkpoint
from distqa.build_identity import full_identity, model_settings
from distqa.checkpoint_verify import SOURCE_FILE, read_trainer_state, source_of, step_folders
from distqa.config import Config
from distqa.config_checks import escaped
from distqa.console import no_load_report, quiet_libraries
from distqa.dist import DistInfo
from distqa.errors import DistqaError
from distqa.finish import save_task_model
from distqa.moved_model import MOVABLE, check_vouched
from distqa.outdir import export_atomically
from distqa.rank0 import reason
from distqa.registry import load_config, load_task
from distqa.resume import check_model_settings, check_task_identity, read_recorded
from distqa.task_settings import SETTINGS_FILE

_FIX = "put back the files it was trained with (or give model.name=DIR where they are now), then export again"
# What the checkpoint's settings name that an export does not need, and may no longer exist.
_NOT_NEEDED = ("data.train=dummy", "data.valid=null", "train.resume=auto")


def checkpoint_config(saved: dict[str, Any], directory: Path, moved: Sequence[str] = ()) -> Config:
    """The run's settings as the checkpoint recorded them, checked as `distqa train` checks them;
    `moved`: `model.name=DIR` and `model.tokenizer=DIR`, the model's files at another place now."""
    saved = read_recorded(saved)
    for item in moved:
        key, _, value = item.partition("=")
        if key not in MOVABLE:
            raise DistqaError(
                f"distqa export takes {' and '.join(f'{k}=DIR' for k in MOVABLE)} alone (given: {item}): every other "
                f"setting is the checkpoint's"
            )
        if not os.path.isdir(value):
            raise DistqaError(
                f"{key}={value}: there is no such folder; give the folder that holds the model's files now"
            )
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        OmegaConf.save(OmegaConf.create(escaped(saved)), path)
        try:
            return load_config(str(path), [*_NOT_NEEDED, *moved])
        except DistqaError as err:
            raise DistqaError(f"cannot read the settings of checkpoint {directory}: {err}") from err


def load_sharded_weights(directory: Path, model: nn.Module) -> None:
    """A sharded (train.parallel=fsdp) checkpoint's model, gathered into `model` in this process
    alone, through the restricted reader that resume and verification use."""
    state = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    try:
        sharded.load_restricted(state, directory, no_dist=True)
    except (ValueError, OSError) as err:
        raise DistqaError(f"cannot load the model from {directory}: {err}") from err


def check_replaceable(target: Path) -> None:
    """An export replaces its folder whole: an existing `target` must be an earlier export (it holds
    the source or settings file every export writes) or empty, never a run's output_dir, a
    checkpoint, a Hugging Face model folder of the user's or a home folder; nor may it lie in a
    run's checkpoints/ folder (a `best` link turned into a model folder would no longer name a step)."""
    parent = target.parent.resolve()  # a link on the way to checkpoints/ leads there all the same
    for folder in (parent, *parent.parents):
        # A run's: it holds step folders or `best`, or beside it a run's records. (Not config.yaml
        # alone: a project's own config.yaml sits beside many a folder of that name.)
        made_by_a_run = step_folders(folder) or os.path.lexists(folder / BEST_NAME)
        if folder.name == "checkpoints" and (made_by_a_run or (folder.parent / "metrics.jsonl").is_file()):
            raise DistqaError(
                f"--output {target} is inside the run's checkpoints folder {folder}, which only training "
                "writes: name a folder outside it (default: OUTPUT/model-step-N)"
            )
    if target.is_symlink() or not target.exists():  # a link is replaced, what it names left alone
        return
    if not target.is_dir():
        raise DistqaError(f"--output {target} is a file, not a folder: name a new folder for the export")
    names = sorted(path.name for path in target.iterdir())
    # Not config.json + model.safetensors alone: any Hugging Face model folder holds those.
    if names and not {SOURCE_FILE, SETTINGS_FILE} & set(names):
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise DistqaError(
            f"--output {target} is a folder that is not a model export (it holds {shown}), and an export "
            "replaces its folder whole: name a new folder, or an earlier export to replace"
        )


def checkpoint_unreadable(directory: Path, err: Exception) -> DistqaError:
    """One line for a checkpoint that could not be read whole: most often one that a run still
    training pruned meanwhile (train.keep_checkpoints), which "free space" would not explain."""
    if not directory.is_dir():
        return DistqaError(
            f"checkpoint {directory} disappeared during the export (a live run pruned it, train.keep_checkpoints, or "
            "set its run aside, train.resume=never): export checkpoints/best, or export after the run"
        )
    if isinstance(err, DistqaError):
        return err
    return DistqaError(f"cannot read checkpoint {directory} ({reason(err)}): name another step-N folder")


def _task_and_model(cfg: Config, state: dict[str, Any], directory: Path, moved: Sequence[str]) -> tuple[Any, nn.Module]:
    """The task with its state, and its model as built from the files the settings name now (its
    weights are loaded after): those files must still be the ones the checkpoint was trained with."""
    task = load_task(cfg)
    identity = full_identity(task)  # (the tokenizer's hash: once)
    # The settings are the checkpoint's, but the files they name may have changed since (a tokenizer
    # folder replaced): its ids would be exported beside weights trained on others.
    check_task_identity(
        directory,
        state.get("task_identity"),
        identity,
        f"than model.tokenizer={cfg.model.tokenizer or cfg.model.name!r} holds now",
        _FIX,
    )
    task.load_state_dict(state.get("task") or {})
    # What a task chose at an evaluation (NQ's thresholds) belongs to that step's weights only: the
    # task compares. (An attribute a task without such state ignores.)
    task.weights_step = state["step"]
    with no_load_report():  # every weight comes from the checkpoint
        model = task.build_model()
    settings = model_settings(model)
    if moved:
        keys = [item.partition("=")[0] for item in moved]
        check_vouched(directory, state, identity, settings, keys, _FIX)
    check_model_settings(
        directory,
        state.get("model_settings"),
        settings,
        f"than model.name={cfg.model.name!r} holds now",
        _FIX,
    )
    return task, model


def export_checkpoint(checkpoint: str, output: str | None = None, moved: Sequence[str] = ()) -> Path:
    """Write the model of `checkpoint` (a step-N folder or a `best` pointer) to `output` (default:
    `model-step-N` beside the run's checkpoints/ folder); returns where it went. `moved`: where
    the model's files are now (`checkpoint_config`), vouched for by the checkpoint's records."""
    quiet_libraries(is_main=True)  # as in training: no library progress bars in a log
    directory = resolve_checkpoint(Path(checkpoint))
    try:
        state = read_trainer_state(directory)
    except OSError as err:  # verified a moment ago: pruned since
        raise checkpoint_unreadable(directory, err) from err
    cfg = checkpoint_config(state["config"], directory, moved)
    # Absolute, links kept (one is replaced, not followed): `--output .` has a name to write beside.
    target = Path(os.path.abspath(output)) if output else directory.parent.parent / f"model-{directory.name}"
    check_replaceable(target)
    task, model = _task_and_model(cfg, state, directory, moved)
    try:
        if (directory / sharded.METADATA_FILE).is_file():
            load_sharded_weights(directory, model)
        else:
            load_model(model, str(directory / "model.safetensors"), device="cpu")
        # Read now, with the weights: the export records it, and the folder may be gone by then.
        source = source_of(directory)
    except (OSError, SafetensorError, DistqaError) as err:
        raise checkpoint_unreadable(directory, err) from err

    def save(folder: Path) -> None:
        save_task_model(task, model, folder)
        task.save_settings(folder)

    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    note = f"the checkpoint {directory} is unchanged: {{fix}} and run again"

    def still_there() -> str | None:
        # A run that set this one aside (train.resume=never) or pruned the checkpoint meanwhile: the
        # target beside it may be the new run's folder now, which must get none of the old weights.
        try:
            unchanged = source_of(directory) == source
        except (OSError, ValueError, KeyError, TypeError):
            unchanged = False
        if unchanged:
            return None
        if not directory.is_dir():
            return str(checkpoint_unreadable(directory, OSError("gone")))
        return f"checkpoint {directory} was written again during the export (another run writes there): export it again"

    export_atomically(save, target, info, note=note, source=source, still_valid=still_there)
    best = state.get("best")
    # The best of the run up to this checkpoint, as its own record says: a later step may have
    # beaten it since (an export of step-3 once said "the best" while checkpoints/best was step-6).
    what = (
        f" ({best['metric']}={best['value']:.4g}, the best up to step {state['step']})"
        if isinstance(best, dict) and best.get("step") == state["step"]
        else ""
    )
    print(f"exported {directory} (step {state['step']}){what} to {target}", flush=True)
    return target
