"""The throughput meter: loss, examples, tokens and gradient norms summed on the device between
two log points, all-reduced at log time (`distqa.metrics` writes what it returns)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from distqa.dist import all_reduce_sum


class ThroughputMeter:
    """Sums loss, examples and tokens between two log points without a host sync per step.

    The running sums stay on the device (`.item()` every step would stall a GPU pipeline); the
    all-reduce at log time is the only synchronisation.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, micro-steps, samples, tokens
        # Gradient norm before clipping: sum over the window's optimizer steps that had a finite
        # norm, and their count (an fp16 step whose gradients overflowed is skipped, not averaged).
        self._norms = torch.zeros(2, dtype=torch.float64, device=device)
        self._start = time.perf_counter()

    def add(self, loss: torch.Tensor, samples: int, tokens: int) -> None:
        self._sums[0] += loss.detach().to(torch.float64)
        self._sums[1] += 1
        self._sums[2] += samples
        self._sums[3] += tokens

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        """One optimizer step's total gradient norm (the same on every rank: gradients are reduced)."""
        finite = torch.isfinite(norm)
        self._norms[0] += torch.where(finite, norm.detach().to(torch.float64), 0.0)
        self._norms[1] += finite.to(torch.float64)

    def local_counts(self) -> tuple[float, float]:
        """(examples, tokens) this rank counted since the last log (one host sync: for rare use)."""
        samples, tokens = self._sums[2:4].tolist()
        return samples, tokens

    def restart_clock(self) -> None:
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The block's time is not training time (a checkpoint's save, which may fall anywhere in a
        log window): the window's clock skips it. On a GPU the queued steps finish first, so that
        their time is counted and only the block's own is left out."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        began = time.perf_counter()
        try:
            yield
        finally:
            self._start += time.perf_counter() - began

    def window(self) -> list[float]:
        """[loss sum, micro-batches] of the open log window over every rank, for a checkpoint.
        Every rank must call it (it all-reduces). Examples and tokens are not kept: a rate needs
        the time they took, which a resumed process does not know."""
        return all_reduce_sum(self._sums[:2].clone()).tolist()

    def resume_window(self, window: list[float] | None, *, is_main: bool, scale: float = 1.0) -> None:
        """Go on with a checkpoint's open window: rank 0 holds its sums (the all-reduce at log time
        then adds them once), the other ranks start from zero. `scale`: this run's micro-batches per
        step over the checkpoint's (processes x train.grad_accum), so that a step before the resume
        weighs as much in the mean as one after it, as in an uninterrupted run."""
        if window and is_main:
            self._sums[0], self._sums[1] = float(window[0]) * scale, float(window[1]) * scale

    def norm_window(self) -> list[float]:
        """[grad-norm sum, steps] of the open log window over every rank (all-reduces), for a checkpoint."""
        return all_reduce_sum(self._norms.clone()).tolist()

    def resume_norm_window(self, window: list[float] | None, *, is_main: bool, scale: float = 1.0) -> None:
        """As `resume_window`, for the gradient norms (`scale`: this run's processes over the
        checkpoint's; every rank adds each step's norm once)."""
        if window and is_main:
            self._norms[0], self._norms[1] = float(window[0]) * scale, float(window[1]) * scale

    def reduce_and_reset(self) -> dict[str, float]:
        """Global figures since the last call; `grad_norm`: the mean over the window's optimizer
        steps (absent when none was recorded). Every rank must call it (it all-reduces)."""
        sums = all_reduce_sum(torch.cat([self._sums, self._norms])).tolist()
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._sums.zero_()
        self._norms.zero_()
        self._start = time.perf_counter()
        loss_sum, micro_steps, samples, tokens, norm_sum, norm_steps = sums
        figures = {
            "loss": loss_sum / max(micro_steps, 1.0),
            "samples_per_s": samples / elapsed,
            "tokens_per_s": tokens / elapsed,
        }
        if norm_steps:  # every rank added the same norm: the mean over ranks and steps is the step mean
            figures["grad_norm"] = norm_sum / norm_steps
        return figures
