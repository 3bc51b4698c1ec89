"""DataLoader worker processes and torchrun's SIGTERM.

torchrun stops a worker by sending SIGTERM to the worker's whole process group. DataLoader worker
processes in it would die at once, and the training process would fail on its next batch instead
of finishing its step and checkpointing. The training DataLoader's workers start from a fork
server that has left the group (`distqa.loader_server`), and each also leaves the group it was
born in (`loader_worker_init`, which covers a loader started otherwise). The training process
holds SIGTERM while they start (`sigterm_held`): its own stop request is delayed, never lost.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

from distqa.console import outlive_closed_output
from distqa.worker_exit import end_with_training_process


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

    A worker forked straight from the training process (a loader without `loader_server`'s
    context) inherits its held SIGTERM (`sigterm_held`): a signal sent to the group while it
    starts waits in the worker, which drops it here once out of the group and only then takes
    signals again.
    """
    os.setpgid(0, 0)
    # A fork server's worker is a fresh interpreter's child: without this, a print of the task's in a
    # worker to a pipe nobody reads stopped the run (BrokenPipeError), blamed on the data (a review).
    outlive_closed_output()
    end_with_training_process()  # PyTorch's watchdog misses a worker stuck in an item, or the server's
    if signal.SIGTERM in signal.sigpending():
        signal.sigwait({signal.SIGTERM})  # sent to the training process's group: not ours
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


@contextlib.contextmanager
def sigterm_held() -> Iterator[None]:
    """Hold SIGTERM while DataLoader workers are started (`iter(loader)`; forked workers inherit
    the held signal and release it in `loader_worker_init`). A SIGTERM for this process meanwhile
    is delivered when the block ends, so the stop it asks for is only delayed, never lost."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
