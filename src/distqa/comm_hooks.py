"""Gradient compression for DDP's all-reduce: `train.ddp_comm_hook` = none | fp16 | bf16 | powersgd.

On a slow link between nodes the all-reduce of fp32 gradients can take longer than the forward and
backward passes. A DDP communication hook replaces DDP's all-reduce of each gradient bucket:
- fp16 / bf16: the bucket is cast to 16 bits, averaged, and cast back (half the bytes on the wire).
- powersgd: PyTorch's PowerSGD, a rank-`train.powersgd_rank` approximation of each weight matrix's
  gradient, with error feedback (what the approximation left out is added to the next step's
  gradient) and warm start (last step's Q). Plain all-reduce for the first
  `train.powersgd_start_step` steps.

PowerSGD's state (error feedback, P and Q memories, its step count and random state) is per rank,
kept per parameter across DDP's bucket rebuilds, and saved in every checkpoint (`distqa.powersgd`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from distqa.powersgd import PowerSGD

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distqa.config import TrainConfig
    from distqa.steptimer import StepTimer

HOOKS = ("none", "fp16", "bf16", "powersgd")
# The dtype each compressing hook sends; under FSDP2 it becomes the gradient reduce-scatter's dtype.
REDUCE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
STATE_FORMAT = 1


def allreduce(state, bucket):  # noqa: ANN001, ANN201
    """DDP's own all-reduce (mean), as a hook: what `none` runs when a timer must wrap it.
    (No annotations on hooks: DDP checks them against its classes, and under
    `from __future__ import annotations` they would be strings.)"""
    return default_hooks.allreduce_hook(state, bucket)


def bf16_hook(state, bucket):  # noqa: ANN001, ANN201
    """Cast to bf16, sum, divide, cast back into the bucket. torch's `bf16_compress_hook` refuses
    gloo (it asks for NCCL 2.10+), while gloo's bf16 all_reduce works: this one runs on both."""
    group = state if state is not None else dist.group.WORLD
    buffer = bucket.buffer()
    # Divided before the sum, as torch's hooks do, so that the sum of N ranks cannot overflow.
    compressed = buffer.to(torch.bfloat16).div_(group.size())

    def decompress(fut):  # noqa: ANN001, ANN202
        buffer.copy_(fut.value()[0])  # in place: no second full-size buffer
        return buffer

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def _powersgd(state, bucket):  # noqa: ANN001, ANN201
    return state.reduce(bucket)


class CommHook:
    """The run's hook and its per-rank state, a part of every checkpoint (`checkpoint_manager.Parts`).

    Only PowerSGD has state; fp16, bf16 and none resume exactly like DDP's own all-reduce."""

    def __init__(self, name: str, world_size: int, powersgd: PowerSGD | None = None) -> None:
        self.name, self.world_size, self.powersgd = name, world_size, powersgd

    @classmethod
    def off(cls, train: TrainConfig, world_size: int) -> CommHook:
        """No DDP (one process, or FSDP, whose reduce dtype `shard` sets): nothing to hook or save."""
        return cls(train.ddp_comm_hook, world_size)

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "hook": self.name,
            "world_size": self.world_size,
            "powersgd": self.powersgd.state_dict() if self.powersgd is not None else None,
        }

    def load_state_dict(self, saved: dict[str, Any] | None) -> str | None:
        """Restore this rank's state; returns why PowerSGD starts afresh instead (the same on every
        rank, for one warning line), or None. Every rank must call it: the ranks agree first, since
        one rank compressing while another does not would mismatch their collectives."""
        if self.powersgd is None:
            return None
        why = _why_afresh(saved, self.world_size, self.powersgd.state.matrix_approximation_rank)
        if dist.is_initialized():
            flag = torch.tensor([0.0 if why is None else 1.0], device=_device(self.powersgd))
            dist.all_reduce(flag)
            if why is None and flag.item() > 0:
                why = "another rank found no state of its own to restore"
        if why is None:
            self.powersgd.load_state_dict(saved["powersgd"])  # type: ignore[index]
        return why


def _why_afresh(saved: dict[str, Any] | None, world_size: int, rank: int) -> str | None:
    if saved and saved.get("world_size") != world_size:
        return f"the checkpoint was written by {saved.get('world_size')} process(es), this run has {world_size}"
    if not saved or saved.get("hook") != "powersgd" or not saved.get("powersgd"):
        return "the checkpoint holds no PowerSGD state (it was written with another train.ddp_comm_hook)"
    if saved["powersgd"].get("rank") != rank:
        return f"the checkpoint's train.powersgd_rank was {saved['powersgd'].get('rank')}"
    return None


def _device(powersgd: PowerSGD) -> torch.device:
    # NCCL reduces CUDA tensors only; gloo CPU ones.
    backend = dist.get_backend()
    return powersgd.params[0].device if backend == "nccl" and powersgd.params else torch.device("cpu")


def install(ddp: DDP, train: TrainConfig, timer: StepTimer) -> CommHook:
    """Register the hook of `train.ddp_comm_hook` on `ddp` (DDP takes one): wrapped by the step
    timer's when it records, so the bench measures the hook that trains."""
    world_size = dist.get_world_size()
    powersgd = PowerSGD(ddp.module, train) if train.ddp_comm_hook == "powersgd" else None
    hooks = {"none": allreduce, "fp16": default_hooks.fp16_compress_hook, "bf16": bf16_hook, "powersgd": _powersgd}
    hook = hooks[train.ddp_comm_hook]
    if timer.enabled:
        hook = timer.wrap(hook)
    if train.ddp_comm_hook != "none" or timer.enabled:  # none, untimed: DDP's own C++ all-reduce
        ddp.register_comm_hook(powersgd, hook)
    return CommHook(train.ddp_comm_hook, world_size, powersgd)


def reduce_dtype(train: TrainConfig, compute_dtype: torch.dtype | None) -> torch.dtype | None:
    """FSDP2's gradient reduce-scatter dtype: the hook's 16-bit type, else fp32 under mixed
    precision (None, FSDP's default, otherwise)."""
    return REDUCE_DTYPES.get(train.ddp_comm_hook, torch.float32 if compute_dtype else None)
