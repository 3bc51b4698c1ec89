"""Which checkpoint a run continues from, and whether it can continue it exactly.

Rank 0 decides (it verifies manifests, newest first) and broadcasts the choice, so every rank loads
the same checkpoint. A checkpoint made with another global batch cannot continue exactly (the data
position counts global batches) and is refused; other changed settings are named in a warning.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from distqa.checkpoint import list_checkpoints, read_trainer_state, verify_checkpoint
from distqa.config import Config
from distqa.dist import DistInfo, broadcast_object, print0
from distqa.errors import ConfigError

# Keys that may change between a run and its resumption without changing what is computed.
RESUME_MAY_DIFFER = {
    "train.keep_checkpoints",
    "train.term_grace_s",
    "train.check_replicas",
    "output_dir",
    "train.resume",
    "train.max_steps",
    "train.epochs",
    "train.log_every",
    "train.checkpoint_every",
    "data.num_workers",
    "train.static_graph",
}


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def choose_checkpoint(root: Path, mode: str, info: DistInfo) -> Path | None:
    """The checkpoint to continue from, decided by rank 0 (which verifies the manifests) and
    broadcast, so every rank loads the same one."""
    choice: Path | None = None
    problem: str | None = None
    if info.is_main:
        if mode == "never":
            if list_checkpoints(root):
                problem = (
                    f"train.resume=never, but {root} already holds checkpoints that this run would "
                    "overwrite: use another output_dir, or train.resume=auto to continue"
                )
        elif mode == "auto":
            for candidate in reversed(list_checkpoints(root)):
                damage = verify_checkpoint(candidate)
                if damage is None:
                    choice = candidate
                    break
                print(f"warning: skipping checkpoint {candidate}: {damage}; trying the one before", flush=True)
        else:
            damage = verify_checkpoint(Path(mode))
            if damage is not None:
                problem = f"train.resume={mode}: the checkpoint is damaged ({damage})"
            choice = Path(mode)
    problem, choice = broadcast_object((problem, choice))  # type: ignore[misc]
    if problem:
        raise ConfigError(str(problem))
    return choice


def check_resumable(directory: Path, cfg: Config, *, global_batch: int, total_steps: int) -> None:
    """Refuse a checkpoint this run cannot continue exactly; warn about settings that changed."""
    state = read_trainer_state(directory)
    if state["global_batch"] != global_batch:
        raise ConfigError(
            f"checkpoint {directory} was trained with a global batch of {state['global_batch']} examples, "
            f"this run has {global_batch} (train.batch_size x train.grad_accum x processes): resume "
            "with the same global batch, or start afresh in another output_dir"
        )
    if state["step"] > total_steps:
        raise ConfigError(f"checkpoint {directory} is at step {state['step']}, past this run's {total_steps} steps")
    saved, now = _flatten(state["config"]), _flatten(dataclasses.asdict(cfg))
    changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k) and k not in RESUME_MAY_DIFFER)
    if changed:
        print0(f"warning: resuming {directory} with changed settings: {', '.join(changed)}")
