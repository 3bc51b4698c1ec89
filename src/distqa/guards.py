"""Guards the trainer runs every step: a collective answer to "may this step's results be
written, and were we told to stop?" and an optional check that data-parallel replicas still hold
the same weights.

Preemption: a platform stops a job with SIGTERM, to torchrun and through it to every worker,
rarely at the same instant. The handler only records the signal; at the end of each step all
ranks agree (one all-reduce of one number) whether any rank has seen it, so they all stop after the
same step, write one checkpoint together, and exit as "preempted".

The same all-reduce carries the two findings that must stop a run before it writes anything of the
step: rank 0 no longer holds output_dir (another run took it over), and non-finite weights (a
diverged run must never be checkpointed, exported, or picked for a resume).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
from torch import nn

from distqa.dist import DistInfo
from distqa.errors import DistqaError, Preempted
from distqa.parallel import all_finite
from distqa.runlock import RunLock


def loader_worker_init(worker_id: int) -> None:
    """`worker_init_fn` of every training DataLoader: its worker processes leave the training
    process's process group.

    torchrun stops a worker by sending SIGTERM to the worker's whole process group, and the
    DataLoader's worker processes are in it. They would die at once, and the training process would
    fail on its next batch ("DataLoader worker ... is killed by signal") instead of finishing its
    step and checkpointing. The signal is meant for the training process. In a group of their own
    they do not get it, yet keep PyTorch's own handling: the loader ends them when it shuts down
    (with SIGTERM as a last resort, which they must not ignore, or the training process waits for
    them forever at exit), and they exit when their parent is gone.

    A SIGTERM can reach the group while a worker is starting, before it has left: the training
    process starts its workers with SIGTERM held (`sigterm_held`), so such a signal waits in the
    worker, which drops it here once out of the group and only then takes signals again.
    """
    os.setpgid(0, 0)
    if signal.SIGTERM in signal.sigpending():
        signal.sigwait({signal.SIGTERM})  # sent to the training process's group: not ours
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


@contextlib.contextmanager
def sigterm_held() -> Iterator[None]:
    """Hold SIGTERM while DataLoader workers are started (`iter(loader)`): they inherit the held
    signal and release it in `loader_worker_init`. A SIGTERM for this process meanwhile is
    delivered when the block ends, so the stop it asks for is only delayed, never lost."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def watch_parent(grace_s: float = 10.0) -> None:
    """End this process soon after the torchrun agent that started it is gone.

    torchrun starts each worker in a session of its own, so when the agent itself is killed
    (SIGKILL, the OOM killer) nothing stops its workers: they would go on writing into output_dir,
    or hang for many minutes in the rendezvous, or join the next launch on the same port. A thread
    polls the parent pid; once the worker has been re-parented it sends itself SIGTERM (the usual
    "checkpoint, then exit", which also ends a worker still blocked in the rendezvous at once) and,
    should that not end it within `grace_s` (a peer is gone and a collective waits for it), exits
    hard. Only under torchrun: a plain `python -m distqa train` outliving its shell (nohup) is fine.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        rank = os.environ.get("RANK", "?")
        print(
            f"distqa [rank {rank}]: torchrun (pid {parent}) is gone: stopping this worker", file=sys.stderr, flush=True
        )
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        print(
            f"distqa [rank {rank}]: still running {grace_s:g} s after torchrun was gone: exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    threading.Thread(target=poll, name="distqa-parent-watch", daemon=True).start()


class StopSignal:
    """Records SIGTERM; `should_stop()` is the all-ranks verdict after a step. Every rank must
    create and poll it, at the same points."""

    def __init__(self, info: DistInfo, lock: RunLock | None = None) -> None:
        self.info = info
        self.lock = lock
        self.received_at: float | None = None
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        # With NCCL, an all-reduce of a CPU flag needs a CPU-capable group, and this keeps the poll
        # off the GPU stream (no device sync per step). Created collectively, here, on all ranks.
        self._group = None
        if info.is_distributed and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()

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

    def preempted(self, step: int, total_steps: int, checkpoint: Path, grace_s: float) -> Preempted:
        """The "checkpointed, now exit" outcome, raised once the checkpoint is written."""
        waited = self.seconds_since()
        late = f" (later than train.term_grace_s={grace_s:g} s: raise it)" if waited > grace_s else ""
        return Preempted(
            f"stopped by SIGTERM at step {step} of {total_steps}; checkpoint {checkpoint} written "
            f"{waited:.1f} s after the signal{late}; run the same command again to resume"
        )

    def seconds_since(self) -> float:
        return 0.0 if self.received_at is None else time.monotonic() - self.received_at

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def _diverged(step: int, hint: str) -> DistqaError:
    return DistqaError(
        f"the weights (or the optimizer's state) hold NaN or inf after step {step}: nothing of that step is "
        f"saved; {hint}"
    )


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    """An exact checksum of a tensor's bytes: their words summed as integers. A float sum would
    depend on the order of the additions, i.e. on the thread count, which nodes may not share."""
    flat = tensor.detach().contiguous().view(-1)
    words = {4: torch.int32, 2: torch.int16, 8: torch.int64}.get(flat.element_size(), torch.uint8)
    return flat.view(words).sum(dtype=torch.int64)


@torch.no_grad()
def check_replicas(model: nn.Module, info: DistInfo, step: int) -> None:
    """Raise if any rank's parameters differ from the others' (DDP should make that impossible;
    this catches a missed all-reduce, a rank-dependent branch or a corrupted update)."""
    if not info.is_distributed:
        return
    sums = torch.stack([_checksum(p) for p in model.parameters()])
    high, low = sums.clone(), sums.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    if not torch.equal(high, low):
        names = [n for n, _ in model.named_parameters()]
        first = int((high != low).nonzero()[0])
        raise DistqaError(
            f"parameters differ across ranks after step {step} (first: {names[first]}, "
            f"{int((high != low).sum())} of {len(names)} tensors): a rank-dependent code path or a lost all-reduce"
        )
