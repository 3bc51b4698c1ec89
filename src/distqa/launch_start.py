"""train.resume=never and train.resume=PATH in a launch's later rounds.

torchrun starts every round of a launch with the same command line: a round after a worker's
failure (`--max-restarts`), and, under worker.sh's NNODES=MIN:MAX, a round at every node that
joins or leaves (torchrun stops the running workers with SIGTERM, they checkpoint, a new round
starts). `never` and a checkpoint folder say where the launch starts; taken again in a later
round, `never` moved the run so far aside and trained from step 0 at every join, exit 0, and a
folder set aside the steps trained since (a review saw 31 of 40 steps redone).

So the first round, once its start is carried out (the earlier run or the other line set aside),
notes that in a store that lives as long as the launch, and a later round continues from
output_dir's newest checkpoint, as `auto` does, said in one line. The store is the agent's
(torchrun shares it with the workers: `rounds.client`, or a client made here for one process in
all), or, where each round makes a store of its own (worker.sh's elastic launch), the
rendezvous's own, which worker.sh names in DISTQA_LAUNCH_STORE. Without either (one
`python -m distqa train`, no torchrun), every start is a launch's first.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from distqa.checkpoint import step_folders
from distqa.dist import DistInfo
from distqa.rank0 import on_rank0, reason

_KEY = "distqa/launch/started"
STORE_ENV = "DISTQA_LAUNCH_STORE"  # HOST:PORT of the elastic rendezvous's store (worker.sh)

_store: dist.Store | None = None
_unreachable: BaseException | None = None  # the first failure to connect, said again, not retried
# The store's host is node 0's agent, which every node's agent reaches: a connection takes
# milliseconds, and one that fails should not hold rank 0 (and the ranks waiting for it) long.
_connect_timeout = timedelta(seconds=15)


def _launch_store() -> dist.Store | None:
    global _store, _unreachable
    from distqa import rounds

    if rounds.client is not None:
        return rounds.client
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None  # not started by torchrun: no rounds (an exported DISTQA_LAUNCH_STORE is stale)
    if _unreachable is not None:
        raise _unreachable
    if _store is None:
        endpoint = os.environ.get(STORE_ENV, "")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # One process in all: distqa.dist keeps no client of the agent's store (a review saw a
            # restarted single-process launch take train.resume=never again).
            endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        if endpoint:
            host, _, port = endpoint.rpartition(":")
            try:
                _store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=_connect_timeout)
            except (OSError, RuntimeError) as err:
                _unreachable = err
                raise
    return _store


def mode_of_this_round(mode: str, output_dir: Path, info: DistInfo) -> str:
    """`mode` in the launch's first round (and for `auto`); `auto` in a later one, where output_dir
    holds a checkpoint to continue (a PATH outside output_dir with none there yet stays PATH).
    Rank 0 decides and every rank gets the same answer."""
    if mode == "auto":
        return mode

    def decide() -> str:
        try:
            store = _launch_store()
            first = store.get(_KEY).decode() if store is not None and store.check([_KEY]) else None
        except (OSError, RuntimeError) as err:  # (torch's store errors are RuntimeErrors)
            print(
                f"warning: cannot read the launch's store ({os.environ.get(STORE_ENV) or 'torchrun agent'}: "
                f"{reason(err)}): a later round of this launch would take train.resume={mode} again",
                flush=True,
            )
            return mode
        if first is None or (mode != "never" and not step_folders(output_dir / "checkpoints")):
            return mode
        print(
            f"train.resume={mode}: this launch carried it out at {first}; a later round of the launch (a restart, "
            "or a node that joined or left) continues from output_dir's newest checkpoint, as train.resume=auto",
            flush=True,
        )
        return "auto"

    return on_rank0(info, decide)  # type: ignore[return-value]


def note_started(mode: str, info: DistInfo) -> None:
    """After the first round carried out `mode` (nothing written before it): later rounds continue."""
    if mode == "auto" or not info.is_main:
        return
    try:
        store = _launch_store()
        if store is not None and not store.check([_KEY]):
            store.set(_KEY, time.strftime("%Y-%m-%d %H:%M:%S"))
    except (OSError, RuntimeError) as err:
        print(
            f"warning: cannot write to the launch's store ({reason(err)}): a later round of this launch "
            f"would take train.resume={mode} again",
            flush=True,
        )
