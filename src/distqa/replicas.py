"""That data-parallel replicas still hold the same weights: after each step that logs or saves, and
every step with `train.check_replicas=true` (`control.AfterStep.compares_replicas`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from distqa.dist import DistInfo
from distqa.errors import DistqaError


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    """An exact checksum of a tensor's bytes: their words summed as integers. A float sum would
    depend on the order of the additions, i.e. on the thread count, which nodes may not share."""
    flat = tensor.detach().contiguous().view(-1)
    words = {4: torch.int32, 2: torch.int16, 8: torch.int64}.get(flat.element_size(), torch.uint8)
    return flat.view(words).sum(dtype=torch.int64)


@torch.no_grad()
def checksums(model: nn.Module) -> torch.Tensor:
    """One exact checksum per parameter of `model`, in its order (what the ranks compare)."""
    return torch.stack([_checksum(p) for p in model.parameters()])


@torch.no_grad()
def check_replicas(model: nn.Module, info: DistInfo, step: int) -> None:
    """Raise if any rank's parameters differ from the others' (DDP should make that impossible;
    this catches a missed all-reduce, a rank-dependent branch or a corrupted update)."""
    if not info.is_distributed:
        return
    sums = checksums(model)
    high, low = sums.clone(), sums.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    if not torch.equal(high, low):
        names = [n for n, _ in model.named_parameters()]
        first = int((high != low).nonzero()[0])
        raise DistqaError(
            f"parameters differ across ranks after step {step} (first: {names[first]}, "
            f"{int((high != low).sum())} of {len(names)} tensors), nothing of it saved: the task's loss must call the "
            "model it is given (calling model.module, or a model kept from build_model, skips DDP's gradient "
            "all-reduce), and no code path may depend on the rank"
        )
