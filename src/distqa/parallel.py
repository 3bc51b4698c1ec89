"""How the model is spread over the processes: `train.parallel=ddp`, `fsdp` or `dp`.

- ddp: every rank holds the whole model, its gradients and the optimizer state; gradients are
  all-reduced once per step (`distqa.dist.data_parallel`).
- fsdp: FSDP2 (`fully_shard`). Each transformer block, then the root, is one unit whose
  parameters, gradients and optimizer state are split over the ranks: a rank holds 1/N of them
  and all-gathers a block's weights just before its forward and backward, then frees them. The
  state per rank shrinks N-fold, for one all-gather more per block and step.
- dp: `torch.nn.DataParallel` in one process: each step it copies the model from GPU 0 to every
  visible GPU, splits the batch along dim 0, runs the copies in threads, gathers their outputs on
  GPU 0 and sums the gradients there. The simplest way onto several GPUs, and slower than ddp (one
  Python process for every GPU, the copies and the gather through GPU 0 every step).

All modes run the same trainer; this module holds what differs (wrapping, gradient sync,
clipping, the full weights for export, the memory figures). `train.activation_checkpointing`
wraps the same blocks in either mode: their activations are recomputed in the backward pass
instead of kept, which trades a forward pass per step for most of the activation memory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from distqa import comm_hooks
from distqa.dist import AUTOCAST_DTYPES, DistInfo, data_parallel
from distqa.errors import ConfigError, DistqaError

if TYPE_CHECKING:  # for hints only
    from distqa.config import TrainConfig


def configure_backends(train: TrainConfig, device: torch.device) -> None:
    """Kernel settings, once and before the first kernel runs."""
    if train.deterministic:
        # cuBLAS is only deterministic with a fixed workspace; it must be set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    elif device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls for the fp32 parts


def wrap(
    model: nn.Module, info: DistInfo, train: TrainConfig, timer: Any
) -> tuple[nn.Module, DDP | None, comm_hooks.CommHook]:
    """(the module to call, its DDP wrapper or None, its communication hook): FSDP2 in place
    (train.parallel=fsdp, with activation checkpointing inside) or activation checkpointing then
    DDP (several processes) with train.ddp_comm_hook, or DataParallel over this process's GPUs
    (train.parallel=dp); then torch.compile (train.compile). `timer` (a StepTimer) times DDP's
    all-reduce when enabled. `model` stays the module whose weights are saved and exported."""
    sharded = train.parallel == "fsdp"
    if sharded:
        shard(model, info, train)
    elif train.activation_checkpointing:
        checkpoint_blocks(model)
    if train.parallel == "dp":
        return one_process_data_parallel(model, info, train), None, comm_hooks.CommHook.off(train, info.world_size)
    ddp = data_parallel(model, info, train) if info.is_distributed and not sharded else None
    called: nn.Module = model
    hook = comm_hooks.CommHook.off(train, info.world_size)
    if ddp is not None:
        called = ddp
        hook = comm_hooks.install(ddp, train, timer)  # with the timer's hook around it
    if train.compile:
        # Compiling the DDP-wrapped module lets Dynamo split the graph at DDP's bucket
        # boundaries, so gradient all-reduce still overlaps the backward pass.
        called = torch.compile(called)
    return called, ddp, hook


def check_placement(train: TrainConfig, info: DistInfo) -> None:
    """Refuse, before anything is written, a mode this process cannot run (train.parallel=dp on the
    CPU or in a launch of several processes; the settings themselves were checked in `distqa.config`)."""
    if train.parallel == "dp":
        dp_device_ids(info)


def dp_device_ids(info: DistInfo) -> list[int]:
    """The GPUs train.parallel=dp splits each batch over: every visible one (CUDA_VISIBLE_DEVICES
    picks them), this process's device first. Refused in one line where DataParallel cannot run."""
    if info.world_size > 1:
        raise ConfigError(
            f"train.parallel=dp runs one process over all of a node's GPUs, and this launch started "
            f"{info.world_size} processes (WORLD_SIZE={info.world_size}): start one process (distqa train, or "
            "torchrun --nproc-per-node 1 on one node), or use train.parallel=ddp for one process per GPU"
        )
    if info.device.type != "cuda":
        raise ConfigError(
            "train.parallel=dp splits each batch over CUDA GPUs, and none is visible here: use "
            "train.parallel=ddp (which also runs on the CPU)"
        )
    first = info.device.index or 0
    return [first, *(i for i in range(torch.cuda.device_count()) if i != first)]


class AutocastForward(nn.Module):
    """`module`, its forward under autocast at `dtype`. DataParallel runs each GPU's copy in a
    thread of its own and carries only whether autocast is on into it, not the dtype, which is
    per thread: the trainer's bf16 would run as fp16 there (the fix the AMP notes give: autocast
    inside the forward). Never saved: checkpoints hold the inner module's weights."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, device_type: str = "cuda") -> None:
        super().__init__()
        self.module, self.dtype, self.device_type = module, dtype, device_type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


def one_process_data_parallel(model: nn.Module, info: DistInfo, train: TrainConfig) -> nn.Module:
    """train.parallel=dp: DataParallel over `dp_device_ids` (outputs gathered on the first). The
    optimizer, the checkpoints and the export keep using `model` itself, so no key ever gains
    DataParallel's `module.` prefix."""
    devices = dp_device_ids(info)
    dtype = AUTOCAST_DTYPES.get(train.precision)
    inner = AutocastForward(model, dtype) if dtype is not None and devices else model
    if not devices:  # no GPU (a test's stand-in): DataParallel then only calls the module
        return nn.DataParallel(inner, device_ids=[])
    return nn.DataParallel(inner, device_ids=devices, output_device=devices[0])


def dp_batch_mean(per_gpu: torch.Tensor, rows: int, gpus: int) -> torch.Tensor:
    """The batch's mean loss from DataParallel's per-GPU means, each weighted by its GPU's share of
    the `rows` examples. DataParallel splits a batch as torch.chunk does, 8 over 3 GPUs as 3, 3, 2:
    a plain mean of the three weighted two examples 1/6 each and six 1/9, exit 0. `gpus` 0 (no
    GPU chosen, as in the CPU tests) takes one chunk per value."""
    sizes = [len(part) for part in torch.arange(rows).chunk(gpus or max(per_gpu.numel(), 1))]
    if len(sizes) != per_gpu.numel():
        raise DistqaError(
            f"the task's loss under train.parallel=dp returned {per_gpu.numel()} values for a batch of {rows} "
            f"that DataParallel splits into {len(sizes)} parts: return one mean per GPU, or the batch's mean"
        )
    weights = torch.tensor(sizes, dtype=per_gpu.dtype, device=per_gpu.device) / rows
    return (per_gpu * weights).sum()


def placement(model: nn.Module) -> str:
    """What the start line says of how the model is spread beyond its process: DataParallel's GPUs."""
    if isinstance(model, nn.DataParallel) and model.device_ids:
        count = len(model.device_ids)
        return f" (DataParallel over {count} GPU{'s' if count > 1 else ''})"
    return ""


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model: the members of its outermost `nn.ModuleList`s that hold
    parameters (BERT's `encoder.layer`, any Hugging Face encoder's layers, a fork's own stack). A
    model without one has no blocks: FSDP then shards it as one unit."""
    blocks: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList):
            continue
        if any(name == outer or name.startswith(f"{outer}.") for outer, _ in blocks):
            continue  # a list inside a block (its sub-layers) is part of that block
        for index, child in enumerate(module):
            if any(True for _ in child.parameters()):
                blocks.append((f"{name}.{index}" if name else str(index), child))
    return [block for _, block in blocks]


def ensure_process_group(info: DistInfo) -> None:
    """FSDP needs a process group even for one process (a resumed run on fewer processes may be
    down to one): create a world of one, in memory, when the launcher made none."""
    if dist.is_initialized():
        return
    kwargs: dict[str, Any] = {"device_id": info.device} if info.device.type == "cuda" else {}
    backend = "nccl" if info.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


def shard(model: nn.Module, info: DistInfo, train: TrainConfig) -> nn.Module:
    """Apply activation checkpointing (when asked) and FSDP2, in place: blocks first, then the root.

    Mixed precision is FSDP's own: parameters stay fp32 and sharded (the optimizer updates the
    fp32 shards); each block's all-gathered copy is cast to bf16/fp16 for its compute, and
    gradients are reduced in fp32 (or train.ddp_comm_hook's fp16/bf16). Autocast over sharded
    parameters would cast every weight again at every use; the trainer turns it off in this mode.
    """
    ensure_process_group(info)
    blocks = transformer_blocks(model)
    if train.activation_checkpointing:
        checkpoint_blocks(model, blocks)
        blocks = transformer_blocks(model)  # the wrappers, which FSDP must shard around
    dtype = AUTOCAST_DTYPES.get(train.precision)
    # train.ddp_comm_hook=fp16|bf16: gradients reduce-scattered in 16 bits (half the bytes).
    reduce = comm_hooks.reduce_dtype(train, dtype)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce)
    # A model on the CPU goes to the device unit by unit as it is sharded: no rank ever holds the
    # whole model on its GPU.
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    # The model's outputs (logits) back in fp32: the task's loss then runs in full precision.
    root = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce, output_dtype=torch.float32)
    fully_shard(model, mp_policy=root if dtype else policy)
    return model


def checkpoint_blocks(model: nn.Module, blocks: list[nn.Module] | None = None) -> None:
    """Recompute each block's activations in the backward pass instead of keeping them.

    Non-reentrant checkpointing restores the RNG state for the recomputation, so dropout draws the
    same masks and the weights equal a run without it. The wrapper hides itself from state dicts:
    checkpoints and exports keep the model's own key names.
    """
    chosen = {id(block) for block in (transformer_blocks(model) if blocks is None else blocks)}
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda module: id(module) in chosen
    )


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, ddp: Any, enabled: bool) -> Iterator[None]:
    """Communicate gradients in this backward pass only when `enabled` (the step's last micro-batch).

    DDP: `no_sync` keeps the gradients local. FSDP: the blocks skip their reduce-scatter and keep
    the unsharded gradients until the last micro-batch, which reduces their sum: the same
    communication as one micro-batch, for one full gradient's memory while accumulating.
    """
    if is_sharded(model):
        model.set_requires_gradient_sync(enabled)  # type: ignore[operator]
        yield
    elif ddp is not None and not enabled:
        with ddp.no_sync():
            yield
    else:
        yield


def clip_gradients(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip to a global norm of `max_norm`, also over sharded (DTensor) gradients.

    A rank holding a shard sees only part of each gradient: the norm of the local shards is
    reduced over the ranks (`full_tensor`) before the common scale is applied, so every rank
    scales by the same factor that one process holding everything would use.
    """
    params = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def grad_scaler(train: TrainConfig, device: torch.device) -> torch.amp.GradScaler:
    """fp16's loss scaler, the same in both modes. Sharded, a rank sees an overflow only in its own
    shards; the scaler's check runs on DTensor gradients, whose dispatch reduces the finding over
    the ranks, so every rank skips the same steps (test_fsdp.py overflows one rank's rows only).
    (FSDP1's ShardedGradScaler would do the same, but its 1-element finding breaks fused AdamW's
    0-dimensional step counters on CUDA: pytorch/pytorch#140514.)"""
    return torch.amp.GradScaler(device.type, enabled=train.precision == "fp16")


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded weights on rank 0's CPU (an empty dict on the other ranks), with the
    model's own key names. Every rank must call it: a sharded model all-gathers block by block."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def whole_model(model: nn.Module, weights: dict[str, torch.Tensor] | None, build: Callable[[], nn.Module]) -> nn.Module:
    """The model to export, on rank 0: itself, or (sharded) a fresh one from `build` (the task's
    build_model) holding `weights`, gathered by every rank with `full_weights` beforehand."""
    if weights is None:
        return model
    whole = build()
    whole.load_state_dict(weights)  # copied into its tensors, so weights the model ties stay tied
    return whole


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


_NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether this rank's tensors (its local shards, under FSDP) hold only finite values.

    One fused max-abs over all of them: NaN propagates through a max, and a max cannot overflow
    (a sum or a 2-norm of large but finite weights would read as inf). One host sync."""
    local = []
    for tensor in map(_local, tensors):
        if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
            continue  # an FSDP rank's empty shard; integers are always finite
        tensor = torch.view_as_real(tensor) if tensor.is_complex() else tensor.detach()
        # float8 and other rare types have no norm kernels: read them as float32.
        local.append(tensor if tensor.dtype in _NORM_DTYPES else tensor.float())
    if not local:
        return True
    return bool(torch.isfinite(torch.nn.utils.get_total_norm(local, norm_type=float("inf"))))


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in map(_local, tensors))


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What one rank holds between steps, from its local shards: parameters, one gradient per
    trainable parameter (the shard's size: DDP keeps whole gradients in its buckets, FSDP the
    reduced shard) and the optimizer state (AdamW: two moments per parameter)."""
    params = list(model.parameters())
    optimizer_tensors = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return {
        "parameters": _bytes(params),
        "gradients": _bytes(p for p in params if p.requires_grad),
        "optimizer": _bytes(optimizer_tensors),
    }
