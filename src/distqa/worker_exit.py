"""How a DataLoader worker ends when its training process is killed: at once, and without a word.

A worker started from the fork server (`loader_server`) is the server's child, so PyTorch's own
watchdog (the worker exits once its parent is gone) watches the server, which lives as long as any
worker; a worker forked by the training process itself is watched only between two items. Either
outlived a SIGKILLed training process (a node's loss, the OOM killer) and held the run's output
pipes open: `end_with_training_process` watches the training process from a thread of the worker,
started as the server forks it (before it reads its dataset, which may hang).

Two of multiprocessing's own paths printed a traceback into the node's log when the training
process died at the wrong moment, and a platform's reader takes the last traceback for the cause:
- a batch's tensors reach the training process through a socket the worker serves (the
  resource_sharer's thread); a process killed while taking one made that thread fail;
- a new worker, forked by the server, reads its dataset and collate from a pipe the training
  process writes; a process killed while writing left it a truncated pickle.
`_quiet_if_orphaned` silences exactly these two, and only once the training process has ended; any
other traceback prints as before, at once (a dataset's own thread failing is the cause a user
needs, even if the training process ends a moment later).
"""

from __future__ import annotations

import os
import pickle
import select
import sys
import threading
import time
from multiprocessing import resource_sharer, spawn
from types import CodeType, TracebackType

from distqa.runlock import proc_stat

# The training process's pid, in the server and its workers (set while the server starts).
PARENT_ENV = "DISTQA_LOADER_SERVER_PARENT"
# Whether this process watches the training process already (a fork server's child, from its fork).
_watching = False
# The socket or pipe a killed process held is closed a moment before the kernel reports its end.
_EXIT_SEEN_WITHIN_S = 5.0
# Where multiprocessing fails when its peer, the training process, dies mid-exchange.
_PEER_CODE: frozenset[CodeType] = frozenset(
    {resource_sharer._ResourceSharer._serve.__code__, spawn._main.__code__}  # type: ignore[attr-defined]
)


def training_process() -> int:
    """The training process's pid, as seen from a loader worker (or the fork server)."""
    pid = os.environ.get(PARENT_ENV, "")
    return int(pid) if pid.isdigit() else os.getppid()


def end_with_training_process() -> None:
    """In a loader worker: exit as soon as the training process is gone, printing nothing of it.
    The fork server calls it in each child as it forks it (`os.register_at_fork`), before the child
    reads its dataset: a dataset whose unpickling hangs (its `__setstate__` opens a stale mount)
    outlived a SIGKILLed training process there; the worker's `worker_init_fn` calls it again."""
    global _watching
    if _watching:
        return
    _watching = True
    parent = training_process()
    try:
        handle = os.pidfd_open(parent)  # readable once the process has ended (Linux 5.3 and later)
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError):
        handle = None  # (then /proc is polled)
    _quiet_if_orphaned(parent, handle)
    threading.Thread(target=_exit_when_gone, args=(parent, handle), name="distqa-loader-watch", daemon=True).start()


def _exit_when_gone(pid: int, handle: int | None) -> None:
    _ends_within(pid, handle, None)
    os._exit(0)


def ended(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie counts), without reaping it."""
    fields = proc_stat(pid)
    return not fields or fields[0] in ("Z", "X")


def _ends_within(pid: int, handle: int | None, wait_s: float | None) -> bool:
    """Whether process `pid` (`handle`: its pidfd, or None) ends within `wait_s` seconds (None: waits for ever)."""
    if handle is not None:
        return bool(select.select([handle], [], [], wait_s)[0])
    deadline = None if wait_s is None else time.monotonic() + wait_s
    while not ended(pid):
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(1.0 if deadline is None else 0.05)
    return True


def _quiet_if_orphaned(pid: int, handle: int | None) -> None:
    """Make `sys.excepthook` (both paths above call it) exit this process without a word when the
    traceback comes from one of those two paths and process `pid` has ended; otherwise it prints."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        peer_gone = isinstance(value, (EOFError, OSError, pickle.UnpicklingError))  # (not an import error, say)
        if peer_gone and _from_a_peer_exchange(tb) and _ends_within(pid, handle, _EXIT_SEEN_WITHIN_S):
            os._exit(0)
        previous(kind, value, tb)

    sys.excepthook = hook


def _from_a_peer_exchange(tb: TracebackType | None) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code in _PEER_CODE:
            return True
        tb = tb.tb_next
    return False
