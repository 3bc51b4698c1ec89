"""One optimizer step: `grad_accum` micro-batches per rank, then clipping and the update.

Gradients are reduced once per step, on the last micro-batch (no sync on the others), then
clipped and applied. The loop around it (`distqa.trainer`) only sequences steps and acts on what
`distqa.control` decides after each.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distqa import parallel
from distqa.errors import DistqaError
from distqa.evaluation import to_device
from distqa.task import batch_rows

if TYPE_CHECKING:
    from distqa.config import TrainConfig
    from distqa.dist import DistInfo
    from distqa.meter import ThroughputMeter
    from distqa.steptimer import StepTimer
    from distqa.task import Batch, Task


@dataclass
class TrainStep:
    """What a step uses. `model` is what the forward pass calls (DDP-wrapped, compiled or FSDP);
    `raw_model` the module itself (its parameters); `ddp` the DDP wrapper, if any."""

    task: Task
    model: nn.Module
    raw_model: nn.Module
    ddp: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    train: TrainConfig
    info: DistInfo
    timer: StepTimer
    autocast_dtype: torch.dtype | None

    def __post_init__(self) -> None:
        # Which parameters train is fixed when the optimizer and DDP are built (`_same_trainable`).
        self.trainable = [p.requires_grad for p in self.raw_model.parameters()]

    def __call__(self, batches: Iterator[Batch], meter: ThroughputMeter) -> None:
        accum, timer = self.train.grad_accum, self.timer
        timer.step_begin()
        for micro in range(accum):
            if micro:
                timer.mark("data")
            cpu_batch = next(batches)
            if not isinstance(cpu_batch, Mapping):
                raise DistqaError(
                    f"the task's collate returned a {type(cpu_batch).__name__}, not a mapping of names to tensors "
                    "(a dict such as {'input_ids': ..., 'labels': ...})"
                )
            tokens = self.task.count_tokens(cpu_batch)  # on the CPU copy: no device sync
            samples = batch_rows(cpu_batch)
            batch = to_device(cpu_batch, self.info.device)
            timer.mark("forward_backward")
            # All-reduce only on the last micro-batch: earlier backward passes just accumulate
            # locally, which saves (accum - 1) rounds of communication per step.
            loss = self._forward_backward(batch, sync=micro == accum - 1)
            meter.add(loss, samples, tokens)
            timer.count(samples, tokens)
        timer.mark("optimizer")
        meter.add_grad_norm(self._update())
        timer.mark("other")  # logging, checkpoints, signal checks: until the next step begins

    def _forward_backward(self, batch: Batch, *, sync: bool) -> torch.Tensor:
        # (self.ddp, not self.model: a compiled model is no DDP instance, but obeys no_sync.)
        with parallel.gradient_sync(self.raw_model, self.ddp, enabled=sync):
            with torch.autocast(
                self.info.device.type,
                dtype=self.autocast_dtype or torch.float32,
                enabled=self.autocast_dtype is not None,
            ):
                loss = self._loss(batch)
            # Each micro-batch's loss is a mean over its examples; dividing by accum makes the
            # accumulated gradient the mean over the whole global batch.
            try:
                self.scaler.scale(loss / self.train.grad_accum).backward()
            except RuntimeError as err:
                if "static_graph" not in str(err):
                    raise
                # DDP's paragraph, raised in the backward pass of a step whose used parameters differ.
                raise DistqaError(
                    "a step used other parameters than the steps before it (a model part used only for some "
                    "batches), which train.static_graph=true does not allow: set train.static_graph=false "
                    "train.find_unused_parameters=true, or use every part in every step"
                ) from err
        return loss

    def _loss(self, batch: Batch) -> torch.Tensor:
        try:
            loss = self.task.loss(self.model, batch)
        except RuntimeError as err:
            if "find_unused_parameters" not in str(err):
                raise
            # DDP's own message is a paragraph; the cause and the switch fit in a line.
            raise DistqaError(
                "some parameters got no gradient in a step (a model part the loss does not use): set "
                "train.find_unused_parameters=true, or leave that part out of the model"
            ) from err
        if not torch.is_tensor(loss):
            raise DistqaError(
                f"the task's loss returned a {type(loss).__name__}: return the loss tensor itself (not .item())"
            )
        if self.train.parallel == "dp" and loss.dim() == 1:
            # A loss the model computes in its forward (a Hugging Face model given labels) comes back
            # from DataParallel as one mean per GPU, gathered into a vector. (The built-in tasks
            # compute the loss from the gathered outputs, which is exact whatever the split.)
            loss = parallel.dp_batch_mean(loss, batch_rows(batch), len(self.model.device_ids))
        if loss.dim() != 0 or not loss.is_floating_point() or not loss.requires_grad:
            got = f"shape {list(loss.shape)}" if loss.dim() else f"{loss.dtype}, requires_grad={loss.requires_grad}"
            raise DistqaError(
                f"the task's loss must be a floating-point scalar with a gradient; it returned a tensor of {got}: "
                "take the mean over the batch, and do not detach it or compute it under torch.no_grad()"
            )
        return loss

    def _update(self) -> torch.Tensor:
        """Clip, step, schedule; the total gradient norm before clipping (on the device: no sync)."""
        self._same_trainable()
        # The true gradients, not the fp16-scaled ones, are clipped and measured (a no-op without fp16).
        self.scaler.unscale_(self.optimizer)
        if self.train.max_grad_norm > 0:
            norm = parallel.clip_gradients(self.raw_model.parameters(), self.train.max_grad_norm)
        else:
            norm = total_grad_norm(self.raw_model.parameters())
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
        return norm

    def _same_trainable(self) -> None:
        """A parameter unfrozen during the run (gradual unfreezing) is in neither the optimizer nor
        DDP's all-reduce: it never trained, and its rank-local gradient still entered the clipping
        norm, so the ranks' weights drifted apart; one frozen during the run leaves DDP waiting for
        its gradient. Both are refused before the step is applied (a list of flags: microseconds)."""
        now = [p.requires_grad for p in self.raw_model.parameters()]
        if now == self.trainable:
            return
        i = next(i for i, (then, flag) in enumerate(zip(self.trainable, now)) if then != flag)
        name, what = [n for n, _ in self.raw_model.named_parameters()][i], "unfrozen" if now[i] else "frozen"
        raise DistqaError(
            f"parameter {name} was {what} during training (its requires_grad changed): the optimizer and DDP "
            "take the parameters that require a gradient when the run starts; set requires_grad in the task's "
            "build_model (nor can a resume change them: the checkpoint's optimizer state holds the ones it trained)"
        )


def total_grad_norm(parameters: Iterable[nn.Parameter]) -> torch.Tensor:
    """The global 2-norm of the gradients, as `parallel.clip_gradients` measures it, without clipping:
    a sharded (DTensor) norm is reduced over the ranks, so every rank holds the whole model's."""
    total = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    return total.full_tensor() if isinstance(total, DTensor) else total
