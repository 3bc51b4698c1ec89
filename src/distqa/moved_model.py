"""A run's model files named at another place than its checkpoint records: a local folder moved
(the run copied to another machine, a volume mounted elsewhere), or a hub id's files copied into a
folder for a machine that cannot reach the hub.

Every weight of a resume or an export comes from the checkpoint: `model.name` and
`model.tokenizer` give only the model's config and the tokenizer, and the checkpoint records both
(`build_identity.model_settings`; the tokenizer's hash in the task's identity). So they may name
other folders, as long as those records are there to vouch for the new files whole; the values
themselves are compared by `resume.check_task_identity` and `resume.check_model_settings`, as for
any resume or export. A random model's name ('tiny') is its config: never "moved".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from distqa.build_identity import dropout_keys
from distqa.dist import print0
from distqa.errors import ConfigError
from distqa.models import RANDOM_MODELS

MOVABLE = ("model.name", "model.tokenizer")


def records_kept(state: dict[str, Any]) -> bool:
    """Whether the checkpoint's trainer state holds both records (an earlier distqa kept none)."""
    return isinstance(state.get("task_identity"), dict) and isinstance(state.get("model_settings"), dict)


def moved_keys(state: dict[str, Any], saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The MOVABLE keys among the changed ones (`saved`, `now`: each changed key's two values, as
    `resume.changed_settings` gives them) whose new value is a folder here, where the checkpoint
    kept the records that can vouch for it."""
    if not records_kept(state):
        return []
    return [
        key
        for key in MOVABLE
        if key in now
        and isinstance(now[key], str)
        and os.path.isdir(now[key])
        and not {now[key], saved.get(key)} & set(RANDOM_MODELS)  # ('tiny' is built, even beside a folder 'tiny')
    ]


def check_vouched(
    directory: Path,
    state: dict[str, Any],
    task_identity: dict[str, str],
    model_settings: dict[str, Any] | None,
    keys: list[str],
    fix: str,
) -> None:
    """Before the records' values are compared: both records kept, and the same identity entries on
    both sides (the value comparison leaves out an entry one side lacks: a tokenizer hashed at
    training and none now, or the other way round, would pass it)."""
    shown = " and ".join(keys)
    if not records_kept(state) or model_settings is None:
        raise ConfigError(
            f"checkpoint {directory} keeps no record of its model's config and tokenizer (an earlier distqa "
            f"wrote it), so {shown} cannot name other files than it was trained with: {fix}"
        )
    saved = sorted(state["task_identity"])
    if saved != sorted(task_identity):
        raise ConfigError(
            f"checkpoint {directory} was trained with {_entries(saved)}, and this run builds "
            f"{_entries(sorted(task_identity))} from {shown}: {fix}"
        )


def _entries(names: list[str]) -> str:
    return ", ".join(f"a {name}" for name in names) if names else "no tokenizer"


def warn_of_folder_dropout(
    directory: Path, state: dict[str, Any], now: dict[str, Any] | None, dropout: float | None
) -> None:
    """With model.dropout unset then and now, the dropout rates are model.name's own config's: a
    folder moved to another copy, or edited, with other rates trained on with them, unsaid (a
    review). Said as a setting applied from the resume step; `dropout` is this run's model.dropout."""
    saved, config = state.get("model_settings"), state.get("config")
    then = config.get("model", {}).get("dropout") if isinstance(config, dict) else None
    if dropout is not None or then is not None or not isinstance(saved, dict) or now is None:
        return
    differ = [key for key in dropout_keys(now) if key in saved and saved[key] != now[key]]
    if differ:
        shown = "; ".join(f"{key}: {saved[key]!r} then, {now[key]!r} now" for key in differ)
        print0(
            f"warning: resuming {directory} with other dropout rates in model.name's config, applied from step "
            f"{state['step']} on: {shown} (model.dropout=RATE sets one rate for all)"
        )
