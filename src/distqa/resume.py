"""Which checkpoint a run continues from, and whether it can continue it.

Rank 0 decides (it verifies manifests, newest first) and broadcasts the choice, so every rank loads
the same checkpoint. Every setting falls in one of three kinds when it differs from the
checkpoint's, as its field declares it (`distqa.config.setting(..., resume=...)`, for the core's
keys and a task's own `task.*` keys alike; a test walks every key of the schema):
- "silent": how the run is operated, not what it computes;
- "applied": takes effect from the resume step on, and a warning names it;
- undeclared: it changes what the checkpoint's state means (the model, the data, the optimizer's
  kind, the seed): refused in one line naming the key, never a traceback at the first step.
The data itself is compared by fingerprint (`distqa.data_identity`), so a moved file is fine and a
changed one is refused unless `train.allow_data_change=true`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from distqa.agreement import flatten
from distqa.build_identity import dropout_keys
from distqa.checkpoint import list_checkpoints, read_trainer_state, step_folders, verify_checkpoint
from distqa.checkpoint_verify import STATE_FILE, folder_step, none_on_any_rank, same_on_every_rank
from distqa.config import Config
from distqa.config_layers import setting_field
from distqa.data_agreement import same_identity
from distqa.dist import DistInfo, print0
from distqa.errors import ConfigError
from distqa.moved_model import check_vouched, moved_keys, warn_of_folder_dropout
from distqa.optim import SCHEDULES, rate_after, warmup_steps
from distqa.rank0 import on_rank0, reason
from distqa.set_aside import set_aside_earlier_run, undo_killed_move
from distqa.sharded import sees_rank0_files


def resume_kind(cfg: Config, key: str) -> str:
    """ "silent", "applied" or "refused": what a change of `key` means when resuming, as its field
    declares it (`setting(..., resume=...)`; without it, and for a key the schema lacks: refused)."""
    found = setting_field(cfg, key)
    return "refused" if found is None else found.metadata.get("resume", "refused")


def choose_checkpoint(output_dir: Path, mode: str, info: DistInfo) -> Path | None:
    """The checkpoint to continue from, decided by rank 0 (which verifies the manifests) and
    broadcast, so every rank loads the same one (or raises the same error).

    A checkpoint in output_dir is named to each rank under its own output_dir, which another node
    may mount at another path; each rank then proves it sees the same files (`same_on_every_rank`)."""
    root = output_dir / "checkpoints"

    def choose() -> tuple[Path, Path | None] | None:
        chosen = _choose(output_dir, root, mode)
        return None if chosen is None else (chosen, _inside(chosen, output_dir))

    choice = on_rank0(
        info,
        choose,
        # (Moving an earlier run aside, train.resume=never or auto over records, fails here too.)
        failure=lambda err: f"cannot read the checkpoints in {root} or move an earlier run aside: {reason(err)}",
        error=ConfigError,
    )
    if choice is None:
        if mode == "auto":
            none_on_any_rank(root, info)
        return None
    chosen, inside = choice
    mine = chosen if inside is None or info.is_main else output_dir / inside
    # A node that sees rank 0's output_dir reads the files rank 0 verified: no second reading.
    shared = inside is not None and info.is_distributed and sees_rank0_files(output_dir, info)[info.rank]
    same_on_every_rank(mine, info, shared=shared)
    return mine


def _inside(path: Path, folder: Path) -> Path | None:
    """`path` relative to `folder` when it lies inside it (as written: links are not followed)."""
    try:
        return Path(os.path.abspath(path)).relative_to(os.path.abspath(folder))
    except ValueError:
        return None


def _not_a_checkpoint(path: Path) -> str:
    """What a train.resume folder that is no checkpoint is (a run's output_dir, its checkpoints/,
    its model/), and the checkpoint to name instead."""
    # Newest first, each verified only until one passes: verifying hashes every file of a checkpoint.
    found = sorted(list_checkpoints(path) + list_checkpoints(path / "checkpoints"), key=folder_step, reverse=True)
    newest = next((c for c in found if verify_checkpoint(c) is None), None)
    instead = f"name one of its checkpoints, the newest {newest}" if newest else "it holds none"
    return f"this folder is not a checkpoint (a step-N folder under an output_dir's checkpoints/): {instead}"


def _choose(output_dir: Path, root: Path, mode: str) -> Path | None:
    undone = undo_killed_move(output_dir)  # first: every choice below sees the earlier run whole
    for staging in undone:  # a checkpoint named inside the stopped move's folder is back in place
        inside = _inside(Path(mode), staging) if mode not in ("auto", "never") else None
        if inside is not None:
            raise ConfigError(
                f"train.resume={mode} lay in {staging}, the folder of a move of the run aside that was stopped: "
                f"it is back at {output_dir / inside}: name that"
            )
    if mode == "never":
        moved = set_aside_earlier_run(output_dir)
        if moved is not None:
            print(f"train.resume=never: the earlier run in {output_dir} was moved to {moved}", flush=True)
        return None
    if mode != "auto":
        path = Path(mode)
        damage = verify_checkpoint(path)
        if damage == "no manifest" and folder_step(path) is None and not (path / STATE_FILE).exists():
            raise ConfigError(f"train.resume={mode}: {_not_a_checkpoint(path)}")  # not "damaged": a review
        if damage is not None:
            raise ConfigError(f"train.resume={mode}: the checkpoint is damaged ({damage})")
        return path
    skipped = []
    for candidate in reversed(list_checkpoints(root)):
        damage = verify_checkpoint(candidate)
        if damage is None:
            return candidate
        skipped.append(f"{candidate.name}: {damage}")
        print(f"warning: skipping checkpoint {candidate}: {damage}; trying the one before", flush=True)
    if step_folders(root):
        # A run was here, and none of its checkpoints can be used: starting from step 0 would
        # silently redo (and overwrite the record of) all its work.
        found = "; ".join(skipped) if skipped else "each lacks its trainer_state.json"
        raise ConfigError(
            f"no usable checkpoint in {root} ({found}): name one with train.resume=PATH, or start "
            "afresh with train.resume=never (the earlier run's files are moved aside, not deleted)"
        )
    # Records without a step folder (its checkpoints deleted): nothing to continue, but a start
    # from step 0 must not overwrite them.
    moved = set_aside_earlier_run(output_dir)
    if moved is not None:
        print(
            f"train.resume=auto: {output_dir} holds an earlier run's records but no checkpoint to continue "
            f"from: they were moved to {moved}, and this run starts from step 0",
            flush=True,
        )
    return None


def check_resumable(directory: Path, cfg: Config, *, global_batch: int) -> dict[str, Any]:
    """Refuse a checkpoint whose settings this run cannot continue; return its trainer state.

    Called before the data is built (preparing features can take hours), so a refusal costs
    nothing and writes nothing; the data and the step count are checked by `check_continuation`."""
    state = read_trainer_state(directory)
    if state["global_batch"] != global_batch:
        raise ConfigError(
            f"checkpoint {directory} was trained with a global batch of {state['global_batch']} examples, "
            f"this run has {global_batch} (train.batch_size x train.grad_accum x processes): resume "
            "with the same global batch (train.global_batch keeps it at any process count), or start afresh "
            "in another output_dir"
        )
    refused, saved, now = _changed_of_kind("refused", state, cfg)
    moved = moved_keys(state, saved, now)
    if moved:  # its records are compared with the files once the model is built (check_continuation)
        refused = [key for key in refused if key not in moved]
        print0(
            f"resuming {directory} with the model's files at another place: {_shown(moved, saved, now)}; every "
            "weight comes from the checkpoint, and their config and tokenizer must be the ones it records"
        )
    if "train.parallel" in refused:
        raise ConfigError(
            f"cannot resume {directory} with changed train.parallel ({saved['train.parallel']!r} -> "
            f"{now['train.parallel']!r}): its model and optimizer are stored "
            + ("as shards" if saved["train.parallel"] == "fsdp" else "whole")
            + f"; resume with train.parallel={saved['train.parallel']}, or start afresh with train.resume=never"
        )
    if refused:
        raise ConfigError(
            f"cannot resume {directory} with changed {_shown(refused, saved, now)}: it changes the model, the "
            "data or the optimizer the checkpoint holds; set it back, or start afresh with train.resume=never"
        )
    _refuse_finished_with_other_settings(state, cfg, _planned_steps(state, cfg))
    return state


def _planned_steps(state: dict[str, Any], cfg: Config) -> int | None:
    """This run's length when it is known before the data is built: train.max_steps, or the
    checkpoint's own plan when neither train.max_steps nor train.epochs changed."""
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    saved = state["config"].get("train", {})
    same = (saved.get("max_steps"), saved.get("epochs")) == (cfg.train.max_steps, cfg.train.epochs)
    return state.get("total_steps") if same else None


def _refuse_finished_with_other_settings(state: dict[str, Any], cfg: Config, total_steps: int | None) -> None:
    if state["step"] != total_steps:
        return
    applied, saved, now = _changed_of_kind("applied", state, cfg)
    if applied:
        # Nothing would train with the new settings, yet config.yaml and the plot would claim them.
        raise ConfigError(
            f"the run in {cfg.output_dir} finished at step {total_steps} with other settings "
            f"({_shown(applied, saved, now)}): nothing to train; to train with these settings use another "
            "output_dir, or train.resume=never (the finished run is moved aside, not deleted)"
        )


class _Absent:
    """A key one side of a resume has and the other lacks."""

    def __repr__(self) -> str:
        return "absent"


ABSENT = _Absent()


def changed_settings(state: dict[str, Any], cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    """(checkpoint's value, this run's value) of every key that differs, by key (ABSENT: one side
    lacks it)."""
    # Through JSON, as trainer_state.json holds them: a tuple default is the list it was saved as,
    # not a change (every resume of a fork with one was refused).
    saved, now = flatten(read_recorded(state["config"])), flatten(json.loads(json.dumps(dataclasses.asdict(cfg))))
    # A core key the checkpoint's distqa did not have yet (or that was removed since) is not
    # compared. A task's key is: a setting of a fork renamed, added or dropped, or an entry of a
    # dict setting given or left out, changed what the run computes without a word.
    keys = [k for k in now if k in saved or k.startswith("task.")]
    keys += [k for k in saved if k not in now and k.startswith("task.")]
    if now.get("train.global_batch") and saved.get("train.global_batch") == now["train.global_batch"]:
        # Derived from it for this run's process count (`resolve_global_batch`), not set: an
        # elastic resume on other nodes was warned of a grad_accum change nobody made.
        keys = [k for k in keys if k != "train.grad_accum"]
    changed = sorted(k for k in keys if saved.get(k, ABSENT) != now.get(k, ABSENT))
    return {k: saved.get(k, ABSENT) for k in changed}, {k: now.get(k, ABSENT) for k in changed}


def _changed_of_kind(kind: str, state: dict[str, Any], cfg: Config) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """The changed keys of one kind ("refused", "applied"), and every changed key's two values."""
    saved, now = changed_settings(state, cfg)
    return [k for k in saved if resume_kind(cfg, k) == kind], saved, now


def _shown(keys: list[str], saved: dict[str, Any], now: dict[str, Any]) -> str:
    return ", ".join(f"{k} ({saved[k]!r} -> {now[k]!r})" for k in keys)


_FILES_FIX = (
    "give model.name and model.tokenizer the files it was trained with, or start afresh with train.resume=never"
)


def check_continuation(
    directory: Path,
    state: dict[str, Any],
    cfg: Config,
    *,
    total_steps: int,
    data: dict[str, Any],
    task_identity: dict[str, str] | None = None,
    model_settings: dict[str, Any] | None = None,
) -> bool:
    """Once the data is built: refuse other data, another tokenizer or too few steps; True when the
    checkpoint is the end of this run already (nothing to train). Warns about settings applied from
    the resume step."""
    if state["step"] > total_steps:
        raise ConfigError(
            f"checkpoint {directory} is at step {state['step']}, past this run's {total_steps} steps: raise "
            "train.max_steps (or train.epochs), or start afresh with train.resume=never"
        )
    moved = moved_keys(state, *changed_settings(state, cfg))
    if moved:
        check_vouched(directory, state, task_identity or {}, model_settings, moved, _FILES_FIX)
    # The tokenizer first: NQ's features, made by it, would show as other data.
    check_task_identity(directory, state.get("task_identity"), task_identity or {}, "than this run builds")
    check_model_settings(directory, state.get("model_settings"), model_settings, "than this run builds")
    warn_of_folder_dropout(directory, state, model_settings, cfg.model.dropout)
    _check_data(directory, state.get("data"), data, cfg)
    _refuse_finished_with_other_settings(state, cfg, total_steps)
    if state["step"] == total_steps:
        return True
    applied, saved, now = _changed_of_kind("applied", state, cfg)
    if applied:
        print0(
            f"warning: resuming {directory} with changed settings, applied from step {state['step']} on: "
            + _shown(applied, saved, now)
        )
    _warn_of_another_length(directory, state, cfg, total_steps)
    return False


def _warn_of_another_length(directory: Path, state: dict[str, Any], cfg: Config, total_steps: int) -> None:
    """train.max_steps, train.epochs (or the data's size) may change a run's length on resume;
    the schedule is then the new length's from the resume step on, and with a warm-up its rate can
    drop and warm up again (a review saw 5.7e-4 become 4e-4, then climb): said, never silent."""
    planned, step = state.get("total_steps"), state["step"]
    if not isinstance(planned, int) or planned == total_steps:
        return
    rate, then = rate_after(cfg.train, total_steps, step), _schedule_settings(state, cfg)
    # (A finished run made longer has no rate of its own left to compare with.)
    before = f" ({rate_after(then, planned, step):.3g} in {planned} steps)" if step < planned else ""
    warm = warmup_steps(then, planned), warmup_steps(cfg.train, total_steps)
    again = f"; its warm-up now ends at step {warm[1]}, not {warm[0]}" if warm[1] > step and warm[0] != warm[1] else ""
    print0(
        f"warning: resuming {directory} with another length, applied from step {step} on: {planned} -> "
        f"{total_steps} steps; the learning-rate schedule is the new length's: step {step + 1}'s rate is "
        f"{rate:.3g}{before}{again}"
    )


def _schedule_settings(state: dict[str, Any], cfg: Config) -> Any:
    """This run's train settings with the checkpoint's rate, warm-up and schedule: the "before" of
    the length line is the run's own schedule, also where one of those changed with the length.
    (A copy, not `dataclasses.replace`, which would check every setting again; a value this
    distqa does not know keeps this run's.)"""
    saved = state["config"].get("train", {}) if isinstance(state.get("config"), dict) else {}
    then = copy.copy(cfg.train)
    if isinstance(saved.get("lr"), int | float) and saved["lr"] > 0:
        then.lr = float(saved["lr"])
    if isinstance(saved.get("warmup_ratio"), int | float) and 0 <= saved["warmup_ratio"] <= 1:
        then.warmup_ratio = float(saved["warmup_ratio"])
    if saved.get("lr_schedule") in SCHEDULES:
        then.lr_schedule = saved["lr_schedule"]
    return then


def check_task_identity(
    directory: Path,
    saved: Any,
    now: dict[str, str],
    builder: str,
    fix: str = _FILES_FIX,
) -> None:
    """The same setting may name other files on resume or export (a hub id's newer snapshot, a
    folder replaced): a tokenizer that gives other ids would train on, or be exported beside the
    weights, as if nothing changed. `builder` says who built `now` ("than this run builds").
    (Checkpoints written before identities were kept have none.)"""
    differ = _differing(saved, now)
    if differ:
        shown = "; ".join(f"{key}: {str(saved[key])[:12]} then, {now[key][:12]} now" for key in differ)
        raise ConfigError(
            f"checkpoint {directory} was trained with another {', '.join(differ)} {builder} ({shown}): {fix}"
        )


def check_model_settings(
    directory: Path,
    saved: Any,
    now: dict[str, Any] | None,
    builder: str,
    fix: str = "give model.name the files it was trained with, or start afresh with train.resume=never",
) -> None:
    """As `check_task_identity`, for the model's config (`build_identity.model_settings`). A key
    one of them lacks is left alone: another version of transformers adds or drops keys of its own
    (a checkpoint from before these were kept has none)."""
    applied = set(dropout_keys(now or {}))  # (compared apart: model.dropout's change is applied)
    differ = [key for key in _differing(saved, now) if key not in applied]
    if differ:
        shown = "; ".join(f"{key}: {saved[key]!r} then, {now[key]!r} now" for key in differ[:4])
        more = f"; and {len(differ) - 4} more" if len(differ) > 4 else ""
        raise ConfigError(
            f"checkpoint {directory} was trained with another model config {builder} ({shown}{more}): {fix}"
        )


def _differing(saved: Any, now: dict[str, Any] | None) -> list[str]:
    """The keys both records hold with other values, sorted; none where the checkpoint kept no
    record (`saved` is not a dict) or this run builds none (`now` is None)."""
    if not isinstance(saved, dict) or now is None:
        return []
    return sorted(key for key in saved.keys() & now.keys() if saved[key] != now[key])


def _check_data(directory: Path, saved: Any, now: dict[str, Any], cfg: Config) -> None:
    if not isinstance(saved, dict):
        return  # a checkpoint from before data identities were recorded
    if same_identity(saved, now):
        return
    old, same_length = str(saved.get("fingerprint", "")), saved.get("examples") == now["examples"]
    if same_length and len(old) != len(str(now["fingerprint"])):
        # Written by a distqa whose fingerprint sampled 64 examples (16 characters): not comparable.
        what = (
            f"checkpoint {directory} recorded its data with an older kind of fingerprint ({old}), which "
            f"cannot be compared with this one (data.train={cfg.data.train!r}, {now['examples']} examples)"
        )
        going_on, fix = "continuing", "if data.train is unchanged, set train.allow_data_change=true once to resume"
    elif same_length and saved.get("format", 1) != now.get("format", 1):
        # Format 2 reads dataclasses, sets and other objects otherwise; dicts, lists, tensors, text
        # and Arrow columns as before: for those a differing fingerprint is other data.
        what = (
            f"data.train={cfg.data.train!r} has another fingerprint than checkpoint {directory} recorded "
            f"({old}, format {saved.get('format', 1)}; now {now['fingerprint']}, format {now.get('format', 1)}): "
            "if its items hold only dicts, lists, tensors, text and numbers the data changed; if they hold "
            "dataclasses, sets or other objects, format 2 reads those otherwise"
        )
        going_on = "continuing"
        fix = "restore the data, or (the same data, read otherwise) set train.allow_data_change=true once to resume"
    else:
        what = (
            f"data.train={cfg.data.train!r} is not the data checkpoint {directory} was trained on "
            f"({saved.get('examples')} examples, fingerprint {saved.get('fingerprint')}; now {now['examples']} "
            f"examples, fingerprint {now['fingerprint']})"
        )
        going_on = "continuing on the new data"
        fix = "restore that data, or set train.allow_data_change=true to continue on this data anyway"
    if cfg.train.allow_data_change:
        print0(f"warning: {what}; {going_on} (train.allow_data_change=true)")
        return
    raise ConfigError(f"{what}: {fix}")


def read_recorded(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's recorded settings as this version reads them: a `train.momentum` recorded
    with another optimizer than sgd (allowed before it was refused) did nothing, and reads as unset,
    so that such a checkpoint still exports and resumes without a change."""
    train = saved.get("train")
    if isinstance(train, dict) and train.get("optimizer") != "sgd" and train.get("momentum"):
        return {**saved, "train": {**train, "momentum": 0.0}}
    return saved
