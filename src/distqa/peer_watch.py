"""Ends a process whose neighbouring rank is gone, whatever it waits in (`PeerWatch`): a lost
peer under gloo can otherwise leave it waiting the process group's whole timeout."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from distqa.errors import DistqaError


class PeerWatch:
    """Ends this process when a neighbouring rank's process is gone, whatever this one is waiting in.

    A peer killed while it sends into a gloo collective (a node lost mid-all-gather under FSDP, or
    mid-all-reduce under DDP) can leave this process waiting for the rest of that message: gloo
    closes the connection but does not wake the receive whose first bytes had already arrived, which
    then waits the process group's whole timeout (30 minutes) instead of failing, and torchrun never
    starts the next round. Seen in the elastic node test: rank 0 in `UnboundBuffer::waitRecv` under
    `gloo::allgather`, its socket to the lost node already closed. So each rank counts up a key in
    the rendezvous store every `INTERVAL_S` from a thread of its own, and watches the counters of
    its two ring neighbours (rank - 1, rank + 1: every loss is seen by two ranks, at a cost that does
    not grow with the world): one that has not moved for DISTQA_PEER_TIMEOUT_S (default 60; 0: off)
    is a lost peer, said in one line before this process exits for torchrun to restart the round.
    A rank that stops on purpose (`cleanup`) marks its counter done first. Only a dead process
    stops counting: a busy one (a long data preparation, a slow step) still counts from this thread.

    Under worker.sh's static rendezvous it also watches the restart round (`distqa.rounds`): a lost
    node started again opens the next round at once, and its workers wait there only RDZV_TIMEOUT
    for the others. Seen in the node test: rank 0, hung as above, noticed the loss after its 60 s,
    when the new node had given up after its 30. A later round means this one is over, so this
    process ends within one interval of it, whatever DISTQA_PEER_TIMEOUT_S says.
    """

    INTERVAL_S = 2.0
    DONE = 1 << 40  # added to the counter by a rank that stops on purpose
    current: PeerWatch | None = None

    def __init__(
        self, rank: int, world_size: int, timeout_s: float, prefix: str, round_number: int | None = None
    ) -> None:
        self.rank, self.world_size, self.timeout_s, self.prefix = rank, world_size, timeout_s, prefix
        self.round_number = round_number  # this process's restart round; None: elastic rendezvous
        self.peers = sorted({(rank - 1) % world_size, (rank + 1) % world_size} - {rank})
        self.addr, self.port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.store: dist.Store | None = None
        self.store_lost = False  # a call to the store failed (its host may be gone for good)
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    @classmethod
    def timeout_from_env(cls) -> float:
        """DISTQA_PEER_TIMEOUT_S, checked: 0 (off), or long enough that one tick (INTERVAL_S and
        the reads) stays under the pause check's half timeout; shorter, every tick would look like
        a pause and no peer would ever be reported lost."""
        raw = os.environ.get("DISTQA_PEER_TIMEOUT_S") or "60"
        try:
            value = float(raw)
        except ValueError:
            raise DistqaError(f"DISTQA_PEER_TIMEOUT_S={raw!r} is not a number of seconds (0: off)") from None
        least = 3 * cls.INTERVAL_S
        if not math.isfinite(value) or value < 0 or 0 < value < least:
            raise DistqaError(
                f"DISTQA_PEER_TIMEOUT_S={raw} must be 0 (off) or at least {least:g} s: each rank counts "
                f"every {cls.INTERVAL_S:g} s, and a shorter silence would never be told from a paused job"
            )
        return value

    @classmethod
    def start(cls, rank: int, world_size: int, timeout_s: float) -> None:
        """Watch this rank's neighbours for `timeout_s` of silence (`timeout_from_env`; 0: off)."""
        if timeout_s == 0 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            return  # off, or a process group made without a TCP store to count in
        from distqa import rounds

        # Static rendezvous: the agent's store outlives a round, so the keys are the round's own.
        number = rounds.joined.number if rounds.joined is not None else None
        prefix = f"distqa/round-{number}/" if number is not None else "distqa/"
        cls.current = watch = cls(rank, world_size, timeout_s, prefix, number)
        watch.thread = threading.Thread(target=watch._run, name="distqa-peer-watch", daemon=True)
        watch.thread.start()

    def _key(self, rank: int) -> str:
        return f"{self.prefix}alive/{rank}"

    def _add(self, rank: int, amount: int) -> int:
        # A client of its own, with a short timeout: the trainer's may be busy, and a store that no
        # longer answers must count as silence, not block this thread.
        if self.store is None:
            if self.stopped.is_set() and self.store_lost:
                # Stopping (a preemption, the end) after the store stopped answering: node 0's store
                # may be gone with its container, and a new client would retry its connect (and the
                # name lookup) for its whole timeout, past a `docker stop`'s grace period (issue 26:
                # rank 1 "hung" after its checkpoint and was killed, exit 137).
                raise RuntimeError("the store stopped answering: no new client while stopping")
            # Connecting gives up after one interval (a store that is gone counts as silence at once);
            # a connected client waits 10 s for an answer.
            self.store = dist.TCPStore(
                self.addr, self.port, is_master=False, timeout=timedelta(seconds=self.INTERVAL_S)
            )
            self.store.set_timeout(timedelta(seconds=10))
        return self.store.add(self._key(rank), amount)

    def _run(self) -> None:
        start = time.monotonic()
        seen = {peer: (-1, start) for peer in self.peers}
        answered = looked = start  # when the store last answered; when this thread last looked
        while not self.stopped.wait(self.INTERVAL_S):
            try:
                self._add(self.rank, 1)
                values = {peer: self._add(peer, 0) for peer in list(seen)}
                later = self._later_round()
                answered = time.monotonic()
            except Exception:  # noqa: BLE001 (the store's host is gone, or the network: silence)
                self.store, values, self.store_lost, later = None, {}, True, None
            if later is not None and not self.stopped.is_set():
                self._round_over(*later)
            now = time.monotonic()
            if now - looked > self.timeout_s / 2:
                # This thread did not look for that long: the process did not run (the whole job
                # paused, SIGSTOP or `docker pause`, wherever this loop was, even mid-read), so its
                # neighbours did not either, and their counters would look long silent.
                seen = {peer: (value, now) for peer, (value, _) in seen.items()}
                answered = now
            looked = now
            for peer, value in values.items():
                if value >= self.DONE:
                    del seen[peer]  # it stopped on purpose
                elif value != seen[peer][0]:
                    seen[peer] = (value, now)
            silent = sorted(peer for peer, (_, since) in seen.items() if now - since > self.timeout_s)
            if silent and not self.stopped.is_set():
                self._lost(silent, store_silent=now - answered > self.timeout_s)

    def _later_round(self) -> tuple[int, list[int]] | None:
        from distqa import rounds

        if self.round_number is None or self.store is None:
            return None
        return rounds.came_back(self.store, self.round_number, self.world_size)

    def _round_over(self, later: int, ranks: list[int]) -> None:
        who = f"rank(s) {', '.join(str(rank) for rank in ranks)}" if ranks else "a rank"
        self._end(
            f"{who} started again and opened restart round {later} while this process was in restart "
            f"round {self.round_number}"
        )

    def _lost(self, silent: list[int], store_silent: bool = False) -> None:
        where = f" in restart round {self.round_number}" if self.round_number is not None else ""
        ranks = ", ".join(str(peer) for peer in silent)
        store = f" (the rendezvous store at {self.addr}:{self.port} did not answer either)" if store_silent else ""
        silence = f"gave no sign of life for {self.timeout_s:g} s{where} (DISTQA_PEER_TIMEOUT_S)"
        self._end(f"rank(s) {ranks}{store} {silence}")

    def _end(self, why: str) -> None:
        line = (
            f"distqa [rank {self.rank}]: error: lost a peer: {why}: torchrun starts the next round if "
            "restarts are left (MAX_RESTARTS, --max-restarts) and it resumes from the newest checkpoint"
        )
        print(line, file=sys.stderr, flush=True)
        if error_file := os.environ.get("DISTQA_ERROR_FILE"):
            with contextlib.suppress(OSError), open(error_file, "a") as f:
                f.write(line + "\n")
        # The main thread may be inside a collective that never returns: no cleanup can run there.
        os._exit(1)

    def stop(self, done: bool = True) -> None:
        """Stop watching; `done`: tell the neighbours that this rank ends on purpose. A rank that
        fails alone says nothing: its silence is what makes the neighbours stop waiting for it."""
        self.stopped.set()
        # The watch thread leaves its loop first: a store client torn down mid-call aborts the process.
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=15)
        if done:
            with contextlib.suppress(Exception):
                self._add(self.rank, self.DONE)
        self.store = None
