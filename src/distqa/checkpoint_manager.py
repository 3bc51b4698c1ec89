"""The run's checkpoints as one object over registered stateful parts (torchtitan's
`CheckpointManager(states={...})`): what a checkpoint holds is listed once, in `Parts`, and saving
and restoring walk that one list.

`distqa.checkpoint` writes and verifies the files; this is the trainer's side of it: the parts of
the run (model, optimizer, schedule, scaler: their own files; the task's state and the trainer's
state: trainer_state.json), the run lock that must still be held when a checkpoint is published,
and what a resume restores, RNG streams included.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from distqa import checkpoint as ckpt
from distqa import parallel
from distqa.best import BEST_NAME, point_at, pointed, unpoint
from distqa.comm_hooks import CommHook
from distqa.config import Config
from distqa.data_agreement import same_identity
from distqa.dist import DistInfo, print0
from distqa.meter import ThroughputMeter
from distqa.optim import apply_settings
from distqa.rank0 import fix_for, on_rank0, reason
from distqa.runlock import RunLock
from distqa.sampler import derive_seed, seed_everything


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclasses.dataclass
class TrainerState:
    """The trainer's own part of a checkpoint (trainer_state.json): where the run is (step, data
    position), what it is (global batch, planned length, settings, data identity), and the open
    log window, so that the first loss logged after a resume averages the same steps as an
    uninterrupted run's."""

    cfg: Config
    info: DistInfo
    meter: ThroughputMeter
    global_batch: int
    total_steps: int
    epoch_steps: int
    data_identity: dict[str, Any]
    # The validation data's identity (`agreed_identity` of the task's eval dataset), or None.
    valid_identity: dict[str, Any] | None = None
    # `Task.identity` (the tokenizer's hash): a resume compares it (`resume.check_continuation`).
    task_identity: dict[str, str] | None = None
    # `build_identity.model_settings`: the model's config, compared on resume and export.
    model_settings: dict[str, Any] | None = None
    step: int = 0  # the last finished step
    # train.best_metric's record so far: {"metric", "mode", "value", "step"} (`distqa.best`).
    best: dict[str, Any] | None = None
    # This step's evaluation raised (the task's metric code): the resume runs it first (`distqa.evaluate_again`).
    evaluation_pending: bool = False

    def state_dict(self) -> dict[str, Any]:
        """Every rank calls it: the log window is summed over the ranks."""
        window = self.meter.window()
        return {
            "step": self.step,
            "epoch": self.step // self.epoch_steps,
            "step_in_epoch": self.step % self.epoch_steps,
            "global_batch": self.global_batch,
            # The planned length: a rerun can tell a finished run before it builds any data.
            "total_steps": self.total_steps,
            "world_size": self.info.world_size,
            "config": dataclasses.asdict(self.cfg),
            "data": self.data_identity,
            "valid_data": self.valid_identity,
            "task_identity": self.task_identity,
            "model_settings": self.model_settings,
            # A loss sum that is not finite stops the run at its log, and its message names this
            # checkpoint's weights (checked finite) as the last finite ones: kept usable, without it.
            "log_window": window if all(math.isfinite(v) for v in window) else None,
            "grad_norm_window": self.meter.norm_window(),
            "best": self.best,
            "evaluation_pending": self.evaluation_pending,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.evaluation_pending = state.get("evaluation_pending") is True
        # (A checkpoint written before the window was saved has none: the first loss then averages
        # only the steps since the resume.) The window counts micro-batches of every rank, and
        # norms once per rank: rescaled when the processes or train.grad_accum changed.
        ranks, accum = self.info.world_size, self.cfg.train.grad_accum
        saved_ranks = int(state.get("world_size") or ranks)
        saved_accum = int(((state.get("config") or {}).get("train") or {}).get("grad_accum") or accum)
        main, micro = self.info.is_main, ranks * accum / (saved_ranks * saved_accum)
        self.meter.resume_window(state.get("log_window"), is_main=main, scale=micro)
        self.meter.resume_norm_window(state.get("grad_norm_window"), is_main=main, scale=ranks / saved_ranks)
        # A record of another metric or direction (changed on resume) is no record of this one.
        best, train = state.get("best"), self.cfg.train
        same = isinstance(best, dict) and (best.get("metric"), best.get("mode")) == (train.best_metric, train.best_mode)
        same_data = self._same_validation(state.get("valid_data"), best if same else None)
        self.best = best if same and same_data else None

    def _same_validation(self, saved: Any, best: dict[str, Any] | None) -> bool:
        """Whether the validation data is the checkpoint's (a checkpoint from before identities were
        recorded counts as the same). Other data: one warning (the eval_* figures change data set
        from here on), and the best record, measured on the old data, is no record on the new."""
        now = self.valid_identity
        if not isinstance(saved, dict) or now is None or same_identity(saved, now):
            return True
        record = ""
        if best is not None:
            record = (
                f"; train.best_metric's record ({best['metric']}={best['value']:.4g} at step {best['step']}) "
                "was measured on it and starts again"
            )
        if self.info.is_main:
            print(
                f"warning: data.valid={now['valid']!r} ({now['examples']} examples, fingerprint {now['fingerprint']}) "
                f"is not the validation data this run had until step {self.step} ({saved.get('examples')} examples, "
                f"fingerprint {saved.get('fingerprint')}){record}",
                flush=True,
            )
        return False


@dataclasses.dataclass
class Parts:
    """Everything a checkpoint holds, registered once. The first four have files of their own
    (`distqa.checkpoint`); `task` and `trainer` are Stateful and ride in trainer_state.json (the
    task's state as its "task" entry, written by rank 0)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    task: Stateful
    trainer: TrainerState
    # train.ddp_comm_hook's state, per rank (PowerSGD's error feedback and memories; `distqa.comm_hooks`).
    comm_hook: CommHook | None = None

    def files(self) -> dict[str, Any]:
        """The parts `checkpoint.save_checkpoint` and `load_checkpoint` store in their own files."""
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "scaler": self.scaler}

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


# train.parallel=dp: the seeds of the replica GPUs' generators, apart from every other seed's parts.
REPLICA_STREAM = 0xD9


class CheckpointManager:
    def __init__(self, root: Path, cfg: Config, info: DistInfo, *, sharded: bool, lock: RunLock | None) -> None:
        self.root, self.cfg, self.info, self.sharded, self.lock = root, cfg, info, sharded, lock
        self.parts: Parts | None = None
        self.resumed_from: Path | None = None  # (`restore`'s checkpoint: never removed as a leftover)
        # train.parallel=dp: the GPUs besides this process's own that run a copy of the model, each
        # drawing dropout masks from its own generator, saved and restored with this rank's RNG.
        self.replicas = parallel.dp_device_ids(info)[1:] if cfg.train.parallel == "dp" else []

    def track(self, parts: Parts) -> None:
        """The parts every checkpoint holds, from now on."""
        self.parts = parts

    def save(self) -> Path:
        """Every rank calls it, at the trainer state's step; `step-N` appears whole or not at all
        (`checkpoint.save_checkpoint`)."""
        assert self.parts is not None, "track() the parts first"
        p, info = self.parts, self.info
        state = {**p.trainer.state_dict(), "task": p.task.state_dict() if info.is_main else {}}
        best = p.trainer.best
        # Never pruned: the best so far, and the one `best` names until it is moved on (a crash
        # between this save and the move must leave it naming a whole checkpoint).
        protect = {f"step-{best['step']}"} if best else set()
        named = pointed(self.root) if info.is_main else None
        if named is not None:
            protect.add(named.name)
        source = self.resumed_from
        if source is not None and source.parent == self.root.resolve() and source.name.startswith("."):
            # train.resume=PATH named what a kill left (.old-step-N): the user's now, never removed as
            # a leftover. (A step-N source is pruned as any checkpoint is.)
            protect.add(source.name)
        final = ckpt.save_checkpoint(
            self.root,
            **p.files(),
            keep=self.cfg.train.keep_checkpoints,
            protect=protect,
            trainer_state=state,
            info=info,
            sharded=self.sharded,
            # Read again just before the checkpoint is renamed into place: a holder paused inside
            # the write must not publish a checkpoint into a folder another run now owns.
            still_holding=self.lock.verify if self.lock is not None else None,
            comm_state=p.comm_hook.state_dict() if p.comm_hook is not None else None,
            rng_replicas=self.replicas,
        )
        if best is not None and best["step"] == p.trainer.step:
            self._point_best(best["step"])
        return final

    def _seed_replicas(self, *parts: int) -> None:
        """A seed of its own for each dp replica's GPU: torch.manual_seed gives every GPU the same
        one, and the copies would draw the same dropout masks for their shares of the batch."""
        if self.replicas:
            torch.cuda.init()  # (default_generators is filled in by CUDA's initialisation)
            for i in self.replicas:
                # A stream of their own: derive_seed(*parts, 0) would equal derive_seed(*parts), the
                # process's own GPU's seed (numpy's SeedSequence drops trailing zeros), and GPU 0 is
                # a replica when the process's GPU is another.
                torch.cuda.default_generators[i].manual_seed(derive_seed(*parts, REPLICA_STREAM, i))

    def _point_best(self, step: int, resumed_from: Path | None = None) -> None:
        """`checkpoints/best` names step-`step` (a whole checkpoint by now); every rank learns how it
        went. `resumed_from`: the checkpoint just loaded, never pruned here (with the newest one
        damaged and train.keep_checkpoints lowered, it went, and a kill then lost its steps)."""
        on_rank0(
            self.info,
            lambda: self._point_and_prune(step, resumed_from),
            failure=lambda err: (
                f"cannot write {self.root / BEST_NAME} ({reason(err)}): {fix_for(err)} and run again to resume"
            ),
        )

    def _point_and_prune(self, step: int, resumed_from: Path | None) -> None:
        point_at(self.root, step)
        # The best before this one was kept while `best` named it: now it goes, unless it is new enough.
        protect = {f"step-{step}", *([resumed_from.name] if resumed_from is not None else [])}
        ckpt.prune(self.root, self.cfg.train.keep_checkpoints, protect)

    def restore(self, directory: Path | None) -> int:
        """Load `directory` into every part; the step to go on from. Without a checkpoint: step 0,
        and each rank's RNG seeded for its own dropout masks."""
        assert self.parts is not None, "track() the parts first"
        cfg, info, p = self.cfg, self.info, self.parts
        if directory is None:
            # Different dropout masks per rank: identical masks would correlate the ranks' noise.
            seed_everything(derive_seed(cfg.seed, info.rank))
            self._seed_replicas(cfg.seed, info.rank)
            return 0
        self.resumed_from = Path(directory).resolve()
        state = ckpt.load_checkpoint(
            directory, **p.files(), info=info, sharded=self.sharded, rng_replicas=self.replicas
        )
        # Settings that may change on resume (lr, weight decay, ...) win over the restored ones.
        apply_settings(p.optimizer, p.scheduler, cfg.train)
        p.task.load_state_dict(state.get("task") or {})
        p.trainer.load_state_dict(state)
        # Every rank calls it (they agree on it); one line when PowerSGD's state cannot continue.
        why = p.comm_hook.load_state_dict(state.get("comm_hook")) if p.comm_hook is not None else None
        if why:
            print0(f"warning: train.ddp_comm_hook=powersgd starts its state afresh at step {state['step']}: {why}")
        if not state["rng_restored"]:
            seed_everything(derive_seed(cfg.seed, info.rank, state["step"]))
            self._seed_replicas(cfg.seed, info.rank, state["step"])
            print(
                f"warning: rank {info.rank} has no RNG state in {directory} (it was written by "
                f"{state['world_size']} processes): seeded afresh, so dropout differs from an "
                "uninterrupted run",
                flush=True,
            )
        elif not state["cuda_rng_restored"]:
            # A checkpoint written on the CPU (or, under dp, with fewer GPUs), resumed on GPUs:
            # without this every rank's CUDA generator would start from the same seed and draw the
            # same dropout masks.
            torch.cuda.manual_seed(derive_seed(cfg.seed, info.rank, state["step"]))
            self._seed_replicas(cfg.seed, info.rank, state["step"])
            print0(
                f"warning: {directory} holds no CUDA RNG state for every GPU this run uses (written on the "
                "CPU, or on fewer GPUs): CUDA seeded afresh per rank and GPU"
            )
        self._best_again(directory)
        print0(f"resumed from {directory} at step {state['step']}")
        return p.trainer.step

    def _best_again(self, directory: Path) -> None:
        """Resumed from an earlier checkpoint than the newest, `best` may name a step of the
        abandoned continuation: it names this run's record again. A record whose checkpoint is gone
        (removed by hand, or pruned by a distqa before `prune` kept it) names weights no export can
        give: the record starts again, said in one line, and `best` waits for the next evaluation."""
        assert self.parts is not None
        best, info = self.parts.trainer.best, self.info
        if best is None:
            return
        folder = self.root / f"step-{best['step']}"
        found = on_rank0(info, lambda: (folder.is_dir(), pointed(self.root) != folder))  # (one broadcast)
        exists, elsewhere = found if found is not None else (False, False)
        if exists:
            if elsewhere:
                self._point_best(best["step"], directory)
            return
        print0(
            f"warning: train.best_metric's record ({best['metric']}={best['value']:.4g} at step {best['step']}) "
            f"names a checkpoint that is gone from {self.root} (removed, or pruned by an older distqa): the "
            "record starts again at the next evaluation, which `best` will name"
        )
        self.parts.trainer.best = None
        on_rank0(info, lambda: unpoint(self.root))
