"""One live run per output_dir: the lock file, its heartbeat, and stale locks of killed runs, on the
same machine and as another node of a shared volume would see them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distqa import runlock
from distqa.errors import DistqaError
from distqa.runlock import LOCK_NAME, RunLock


@pytest.fixture(autouse=True)
def short_lease(monkeypatch):
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(runlock, "LEASE_S", 2.0)


def foreign_lock(folder: Path, **fields) -> Path:
    """A lock as a run on another machine (or container) would have written it."""
    record = {"host": "node-7", "pid": 4242, "proc_start": "1", "pidns": 1, "boot_id": "b", "token": "t"}
    record.update(fields)
    path = folder / LOCK_NAME
    path.write_text(json.dumps(record))
    return path


def age(path: Path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_a_live_holder_on_this_machine_is_refused_at_once(tmp_path):
    first = RunLock(tmp_path)
    first.acquire()
    try:
        start = time.monotonic()
        with pytest.raises(
            DistqaError, match=rf"output_dir {tmp_path} is in use by another run \(host .*, pid {os.getpid()}"
        ):
            RunLock(tmp_path).acquire()
        assert time.monotonic() - start < 1
    finally:
        first.release()
    assert not (tmp_path / LOCK_NAME).exists()  # released at exit
    second = RunLock(tmp_path)
    second.acquire()
    second.release()


def test_the_lock_of_a_killed_process_on_this_machine_is_taken_over_at_once(tmp_path, capsys):
    holder = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pathlib import Path; from distqa.runlock import RunLock; "
            f"RunLock(Path({str(tmp_path)!r})).acquire(); import os; os._exit(9)",
        ],
        check=False,
    )
    assert holder.returncode == 9 and (tmp_path / LOCK_NAME).exists()  # died holding it
    start = time.monotonic()
    lock = RunLock(tmp_path)
    lock.acquire()
    assert time.monotonic() - start < 1
    assert "taking over" in capsys.readouterr().out
    assert lock.token in (tmp_path / LOCK_NAME).read_text()
    lock.release()


def test_another_nodes_live_heartbeat_is_refused(tmp_path):
    path = foreign_lock(tmp_path)
    stop = threading.Event()

    def beat():
        while not stop.wait(0.2):
            os.utime(path)

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        start = time.monotonic()
        with pytest.raises(DistqaError, match="host node-7, pid 4242"):
            RunLock(tmp_path).acquire()
        assert time.monotonic() - start < runlock.LEASE_S
    finally:
        stop.set()
        thread.join()


def test_another_nodes_silent_lock_is_stale_after_the_lease(tmp_path, capsys):
    path = foreign_lock(tmp_path)
    start = time.monotonic()
    lock = RunLock(tmp_path)
    lock.acquire()  # waits until the heartbeat is older than the lease
    waited = time.monotonic() - start
    assert 1.5 < waited < runlock.LEASE_S + 2
    assert "heartbeat stopped" in capsys.readouterr().out
    lock.release()

    path = foreign_lock(tmp_path)
    age(path, 3600)  # long dead: taken at once
    start = time.monotonic()
    lock = RunLock(tmp_path)
    lock.acquire()
    assert time.monotonic() - start < 1
    lock.release()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200))
def test_a_lock_file_of_any_bytes_is_judged_by_its_heartbeat(tmp_path, data):
    path = tmp_path / LOCK_NAME
    path.write_bytes(data)
    age(path, 3600)
    lock = RunLock(tmp_path)
    lock.acquire()
    assert lock.token in path.read_text()
    lock.release()


def test_a_holder_whose_lock_was_taken_over_learns_it(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        foreign_lock(tmp_path)  # another run judged it dead and took it
        deadline = time.monotonic() + 5
        while lock.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lock.lost is not None and "host node-7, pid 4242" in lock.lost
    finally:
        lock.release()
    assert (tmp_path / LOCK_NAME).exists()  # release leaves the other run's lock alone


@pytest.mark.parametrize("round_", range(20))  # a race: many rounds, so a window that exists shows
def test_two_runs_racing_for_a_stale_lock_end_with_one_holder(tmp_path, round_):
    foreign_lock(tmp_path)
    age(tmp_path / LOCK_NAME, 3600)
    results: list[object] = []

    def contend():
        lock = RunLock(tmp_path)
        try:
            lock.acquire()
            results.append(lock)
        except DistqaError as err:
            results.append(err)

    threads = [threading.Thread(target=contend) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    holders = [r for r in results if isinstance(r, RunLock)]
    try:
        assert len(holders) == 1, results
        assert holders[0].token in (tmp_path / LOCK_NAME).read_text()
    finally:
        for holder in holders:
            holder.release()
