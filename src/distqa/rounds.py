"""Restart rounds that every node agrees on, kept in torchrun's rendezvous store.

When a worker dies, torchrun (`--max-restarts`) starts a new round of workers against the same
store. The process group's keys of the dead round are still there, so each round needs a namespace
of its own, or gloo connects to the dead workers' addresses (PITFALLS #1). torchrun's own
`TORCHELASTIC_RESTART_COUNT` cannot name it on several nodes: it counts this node's restarts, and a
node that replaces a lost one starts again at 0 while the others are at 1 or more. Its workers would
then meet the others in no namespace at all and spend a restart to catch up.

So the round is agreed in the store itself. Every rank remembers the last round it joined
(`last/RANK`), and a new process of that rank must join a later one:

1. read the current round C; if this rank already joined C, move the current round to C+1
   (compare-and-set, so that several ranks moving it at once move it once);
2. record C as this rank's last round, then count itself in (`joined`) and wait for all
   WORLD_SIZE ranks; then count itself in again (`ready`) and wait for all once more. A member
   that died while it waited for the others is in `joined` but never in `ready`;
3. either wait ends early when the current round moves past C (a member of it died and came
   back: the round is dead, join the next one), or after `timeout_s`.

What is left is a member that dies within one poll (50 ms) of the others seeing `ready` complete:
the others then wait in the process group's start for the store's timeout.

A rank that never joins within the timeout is named with the node it was last seen on, and the
round is marked as given up, so that torchrun's remaining restarts on the other nodes fail at once
with the same line instead of waiting the timeout again each.
"""

from __future__ import annotations

import re
import secrets
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist

from distqa.errors import DistqaError, PeerLost

_KEY = "distqa/rounds/"


class RoundTimeout(DistqaError):
    """Some ranks did not join a restart round in time: their node is gone."""


@dataclass(frozen=True)
class Round:
    number: int
    # node rank -> that node's local restart count (0: its torchrun agent is new), for the log line
    nodes: dict[int, int]

    def describe(self) -> str:
        fresh = sorted(node for node, restarts in self.nodes.items() if restarts == 0)
        again = sorted(node for node in self.nodes if node not in fresh)
        parts = []
        if fresh:
            parts.append(f"node(s) {_list(fresh)} started anew")
        if again:
            parts.append(f"node(s) {_list(again)} restarted their workers")
        return f"restart round {self.number}: {' and '.join(parts)}"


def _list(items: list[int]) -> str:
    return ", ".join(str(item) for item in items)


def _get_int(store: dist.Store, key: str, default: int) -> int:
    # `check` does not block; `get` of a missing key would wait the store's whole timeout.
    return int(store.get(key)) if store.check([key]) else default


def _current(store: dist.Store) -> int:
    return store.add(_KEY + "current", 0)  # creates it at 0 on first use


def _move_current_to(store: dist.Store, target: int) -> None:
    """Raise the current round to at least `target`; never lowers it."""
    while (cur := _current(store)) < target:
        store.compare_set(_KEY + "current", str(cur), str(target))


def came_back(store: dist.Store, number: int, world_size: int) -> tuple[int, list[int]] | None:
    """None while restart round `number` is the newest. Once a later one is open: that round and
    the ranks that joined it. Only a new process of a member of `number` opens one, so a member
    died and came back, and `number` is over for every rank (`PeerWatch` ends them at once)."""
    current = _current(store)
    if current <= number:
        return None
    back = [rank for rank in range(world_size) if _get_int(store, f"{_KEY}last/{rank}", -1) > number]
    return current, back


def _given_up(store: dist.Store) -> None:
    if store.check([_KEY + "given-up"]):
        raise RoundTimeout(store.get(_KEY + "given-up").decode())


def join_round(
    store: dist.Store,
    rank: int,
    world_size: int,
    node: int,
    local_restarts: int,
    timeout_s: float,
    poll_s: float = 0.05,
) -> Round:
    """Join the next restart round that all `world_size` ranks join; see the module docstring."""
    _given_up(store)
    store.set(f"{_KEY}node-of/{rank}", str(node))  # kept across rounds: names a rank that goes missing
    deadline = time.monotonic() + timeout_s
    me = f"{node}|{socket.gethostname()}|{secrets.token_hex(4)}"  # this process's claim on its rank
    need = _get_int(store, f"{_KEY}last/{rank}", -1) + 1
    while True:
        _move_current_to(store, need)
        number = _current(store)
        prefix = f"{_KEY}{number}/"
        if _went_ahead(store, prefix):  # without this process: an elastic run that shrank, now growing
            need = number + 1
            continue
        store.set(f"{_KEY}last/{rank}", str(number))  # before counting in: a death after it ends the round
        store.set(f"{prefix}node-{node}", str(local_restarts))
        _check_members(store, prefix, number, rank, world_size, me)
        # Two counts: `joined` reaches world_size also when a member died while it waited; `ready`
        # is counted only by members that saw `joined` complete, i.e. were alive when all were in.
        if _count_in(store, prefix, "joined", rank, number, world_size, deadline, timeout_s, poll_s):
            if _count_in(store, prefix, "ready", rank, number, world_size, deadline, timeout_s, poll_s):
                nodes = {}
                for other in range(world_size):
                    home = _get_int(store, f"{_KEY}node-of/{other}", -1)
                    if home >= 0 and home not in nodes:
                        nodes[home] = _get_int(store, f"{prefix}node-{home}", 0)
                return Round(number, nodes)
        need = number + 1


def _went_ahead(store: dist.Store, prefix: str) -> bool:
    """The round is complete: every member it counted is ready. A process that comes to it now is
    not one of them, whatever its rank: a node that comes back to an elastic run (NNODES=MIN:MAX)
    which went on without it, at the round its remaining node made alone (of another world size).
    Joining it, its processes were refused for counting another world, or (before that check)
    waited on counters that were already complete, and the run spent a restart."""
    if not store.check([prefix + "world", prefix + "ready"]):
        return False
    size = store.get(prefix + "world").decode().split("|")[0]
    return size.isdigit() and int(store.get(prefix + "ready")) >= int(size)


def _check_members(store: dist.Store, prefix: str, number: int, rank: int, world_size: int, me: str) -> None:
    """Every member of a round counts the same world, and each rank is one process. Two nodes given
    one NODE_RANK ran every rank of it twice (the count complete before the other node was in).
    Processes that count different worlds (torchrun's agent 0 assigns ranks from every node's own
    process count, unless TORCH_ELASTIC_WORKER_IDENTICAL=1 has each compute its own) waited for a
    count the others never reach. Either ended after RDZV_TIMEOUT, or in the process group's own
    start, naming ranks that never existed. A new process of a rank joins a later round, so a rank
    claimed in this one is claimed by another process."""
    node, host, _ = me.split("|")
    first = store.compare_set(f"{prefix}world", "", f"{world_size}|{node}|{host}").decode()
    size, their_node, their_host = (first.split("|") + ["?", "?", "?"])[:3]  # (a value of another kind: "?")
    if size != str(world_size):
        raise DistqaError(
            f"node {node} ({host}) counts {world_size} processes in the run, node {their_node} ({their_host}) "
            f"{size}: start every node with the same NNODES and NPROC_PER_NODE (the run has NNODES x "
            "NPROC_PER_NODE processes)"
        )
    held = store.compare_set(f"{prefix}joined-{rank}", "", me).decode()
    if held != me:
        their_node, their_host = (held.split("|") + ["?", "?"])[:2]
        raise DistqaError(
            f"rank {rank} was started twice in restart round {number}: by node {their_node} ({their_host}) and by "
            f"node {node} ({host}): give every node a NODE_RANK of its own, 0 to NNODES-1"
        )


def _count_in(
    store: dist.Store,
    prefix: str,
    counter: str,
    rank: int,
    number: int,
    world_size: int,
    deadline: float,
    timeout_s: float,
    poll_s: float,
) -> bool:
    """Count this rank in `counter`, then wait for all: True when complete, False when the round is
    dead (the current round moved past it: one of its members died and came back)."""
    if counter != "joined":  # (joined-RANK holds the rank's claim: `_check_members`)
        store.set(f"{prefix}{counter}-{rank}", "1")  # who is in: named when others are missing
    store.add(prefix + counter, 1)
    while int(store.get(prefix + counter)) < world_size:
        _given_up(store)
        if _current(store) > number:
            return False
        if time.monotonic() > deadline:
            _give_up(store, prefix, counter, number, world_size, timeout_s)
        time.sleep(poll_s)
    return True


def _give_up(store: dist.Store, prefix: str, counter: str, number: int, world_size: int, timeout_s: float) -> None:
    missing = [rank for rank in range(world_size) if not store.check([f"{prefix}{counter}-{rank}"])]
    by_node: dict[str, list[int]] = {}
    for rank in missing:
        home = _get_int(store, f"{_KEY}node-of/{rank}", -1)
        by_node.setdefault(f"node {home}" if home >= 0 else "a node never seen", []).append(rank)
    who = "; ".join(f"{where} (rank {_list(ranks)})" for where, ranks in sorted(by_node.items()))
    message = (
        f"{who} did not join restart round {number} within {timeout_s:g} s (RDZV_TIMEOUT): "
        "the node is gone; start it again with the same command, or restart the whole run"
    )
    store.set(_KEY + "given-up", message)
    raise RoundTimeout(message)


# What gloo and NCCL say when a peer process is gone (killed, or its node lost): the expected end
# of a round that torchrun then restarts, worth one line rather than a traceback.
_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited|"
    r"NCCL communicator was aborted"
)
_PEER_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")

joined: Round | None = None  # this process's round, once its process group exists
client: dist.Store | None = None  # the agent's store, kept for the launch's life (launch_start)


def as_peer_loss(err: BaseException, step: int) -> PeerLost | None:
    """`err` said as one line when it is the loss of a peer process; None for anything else."""
    text = str(err)
    found = _PEER_GONE.search(text)
    if found is None:
        return None
    address = _PEER_ADDRESS.search(text[found.start() :])
    peer = f" at {address.group(1)}" if address else ""
    where = f" in restart round {joined.number}" if joined is not None else ""  # None: elastic (c10d) rounds
    return PeerLost(
        f"lost a peer{peer} at step {step}{where} ({found.group(0)}): torchrun starts "
        "the next round if restarts are left (MAX_RESTARTS, --max-restarts) and it resumes from the newest "
        "checkpoint"
    )
