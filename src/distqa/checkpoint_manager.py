"""The run's checkpoints as one object: what they hold is registered once, then saved and restored.

`distqa.checkpoint` writes and verifies the files; this is the trainer's side of it: the parts of
the run (model, optimizer, schedule, scaler, the task's own state) and the trainer's state
(step, data position, settings, data identity), the run lock that must still be held when a
checkpoint is published, and what a resume restores, RNG streams included.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distqa import checkpoint as ckpt
from distqa.config import Config
from distqa.dist import DistInfo, print0
from distqa.optim import apply_settings
from distqa.runlock import RunLock
from distqa.sampler import derive_seed, seed_everything


@dataclasses.dataclass
class Parts:
    """What a checkpoint holds besides the trainer's own state. `task` has state_dict/load_state_dict."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    task: Any

    def checked_tensors(self, *, with_optimizer: bool) -> list[torch.Tensor]:
        """What the finiteness check covers: parameters and buffers; with the optimizer's
        state on the steps that save it (AdamW's second moment can overflow to inf while the
        weights stay finite, frozen from then on: a checkpoint of that is no less wrong)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]  # (integer buffers are skipped there)
        if with_optimizer:
            for state in self.optimizer.state.values():
                # (0-dimensional entries are step counters, possibly on another device.)
                tensors += [v for v in state.values() if torch.is_tensor(v) and v.dim()]
        return tensors


class CheckpointManager:
    def __init__(self, root: Path, cfg: Config, info: DistInfo, *, sharded: bool, lock: RunLock | None) -> None:
        self.root, self.cfg, self.info, self.sharded, self.lock = root, cfg, info, sharded, lock
        self.parts: Parts | None = None
        self.run: dict[str, Any] = {}

    def track(self, parts: Parts, *, global_batch: int, total_steps: int, data_identity: dict[str, Any]) -> None:
        """The parts every checkpoint holds, and what the trainer state records of the run."""
        self.parts = parts
        self.run = {"global_batch": global_batch, "total_steps": total_steps, "data": data_identity}

    def save(self, step: int, epoch_steps: int) -> Path:
        """Every rank calls it; `step-N` appears whole or not at all (`checkpoint.save_checkpoint`)."""
        assert self.parts is not None, "track() the parts first"
        p, info = self.parts, self.info
        state = {
            "step": step,
            "epoch": step // epoch_steps,
            "step_in_epoch": step % epoch_steps,
            "global_batch": self.run["global_batch"],
            # The planned length: a rerun can tell a finished run before it builds any data.
            "total_steps": self.run["total_steps"],
            "world_size": info.world_size,
            "config": dataclasses.asdict(self.cfg),
            "data": self.run["data"],
            "task": p.task.state_dict() if info.is_main else {},
        }
        return ckpt.save_checkpoint(
            self.root,
            keep=self.cfg.train.keep_checkpoints,
            model=p.model,
            optimizer=p.optimizer,
            scheduler=p.scheduler,
            scaler=p.scaler,
            trainer_state=state,
            info=info,
            sharded=self.sharded,
            # Read again just before the checkpoint is renamed into place: a holder paused inside
            # the write must not publish a checkpoint into a folder another run now owns.
            still_holding=self.lock.verify if self.lock is not None else None,
        )

    def restore(self, directory: Path | None) -> int:
        """Load `directory` into every part; the step to go on from. Without a checkpoint: step 0,
        and each rank's RNG seeded for its own dropout masks."""
        assert self.parts is not None, "track() the parts first"
        cfg, info, p = self.cfg, self.info, self.parts
        if directory is None:
            # Different dropout masks per rank: identical masks would correlate the ranks' noise.
            seed_everything(derive_seed(cfg.seed, info.rank))
            return 0
        state = ckpt.load_checkpoint(
            directory,
            model=p.model,
            optimizer=p.optimizer,
            scheduler=p.scheduler,
            scaler=p.scaler,
            info=info,
            sharded=self.sharded,
        )
        # Settings that may change on resume (lr, weight decay, ...) win over the restored ones.
        apply_settings(p.optimizer, p.scheduler, cfg.train)
        p.task.load_state_dict(state.get("task") or {})
        if not state["rng_restored"]:
            seed_everything(derive_seed(cfg.seed, info.rank, state["step"]))
            print(
                f"warning: rank {info.rank} has no RNG state in {directory} (it was written by "
                f"{state['world_size']} processes): seeded afresh, so dropout differs from an "
                "uninterrupted run",
                flush=True,
            )
        print0(f"resumed from {directory} at step {state['step']}")
        return int(state["step"])
