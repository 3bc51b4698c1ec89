"""The verdict every rank reaches after each step: may this step's results be written, and were
we told to stop?

Preemption: a platform stops a job with SIGTERM, to torchrun and through it to every worker,
rarely at the same instant. The handler only records the signal; at the end of each step all
ranks agree (one all-reduce of one number) whether any rank has seen it, so they all stop after the
same step, write one checkpoint together, and exit as "preempted".

The same all-reduce carries the two findings that must stop a run before it writes anything of the
step: rank 0 no longer holds output_dir (another run took it over), and non-finite weights (a
diverged run must never be checkpointed, exported, or picked for a resume).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from distqa import outcome
from distqa.dist import DistInfo
from distqa.errors import DistqaError, Preempted
from distqa.parallel import all_finite
from distqa.runlock import RunLock


class StopSignal:
    """Records SIGTERM; `should_stop()` is the all-ranks verdict after a step. Every rank must
    create and poll it, at the same points."""

    def __init__(self, info: DistInfo, lock: RunLock | None = None) -> None:
        self.info = info
        self.lock = lock
        self.received_at: float | None = None
        self.signal_name = "SIGTERM"  # what asked for the stop (another rank's: said as SIGTERM)
        # SIGINT (Ctrl-C; torchrun passes it on to the workers) stops as SIGTERM does, with a
        # checkpoint; a second one interrupts at once, as Ctrl-C twice does anywhere. SIGHUP too:
        # a terminal that closes (an ssh session lost) sends it, and torchrun passes on the signal
        # it got; it killed every rank, the steps since the last checkpoint lost. Where SIGHUP or
        # SIGINT is ignored (`nohup`, a shell's background job), it stays ignored: a nohup run went on
        # after a logout, and must (a review saw it stop).
        stops = [signal.SIGTERM, *(s for s in (signal.SIGINT, signal.SIGHUP) if signal.getsignal(s) != signal.SIG_IGN)]
        self._previous = {sig: signal.signal(sig, self._handle) for sig in stops}
        outcome.training()  # a launcher's stop from here on finds a checkpoint, or says why not
        # With NCCL, an all-reduce of a CPU flag needs a CPU-capable group, and this keeps the poll
        # off the GPU stream (no device sync per step). Created collectively, here, on all ranks.
        self._group = None
        if info.is_distributed and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
            self.signal_name = signal.Signals(signum).name
        elif signum == signal.SIGINT and self.signal_name == "SIGINT":
            raise KeyboardInterrupt

    def should_stop(self, step: int, weights: Iterable[torch.Tensor] | None = None, hint: str = "") -> bool:
        """Called after each step, before anything of it is written. One all-reduce of three flags:
        - rank 0 lost output_dir: its lock is read now (`RunLock.verify`), not at the last heartbeat,
          so a holder that was paused across a takeover writes nothing once it runs again; raises;
        - `weights` (this rank's parameters and buffers, on the steps that write; with the optimizer's
          state on those that save) hold NaN or inf; raises,
          with `hint` saying which settings to lower;
        - some rank got SIGTERM: returns True (checkpoint, then exit)."""
        lost = self.lock.verify() if self.lock is not None else None
        bad = weights is not None and not all_finite(weights)
        took_over, diverged, stop = self._on_any_rank(lost is not None, bad, self.received_at is not None)
        if took_over:
            raise DistqaError(
                (lost or "rank 0 lost the hold of output_dir")
                + ": stopping so that two runs never write into one folder"
            )
        if diverged:
            raise _diverged(step, hint)
        if stop and self.received_at is None:
            self.received_at = time.monotonic()  # another rank got it: count the grace from now
        return stop

    def check_finite(self, step: int, weights: Iterable[torch.Tensor], hint: str) -> None:
        """The weights check alone (collective), for a save the verdict did not check for."""
        (diverged,) = self._on_any_rank(not all_finite(weights))
        if diverged:
            raise _diverged(step, hint)

    def _on_any_rank(self, *flags: bool) -> list[bool]:
        """Each flag, true when it is true on any rank: one all-reduce, on the CPU group."""
        found = torch.tensor(flags, dtype=torch.int32)
        if self.info.is_distributed:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self._group)
        return [bool(f) for f in found.tolist()]

    def preempted(
        self, step: int, total_steps: int, checkpoint: Path, grace_s: float, *, resume: str = "auto"
    ) -> Preempted:
        """The "checkpointed, now exit" outcome, raised once the checkpoint is written. `resume`:
        the run's train.resume, which says what the same command would do again."""
        waited = self.seconds_since()
        late = f" (later than train.term_grace_s={grace_s:g} s: raise it)" if waited > grace_s else ""
        if "TORCHELASTIC_RUN_ID" in os.environ:  # a process that ends after this (not a test's own)
            # It should be gone within seconds. Seen twice under load: one rank still running 30 s
            # after its checkpoint, until torchrun killed it, and nothing said where it waited.
            faulthandler.dump_traceback_later(20, exit=False)
        return Preempted(
            f"stopped by {self.signal_name} at step {step} of {total_steps}; checkpoint {checkpoint} written "
            f"{waited:.1f} s after the signal{late}; {how_to_resume(resume)}"
        )

    def seconds_since(self) -> float:
        return 0.0 if self.received_at is None else time.monotonic() - self.received_at

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def how_to_resume(resume: str) -> str:
    """The command that continues a stopped run. Its own train.resume=PATH (or never) would start
    over from PATH (or from step 0) and set the newer checkpoints aside (`distqa.resume`)."""
    if resume == "auto":
        return "run the same command again to resume"
    return f"to resume, run the same command with train.resume=auto in place of train.resume={resume}"


def _diverged(step: int, hint: str) -> DistqaError:
    return DistqaError(
        f"the weights (or the optimizer's state) hold NaN or inf after step {step}: nothing of that step is "
        f"saved; {hint}"
    )
