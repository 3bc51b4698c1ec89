"""The yardstick for the trainer's overhead: the shortest correct DDP loop, written out by hand.

It does the same arithmetic as `Trainer` (same model, data, batch, precision, gradient clipping,
AdamW) and nothing else: no schedule, no metrics, no checkpoints, no signal handling, no progress
bar, no step timer. `distqa bench --baseline` runs it beside the trainer in the same session and
reports the ratio of their throughputs.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from distqa.config import Config
from distqa.dist import DistInfo, autocast_dtype, default_num_workers, local_main_first
from distqa.task import Task


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_baseline(cfg: Config, task: Task, info: DistInfo, *, warmup: int) -> tuple[dict[str, Any], nn.Module]:
    """Run `cfg.train.max_steps` optimizer steps; time those after the first `warmup`."""
    torch.manual_seed(cfg.seed)
    with local_main_first(info):
        raw = task.build_model().to(info.device)
        dataset = task.build_train_dataset()
    if info.device.type == "cuda" and not cfg.train.deterministic:
        torch.set_float32_matmul_precision("high")  # as the trainer does
    model: nn.Module = raw
    if info.is_distributed:
        model = DDP(raw, device_ids=[info.local_rank] if info.device.type == "cuda" else None)
    if cfg.train.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(
        raw.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, fused=info.device.type == "cuda"
    )
    num_workers = default_num_workers() if cfg.data.num_workers is None else cfg.data.num_workers
    sampler = DistributedSampler(dataset, num_replicas=info.world_size, rank=info.rank, seed=cfg.seed)
    loader = DataLoader(
        dataset,
        batch_size=cfg.train.batch_size,
        sampler=sampler,
        drop_last=True,
        collate_fn=task.collate,
        num_workers=num_workers,
        pin_memory=info.device.type == "cuda",
    )
    dtype = autocast_dtype(cfg.train.precision)
    accum = cfg.train.grad_accum

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    stream = batches()
    samples = tokens = 0
    start = 0.0
    model.train()
    for step in range(cfg.train.max_steps):
        if step == warmup:
            _sync(info.device)
            start = time.perf_counter()
            samples = tokens = 0
        for micro in range(accum):
            batch = next(stream)
            samples += len(next(iter(batch.values())))
            tokens += task.count_tokens(batch)
            batch = {k: v.to(info.device, non_blocking=True) for k, v in batch.items()}
            sync = model.no_sync() if micro < accum - 1 and isinstance(model, DDP) else contextlib.nullcontext()
            with sync:
                with torch.autocast(info.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                    loss = task.loss(model, batch)
                (loss / accum).backward()
        if cfg.train.max_grad_norm > 0:
            nn.utils.clip_grad_norm_(raw.parameters(), cfg.train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _sync(info.device)
    measured = cfg.train.max_steps - warmup
    summary = {
        "steps": measured,
        "seconds": time.perf_counter() - start,
        "samples": samples,
        "tokens": tokens,
        "phase_ms": {},
    }
    return summary, raw
