"""Evaluation during training, run by the trainer for any task.

The task says what to compute (`Task.build_eval_dataset`, `Task.eval_step`, `Task.compute_metrics`);
this module does what every task would otherwise write again: each rank takes a contiguous share of
the validation set (no sampler padding, so nothing is counted twice, and no collective inside the
forward pass, so shares may differ in length), runs the unwrapped model in eval mode under
`no_grad` and the run's autocast, and rank 0 gathers every output in dataset order.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from distqa.dist import DistInfo, gather_to_main, print0
from distqa.task import Task


def evaluate(
    task: Task,
    model: nn.Module,
    dataset: Dataset,
    info: DistInfo,
    *,
    step: int,
    batch_size: int,
    autocast_dtype: torch.dtype | None,
    to_device: Any,
) -> dict[str, float]:
    """The task's validation metrics on rank 0 (an empty dict elsewhere). Every rank must call it."""
    start = time.perf_counter()
    n = len(dataset)  # type: ignore[arg-type]
    share = Subset(dataset, range(n * info.rank // info.world_size, n * (info.rank + 1) // info.world_size))
    loader = DataLoader(share, batch_size=batch_size, collate_fn=task.collate)
    was_training = model.training
    model.eval()
    outputs: list[Any] = []
    try:
        with (
            torch.no_grad(),
            torch.autocast(info.device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None),
        ):
            for batch in loader:
                outputs.extend(task.eval_step(model, to_device(batch)))
    finally:
        model.train(was_training)
    gathered = [item for part in gather_to_main(outputs, info) for item in part]
    metrics = task.compute_metrics(gathered, step) if info.is_main else {}
    shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
    print0(f"eval at step {step}: {shown or 'no metrics'} ({n} items, {time.perf_counter() - start:.1f} s)")
    return metrics
