"""The yardstick for the trainer's overhead: the shortest correct DDP loop, written out by hand.

It does the same arithmetic as `Trainer` (same model, batches, activation checkpointing, DDP
settings, precision and fp16 loss scaling, gradient clipping, and the optimizer train.optimizer
names, built as the trainer builds it) and nothing else: no schedule, no metrics, no checkpoints,
no signal handling, no progress bar. It carries the same `StepTimer` marks as the trainer (a
clock reading each), so the two breakdowns can be compared phase by phase. `distqa bench
--baseline` runs it beside the trainer in the same session and reports the ratio of their
throughputs.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distqa import comm_hooks
from distqa.config import Config
from distqa.dist import DistInfo, autocast_dtype, data_parallel, local_main_first
from distqa.evaluation import to_device
from distqa.optim import build_optimizer
from distqa.parallel import checkpoint_blocks, configure_backends
from distqa.sampler import training_batches
from distqa.steptimer import StepTimer
from distqa.task import Task, batch_rows


def _batches(cfg: Config, task: Task, info: DistInfo, dataset: Any) -> Iterator[dict[str, torch.Tensor]]:
    """The trainer's batches (its sampler and loader), so both loops see the same batches in the
    same order: with padding to each batch's longest sequence, other batches would be other amounts
    of work."""
    for epoch in itertools.count():
        yield from training_batches(dataset, task.collate_fn(), cfg, info, epoch, start_step=0)


def _build(cfg: Config, task: Task, info: DistInfo, timer: StepTimer) -> tuple[nn.Module, DDP | None, nn.Module, Any]:
    """(raw model, its DDP wrapper or None, the model to call, the training dataset)."""
    # The trainer's kernel settings (TF32, or deterministic kernels under train.deterministic), set
    # where the trainer sets them: before the first kernel, so both loops run the same kernels.
    configure_backends(cfg.train, info.device)
    torch.manual_seed(cfg.seed)
    with local_main_first(info):
        raw = task.build_model().to(info.device)
        dataset = task.build_train_dataset()
    # The trainer's activation checkpointing and DDP settings, so the comparison is of the loops,
    # not of options: without it the trainer's second forward of each block (9-17 % of a step)
    # was reported as the trainer's overhead (found by a review).
    if cfg.train.activation_checkpointing:
        checkpoint_blocks(raw)
    ddp = data_parallel(raw, info, cfg.train) if info.is_distributed else None
    model: nn.Module = ddp or raw
    if ddp is not None:
        comm_hooks.install(ddp, cfg.train, timer)  # the trainer's train.ddp_comm_hook, timed the same way
    if cfg.train.compile:
        model = torch.compile(model)
    return raw, ddp, model, dataset


def run_baseline(cfg: Config, task: Task, info: DistInfo, *, warmup: int) -> tuple[dict[str, Any], nn.Module]:
    """Run `cfg.train.max_steps` optimizer steps; time those after the first `warmup`."""
    timer = StepTimer(info.device, warmup=warmup)
    raw, ddp, model, dataset = _build(cfg, task, info, timer)
    # The trainer's optimizer (SGD or AdamW, its parameter groups): a hand-built AdamW beside a
    # trainer on SGD put the optimizers' difference into the ratio.
    optimizer = build_optimizer(raw, cfg.train, info.device)
    scaler = torch.amp.GradScaler(info.device.type, enabled=cfg.train.precision == "fp16")
    dtype = autocast_dtype(cfg.train.precision)
    accum = cfg.train.grad_accum
    stream = _batches(cfg, task, info, dataset)
    model.train()
    for _ in range(cfg.train.max_steps):
        timer.step_begin()
        for micro in range(accum):
            if micro:
                timer.mark("data")
            batch = next(stream)
            # As the trainer counts and moves a batch: a fork's may nest, or hold strings (ids).
            timer.count(batch_rows(batch), task.count_tokens(batch))
            batch = to_device(batch, info.device)
            timer.mark("forward_backward")
            sync = ddp.no_sync() if micro < accum - 1 and ddp is not None else contextlib.nullcontext()
            with sync:
                with torch.autocast(info.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                    loss = task.loss(model, batch)
                scaler.scale(loss / accum).backward()
        timer.mark("optimizer")
        if cfg.train.max_grad_norm > 0:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(raw.parameters(), cfg.train.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        timer.mark("other")
    timer.finish()
    return timer.summary(), raw
