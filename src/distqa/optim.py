"""Optimizer with BERT's weight-decay grouping, and the warm-up + decay learning-rate schedule."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from transformers import get_scheduler

if TYPE_CHECKING:  # for hints only
    from distqa.config import TrainConfig

# transformers' names for our three schedules; all three warm up linearly from 0 first.
_SCHEDULES = {"linear": "linear", "constant": "constant_with_warmup", "cosine": "cosine"}

_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)


def _is_norm(module: nn.Module) -> bool:
    # Many encoders bring their own norm classes (T5LayerNorm, LlamaRMSNorm, ...): match by name too.
    return isinstance(module, _NORM_TYPES) or "norm" in type(module).__name__.lower()


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into decayed and not decayed.

    Decay on biases and normalisation weights only pulls them towards 0, which for a LayerNorm
    gain means towards switching the layer off; BERT and every recipe since exempt them.
    """
    decay, no_decay = [], []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            (no_decay if name == "bias" or _is_norm(module) else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    groups = parameter_groups(model, cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    # The fused kernel updates every parameter in one launch on CUDA; it does not exist on CPU.
    return torch.optim.AdamW(groups, lr=cfg.lr, fused=device.type == "cuda")


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> LambdaLR:
    warmup_steps = math.ceil(cfg.warmup_ratio * total_steps)
    return get_scheduler(
        _SCHEDULES[cfg.lr_schedule],
        optimizer,
        num_warmup_steps=warmup_steps,
        num_training_steps=total_steps,
    )


def apply_settings(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, cfg: TrainConfig) -> None:
    """After restoring optimizer and scheduler state, make the configured rate, weight decay and
    momentum win over the restored ones, so that changing them on resume does what it says.

    For unchanged settings this writes the values the state already held (the rate is computed by
    the same expression LambdaLR uses), so an exact resume stays exact.
    """
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    for group, lr_lambda in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = cfg.lr
        group["lr"] = cfg.lr * lr_lambda(scheduler.last_epoch)
    optimizer.param_groups[0]["weight_decay"] = cfg.weight_decay  # group 0 decays (parameter_groups)
    if cfg.optimizer == "sgd":
        for group in optimizer.param_groups:
            group["momentum"] = cfg.momentum
