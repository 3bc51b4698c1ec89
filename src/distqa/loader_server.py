"""In a distributed run, the training DataLoader's workers start from a fork server, never forked
from the training process.

A training process has threads: gloo's, distqa's watches, TensorBoard's writer. Python up to 3.11
can deadlock a child forked while another thread holds the interpreter's thread-state lock
(CPython gh-112275: the child waits in `PyOS_AfterFork_Child` forever), and gloo's threads take
that lock whenever they call into Python, e.g. to free a tensor a collective held. distqa's
loaders forked fresh workers at every epoch, and now and then one hung before its first batch:
the rank waited for data, the others in their next collective (seen at an epoch boundary of a
two-node run, and twice in about 350 epoch starts of a two-process run). A fork server is a
single-threaded process, started once per training process (about 2 s, on another core), and
forking from it is safe; Python 3.14 makes it the default on Linux for the same reason. A run of
one process without a process group keeps plain fork: none of its threads calls into Python
without holding the GIL.

The server also leaves the training process's process group as it starts, the first module it
imports being this one, so the workers it forks are never in that group: torchrun stops a worker
with SIGTERM to the group, which is meant for the training process alone (see `worker_signals`).

What a worker needs (the dataset, the task's `collate_fn`, `worker_init_fn`) reaches it pickled.
A worker's parent is the server, so PyTorch's own check (the worker exits once its parent is gone)
would never fire when the training process is killed: `worker_exit` watches it.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from multiprocessing.context import BaseContext
from typing import Any

from distqa.errors import DistqaError
from distqa.worker_exit import PARENT_ENV, end_with_training_process, ended

# Imported first by the server (this module: it acts on import), then what every worker unpickles
# its task with, so that forking a worker does not import torch again, then "__main__", as in
# Python's own default. A worker runs a script's main module again (as `__mp_main__`, for a dataset
# defined there), so a script that trains must guard its top level with `if __name__ ==
# "__main__":`, as for any multiprocessing; `python -m distqa` is not run again.
PRELOAD = [__name__, "torch", "distqa.worker_signals", "__main__"]


def _leave_the_group_if_server() -> None:
    # PARENT_ENV is set only while `_start_server` starts the server: a process with it whose
    # parent is the process it names is that server (its workers inherit it, but import this
    # module from the server's memory, never again).
    if os.environ.get(PARENT_ENV) == str(os.getppid()):
        try:
            os.setpgid(0, 0)
        except OSError:
            pass  # (a session leader cannot; never fail an import for it)
        os.register_at_fork(after_in_child=end_with_training_process)  # each worker, from its first moment


_leave_the_group_if_server()


def loader_context(workers: int, uses: tuple[object, ...] = (), *, distributed: bool = True) -> BaseContext | None:
    """The multiprocessing context of a training DataLoader with `workers` workers: in a
    `distributed` run, the fork server, running and out of the training process's group; in one
    process, plain fork (its threads are distqa's own Python threads, which touch the lock only
    while they hold the GIL, as the forking thread does: forking is safe, and costs no server
    start); None without workers or off Linux (the platform's default, spawn). The server imports
    the modules of `uses` (the dataset, the collate) as it starts, so that a worker does not at
    every epoch. Call it with SIGTERM held (`sigterm_held`)."""
    if not workers or not sys.platform.startswith("linux"):
        return None
    if not distributed:
        return multiprocessing.get_context("fork")
    context = multiprocessing.get_context("forkserver")
    modules = [_module_of(thing) for thing in uses]
    context.set_forkserver_preload([*PRELOAD[:-1], *(m for m in modules if m), PRELOAD[-1]])
    os.environ[PARENT_ENV] = str(os.getpid())  # for the server alone: other children must not see it
    try:
        _start_server()
    finally:
        del os.environ[PARENT_ENV]
    return context


def _start_server(attempts: int = 3, wait_s: float = 30.0) -> None:
    """Start the server unless it runs, and wait until it has left this process's group. A SIGTERM
    to the group in the few milliseconds before that ends it: then it is started again (the signal
    itself is held for the training process, which acts on it after the loader has started)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    for _ in range(attempts):
        forkserver.ensure_running()
        pid = getattr(server, "_forkserver_pid", None)
        if pid is None:
            return  # (another Python's internals: the server starts as that Python starts it)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if ended(pid):
                break  # it died while starting: ensure_running reaps it and starts a new one
            if os.getpgid(pid) != os.getpgid(0):
                return
            time.sleep(0.005)
        else:
            return  # alive but still in the group after wait_s (a very slow start): the workers leave it themselves
    raise DistqaError(
        f"the DataLoader workers' fork server did not start ({attempts} tries): set data.num_workers=0 "
        "to load batches in the training process"
    )


def _module_of(thing: object) -> str | None:
    """The module a worker imports to unpickle `thing`: a function's or class's own, else its class's."""
    thing = getattr(thing, "func", thing)  # functools.partial: its function
    thing = getattr(thing, "__self__", thing)  # a bound method: its object
    if not (isinstance(thing, type) or inspect.isfunction(thing)):
        thing = type(thing)
    module = getattr(thing, "__module__", None)
    return module if module not in (None, "builtins", "__main__") else None


# torch's words when a DataLoader worker process is gone ("DataLoader worker (pid 123) is killed by
# signal: Killed.", "... exited unexpectedly"): the OOM killer's usual victim, the biggest process
# but one.
_WORKER_GONE = re.compile(
    r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (is killed by signal: [\w ]+|exited unexpectedly)"
)


# torch's own words when a DataLoader's timeout ends, and nothing else: a worker's error that
# quotes them (its whole traceback comes back as the text of a RuntimeError) is not a timeout.
_TIMED_OUT = re.compile(r"DataLoader timed out after (\d+(?:\.\d+)?) seconds")

# How often a rank waiting for a batch looks whether its workers still live. torch looks when the
# DataLoader's timeout ends (every 5 s without one), and a fork server's worker is not this
# process's child: its death raises no SIGCHLD here. With the timeout at data.timeout_s, a worker
# the OOM killer took was seen only after 600 s, its rank's peers waiting in a collective meanwhile.
LIVENESS_S = 1.0


def loader_timeout(workers: int, timeout_s: float) -> float:
    """The DataLoader's own `timeout`: a slice of data.timeout_s, which `Patient` waits out."""
    return min(LIVENESS_S, timeout_s or LIVENESS_S) if workers else 0


class Patient(Iterator[Any]):
    """A DataLoader's iterator (its timeout `loader_timeout`) that waits up to `timeout_s` seconds in
    all for a batch (0: for ever); at the end of every slice torch looks at its workers, and a dead
    one is an error at once. (torch's iterator is left as it was by its timeout, which it raises
    before it takes anything: asking again waits for the same batch.)"""

    def __init__(self, iterator: Iterator[Any], timeout_s: float) -> None:
        self.iterator, self.timeout_s = iterator, timeout_s

    def __iter__(self) -> Patient:
        return self

    def __next__(self) -> Any:
        start = time.monotonic()
        while True:
            try:
                return next(self.iterator)
            except RuntimeError as err:
                if type(err) is not RuntimeError or not _TIMED_OUT.fullmatch(str(err)):
                    raise
                self._pin_thread_alive()
                if self.timeout_s and time.monotonic() - start >= self.timeout_s:
                    raise RuntimeError(f"DataLoader timed out after {self.timeout_s:g} seconds") from None
            except (ConnectionError, EOFError) as err:
                # A worker killed while it handed over a batch's tensors (its socket): torch names
                # a dead worker only once the server has reported its end.
                self._no_dead_worker(err)
                raise

    def _pin_thread_alive(self) -> None:
        """torch looks at its pin-memory thread (CUDA) only without a timeout: it dies when it cannot
        take a batch's tensors (a worker killed while it handed them over)."""
        thread = getattr(self.iterator, "_pin_memory_thread", None)
        if thread is not None and not thread.is_alive():
            failed = RuntimeError("Pin memory thread exited unexpectedly")
            self._no_dead_worker(failed)
            raise failed

    def _no_dead_worker(self, err: BaseException) -> None:
        workers = getattr(self.iterator, "_workers", [])  # (torch's own list of its worker processes)
        deadline = time.monotonic() + 2 * LIVENESS_S
        while not (dead := [str(w.pid) for w in workers if not w.is_alive()]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if dead:
            raise RuntimeError(f"DataLoader worker (pid(s) {', '.join(dead)}) exited unexpectedly") from err


def _shm_full(path: str = "/dev/shm") -> str:
    """Where /dev/shm is half full or more: a batch that does not fit there fails in the worker's
    feeder thread, the worker lives on, and the batch never comes (docker's default is 64 MB; a
    review saw a run wait out data.timeout_s blamed on the data's storage)."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return ""
    if usage.total == 0 or usage.free * 2 > usage.total:
        return ""
    free, total = usage.free / 2**20, usage.total / 2**20
    return (
        f", or /dev/shm is full ({free:.1f} of {total:.1f} MiB free), where a batch that does not fit stops its worker "
        "for good: docker run --shm-size=2g (Kubernetes: a memory emptyDir at /dev/shm), or lower data.num_workers"
    )


def as_worker_loss(err: BaseException) -> DistqaError | None:
    """`err` said as one line when a DataLoader worker of this process died or stalled past
    data.timeout_s; None for anything else."""
    stalled = _TIMED_OUT.fullmatch(str(err))
    if stalled is not None:
        return DistqaError(
            f"waited {float(stalled.group(1)):g} s for a batch from the DataLoader workers (data.timeout_s): a worker "
            f"is stuck reading an item (a stale network mount, a lock held elsewhere){_shm_full()}; fix the data's "
            "storage and run the same command again to resume from the newest checkpoint, or raise data.timeout_s "
            "if a batch may take longer"
        )
    found = _WORKER_GONE.search(str(err))
    if found is None:
        return None
    how = found.group(2).replace("is killed by signal: ", "was killed by signal ")
    if "shared memory" in str(err):  # a Bus error where /dev/shm is full (docker's default is 64 MB)
        cause = "the workers ran out of shared memory (/dev/shm: docker run --shm-size, or lower data.num_workers)"
    else:
        cause = (
            "most often the out-of-memory killer (the kernel log says so): lower data.num_workers or "
            "train.batch_size, or give the job more memory"
        )
    return DistqaError(
        f"a DataLoader worker (pid {found.group(1).strip()}) {how}: {cause}; then run the same command again "
        "to resume from the newest checkpoint"
    )
