"""Gradient compression for DDP's all-reduce: `train.ddp_comm_hook` = none | fp16 | bf16 | powersgd.

On a slow link between nodes the all-reduce of fp32 gradients can take longer than the forward and
backward passes. A DDP communication hook replaces DDP's all-reduce of each gradient bucket:
- fp16 / bf16: the bucket is cast to 16 bits, averaged, and cast back (half the bytes on the wire).
- powersgd: PyTorch's PowerSGD, a rank-`train.powersgd_rank` approximation of each weight matrix's
  gradient, with error feedback (what the approximation left out is added to the next step's
  gradient) and warm start (last step's Q). Plain all-reduce for the first
  `train.powersgd_start_step` steps.

PowerSGD's state (error feedback, P and Q memories, its step count and random state) is per rank and
keyed by DDP's bucket index. DDP builds its buckets in parameter order, then rebuilds them after the
first step in the order gradients became ready, so a resumed run's first step sees other buckets
than the uninterrupted run did at that step. The state is therefore kept, saved and restored per
parameter (`_Pieces`), and laid out again for whatever bucket asks for it: the arithmetic of each
gradient matrix does not depend on which bucket it rides in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

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


class _Pieces:
    """Where each gradient's PowerSGD state lies in a bucket's flat tensors (bucket by bucket, as
    PowerSGD lays them out): error feedback in gradient order, P and Q of the compressed matrices
    grouped by shape in order of first appearance (powerSGD_hook's `shape_to_tensors`)."""

    def __init__(self, shapes: list[torch.Size], rank: int, min_rate: float) -> None:
        self.error: list[tuple[int, int]] = []  # (offset, length) per gradient
        self.p: dict[int, tuple[int, int]] = {}  # gradient position -> (offset, length) in P
        self.q: dict[int, tuple[int, int]] = {}
        offset, groups = 0, {}
        for pos, shape in enumerate(shapes):
            numel = shape.numel()
            self.error.append((offset, numel))
            offset += numel
            n = shape[0]
            m = numel // n
            r = min(n, m, rank)
            if powerSGD_hook._should_compress(n, m, r, min_rate)[0]:
                groups.setdefault((n, m, r), []).append(pos)
        p_off = q_off = 0
        for (n, m, r), positions in groups.items():
            for pos in positions:
                self.p[pos], self.q[pos] = (p_off, n * r), (q_off, m * r)
                p_off, q_off = p_off + n * r, q_off + m * r
        self.total = offset


class PowerSGD:
    """PyTorch's PowerSGD hook and state, kept per parameter across bucket rebuilds and resumes."""

    def __init__(self, model: nn.Module, train: TrainConfig, group: Any = None) -> None:
        self.state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=train.powersgd_rank,
            start_powerSGD_iter=train.powersgd_start_step,
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,  # the same on every rank: the random Qs must agree
        )
        self.params = list(model.parameters())
        self._index = {p.data_ptr(): i for i, p in enumerate(self.params)}
        self.layouts: dict[int, tuple[int, ...]] = {}  # bucket index -> parameter indices
        # Per-parameter state not yet laid out in a bucket: param index -> {"error", "p", "q"}.
        self.pieces: dict[int, dict[str, torch.Tensor]] = {}
        self.seen: set[int] = set()  # buckets reduced in the current step
        # torch's hook waits on its P all-reduce inside a callback, which gloo runs on one of its few
        # worker threads: with several buckets in flight those threads all wait and the step hangs
        # (seen at 2 processes with a 0.1 MB bucket_cap_mb). On gloo each bucket is therefore
        # reduced before the next is handed over (no overlap with the backward pass; same values).
        self.blocking = dist.get_backend(group) == "gloo"

    def reduce(self, bucket: Any) -> Any:
        layout = tuple(self._index[p.data_ptr()] for p in bucket.parameters())
        index = bucket.index()
        if self.layouts.get(index) != layout:
            # New buckets (DDP's rebuild, a resume): the state of every bucket not yet reduced in
            # this step goes back to its parameters, and this bucket's is laid out from theirs.
            # (Buckets already reduced in this step keep theirs: their futures may still use it.)
            self._split_unseen()
            self._assemble(index, layout, bucket.buffer())
            self.layouts[index] = layout
        self.seen.add(index)
        future = powerSGD_hook.powerSGD_hook(self.state, bucket)
        if self.blocking:
            future.wait()
        if bucket.is_last():  # DDP reduces bucket 0 last: the step's communication is all launched
            self.seen.clear()
        return future

    def _split_unseen(self) -> None:
        s = self.state
        for index in [i for i in self.layouts if i not in self.seen]:
            self.pieces.update(self._split_bucket(index, self.layouts.pop(index)))
            for memory in (s.error_dict, s.p_memory_dict, s.q_memory_dict):
                memory.pop(index, None)

    def _layout(self, layout: tuple[int, ...]) -> _Pieces:
        shapes = [self.params[i].shape for i in layout]
        return _Pieces(shapes, self.state.matrix_approximation_rank, self.state.min_compression_rate)

    def _split_bucket(self, index: int, layout: tuple[int, ...]) -> dict[int, dict[str, torch.Tensor]]:
        """One bucket's state per parameter (views of its tensors); empty before PowerSGD began."""
        s, pieces = self.state, {}
        if index not in s.error_dict:
            return pieces
        places = self._layout(layout)
        for pos, param in enumerate(layout):
            offset, length = places.error[pos]
            piece = {"error": s.error_dict[index][offset : offset + length]}
            if pos in places.p and index in s.p_memory_dict:
                (po, pl), (qo, ql) = places.p[pos], places.q[pos]
                piece["p"] = s.p_memory_dict[index][po : po + pl]
                piece["q"] = s.q_memory_dict[index][qo : qo + ql]
            pieces[param] = piece
        return pieces

    def _split(self) -> dict[int, dict[str, torch.Tensor]]:
        """The whole state per parameter, without changing the buckets' own tensors."""
        pieces = dict(self.pieces)
        for index, layout in self.layouts.items():
            pieces.update(self._split_bucket(index, layout))
        return pieces

    def _clear(self) -> None:
        self.layouts.clear()
        self.seen.clear()
        for memory in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
            memory.clear()

    def _assemble(self, index: int, layout: tuple[int, ...], buffer: torch.Tensor) -> None:
        if not all(param in self.pieces for param in layout):
            return  # (a parameter without state: this bucket starts afresh, as PowerSGD would)
        places, pieces = self._layout(layout), [self.pieces.pop(param) for param in layout]
        device, dtype = buffer.device, buffer.dtype
        self.state.error_dict[index] = torch.cat([p["error"] for p in pieces]).to(device, dtype)
        for key, memory, where in (
            ("p", self.state.p_memory_dict, places.p),
            ("q", self.state.q_memory_dict, places.q),
        ):
            ordered = sorted(where, key=lambda pos: where[pos][0])
            parts = [pieces[pos][key] for pos in ordered if key in pieces[pos]]
            if len(parts) == len(ordered):
                memory[index] = (torch.cat(parts) if parts else torch.empty(0)).to(device, dtype)

    def state_dict(self) -> dict[str, Any]:
        s = self.state
        name, keys, pos, has_gauss, cached = s.rng.get_state()
        return {
            "rank": s.matrix_approximation_rank,
            "iter": s.iter,
            # NumPy's key array as a plain list: weights_only loading refuses ndarrays.
            "rng": (name, keys.tolist(), pos, has_gauss, cached),
            "numel": (s.total_numel_before_compression, s.total_numel_after_compression, s.next_stats_report),
            "pieces": {i: {k: t.detach().cpu().clone() for k, t in p.items()} for i, p in self._split().items()},
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        s = self.state
        s.iter = int(saved["iter"])
        name, keys, pos, has_gauss, cached = saved["rng"]
        s.rng.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        s.total_numel_before_compression, s.total_numel_after_compression, s.next_stats_report = saved["numel"]
        self._clear()
        self.pieces = {int(i): dict(p) for i, p in saved["pieces"].items()}


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
