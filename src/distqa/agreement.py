"""Every rank runs the same settings, or none starts.

Each node reads its own command line and config file. Two nodes whose settings differ would train
apart without a word: DDP averages the gradients of different learning rates into one update, a
different `train.max_steps` leaves one node waiting forever in a collective, and rank 0 exports its
own idea of the model with exit 0. So before anything is written, the ranks all-gather a hash of the
resolved configuration; only when the hashes differ do they gather the settings themselves, to name
each differing key with every rank's value in one line (the same line on every rank).

A few keys are per node by nature and left out of the comparison: `PER_NODE` is the one list.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import TYPE_CHECKING, Any

from distqa.dist import DistInfo, all_gather_objects
from distqa.errors import ConfigError

if TYPE_CHECKING:  # for hints only
    from distqa.config import Config

# Keys that may differ between nodes: each is a path or a resource of the node itself, and what
# it leads to is compared on its own (the training data by its fingerprint, `distqa.data_identity`;
# a shared output_dir under train.parallel=fsdp by `distqa.sharded.require_shared`).
PER_NODE = frozenset(
    {
        "output_dir",  # the same volume may be mounted at another path; rank 0's is the one written
        "data.train",
        "data.valid",
        "data.num_workers",  # the node's own CPUs
    }
)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1}} -> {"train.lr": 1}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# torchrun's node count as this node's torchrun has it (--nnodes; worker.sh's NNODES): a static
# rendezvous takes each node's own, so nodes started with different counts could form a group
# (and train with exit 0) while another node waited in vain, or hang after the export.
NODE_COUNT = "NNODES (torchrun --nnodes)"


def compared_settings(cfg: Config) -> dict[str, Any]:
    """The resolved settings every rank must share: all keys except `PER_NODE`, and the node count."""
    settings = {k: v for k, v in flatten(dataclasses.asdict(cfg)).items() if k not in PER_NODE}
    if os.environ.get("GROUP_WORLD_SIZE"):
        settings[NODE_COUNT] = os.environ["GROUP_WORLD_SIZE"]
    return settings


def settings_hash(settings: dict[str, Any]) -> str:
    # repr() for values JSON has no form for; the key order is fixed by sort_keys.
    text = json.dumps(settings, sort_keys=True, default=repr, allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def differences(views: list[dict[str, Any]]) -> str:
    """'train.lr (rank 0: 0.1, rank 1: 0.5); ...' for every key whose value is not the same on all ranks."""
    keys = sorted({k for view in views for k in view})
    missing = object()
    parts = []
    for key in keys:
        values = [view.get(key, missing) for view in views]
        if any(v != values[0] for v in values[1:]):
            shown = ", ".join(f"rank {rank}: {'(none)' if v is missing else repr(v)}" for rank, v in enumerate(values))
            parts.append(f"{key} ({shown})")
    return "; ".join(parts)


def check_same_settings(cfg: Config, info: DistInfo) -> None:
    """Raise the same one-line ConfigError on every rank if any rank's settings differ. Every rank
    must call it; one small all-gather when they agree (the usual case), two when they do not."""
    if not info.is_distributed:
        return
    mine = compared_settings(cfg)
    hashes = all_gather_objects(settings_hash(mine), info)
    if len(set(hashes)) == 1:  # type: ignore[arg-type]
        return
    views: list[dict[str, Any]] = all_gather_objects(mine, info)  # type: ignore[assignment]
    raise ConfigError(
        f"the processes of this run have different settings: {differences(views)}: give every node the "
        f"same config file and KEY=VALUE settings (only {', '.join(sorted(PER_NODE))} may differ)"
    )
