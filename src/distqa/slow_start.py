"""The first step's report, and a warning where that step says the run will be slow.

A large model, or bf16/fp16 (emulated, slower than fp32 on most CPUs), trained on the CPU can take
minutes per step: BERT-base at 512 tokens in bf16 showed no progress line for 13 minutes. So on the
CPU, with a mixed precision or more than 100M parameters, a line says so before the first step, and
once it ends one line gives its FLOPs (`distqa.flops`), its measured time, the time to expect per
step and for the run, and what to change: a shorter `task.max_seq_len`, `model.name=tiny`, fp32.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from distqa.console import duration
from distqa.control import after_step
from distqa.dist import print0
from distqa.errors import DistqaError

if TYPE_CHECKING:
    from torch import nn

    from distqa.config import Config
    from distqa.console import TrainProgress
    from distqa.dist import DistInfo
    from distqa.meter import ThroughputMeter

BIG_MODEL = 100_000_000  # parameters: beyond this a CPU step of a few hundred tokens takes minutes
SHORT_SEQ = 128  # the sequence length suggested instead (the attention's cost grows with its square)


def slow_reasons(device_type: str, precision: str, n_params: int) -> list[str]:
    """Why a run on this device may take minutes per step (empty: no reason known)."""
    if device_type != "cpu":
        return []
    reasons = []
    if precision != "fp32":
        reasons.append(f"{precision} (emulated on most CPUs: slower than fp32)")
    if n_params > BIG_MODEL:
        reasons.append(f"{n_params / 1e6:.0f}M parameters")
    return reasons


def suggestions(cfg: Config, uses: Any = None) -> str:
    """What to try instead, from this run's settings (`uses`: the task's `core_settings`, if it says)."""
    tries = []
    seq_len = getattr(cfg.task, "max_seq_len", None)
    if isinstance(seq_len, int) and seq_len > SHORT_SEQ:
        tries.append(f"task.max_seq_len={SHORT_SEQ} (now {seq_len})")
    if cfg.model.name != "tiny" and (uses is None or "model.name" in uses):
        tries.append("model.name=tiny")
    if cfg.train.precision != "fp32":
        tries.append("train.precision=fp32")
    return ", ".join([*tries, "or a GPU"])


def step_flops(task: Any, model: nn.Module, samples: float, tokens: float) -> float | None:
    """The training FLOPs of one step of `samples` examples of `tokens` tokens in all, or None when
    the task cannot give its model's shape (a model without a Hugging Face config)."""
    if not samples or not tokens:
        return None
    try:
        shape = task.model_shape(model)
    except DistqaError:
        return None
    return float(shape.flops_per_token(round(tokens / samples)) * tokens)


def before_line(reasons: list[str], step: int = 1) -> str:
    """`step`: the step about to run, 1 unless the run resumed."""
    return (
        f"warning: training on the CPU with {', '.join(reasons)}: steps may take minutes; step {step} is "
        "running, and its time and the time to expect per step follow when it ends"
    )


def _amount(flops: float) -> str:
    return f"{flops / 1e12:.3g} TFLOP" if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP"


def estimate_line(
    reasons: list[str],
    seconds: float,
    flops: float | None,
    steps_left: int,
    cfg: Config,
    uses: Any = None,
    step: int = 1,
) -> str:
    """One line: the first step's FLOPs and time (`step`: its number, 1 unless the run resumed),
    what the rest will take, and what to try instead."""
    work = f"{_amount(flops)} in {seconds:.1f} s ({flops / seconds / 1e9:.3g} GFLOP/s)" if flops else ""
    first = f"step {step} took {seconds:.1f} s" if not work else f"step {step}: {work}"
    # The first step pays one-time costs too (allocations, the loader's start): an upper bound.
    return (
        f"warning: {first} on the CPU with {', '.join(reasons)}: expect up to {seconds:.3g} s per step, "
        f"{duration(seconds * steps_left)} for the {steps_left} steps left; to go faster try "
        f"{suggestions(cfg, uses)}"
    )


class FirstStep:
    """This process's first step: the slow set-up's line before it, and its report once it ends."""

    def __init__(
        self, cfg: Config, task: Any, model: nn.Module, info: DistInfo, total_steps: int, done: int = 0
    ) -> None:
        """`done`: the steps already trained (a resumed run's first step is done + 1)."""
        self.cfg, self.task, self.model, self.info, self.total_steps = cfg, task, model, info, total_steps
        self.began: float | None = time.perf_counter()  # what the user waits for: the loader's start too
        n_params = sum(p.numel() for p in model.parameters())
        self.reasons = slow_reasons(info.device.type, cfg.train.precision, n_params)
        if self.reasons:
            print0(before_line(self.reasons, done + 1))

    def after(self, step: int, progress: TrainProgress, meter: ThroughputMeter) -> None:
        """After every step, before anything else of it is done; reports the first one only."""
        if self.began is None:
            return
        if self.info.device.type == "cuda":
            torch.cuda.synchronize(self.info.device)  # the step's kernels, not only their launches
        seconds, self.began = time.perf_counter() - self.began, None
        if not after_step(step, self.total_steps, self.cfg.train).log:  # else its record line follows at once
            progress.first_step(seconds)
        if self.reasons and self.info.is_main:
            samples, tokens = meter.local_counts()
            ranks = self.info.world_size  # every rank's share of the batch is alike
            flops = step_flops(self.task, self.model, samples * ranks, tokens * ranks)
            uses = getattr(self.task, "core_settings", None)
            print0(estimate_line(self.reasons, seconds, flops, self.total_steps - step, self.cfg, uses, step))
