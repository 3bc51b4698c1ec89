"""The restart-round protocol (distqa.rounds) against a real TCPStore, with one thread per rank.

A process that dies is played by doing what it did to the store (its record and count), then
nothing more: a real dead process cannot go on to the next round either.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from distqa.errors import DistqaError
from distqa.peer_watch import PeerWatch
from distqa.rounds import Round, RoundTimeout, as_peer_loss, came_back, join_round

WORLD = 4  # 2 nodes x 2 processes: ranks 0 and 1 on node 0, ranks 2 and 3 on node 1


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield server
    del server


def client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))


def join_all(server, ranks, restarts, timeout_s=20.0) -> dict[int, Round]:
    """Ranks joining at once, each from its own client (as processes do): rank -> its round."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = {
            rank: pool.submit(join_round, client(server), rank, WORLD, rank // 2, restarts[rank // 2], timeout_s)
            for rank in ranks
        }
        return {rank: future.result(timeout=60) for rank, future in futures.items()}


def test_every_rank_joins_round_zero_on_a_fresh_start(store):
    rounds = join_all(store, range(WORLD), {0: 0, 1: 0})
    assert {r.number for r in rounds.values()} == {0}


def test_a_replacement_node_joins_the_round_of_the_nodes_that_restarted(store):
    """Node 1 was replaced: its agent is new (restart count 0) while node 0's restarted its workers
    (count 1). torchrun's counters differ; the round must not. Both start orders are tried."""
    join_all(store, range(WORLD), {0: 0, 1: 0})
    with ThreadPoolExecutor(2) as pool:
        late_node_0 = pool.submit(lambda: (time.sleep(0.5), join_all(store, [0, 1], {0: 1, 1: 0}))[1])
        node_1 = join_all(store, [2, 3], {0: 1, 1: 0})
        node_0 = late_node_0.result(timeout=60)
    rounds = {**node_0, **node_1}
    assert {r.number for r in rounds.values()} == {1}
    assert rounds[0].describe() == "restart round 1: node(s) 1 started anew and node(s) 0 restarted their workers"

    # Again, node 0 first this time: round 2 for everyone.
    with ThreadPoolExecutor(2) as pool:
        late_node_1 = pool.submit(lambda: (time.sleep(0.5), join_all(store, [2, 3], {0: 2, 1: 0}))[1])
        rounds = {**join_all(store, [0, 1], {0: 2, 1: 0}), **late_node_1.result(timeout=60)}
    assert {r.number for r in rounds.values()} == {2}


def test_a_round_whose_member_died_before_it_completed_is_left_for_the_next(store):
    join_all(store, range(WORLD), {0: 0, 1: 0})
    # Round 1: rank 0 joins first, then dies before the others are in.
    dead = client(store)
    dead.add("distqa/rounds/current", 1)
    dead.set("distqa/rounds/last/0", "1")
    dead.add("distqa/rounds/1/joined", 1)
    dead.set("distqa/rounds/1/joined-0", "1")
    with ThreadPoolExecutor(1) as pool:
        # Ranks 1 to 3 count themselves in: with the dead rank 0, all 4 have.
        waiting = pool.submit(join_all, store, [1, 2, 3], {0: 1, 1: 1})
        time.sleep(1.0)
        assert not waiting.done(), "a round went ahead with a member that died in it"
        late = join_all(store, [0], {0: 2, 1: 1})  # rank 0's next process: all move on
        rounds = {**waiting.result(timeout=60), **late}
    assert {r.number for r in rounds.values()} == {2}


def test_a_node_that_never_comes_back_is_named_in_time_and_later_restarts_fail_at_once(store):
    join_all(store, range(WORLD), {0: 0, 1: 0})
    start = time.monotonic()
    with pytest.raises(RoundTimeout) as err:
        join_all(store, [0, 1], {0: 1, 1: 0}, timeout_s=1.0)
    assert time.monotonic() - start < 5
    assert str(err.value).startswith("node 1 (rank 2, 3) did not join restart round 1 within 1 s")
    # torchrun's next restart on node 0 gets the same line without waiting again.
    start = time.monotonic()
    with pytest.raises(RoundTimeout, match="node 1 \\(rank 2, 3\\) did not join"):
        join_round(client(store), 0, WORLD, 0, 2, timeout_s=60)
    assert time.monotonic() - start < 1


def test_only_the_loss_of_a_peer_is_said_as_one():
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[10.231.7.2]:41093. This is typically caused by a remote worker crashing."
    )
    lost = as_peer_loss(gloo, step=9)
    assert str(lost).startswith("lost a peer at 10.231.7.2 at step 9 (Connection closed by peer): torchrun starts")
    assert as_peer_loss(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), step=9) is None


def test_a_member_that_joined_and_died_is_the_one_named(store):
    """All ranks counted themselves in, but rank 0 died before the second count: the timeout names
    rank 0, not nobody."""
    join_all(store, range(WORLD), {0: 0, 1: 0})
    dead = client(store)
    dead.add("distqa/rounds/current", 1)
    dead.set("distqa/rounds/last/0", "1")
    dead.set("distqa/rounds/1/joined-0", "1")
    dead.add("distqa/rounds/1/joined", 1)
    with pytest.raises(RoundTimeout, match=r"^node 0 \(rank 0\) did not join restart round 1 within 1 s"):
        join_all(store, [1, 2, 3], {0: 1, 1: 1}, timeout_s=1.0)


def test_a_member_that_came_back_ends_the_survivors_round_within_one_watch_interval(store, monkeypatch):
    """A node lost mid-message can leave a survivor hung in gloo until DISTQA_PEER_TIMEOUT_S (60 s),
    while the replacement's workers, already in the next round, give up after RDZV_TIMEOUT (the
    node test's flake: 30 s). The survivors' PeerWatch sees the next round open and ends them at
    once, naming who came back; a round nobody left is left alone."""
    join_all(store, range(WORLD), {0: 0, 1: 0})
    assert came_back(store, 0, WORLD) is None

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setattr(PeerWatch, "INTERVAL_S", 0.05)
    ended: list[str] = []
    # Rank 0 in round 0; a silence timeout far beyond the test, so only the round can end it.
    watch = PeerWatch(0, WORLD, timeout_s=600, prefix="distqa/round-0/", round_number=0)
    watch._end = lambda why: (ended.append(why), watch.stopped.set())  # type: ignore[method-assign]
    thread = threading.Thread(target=watch._run, daemon=True)
    thread.start()
    time.sleep(0.5)  # ten intervals with round 0 the newest
    assert ended == []

    # Node 1 is replaced: its new ranks 2 and 3 open round 1 and wait there for node 0.
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(join_round, client(store), rank, WORLD, 1, 0, 5.0) for rank in (2, 3)]
        thread.join(timeout=5)
        # The watch may look between the two joins: it names whoever had come back by then.
        said = r"rank\(s\) (2|3|2, 3) started again and opened restart round 1 while this process was in"
        said += " restart round 0"
        assert len(ended) == 1 and re.fullmatch(said, ended[0]), ended
        deadline = time.monotonic() + 5  # both joins under way by then (each thread's first request)
        while came_back(store, 0, WORLD) != (1, [2, 3]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert came_back(store, 0, WORLD) == (1, [2, 3])
        # Node 0's new workers then meet them in round 1.
        node_0 = join_all(store, [0, 1], {0: 1, 1: 0})
        assert {r.number for r in node_0.values()} == {1}
        assert {f.result(timeout=10).number for f in waiting} == {1}


def test_a_node_that_counts_another_world_is_refused_at_once(store):
    """NNODES=2 on node 0 and NNODES=3 on node 1: each side waited for a count the other never
    reaches, then timed out naming ranks that never existed."""
    with ThreadPoolExecutor(1) as pool:
        node_0 = pool.submit(join_round, client(store), 0, WORLD, 0, 0, 3.0)
        time.sleep(0.5)
        start = time.monotonic()
        with pytest.raises(DistqaError, match=r"^node 1 \(.*\) counts 6 processes in the run, node 0 \(.*\) 4: start"):
            join_round(client(store), 4, 6, 1, 0, 20.0)
        assert time.monotonic() - start < 2
        with pytest.raises(RoundTimeout):
            node_0.result(timeout=60)


def test_two_nodes_given_one_node_rank_are_refused(store):
    """Both started with NODE_RANK=1: ranks 2 and 3 twice. A second process of a rank moves every
    process of it to a later round (it looks like a rank started again), where both counted in: the
    count of 4 could be complete without node 0, and the process group met two processes of a rank.
    Now the one of the two that comes second into a round is refused, naming the rank."""

    def outcome(rank: int) -> BaseException | None:
        try:
            join_round(client(store), rank, WORLD, 1, 0, 3.0)
        except BaseException as err:  # noqa: BLE001 - what each process ends with
            return err
        return None

    with ThreadPoolExecutor(3) as pool:
        first = [pool.submit(outcome, rank) for rank in (2, 3)]
        time.sleep(0.5)
        again = pool.submit(outcome, 2)
        ends = [str(future.result(timeout=60)) for future in [*first, again]]
    twice = [end for end in ends if end.startswith("rank 2 was started twice in restart round 1: by node 1 (")]
    assert len(twice) == 1, ends
    assert twice[0].endswith("give every node a NODE_RANK of its own, 0 to NNODES-1")


def test_a_node_back_in_an_elastic_run_that_went_on_without_it_skips_the_round_made_alone(store):
    """NNODES=1:2, 2 processes a node: node 1 lost, node 0 went on alone (world 2) in round 1.
    When node 1 comes back, its ranks (last in round 0) came to round 1 before node 0's new
    processes moved on, and were refused for counting another world (found by a review)."""
    join_all(store, range(WORLD), {0: 0, 1: 0})
    with ThreadPoolExecutor(2) as pool:
        alone = [pool.submit(join_round, client(store), rank, 2, 0, 1, 20.0) for rank in (0, 1)]
        assert {future.result(timeout=60).number for future in alone} == {1}
    with ThreadPoolExecutor(2) as pool:
        late_node_0 = pool.submit(lambda: (time.sleep(0.3), join_all(store, [0, 1], {0: 2, 1: 0}))[1])
        node_1 = join_all(store, [2, 3], {0: 2, 1: 0})
        rounds = {**late_node_0.result(timeout=60), **node_1}
    assert {r.number for r in rounds.values()} == {2}
