"""DataLoader worker processes and torchrun's SIGTERM.

torchrun stops a worker by sending SIGTERM to the worker's whole process group, and the
DataLoader's worker processes are in it: they would die at once, and the training process would
fail on its next batch instead of finishing its step and checkpointing. The training DataLoader's
workers therefore leave the group (`loader_worker_init`), and are started with SIGTERM held
(`sigterm_held`) so that a signal sent while one starts is not lost on the wrong process.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator


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
