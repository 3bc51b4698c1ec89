"""Optimizer with BERT's weight-decay grouping, and the warm-up + decay learning-rate schedule."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from transformers import get_scheduler

from distqa.dist import print0

if TYPE_CHECKING:  # for hints only
    from distqa.config import TrainConfig

# transformers' names for our three schedules; all three warm up linearly from 0 first.
SCHEDULES = {"linear": "linear", "constant": "constant_with_warmup", "cosine": "cosine"}  # ours: transformers'

_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)


def _is_norm(module: nn.Module) -> bool:
    # Many encoders bring their own norm classes (T5LayerNorm, LlamaRMSNorm, ...): match by name too.
    return isinstance(module, _NORM_TYPES) or "norm" in type(module).__name__.lower()


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into decayed and not decayed.

    Decay on biases and normalisation weights only pulls them towards 0, which for a LayerNorm
    gain means towards switching the layer off; BERT and every recipe since exempt them.

    Each parameter is listed once: a tied one (BART's and T5's shared embedding is also their
    encoder's and decoder's `embed_tokens`) is held by several modules, and listed once per module
    AdamW stepped it that many times per step (its update, decay and step count tripled), exit 0.
    """
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            # Every parameter named a bias: attention's `in_proj_bias` (torch's TransformerEncoderLayer),
            # `bias_k` and XLNet's `r_w_bias` were decayed before. (Hugging Face's Trainer also exempts
            # T5's `relative_attention_bias.weight`, an embedding by its full name; it is decayed here.)
            (no_decay if "bias" in name or _is_norm(module) else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def fused_for(device: torch.device) -> bool:
    """Whether AdamW on `device` runs the fused kernel: on CUDA it updates every parameter in one
    launch. On the CPU the plain implementation is the one distqa has always run (and tested)."""
    return device.type == "cuda"


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    groups = parameter_groups(model, cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    return torch.optim.AdamW(groups, lr=cfg.lr, fused=fused_for(device))


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    return math.ceil(cfg.warmup_ratio * total_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> LambdaLR:
    if total_steps == 1 and warmup_steps(cfg, total_steps):  # warm-up starts at 0, Hugging Face's convention
        print0(
            f"warning: train.warmup_ratio={cfg.warmup_ratio} over a run of 1 step: its learning rate is 0, "
            "so it changes no weight (set train.warmup_ratio=0 to train it)"
        )
    return _schedule(optimizer, cfg, total_steps)


def _schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> LambdaLR:
    return get_scheduler(
        SCHEDULES[cfg.lr_schedule],
        optimizer,
        num_warmup_steps=warmup_steps(cfg, total_steps),
        num_training_steps=total_steps,
    )


def rate_after(cfg: TrainConfig, total_steps: int, step: int) -> float:
    """The learning rate of step `step + 1` in a run of `total_steps` steps: what the schedule
    gives once `step` steps are done (as LambdaLR computes it, on a stand-in parameter)."""
    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    return cfg.lr * _schedule(stand_in, cfg, total_steps).lr_lambdas[0](step)


def apply_settings(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, cfg: TrainConfig) -> None:
    """After restoring optimizer and scheduler state, make the configured rate, weight decay and
    momentum win over the restored ones, so that changing them on resume does what it says, and
    give AdamW the implementation of this device (`match_device`).

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
    match_device(optimizer)


def match_device(optimizer: torch.optim.Optimizer) -> None:
    """Give a restored AdamW the implementation a fresh one on its parameters' device uses.

    `load_state_dict` keeps the *saved* param groups, `fused` flag included: a checkpoint written on
    the CPU (fused False) resumed on CUDA would run the foreach path, one host sync per parameter
    per step to read its `step`, and under fp16 crash, because GradScaler hands the fused-only
    `found_inf` to an optimizer built fused. The reverse (GPU to CPU) would run fused on the CPU,
    which no fresh CPU run does. The implementation does not change the arithmetic's result beyond
    rounding, so the switch is safe at any step.
    """
    if not isinstance(optimizer, torch.optim.AdamW):
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params:
        return
    fused = fused_for(params[0].device)
    for group in optimizer.param_groups:
        group["fused"] = fused
        group["foreach"] = None  # as a fresh one: fused excludes foreach; unfused, torch picks per device
    # GradScaler asks this of the instance, not of the groups: fused steps take the scale themselves.
    optimizer._step_supports_amp_scaling = fused  # type: ignore[attr-defined]
    # Where a fresh AdamW keeps `step` (torch.optim.adam `_init_group`): a float32 tensor on the
    # parameter's device when fused or capturable, else a CPU scalar (no launch to add 1 to it).
    # load_state_dict left it where map_location put it, i.e. on this device.
    for group in optimizer.param_groups:
        on_device = group["fused"] or group.get("capturable", False)
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state or not torch.is_tensor(state.get("step")):
                continue
            step = state["step"]
            state["step"] = step.to(p.device, torch.float32) if on_device else step.cpu()
