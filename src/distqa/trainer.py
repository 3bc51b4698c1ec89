"""The generic training loop, for DDP, FSDP2 or DataParallel (`distqa.parallel`). It knows nothing
of Natural Questions: see `distqa.task.Task`.

In named parts: set-up (settings agreed, output_dir claimed, model and data built, parts wrapped
and registered with the checkpoint manager), restore, the loop (`distqa.train_step` does a step,
`distqa.control` plans what follows: log, evaluate, save, check, stop), and the finish (plot and
export). Every rank runs the same code; rank 0 alone prints and writes all but sharded checkpoints.
"""

from __future__ import annotations

import math
import signal
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from distqa import outcome, parallel
from distqa.agreement import check_same_settings
from distqa.best import best_after_evaluation, require_evaluation
from distqa.build_identity import check_same_build
from distqa.checkpoint_manager import CheckpointManager, Parts, TrainerState
from distqa.config import Config, to_yaml
from distqa.console import TrainProgress, dataset_size, quiet_libraries
from distqa.control import FIRST_LOSS_NOT_FINITE, after_step, diverged_hint
from distqa.data_agreement import agreed_identity, agreed_samples, agreed_valid_identity
from distqa.dist import DistInfo, autocast_dtype, barrier, cleanup, init_distributed, local_main_first, print0
from distqa.errors import DistqaError, EvaluationFailed, Preempted
from distqa.evaluate_again import evaluate_again
from distqa.evaluation import run_evaluation
from distqa.finish import export_final, is_exported, plot_run, summary
from distqa.launch_start import mode_of_this_round, note_started
from distqa.loader_server import as_worker_loss
from distqa.meter import ThroughputMeter
from distqa.metrics import MetricsWriter
from distqa.optim import build_optimizer, build_scheduler
from distqa.outdir import archive_config, claim, write_text
from distqa.parent_watch import watch_parent
from distqa.rank0 import raise_on_every_rank
from distqa.registry import load_task
from distqa.replicas import check_replicas
from distqa.resume import changed_settings, check_continuation, check_resumable, choose_checkpoint
from distqa.rounds import as_peer_loss
from distqa.sampler import check_picklable, seed_everything, steps_per_epoch, training_batches
from distqa.set_aside import set_aside_other_line
from distqa.sharded import require_shared
from distqa.slow_start import FirstStep
from distqa.steptimer import StepTimer
from distqa.stop_signal import StopSignal
from distqa.task import Task
from distqa.train_step import TrainStep


class Trainer:
    """`timer` records where step time goes (`distqa bench`); `save_outputs=False` skips the final
    checkpoint, model export and plot, for runs that only measure speed."""

    def __init__(
        self,
        cfg: Config,
        task: Task,
        info: DistInfo,
        *,
        timer: StepTimer | None = None,
        save_outputs: bool = True,
        keep_sigterm_handler: bool = False,
    ) -> None:
        self.cfg, self.task, self.info, self.save_outputs = cfg, task, info, save_outputs
        self.timer = timer or StepTimer.off(info.device)
        # The CLI keeps the SIGTERM handler (record only) after the last step (no failure); tests get theirs back.
        self.keep_sigterm_handler = keep_sigterm_handler
        self.stop: StopSignal | None = None
        self.state: TrainerState | None = None
        self.out, self.ckpt_root = Path(cfg.output_dir), Path(cfg.output_dir) / "checkpoints"
        self.sharded = cfg.train.parallel == "fsdp"
        # FSDP casts the gathered weights itself (its mixed-precision policy): no autocast on top.
        self.autocast_dtype = None if self.sharded else autocast_dtype(cfg.train.precision)
        self.meter = ThroughputMeter(info.device)

    @property
    def step(self) -> int:
        """The last finished step (for the message when a peer is lost)."""
        return self.state.step if self.state is not None else 0

    def fit(self) -> Path:
        parallel.check_placement(self.cfg.train, self.info)  # train.parallel=dp where it cannot run: one line
        # Before output_dir is touched: nodes started with other settings must not write anything.
        check_same_settings(self.cfg, self.info)
        train = self.cfg.train
        train.resolve_global_batch(self.info.world_size)  # the same on every rank, as the settings are
        self.global_batch = train.batch_size * train.grad_accum * self.info.world_size
        self.lock = claim(self.out, self.info)
        self.checkpoints = CheckpointManager(self.ckpt_root, self.cfg, self.info, sharded=self.sharded, lock=self.lock)
        try:
            return self._fit()
        except RuntimeError as err:  # torch.distributed's errors are RuntimeErrors, the DataLoader's too
            lost = (as_peer_loss(err, self.step) if self.info.is_distributed else None) or as_worker_loss(err)
            if lost is None:
                raise
            raise lost from err
        finally:
            if self.stop is not None and not self.keep_sigterm_handler:
                self.stop.close()
            if self.lock is not None:
                self.lock.release()

    def _fit(self) -> Path:
        # Decided before anything is written: train.resume=never may move an earlier run aside.
        mode = mode_of_this_round(self.cfg.train.resume, self.out, self.info)
        resume_from = choose_checkpoint(self.out, mode, self.info)
        # The settings first, then the data: a refused resume costs no data preparation.
        saved = check_resumable(resume_from, self.cfg, global_batch=self.global_batch) if resume_from else None
        dataset = self._build()
        finished = saved is not None and check_continuation(
            resume_from,  # type: ignore[arg-type]
            saved,
            self.cfg,
            total_steps=self.total_steps,
            data=self.data_identity,
            task_identity=self.task_identity,
            model_settings=self.model_settings,
        )
        # (finished: the same on every rank.) train.resume=PATH: output_dir then holds PATH's line
        # alone (later ones, or another run, set aside), finished or not: nothing lands beside another's.
        aside = set_aside_other_line(self.out, resume_from, mode, self.info)
        note_started(mode, self.info)
        if finished and (not self.save_outputs or is_exported(self.out, resume_from, self.info)):  # type: ignore[arg-type]
            print0(
                f"the run in {self.out} already finished at step {self.total_steps}: nothing to train, "
                "nothing written; to train again use another output_dir or train.resume=never"
            )
            return self.out / "model"
        self._set_up()
        step = self._restore(resume_from, saved, finished)
        # From here on, SIGTERM means "checkpoint, then exit"; after the last step, nothing.
        self.stop = StopSignal(self.info, self.lock)
        # An evaluation owed (it failed, its checkpoint written first) adds a record: plotted again.
        if owed := self.state.evaluation_pending:  # type: ignore[union-attr]  # (the restore made it)
            evaluate_again(self, step)
        if step < self.total_steps:
            self._run_steps(dataset, resume_from)
        elif aside is not None:  # finished at PATH: the set-aside line's records cut back, as a resume's
            MetricsWriter(self.out, self.info, resume_step=step).close()
        final = resume_from if finished else self.ckpt_root / f"step-{self.total_steps}"
        self._finish(final, plot=not finished or owed)  # type: ignore[arg-type]
        barrier()
        return self.out / "model"

    # ----------------------------------------------------------------------------- set-up
    def _build(self) -> Dataset:
        """The model (not yet wrapped) and the training data, with its step counts."""
        cfg, info = self.cfg, self.info
        if self.sharded:
            require_shared(self.out, info)  # every rank writes its shards there
        parallel.configure_backends(cfg.train, info.device)
        # Same seed on every rank: identical weights (DDP broadcasts rank 0's anyway) and RNG streams.
        seed_everything(cfg.seed)
        with local_main_first(info):
            self.raw_model = self.task.build_model()
        # As built, on the CPU: the same code, weights and tokenizer on every rank (on resume: tokenizer, config).
        self.task_identity, self.model_settings = check_same_build(self.raw_model, self.task, info)
        if not self.sharded:  # FSDP moves it to the device itself, one unit at a time, as it shards it
            self.raw_model.to(info.device)
        with local_main_first(info):  # one process per node builds a data cache, the others then read it
            dataset = self.task.build_train_dataset()
            valid = self.task.eval_dataset()  # built here, where a task may prepare a cache once per node
        # Every rank has each set or none has, and items sampled by every process (and its loader's
        # workers) agree: before any process reads a set whole, and before a rank may refuse alone.
        named = [("data.train", dataset, cfg.data.train), ("data.valid", valid, cfg.data.valid)]
        agreed_samples(info, named, loader=(self.task.collate_fn(), cfg))
        check_picklable(self.task.collate_fn(), cfg, info)
        self.valid_identity = agreed_valid_identity(self.task, info, cfg.data.valid)
        require_evaluation(self.task, cfg.train)
        self.data_identity = agreed_identity(self.task.data_fingerprint, dataset, info, cfg.data.train)
        train = cfg.train
        self.n_train = len(dataset)  # type: ignore[arg-type]  # each epoch's must be the same (training_batches)
        self.epoch_steps = steps_per_epoch(len(dataset), train.batch_size, train.grad_accum, info.world_size)  # type: ignore[arg-type]
        self.total_steps = train.max_steps if train.max_steps > 0 else train.epochs * self.epoch_steps
        self.dataset_size = dataset_size(dataset)
        return dataset

    def _set_up(self) -> None:
        """Wrap the model, build what trains it, and register every part of a checkpoint once."""
        cfg, info = self.cfg, self.info
        # First: FSDP replaces the parameters the optimizer must hold.
        self.model, self.ddp, comm_hook = parallel.wrap(self.raw_model, info, cfg.train, self.timer)
        self.optimizer = build_optimizer(self.raw_model, cfg.train, info.device)
        scheduler = build_scheduler(self.optimizer, cfg.train, self.total_steps)
        scaler = parallel.grad_scaler(cfg.train, info.device)
        self.state = TrainerState(
            cfg,
            info,
            self.meter,
            self.global_batch,
            self.total_steps,
            self.epoch_steps,
            self.data_identity,
            valid_identity=self.valid_identity,
            task_identity=self.task_identity,
            model_settings=self.model_settings,
        )
        self.parts = Parts(self.raw_model, self.optimizer, scheduler, scaler, self.task, self.state, comm_hook)
        self.checkpoints.track(self.parts)
        self.train_step = TrainStep(
            self.task, self.model, self.raw_model, self.ddp, self.optimizer, scheduler, scaler,
            cfg.train, info, self.timer, self.autocast_dtype,
        )  # fmt: skip

    # ----------------------------------------------------------------------------- restore
    def _restore(self, resume_from: Path | None, saved: dict[str, Any] | None, finished: bool) -> int:
        """Every part from the checkpoint (or a fresh start); config.yaml; the start line."""
        info = self.info
        step = self.checkpoints.restore(resume_from)
        # config.yaml says what trains from here on, written once every check has passed; a resume
        # with other settings keeps the earlier one as config-history/<step>.yaml. (finished: only
        # model/ was missing, and the same settings export it.)
        if not finished:
            if saved is not None and changed_settings(saved, self.cfg)[0]:
                archive_config(self.out, step, info)
            write_text(self.out / "config.yaml", to_yaml(self.cfg), info)
        n_params = sum(p.numel() for p in self.raw_model.parameters())
        print0(
            f"distqa: {info.world_size} process(es) on {info.device.type}{parallel.placement(self.model)}, "
            f"{n_params / 1e6:.1f}M parameters, "
            f"{self.dataset_size}, global batch {self.global_batch}, steps {step}->{self.total_steps}"
        )
        return step

    # ----------------------------------------------------------------------------- the loop
    def _run_steps(self, dataset: Dataset, resumed_from: Path | None) -> None:
        """Steps from the restored one to the last, epoch by epoch; each followed by its plan."""
        cfg, info, state = self.cfg, self.info, self.state
        assert state is not None
        self.metrics = MetricsWriter(self.out, info, resume_step=state.step)
        # What to lower if the run diverges, and where its last finite weights are (each save moves it).
        self.hint = diverged_hint(cfg.train, resumed_from)
        # A bar on a terminal, else a line per record.
        self.progress = TrainProgress(self.total_steps, state.step, enabled=info.is_main)
        # On a slow set-up a line now, and one when the first step ends: its time, what the rest takes.
        first_step = FirstStep(cfg, self.task, self.raw_model, info, self.total_steps, state.step)
        self.meter.restart_clock()  # throughput counts training time, not the set-up
        self.model.train()
        try:
            while state.step < self.total_steps:
                epoch, in_epoch = divmod(state.step, self.epoch_steps)
                batches = training_batches(dataset, self.task.collate_fn(), cfg, info, epoch, in_epoch, self.n_train)
                for _ in range(in_epoch, min(self.epoch_steps, in_epoch + self.total_steps - state.step)):
                    lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
                    self.train_step(batches, self.meter)
                    state.step += 1
                    self.progress.advance()
                    first_step.after(state.step, self.progress, self.meter)
                    self._after_step(lr)
            self.timer.finish()
            self.metrics.close()  # every rank: rank 0's last write to tb/ may fail
        finally:
            self.progress.close()
            self.metrics.abandon()  # (closed already, unless an error or a stop left the loop)

    def _after_step(self, lr: float) -> None:
        """Act on `control.after_step`'s plan: check replicas, evaluate, check, log, save, stop;
        nothing of a step is evaluated or written before its replicas and weights are checked."""
        stop, state = self.stop, self.state
        assert stop is not None and state is not None
        step = state.step
        plan = after_step(step, self.total_steps, self.cfg.train, save_outputs=self.save_outputs)
        if compared := plan.compares_replicas:
            check_replicas(self.raw_model, self.info, step)
        record, failed = self._record(step, lr) if plan.log else None, None
        if plan.evaluate and record is not None:
            try:
                record.update(
                    run_evaluation(self.task, self.raw_model, self.info, step=step, autocast_dtype=self.autocast_dtype)
                )
                self.meter.restart_clock()  # evaluation time is not training throughput
            except EvaluationFailed as err:  # the task's metric code: log and save the step, then stop
                failed, plan = err, plan.on_failed_evaluation(self.save_outputs)
        weights = self.parts.checked_tensors(with_optimizer=plan.save) if plan.check_weights else None
        plan = plan.on_stop_request(stop.should_stop(step, weights, self.hint))
        train, info, root = self.cfg.train, self.info, self.ckpt_root
        if (
            plan.evaluate
            and self.save_outputs
            and (best := best_after_evaluation(record, train, state.best, info, root))
        ):
            state.best = best  # before the save: this step's checkpoint holds its own record
            plan = plan.on_new_best()  # (after the stop request: its optimizer check must stay)
        if record is not None:
            self.metrics.log(record)
            self.progress.report(record)
        if plan.compares_replicas and not compared:  # a save the plan did not foresee (a stop, a new best)
            check_replicas(self.raw_model, self.info, step)
        if plan.check_optimizer:
            stop.check_finite(step, self.parts.checked_tensors(with_optimizer=True), self.hint)
        state.evaluation_pending = failed is not None  # (saved: the resume runs it first)
        if plan.save:
            with self.meter.paused():  # samples/s counts training, not saving (as evaluation is left out)
                self.hint = diverged_hint(self.cfg.train, self.checkpoints.save())
        if failed is not None:
            saved = f"; checkpoint {root}/step-{step} written first: the same command evaluates it again"
            saved = saved if plan.save else ""
            raise EvaluationFailed(f"evaluation at step {step}: {failed}{saved}") from failed
        if plan.stop:
            checkpoint, grace = self.ckpt_root / f"step-{step}", self.cfg.train.term_grace_s
            raise stop.preempted(step, self.total_steps, checkpoint, grace, resume=self.cfg.train.resume)

    def _record(self, step: int, lr: float) -> dict[str, Any]:
        """The metrics line of this step: the log window's figures (the evaluation's are added)."""
        record = {"step": step, "epoch": round(step / self.epoch_steps, 4), "lr": lr, **self.meter.reduce_and_reset()}
        if not math.isfinite(record["loss"]):
            why = self.hint if step > 1 else FIRST_LOSS_NOT_FINITE  # step 1: the initial weights' loss
            raise DistqaError(f"loss is {record['loss']} at step {step}: {why}")
        return record

    # ----------------------------------------------------------------------------- finish
    def _finish(self, final: Path, plot: bool) -> None:
        """model/ from the final weights (checkpoint `final`), and the run's plot (`plot`: not when
        it only exports, unless an owed evaluation added its record or the plot is missing or old)."""
        # Rank 0 holds the lock; every rank must learn if it was lost (they all stop, none waits).
        lost = self.lock.verify() if self.lock is not None else None
        raise_on_every_rank(f"{lost}: the model is not exported" if lost else None)
        if not self.save_outputs:
            return
        plotted = self.info.is_main and plot_run(self.out, self.cfg, self.task, self.global_batch, again=plot)
        export_final(self.task, self.raw_model, self.out, self.info, final=final, step=self.step, sharded=self.sharded)
        summary(self.out, plotted)


def train(cfg: Config, *, whole_process: bool = False) -> Path:
    """Entry point of `distqa train`: one call per process, under torchrun or alone.

    `whole_process` (the CLI): the process ends after this call, so once the run is complete a
    SIGTERM (a platform stopping a job that is done) is ignored, not a failure, and the launcher is
    told that this rank finished. In-process callers (tests) get their own SIGTERM handling back:
    processes they fork later must stay killable."""
    watch_parent()  # before the rendezvous, which is where an orphan would otherwise wait longest
    info = init_distributed()
    quiet_libraries(is_main=info.is_main)
    ended_well = False  # a rank failing alone must not tell its neighbours it stopped on purpose
    try:
        with local_main_first(info):  # the task may download a tokenizer
            task = load_task(cfg)
        model = Trainer(cfg, task, info, keep_sigterm_handler=whole_process).fit()
        ended_well = True
        if whole_process:  # complete on every rank (fit's last barrier)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            outcome.finished()
        return model
    except Preempted:
        ended_well = True  # every rank checkpointed and stops together
        raise
    finally:
        cleanup(ended_well)
