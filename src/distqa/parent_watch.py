"""A torchrun worker that outlives its agent stops itself (`watch_parent`); a pool worker dies
with the process that forked it (`die_with_parent`)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time


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
