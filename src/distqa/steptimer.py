"""Where a training step's time goes: data, forward+backward, all-reduce wait, optimizer, other.

The trainer calls `mark(phase)` where each phase begins; the time until the next mark belongs to
that phase. On CUDA a mark is an event recorded on the current stream, read once at the end, so
timing adds no host-device synchronisation to the steps it measures, and a phase's time is what
the GPU saw: waiting for data counts only when the GPU ran dry while the host waited for it. On
the CPU a mark is a `perf_counter` reading.

The all-reduce wait is found with a DDP communication hook that wraps the run's own
(`distqa.comm_hooks`): DDP launches a bucket's all-reduce as soon as its gradients are ready, and
it launches the last bucket once the backward computation is done; what is left between that
moment and the end of `backward()` is communication that computation did not hide.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

PHASES = ("data", "forward_backward", "allreduce_wait", "optimizer", "other")
# scripts/bench_network.sh: a byte counter (a sysfs file such as /sys/class/net/VETH/statistics/tx_bytes,
# read in this process's network namespace) over the measured steps, written as JSON to COUNTER_OUT.
COUNTER, COUNTER_OUT = "DISTQA_BENCH_COUNTER", "DISTQA_BENCH_COUNTER_OUT"


def _read_counter() -> int | None:
    path = os.environ.get(COUNTER)
    return int(Path(path).read_text()) if path else None


class StepTimer:
    """Records the phases of steps `warmup + 1 ..`; earlier steps (compilation, cache warm-up,
    DDP's bucket rebuild) are not recorded."""

    def __init__(self, device: torch.device, warmup: int) -> None:
        self.device = device
        self.warmup = warmup
        self.steps_begun = 0
        self._marks: list[tuple[str, Any]] = []
        self.samples = 0
        self.tokens = 0
        self._t0: float | None = None
        self._t1: float | None = None
        self._count0: int | None = None

    @classmethod
    def off(cls, device: torch.device) -> StepTimer:
        """A timer that never records: the trainer's default, so its loop has one code path."""
        return cls(device, warmup=-1)

    @property
    def enabled(self) -> bool:
        return self.warmup >= 0

    @property
    def recording(self) -> bool:
        return self.enabled and self.steps_begun > self.warmup

    def _now(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step_begin(self) -> None:
        if not self.enabled:
            return
        self.steps_begun += 1
        if self.steps_begun == self.warmup + 1:
            # The one synchronisation of the measured window: its wall clock starts here, with
            # every warm-up kernel finished.
            self._sync()
            self._t0 = time.perf_counter()
            self._count0 = _read_counter()
        self.mark("data")

    def mark(self, phase: str) -> None:
        if self.recording:
            self._marks.append((phase, self._now()))

    def count(self, samples: int, tokens: int) -> None:
        if self.recording:
            self.samples += samples
            self.tokens += tokens

    def finish(self) -> None:
        """Close the last recorded step; call once, after the loop."""
        if self.recording:
            self._marks.append(("end", self._now()))
            self._sync()
            self._t1 = time.perf_counter()
            count = _read_counter()
            if count is not None and self._count0 is not None:
                measured = self.steps_begun - self.warmup
                Path(os.environ[COUNTER_OUT]).write_text(json.dumps({"bytes": count - self._count0, "steps": measured}))

    def wrap(self, hook):  # noqa: ANN001, ANN201
        """`hook` (the run's communication hook: DDP registers only one), with a mark when the
        last bucket's gradients are ready. (No annotations: DDP checks them against its own
        classes, and under `from __future__ import annotations` they would be strings.)"""

        def timed(state, bucket):  # noqa: ANN001, ANN202
            if bucket.is_last():
                self.mark("allreduce_wait")
            return hook(state, bucket)

        return timed

    def summary(self) -> dict[str, Any]:
        """Recorded steps, their wall time, samples and tokens, and mean milliseconds per phase."""
        measured = max(self.steps_begun - self.warmup, 0)
        if self._t0 is None or self._t1 is None or measured == 0:
            raise RuntimeError(f"no step was recorded: ran {self.steps_begun} step(s) with {self.warmup} warm-up")
        totals = dict.fromkeys(PHASES, 0.0)
        for (phase, start), (_, end) in zip(self._marks, self._marks[1:]):
            if self.device.type == "cuda":
                seconds = start.elapsed_time(end) / 1000.0
            else:
                seconds = end - start
            totals[phase] += seconds
        return {
            "steps": measured,
            "seconds": self._t1 - self._t0,
            "samples": self.samples,
            "tokens": self.tokens,
            "phase_ms": {k: 1000.0 * v / measured for k, v in totals.items()},
        }
