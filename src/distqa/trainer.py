"""The generic training loop, for DDP or FSDP2 (`distqa.parallel`). It knows nothing of Natural
Questions: see `distqa.task.Task`.

One optimizer step = `grad_accum` micro-batches per rank. Gradients are reduced once per step, on
the last micro-batch (no sync on the others), then clipped and applied. Every rank runs the same
code; rank 0 alone prints, writes metrics and the final model, and all but sharded checkpoints.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import Dataset

from distqa import outcome, parallel
from distqa.agreement import check_same_settings
from distqa.checkpoint_manager import CheckpointManager, Parts
from distqa.config import Config, to_yaml
from distqa.console import TrainProgress, outputs_summary, quiet_libraries, run_title
from distqa.control import after_step, diverged_hint
from distqa.data_identity import agreed_identity
from distqa.dist import (
    DistInfo,
    autocast_dtype,
    barrier,
    broadcast_object,
    cleanup,
    init_distributed,
    local_main_first,
    print0,
)
from distqa.errors import DistqaError, Preempted
from distqa.evaluation import run_evaluation, to_device
from distqa.guards import StopSignal, check_replicas, watch_parent
from distqa.metrics import MetricsWriter, ThroughputMeter, plot_metrics
from distqa.optim import build_optimizer, build_scheduler
from distqa.outdir import archive_config, claim, export_atomically, write_text
from distqa.resume import changed_settings, check_continuation, check_resumable, choose_checkpoint
from distqa.rounds import as_peer_loss
from distqa.sampler import seed_everything, steps_per_epoch, training_batches
from distqa.sharded import require_shared
from distqa.steptimer import StepTimer
from distqa.task import Batch, Task, load_task


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
        self.cfg, self.task, self.info = cfg, task, info
        self.timer = timer or StepTimer.off(info.device)
        self.save_outputs = save_outputs
        # The CLI's process keeps the SIGTERM handler (record only) once the run is done: a SIGTERM
        # after the last step is no failure. In-process callers (tests, bench) get theirs back.
        self.keep_sigterm_handler = keep_sigterm_handler
        self.stop: StopSignal | None = None
        self.out = Path(cfg.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.sharded = cfg.train.parallel == "fsdp"
        # FSDP casts the gathered weights itself (its mixed-precision policy): no autocast on top.
        self.autocast_dtype = None if self.sharded else autocast_dtype(cfg.train.precision)
        self.step = 0  # the last finished step, for the message when a peer is lost

    # ----------------------------------------------------------------------------- set-up

    # ----------------------------------------------------------------------------- the loop
    def _loss(self, batch: Batch) -> torch.Tensor:
        try:
            return self.task.loss(self.model, batch)
        except RuntimeError as err:
            if "find_unused_parameters" not in str(err):
                raise
            # DDP's own message is a paragraph; the cause and the switch fit in a line.
            raise DistqaError(
                "some parameters got no gradient in a step (a model part the loss does not use): set "
                "train.find_unused_parameters=true, or leave that part out of the model"
            ) from err

    def _train_step(self, batches: Iterator[Batch], meter: ThroughputMeter) -> None:
        accum, timer = self.cfg.train.grad_accum, self.timer
        timer.step_begin()
        for micro in range(accum):
            if micro:
                timer.mark("data")
            cpu_batch = next(batches)
            tokens = self.task.count_tokens(cpu_batch)  # on the CPU copy: no device sync
            samples = len(next(iter(cpu_batch.values())))
            batch = to_device(cpu_batch, self.info.device)
            timer.mark("forward_backward")
            # All-reduce only on the last micro-batch: earlier backward passes just accumulate
            # locally, which saves (accum - 1) rounds of communication per step.
            last = micro == accum - 1
            # (self.ddp, not self.model: a compiled model is no DDP instance, but obeys no_sync.)
            with parallel.gradient_sync(self.raw_model, self.ddp, enabled=last):
                with torch.autocast(
                    self.info.device.type,
                    dtype=self.autocast_dtype or torch.float32,
                    enabled=self.autocast_dtype is not None,
                ):
                    loss = self._loss(batch)
                # Each micro-batch's loss is a mean over its examples; dividing by accum makes the
                # accumulated gradient the mean over the whole global batch.
                self.scaler.scale(loss / accum).backward()
            meter.add(loss, samples, tokens)
            timer.count(samples, tokens)
        timer.mark("optimizer")
        if self.cfg.train.max_grad_norm > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the fp16-scaled ones
            parallel.clip_gradients(self.raw_model.parameters(), self.cfg.train.max_grad_norm)
        self.scaler.step(self.optimizer)
        if self.scaler.is_enabled():
            # fp16: the scaler skips the optimizer step when gradients overflowed (and then lowers
            # its scale); the schedule must not advance past a step that never happened.
            scale = self.scaler.get_scale()
            self.scaler.update()
            if self.scaler.get_scale() >= scale:
                self.scheduler.step()
        else:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        timer.mark("other")  # logging, checkpoints, signal checks: until the next step begins

    def fit(self) -> Path:
        # Before output_dir is touched: nodes started with other settings must not write anything.
        check_same_settings(self.cfg, self.info)
        train = self.cfg.train
        train.resolve_global_batch(self.info.world_size)  # the same on every rank, as the settings are
        self.global_batch = train.batch_size * train.grad_accum * self.info.world_size
        self.lock = claim(self.out, self.info)
        self.checkpoints = CheckpointManager(self.ckpt_root, self.cfg, self.info, sharded=self.sharded, lock=self.lock)
        try:
            return self._fit()
        except RuntimeError as err:  # torch.distributed's errors are RuntimeErrors
            lost = as_peer_loss(err, self.step) if self.info.is_distributed else None
            if lost is None:
                raise
            raise lost from err
        finally:
            if self.stop is not None and not self.keep_sigterm_handler:
                self.stop.close()
            if self.lock is not None:
                self.lock.release()

    def _build(self) -> tuple[Dataset, int, int]:
        """The model (not yet wrapped) and the training data: (dataset, steps per epoch, total steps)."""
        cfg, info = self.cfg, self.info
        # Same seed on every rank, so every rank builds identical weights (DDP would broadcast
        # rank 0's anyway, but identical construction keeps RNG streams aligned too).
        seed_everything(cfg.seed)
        with local_main_first(info):
            self.raw_model = self.task.build_model()
        if not self.sharded:  # FSDP moves it to the device itself, one unit at a time, as it shards it
            self.raw_model.to(info.device)
        with local_main_first(info):  # one process per node builds a data cache, the others then read it
            dataset = self.task.build_train_dataset()
            self.task.eval_dataset()  # built here, where a task may prepare a cache once per node
        self.data_identity = agreed_identity(self.task.data_fingerprint, dataset, info, cfg.data.train)
        epoch_steps = steps_per_epoch(len(dataset), cfg.train.batch_size, cfg.train.grad_accum, info.world_size)  # type: ignore[arg-type]
        total_steps = cfg.train.max_steps if cfg.train.max_steps > 0 else cfg.train.epochs * epoch_steps
        return dataset, epoch_steps, total_steps

    def _fit(self) -> Path:
        cfg, info = self.cfg, self.info
        # Decided before anything is written: train.resume=never may move an earlier run aside.
        resume_from = choose_checkpoint(self.out, cfg.train.resume, info)
        # The settings first, then the data: a refused resume costs no data preparation.
        saved = check_resumable(resume_from, cfg, global_batch=self.global_batch) if resume_from else None
        if self.sharded:
            require_shared(self.out, info)  # every rank writes its shards there
        parallel.configure_backends(cfg.train, info.device)
        dataset, epoch_steps, total_steps = self._build()
        finished = saved is not None and check_continuation(
            resume_from,
            saved,
            cfg,
            total_steps=total_steps,
            data=self.data_identity,  # type: ignore[arg-type]
        )
        # (finished is the same on every rank: the same checkpoint, settings and agreed data.)
        if finished and (
            not self.save_outputs or broadcast_object((self.out / "model").is_dir() if info.is_main else None)
        ):
            print0(
                f"the run in {self.out} already finished at step {total_steps}: nothing to train, nothing "
                "written; to train again use another output_dir or train.resume=never"
            )
            return self.out / "model"
        # First: FSDP replaces the parameters the optimizer must hold.
        self.model, self.ddp = parallel.wrap(self.raw_model, info, cfg.train, self.timer)
        self.optimizer = build_optimizer(self.raw_model, cfg.train, info.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.train, total_steps)
        self.scaler = parallel.grad_scaler(cfg.train, info.device)
        self.checkpoints.track(
            Parts(self.raw_model, self.optimizer, self.scheduler, self.scaler, self.task),
            global_batch=self.global_batch,
            total_steps=total_steps,
            data_identity=self.data_identity,
        )
        step = self.checkpoints.restore(resume_from)
        # config.yaml says what trains from here on, written once every check has passed; a resume
        # with other settings keeps the earlier one as config-history/<step>.yaml. (finished: only
        # model/ was missing, and the same settings export it.)
        if not finished:
            if saved is not None and changed_settings(saved, cfg)[0]:
                archive_config(self.out, step, info)
            write_text(self.out / "config.yaml", to_yaml(cfg), info)
        n_params = sum(p.numel() for p in self.raw_model.parameters())
        print0(
            f"distqa: {info.world_size} process(es) on {info.device.type}, {n_params / 1e6:.1f}M parameters, "
            f"{len(dataset)} examples, global batch {self.global_batch}, steps {step}->{total_steps}"  # type: ignore[arg-type]
        )
        # From here on, SIGTERM means "checkpoint, then exit"; after the last step, nothing.
        self.stop = StopSignal(info, self.lock)
        if step < total_steps:
            self._run_steps(dataset, epoch_steps, total_steps, step)
        self._export(finished)
        barrier()
        return self.out / "model"

    def _run_steps(self, dataset: Dataset, epoch_steps: int, total_steps: int, step: int) -> None:
        cfg, info = self.cfg, self.info
        self.metrics = MetricsWriter(self.out, info, resume_step=step)
        meter = self.meter = ThroughputMeter(info.device)
        self.hint = diverged_hint(cfg.train)  # what to lower if the run diverges: the settings' own
        progress = self.progress = TrainProgress(total_steps, step, enabled=info.is_main)  # a bar, or a line per record
        self.model.train()
        try:
            while step < total_steps:
                epoch, in_epoch = divmod(step, epoch_steps)
                batches = training_batches(dataset, self.task.collate, cfg, info, epoch, in_epoch)
                for _ in range(in_epoch, min(epoch_steps, in_epoch + total_steps - step)):
                    lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
                    self._train_step(batches, meter)
                    step = self.step = step + 1
                    progress.advance()
                    self._after_step(step, epoch_steps, total_steps, lr)
            self.timer.finish()
        finally:
            progress.close()
            self.metrics.close()

    def _after_step(self, step: int, epoch_steps: int, total_steps: int, lr: float) -> None:
        """Log, evaluate, check, save, stop: in that order, and nothing written before the check."""
        cfg, stop = self.cfg, self.stop
        assert stop is not None
        plan, hint = after_step(step, total_steps, cfg.train, save_outputs=self.save_outputs), self.hint
        record = None
        if plan.log:
            record = {"step": step, "epoch": round(step / epoch_steps, 4), "lr": lr, **self.meter.reduce_and_reset()}
            if not math.isfinite(record["loss"]):
                raise DistqaError(f"loss is {record['loss']} at step {step}: {hint}")
            if plan.evaluate:
                record.update(
                    run_evaluation(self.task, self.raw_model, self.info, step=step, autocast_dtype=self.autocast_dtype)
                )
                self.meter.restart_clock()  # evaluation time is not training throughput
        parts = self.checkpoints.parts
        assert parts is not None
        weights = parts.checked_tensors(with_optimizer=plan.save) if plan.check_weights else None
        # A SIGTERM at the last step changes nothing: the run saves and exports as planned.
        stopping = stop.should_stop(step, weights, hint) and step < total_steps
        if record is not None:
            self.metrics.log(record)
            self.progress.report(record)
        if cfg.train.check_replicas:
            check_replicas(self.raw_model, self.info, step)
        if plan.save or stopping:
            if not plan.save:  # a save the plan did not foresee: its optimizer state is not checked yet
                stop.check_finite(step, parts.checked_tensors(with_optimizer=True), hint)
            self.checkpoints.save(step, epoch_steps)
        if stopping:
            raise stop.preempted(step, total_steps, self.ckpt_root / f"step-{step}", self.cfg.train.term_grace_s)

    def _export(self, finished: bool) -> None:
        """model/ from the final weights, and the plot of the run (unless it only exports)."""
        # Rank 0 holds the lock; every rank must learn if it was lost (they all stop, none waits).
        lost = broadcast_object(self.lock.verify() if self.lock is not None else None)
        if lost:
            raise DistqaError(f"{lost}: the model is not exported")
        if not self.save_outputs:
            return
        plotted = False
        metrics_path = self.out / "metrics.jsonl"
        if self.info.is_main and not finished and metrics_path.is_file():
            plotted = plot_metrics(metrics_path, self.out / "metrics.png", title=run_title(self.cfg, self.global_batch))
        # A sharded model is gathered by every rank first; rank 0 then builds the whole one
        # inside the export, whose failures every rank learns of.
        weights = parallel.full_weights(self.raw_model) if self.sharded else None
        whole = parallel.whole_model

        def save(folder: Path) -> None:
            self.task.save_model(whole(self.raw_model, weights, self.task.build_model), folder)
            # The task.* settings travel with the model: `distqa predict` builds its inputs alike.
            self.task.save_settings(folder)

        export_atomically(
            save,
            self.out / "model",
            self.info,
            note="the final checkpoint holds the same weights: free space and run the same command "
            "again (it only writes model/)",
        )
        print0(outputs_summary(self.out, plotted=plotted))


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
