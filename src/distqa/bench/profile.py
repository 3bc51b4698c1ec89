"""`distqa bench --profile`: where the time of a step goes, operator by operator.

A launch of its own after the timed rounds (the profiler's overhead must not reach the figures):
the trainer runs its warm-up steps, then `PROFILED_STEPS` steps under `torch.profiler`, and each
rank writes a Chrome trace (chrome://tracing, https://ui.perfetto.dev) beside rank 0's table of
the operators by their own time on the device (on the CPU: by CPU time). On a GPU the trace shows
what the table cannot: whether the device waits for the host between kernels (a step bound by
the Python that launches them) or the host for the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from distqa.steptimer import StepTimer

PROFILED_STEPS = 3
TABLE_ROWS = 30


class ProfilingTimer(StepTimer):
    """A StepTimer whose step boundaries also drive a profiler (`profiling` opens it): the warm-up
    steps but the last pass untraced, that one warms the tracer up, the next PROFILED_STEPS are
    recorded and written to `folder` once the last of them ends."""

    def __init__(self, device: torch.device, warmup: int, folder: Path, rank: int) -> None:
        super().__init__(device, warmup=warmup)
        self.folder, self.rank = folder, rank
        self._profiler: profile | None = None

    @contextlib.contextmanager
    def profiling(self) -> Iterator[None]:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        plan = schedule(wait=max(self.warmup - 1, 0), warmup=1, active=PROFILED_STEPS, repeat=1)
        with profile(activities=activities, schedule=plan, on_trace_ready=self._write) as self._profiler:
            yield
        self._profiler = None

    def step_begin(self) -> None:
        if self._profiler is not None and self.steps_begun > 0:
            self._profiler.step()  # the end of the step before
        super().step_begin()

    def _write(self, finished: profile) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"trace-rank{self.rank}.json"
        finished.export_chrome_trace(str(trace))
        if self.rank != 0:
            return
        key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self.folder / "operators.txt"
        table.write_text(
            f"{PROFILED_STEPS} steps after {self.warmup} warm-up steps, rank 0, sorted by {key}\n"
            + finished.key_averages().table(sort_by=key, row_limit=TABLE_ROWS)
            + "\n"
        )
