"""Evaluation during training, run by the trainer for any task.

The trainer owns the mode: at every evaluation it puts the unwrapped model in eval mode under
`torch.no_grad()` and the run's autocast, calls `Task.evaluate`, puts the model back in train mode
and prints one line with the metrics and the time taken (`run_evaluation`).

`Task.evaluate` is the escape hatch; its default is the common path (`evaluate_dataset`), which
does what every task would otherwise write again: each rank takes a contiguous share of the
validation set (no sampler padding, so nothing is counted twice; shares may differ in length,
and with a sharded model the shorter ones run extra forward passes whose outputs are dropped,
because its forward is collective), batches it with the task's `collate`, calls the
task's `eval_step` per batch, and rank 0 gets every output in dataset order for `compute_metrics`.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from distqa.dist import DistInfo, gather_to_main, print0
from distqa.errors import DistqaError
from distqa.parallel import is_sharded
from distqa.rank0 import raise_on_every_rank
from distqa.rng_state import capture_rng_state, restore_rng_state


def to_device(batch: Any, device: torch.device) -> dict[str, Any]:
    """Tensors to the device; other values (example ids as strings, say) stay as they are."""
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def evaluate_dataset(task: Any, model: nn.Module, dataset: Dataset, info: DistInfo, step: int) -> dict[str, float]:
    """The common path of `Task.evaluate`: sharded eval_step, gathered, compute_metrics on rank 0."""
    n = len(dataset)  # type: ignore[arg-type]
    share = Subset(dataset, range(n * info.rank // info.world_size, n * (info.rank + 1) // info.world_size))
    size = task.cfg.train.batch_size
    loader = DataLoader(share, batch_size=size, collate_fn=task.collate)
    outputs: list[Any] = []
    for batch in loader:
        outputs.extend(task.eval_step(model, to_device(batch, info.device)))
    if is_sharded(model) and n:
        # A sharded model's forward is collective (each block all-gathers its weights), so every
        # rank runs as many as the largest share needs: the smaller shares repeat the data's
        # first batch and drop what it yields.
        spare = task.collate([dataset[i] for i in range(min(size, n))])
        for _ in range(math.ceil(math.ceil(n / info.world_size) / size) - len(loader)):
            task.eval_step(model, to_device(spare, info.device))
    gathered = [item for part in gather_to_main(outputs, info) for item in part]
    # Rank 0 alone scores (its one-line error reaches every rank: `run_evaluation`).
    return task.compute_metrics(gathered, step) if info.is_main else {}


def checked_metrics(metrics: Any) -> dict[str, Any]:
    """The task's metrics as numbers: a one-element tensor or a NumPy number becomes a Python one;
    anything else (text, a dict, several values) is one line naming the key, before anything is
    written. (A tensor once passed until metrics.jsonl's writer failed on it at the end of the
    run, before its last checkpoint.)"""
    if not isinstance(metrics, Mapping):
        raise DistqaError(f"the task's evaluation returned a {type(metrics).__name__}, not a dict of metric numbers")
    checked: dict[str, Any] = {}
    for key, value in metrics.items():
        if (torch.is_tensor(value) and value.numel() == 1) or isinstance(value, np.generic):
            value = value.item()
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DistqaError(
                f"the task's metric {key!r} is {type(value).__name__} {value!r:.60}, not a number: compute_metrics "
                "(or evaluate) must return a dict of names to numbers"
            )
        checked[key] = value
    return checked


@contextlib.contextmanager
def eval_mode(model: nn.Module, device_type: str, autocast_dtype: torch.dtype | None) -> Iterator[None]:
    """Eval mode (dropout off), no gradients and the run's autocast (none when `autocast_dtype` is
    None); the model's own mode back afterwards. Evaluation during training and `distqa predict`
    both run their forward passes under it, so the two agree."""
    was_training = model.training
    model.eval()
    try:
        enabled = autocast_dtype is not None
        with torch.no_grad(), torch.autocast(device_type, dtype=autocast_dtype or torch.float32, enabled=enabled):
            yield
    finally:
        model.train(was_training)


def run_evaluation(
    task: Any, model: nn.Module, info: DistInfo, *, step: int, autocast_dtype: torch.dtype | None
) -> dict[str, float]:
    """Call `task.evaluate` as the trainer promises it: eval mode, no gradients, the run's autocast;
    the model back in train mode afterwards. Every rank must call it."""
    start = time.perf_counter()
    # A fork's evaluate(model, info) may predate the step argument.
    extra = {"step": step} if "step" in inspect.signature(task.evaluate).parameters else {}
    # Evaluating moves no random stream that training draws from: its DataLoader takes a base seed
    # from torch's CPU generator (and a task's evaluate may draw too), which shifted the dropout
    # masks of every later step. train.eval_every and data.valid change nothing computed, and a
    # resume that changes them may say nothing (resume="silent").
    rng = capture_rng_state(info.device)
    metrics: dict[str, Any] = {}
    problem: DistqaError | None = None
    try:
        with eval_mode(model, info.device.type, autocast_dtype):
            try:
                metrics = checked_metrics(task.evaluate(model, info, **extra))
            except DistqaError as err:
                problem = err
    finally:
        restore_rng_state(rng, info.device)
    # Rank 0 alone scores. Its one-line error (a stale validation cache, a metric that is no
    # number) stops every rank with that line, rather than rank 0 alone while the others wait in
    # the next step's collective until its absence is noticed.
    raise_on_every_rank(problem)
    if metrics:  # rank 0's; none at all means the task has nothing to evaluate (no data.valid)
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        print0(f"eval at step {step}: {shown} ({time.perf_counter() - start:.1f} s)")
    return metrics
