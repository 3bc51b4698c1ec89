"""Evaluation during training, run by the trainer for any task.

The trainer owns the mode: at every evaluation it puts the unwrapped model in eval mode under
`torch.no_grad()` and the run's autocast, calls `Task.evaluate`, puts the model back in train mode
and prints one line with the metrics and the time taken (`run_evaluation`).

`Task.evaluate` is the escape hatch; its default is the common path (`evaluate_dataset`), which
does what every task would otherwise write again: each rank takes a contiguous share of the
validation set (no sampler padding, so nothing is counted twice; shares may differ in length,
and with a sharded model the shorter ones run extra forward passes whose outputs are dropped,
because its forward is collective), batches it with the task's `collate_fn()` (the training
loader's), calls the task's `eval_step` per batch, and rank 0 gets every output in dataset order
for `compute_metrics`.

An error in the task's evaluation code, on any rank, stops every rank with one line
(`EvaluationFailed`); the trainer writes the step's checkpoint first. (With a sharded model an
error in `eval_step` ends its rank as before, and the others stop as having lost a peer: they
may be inside a forward pass's collectives, which it can no longer join.)
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import time
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from distqa.dist import DistInfo, gather_to_main, print0
from distqa.errors import DistqaError, EvaluationFailed
from distqa.parallel import is_sharded
from distqa.rank0 import raise_on_any_rank, reason
from distqa.rng_state import capture_rng_state, restore_rng_state
from distqa.rounds import as_peer_loss
from distqa.sampler import EVAL_STREAM, BatchSeeded, ItemSeeded, SeededCollate, derive_seed


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors to the device, in nested mappings, lists and tuples too (`{"inputs": {...}}`, as
    `Task.batch_rows` reads them); other values (example ids as strings, say) stay as they are."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if type(batch) in (list, tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def evaluate_dataset(task: Any, model: nn.Module, dataset: Dataset, info: DistInfo, step: int) -> dict[str, float]:
    """The common path of `Task.evaluate`: sharded eval_step, gathered, compute_metrics on rank 0."""
    n, size = len(dataset), task.cfg.train.batch_size  # type: ignore[arg-type]
    # Whole batches to each rank, and their random draws (a collate's masking, an item's
    # augmentation) seeded by their place in the set, as training seeds them: the same batches and
    # draws at any process count. Before, rank 1's batches began mid-set, and drew from its own
    # dropout stream: a fork's eval_loss was 1.9615 at 1 process and 1.9908 at 2 on equal weights.
    batches = math.ceil(n / size)
    first, last = batches * info.rank // info.world_size, batches * (info.rank + 1) // info.world_size
    seed = derive_seed(task.cfg.seed, EVAL_STREAM)
    seeded = (BatchSeeded if hasattr(dataset, "__getitems__") else ItemSeeded)(dataset, seed, in_process=True)
    share = Subset(seeded, range(first * size, min(last * size, n)))
    # The training loader's collate: a task that overrides only collate_fn() batches alike in both.
    collate = task.collate_fn()
    outputs: list[Any] = []
    problem: DistqaError | None = None
    try:
        # (A generator of its own: a loader draws its base seed from the global one otherwise.)
        loader = DataLoader(
            share, size, collate_fn=SeededCollate(collate, seed, in_process=True), generator=torch.Generator()
        )
        for batch in loader:
            outputs.extend(checked_outputs(task.eval_step(model, to_device(batch, info.device))))
        if is_sharded(model) and n:
            # A sharded model's forward is collective (each block all-gathers its weights), so every
            # rank runs as many as the largest share needs: the smaller shares repeat the data's
            # first batch and drop what it yields.
            spare = collate([dataset[i] for i in range(min(size, n))])
            for _ in range(math.ceil(batches / info.world_size) - (last - first)):
                task.eval_step(model, to_device(spare, info.device))
    except Exception as err:  # noqa: BLE001 - the task's code: one line on every rank (see hook_failed)
        if _passes_through(err, model, info, step):
            raise
        problem = hook_failed("eval_step", err)
    raise_on_any_rank(problem, info)  # before the gather, which a failed rank would never reach
    gathered = [item for part in gather_to_main(outputs, info) for item in part]
    if not info.is_main:
        return {}
    # Rank 0 alone scores (its one-line error reaches every rank: `run_evaluation`).
    try:
        return task.compute_metrics(gathered, step)
    except Exception as err:  # noqa: BLE001
        raise hook_failed("compute_metrics", err) from err


def _passes_through(err: BaseException, model: nn.Module, info: DistInfo, step: int) -> bool:
    """An error this rank ends with as it is, rather than agreeing on it with the others: a lost
    peer (no collective is left to agree on it), or any error with a sharded model (the other ranks
    may be inside a forward's collectives, which this rank would no longer join: they learn of it
    as a lost peer)."""
    return is_sharded(model) or (info.is_distributed and as_peer_loss(err, step) is not None)


def checked_outputs(out: Any) -> Any:
    """`eval_step`'s result, checked: a list (or tuple, tensor, array) of CPU items, one per example
    or window. A dict or a scalar would be gathered as something else (a dict's keys, say) and
    scored without a word; tensors on a GPU would be unpickled on rank 0 onto another rank's GPU."""
    if not (isinstance(out, (list, tuple)) or (isinstance(out, (torch.Tensor, np.ndarray)) and out.ndim >= 1)):
        raise DistqaError(
            f"the task's eval_step returned a {type(out).__name__}, not a list of one item per example (or window) "
            "of the batch"
        )
    if _on_a_device(out):
        raise DistqaError(
            "the task's eval_step returned tensors on the GPU: return CPU items (`.tolist()` or `.cpu()`); they are "
            "pickled to rank 0, which would put them back on another rank's GPU"
        )
    return out


def _on_a_device(value: Any, depth: int = 3) -> bool:
    """Whether `value` holds a tensor off the CPU, looking `depth` levels into lists, tuples and dicts."""
    if torch.is_tensor(value):
        return value.device.type != "cpu"
    if depth == 0:
        return False
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    return any(_on_a_device(item, depth - 1) for item in items)


def hook_failed(hook: str, err: BaseException) -> EvaluationFailed:
    """A task hook's error as one line for every rank (an EvaluationFailed, which pickles to the
    other ranks whatever the task's own class); an error of the task's code has its traceback
    printed here, on the rank it happened on, and kept as the line's cause."""
    if isinstance(err, EvaluationFailed):
        return err
    if isinstance(err, DistqaError):  # the task's own one line (a stale cache, a metric that is no number)
        problem = EvaluationFailed(str(err))
    else:
        traceback.print_exception(err, file=sys.stderr)
        problem = EvaluationFailed(
            f"the task's {hook} raised {type(err).__name__}: {reason(err)} (its traceback is above, from the rank "
            "it happened on)"
        )
    problem.__cause__ = err
    return problem


def checked_metrics(metrics: Any) -> dict[str, Any]:
    """The task's metrics as numbers: a one-element tensor or a NumPy number becomes a Python one;
    anything else (text, a dict, several values) is one line naming the key, before anything is
    written. (A tensor once passed until metrics.jsonl's writer failed on it at the end of the
    run, before its last checkpoint.)"""
    if not isinstance(metrics, Mapping):
        raise DistqaError(f"the task's evaluation returned a {type(metrics).__name__}, not a dict of metric numbers")
    checked: dict[str, Any] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key.startswith("eval_"):
            # They share the metrics line with the training figures: `loss`, `lr` or `step` would
            # overwrite them, and metrics.png and TensorBoard tell evaluation apart by the prefix.
            raise DistqaError(
                f"the task's metric {key!r} is not named eval_*: compute_metrics (or evaluate) must name every "
                "metric eval_<name> (it shares the metrics line with step, loss, lr, ...)"
            )
        if (torch.is_tensor(value) and value.numel() == 1) or isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
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


def rank0_buffers(model: nn.Module, info: DistInfo) -> None:
    """Every rank's buffers become rank 0's, as the checkpoint and the export hold them. DDP sends
    rank 0's to the others before each training forward, and each rank then updates them from its
    own batch (BatchNorm's running statistics): evaluated with its own, each rank scored its share
    of the validation set with another model than the one exported (and train.best_metric picked
    a step by that). FSDP shards parameters only: its buffers are plain tensors, updated apart too."""
    if info.is_distributed:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


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
    rank0_buffers(model, info)
    metrics: dict[str, Any] = {}
    problem: DistqaError | None = None
    try:
        with eval_mode(model, info.device.type, autocast_dtype):
            try:
                metrics = checked_metrics(task.evaluate(model, info, **extra))
            except Exception as err:  # noqa: BLE001 - the task's code: one line on every rank
                # A DistqaError (compute_metrics', the metric checks') is one every rank reaches.
                if not isinstance(err, DistqaError) and _passes_through(err, model, info, step):
                    raise
                problem = hook_failed("evaluate", err)
    finally:
        restore_rng_state(rng, info.device)
    # Rank 0 alone scores. Its one-line error (a stale validation cache, a metric that is no
    # number, a bug in the metric) stops every rank with that line, rather than rank 0 alone while
    # the others wait in the next step's collective until its absence is noticed; the trainer
    # writes the step's checkpoint first (Trainer._after_step).
    raise_on_any_rank(problem, info)
    if metrics:  # rank 0's; none at all means the task has nothing to evaluate (no data.valid)
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        print0(f"eval at step {step}: {shown} ({time.perf_counter() - start:.1f} s)")
    return metrics
