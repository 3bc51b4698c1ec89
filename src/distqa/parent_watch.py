"""A torchrun worker that outlives its agent stops itself (`watch_parent`); a pool's processes die
with the process that forked them (`die_with_parent`, `children_die_with_me`) and never finalize
what they inherited from it (`inherited_objects_frozen`)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

from distqa.runlock import proc_stat


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
    parent = agent_pid()

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


# The process that started this one, read as this module is imported: `python -m distqa` imports
# it first (distqa/__main__.py), before torch, so for a torchrun worker this is its agent. A watch
# that read the parent only when it started, after seconds of imports, took a parent that had died
# meanwhile for init (or a subreaper), and waited for ever in the rendezvous, holding the launch's
# output pipes (a test launch hung).
_STARTED_UNDER = os.getppid()
# `distqa.torchrun` hands its pid to its workers too: for one whose agent died even before this
# module was imported.
AGENT_ENV = "DISTQA_AGENT_PID"


def agent_pid() -> int:
    """The torchrun agent this worker belongs to: the process that started it, unless that was no
    longer the agent (the pid `distqa.torchrun` handed down differs, and is gone: the watch acts at
    once). A handed-down pid that still runs while another process started this one was inherited
    from an outer launch (a torchrun started inside a distqa.torchrun worker): not this worker's."""
    given = os.environ.get(AGENT_ENV, "")
    if not given.isdigit() or int(given) == _STARTED_UNDER:
        return _STARTED_UNDER
    return _STARTED_UNDER if _runs(int(given)) else int(given)


def _runs(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (a zombie, not yet reaped, has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it runs, as another user
        return True
    fields = proc_stat(pid)
    return fields is None or fields[0] not in ("Z", "X")  # (unreadable: it runs, as the signal said)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """In a process forked by `parent` (a `datasets` pool worker): be killed when `parent` dies.

    When only the parent is killed (SIGKILL, the OOM killer), such a worker finishes its share,
    then waits for ever to hand it to the dead parent, holding its memory. (It no longer holds the
    parent's folder lock too: `durable.held_exclusively` drops that at the fork.) Linux's
    parent-death signal ends it with its parent; elsewhere, nothing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:  # the parent died before the signal was asked for
        os._exit(1)


_watching: list[int] = []  # this process's pid while a `children_die_with_me` block runs
_forked_by_main_thread = [True]  # set in the parent just before each fork, read in the child


def _before_fork() -> None:
    _forked_by_main_thread[0] = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    if _watching:
        parent = _watching[-1]
        _watching.clear()  # only the direct children: a pool worker's own forks are its business
        # Linux sends the parent-death signal when the *thread* that forked exits: a pool's helper
        # thread forks a worker in place of one that died, and exits at the pool's end. Seen: that
        # worker was killed holding the task queue's lock, and the pool's terminate waited for it
        # for ever. Only forks of the main thread, which lives as long as the process, are tied.
        if _forked_by_main_thread[0]:
            die_with_parent(parent)


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def children_die_with_me() -> Iterator[None]:
    """Every process forked in the block dies with this one: a `datasets` pool's workers, and its
    manager, which no code of ours runs in. Seen: `distqa prepare --num-proc 2` SIGKILLed, its
    workers ended (they called `die_with_parent`), and the pool's manager stayed, an idle orphan of
    init for good. (Processes started by fork and exec, such as `subprocess`, run no fork hook.)"""
    _watching.append(os.getpid())
    try:
        yield
    finally:
        _watching.pop()


@contextlib.contextmanager
def inherited_objects_frozen() -> Iterator[None]:
    """Processes forked without exec in the block (a `datasets` pool, a one-process run's DataLoader
    workers) never run the finalizers of what they inherited, which a garbage collection there would
    do for the unreachable objects this process had not collected yet, whose state may belong to
    threads or processes that are only this one's: an earlier DataLoader iterator's shutdown of its
    workers, a temporary folder's removal. Seen once in a test process that had trained before: both
    workers of prepare's pool died of a segfault during a collection (faulthandler: "Garbage-
    collecting"). Objects frozen before the fork (gc.freeze, as Python's gc docs advise for fork
    without exec) are never collected there: the children collect only their own, the inherited
    pages stay shared, and this process unfreezes them as the block ends."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
