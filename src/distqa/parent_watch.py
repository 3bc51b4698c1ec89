"""A torchrun worker that outlives its agent stops itself (`watch_parent`)."""

from __future__ import annotations

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
