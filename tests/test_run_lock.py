"""One live run per output_dir: the lock file, its heartbeat, and stale locks of killed runs, on the
same machine and as another node of a shared volume would see them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
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


def test_a_copy_of_a_live_run_s_folder_is_refused_and_told_where_its_lock_was_taken(tmp_path):
    """`cp -r` of a live run's output_dir copies its run.lock: still refused (another node may mount
    the same folder at another path, which a path cannot tell from a copy), with the way out."""
    live, copy = tmp_path / "live", tmp_path / "copy"
    live.mkdir()
    first = RunLock(live)
    first.acquire()
    try:
        copy.mkdir()
        (copy / LOCK_NAME).write_bytes((live / LOCK_NAME).read_bytes())
        with pytest.raises(DistqaError) as raised:
            RunLock(copy).acquire()
        message = str(raised.value)
        assert f"it took the lock in {live}: if this folder is a copy of that one" in message, message
        assert message.endswith(f"delete {copy / LOCK_NAME})"), message
        with pytest.raises(DistqaError) as raised:  # the folder itself: no such advice
            RunLock(live).acquire()
        assert "took the lock in" not in str(raised.value)
        alias = tmp_path / "alias"  # nor the same folder through a symlink (it advised deleting the live lock)
        alias.symlink_to(live)
        with pytest.raises(DistqaError) as raised:
            RunLock(alias).acquire()
        assert "is in use by another run" in str(raised.value) and "took the lock in" not in str(raised.value)
    finally:
        first.release()


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


def acquire_within(lock: RunLock, seconds: float) -> float:
    """Acquire in a thread; fail (instead of hanging for the wrong wait) if it takes longer."""
    errors: list[BaseException] = []

    def take() -> None:
        try:
            lock.acquire()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            errors.append(err)

    start = time.monotonic()
    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        (lock.path).unlink(missing_ok=True)  # let the stuck acquire end
        thread.join()
        lock.release()
        pytest.fail(f"acquire still waiting after {seconds} s")
    if errors:
        raise errors[0]
    return time.monotonic() - start


def test_a_lock_dated_in_the_future_is_taken_over_after_one_lease(tmp_path, capsys, monkeypatch):
    """A skewed clock or a copied folder: the negative age never lengthens the wait past one lease."""
    monkeypatch.setattr(runlock, "LEASE_S", 1.0)
    path = foreign_lock(tmp_path)
    ahead = time.time() + 86400
    os.utime(path, (ahead, ahead))
    lock = RunLock(tmp_path)
    waited = acquire_within(lock, runlock.LEASE_S + 3)
    try:
        assert 0.9 < waited < runlock.LEASE_S + 2
        assert "s in the future" in capsys.readouterr().out
        assert lock.token in path.read_text()
    finally:
        lock.release()


def refused_while_beating(folder: Path, beat: Callable[[], None]) -> None:
    """A foreign holder whose heartbeat (`beat`, every 0.2 s) moves: taking the lock is refused."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(0.2):
            beat()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        with pytest.raises(DistqaError, match="host node-7, pid 4242"):
            RunLock(folder).acquire()
    finally:
        stop.set()
        thread.join()


def test_a_lock_dated_in_the_future_with_a_live_heartbeat_is_refused(tmp_path):
    path = foreign_lock(tmp_path)
    ahead = time.time() + 86400
    os.utime(path, (ahead, ahead))
    beats = iter(range(1, 10**6))
    # Its clock is a day ahead, and it ticks.
    refused_while_beating(tmp_path, lambda: os.utime(path, (ahead + next(beats),) * 2))


def test_the_age_of_a_lock_is_measured_on_the_filesystems_clock(tmp_path, monkeypatch):
    """M4a: this machine's clock an hour off either way changes nothing: a live foreign holder is
    still refused (not judged an hour old), and a long-dead one is still taken at once (not
    watched for a lease). Measured with time.time(), both would go wrong."""
    dead = foreign_lock(tmp_path)
    age(dead, 3600)
    real = time.time
    monkeypatch.setattr(runlock.time, "time", lambda: real() - 3600)  # this machine an hour behind
    lock = RunLock(tmp_path)
    assert acquire_within(lock, runlock.LEASE_S + 3) < 1
    lock.release()

    path = foreign_lock(tmp_path)
    monkeypatch.setattr(runlock.time, "time", lambda: real() + 3600)  # an hour ahead
    # The kernel's (the filesystem's) clock, as a live holder's heartbeat.
    refused_while_beating(tmp_path, lambda: os.utime(path))


def test_a_pid_reused_by_another_process_on_this_machine_is_stale_at_once(tmp_path, capsys):
    """M4b: the holder's pid now belongs to another process (its start time differs): the holder
    is gone, whatever lives under its pid."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = runlock._identity()
        started = runlock.process_start(other.pid)
        assert started is not None
        lock_of = {**me, "pid": other.pid, "token": "t"}
        foreign_lock(tmp_path, **{**lock_of, "proc_start": started})  # that very process: alive, refused at once
        start = time.monotonic()
        with pytest.raises(DistqaError, match=rf"pid {other.pid}"):
            RunLock(tmp_path).acquire()
        assert time.monotonic() - start < 1

        foreign_lock(tmp_path, **{**lock_of, "proc_start": str(int(started) + 1)})  # an earlier process, same pid
        lock = RunLock(tmp_path)
        assert acquire_within(lock, runlock.LEASE_S + 3) < 1
        assert "its process no longer exists" in capsys.readouterr().out
        lock.release()
    finally:
        other.kill()
        other.wait()


def test_a_lock_of_an_earlier_process_with_this_very_pid_is_taken_over(tmp_path, capsys):
    """A container restarted after a SIGKILL: the same host name, pid namespace and boot, and its
    rank 0 often the same pid as before. Its own pid was taken for a live holder: 'in use by
    another run', and the restart policy's next try failed (found by a review, 2 of 4 restarts)."""
    me = runlock._identity()
    started = runlock.process_start(os.getpid())
    foreign_lock(tmp_path, **{**me, "proc_start": str(int(started) - 1), "token": "t"})
    lock = RunLock(tmp_path)
    assert acquire_within(lock, runlock.LEASE_S + 3) < 1
    assert "its process no longer exists" in capsys.readouterr().out
    lock.release()


def test_verify_reports_a_takeover_or_a_deleted_lock_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 3600.0)  # the heartbeat thread never looks
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        assert lock.verify() is None and lock.lost is None
        foreign_lock(tmp_path)  # another run judged this one dead and took the folder
        lost = lock.verify()
        assert lost is not None and "another run took over output_dir" in lost and "host node-7, pid 4242" in lost
        assert lock.lost == lost
        (tmp_path / LOCK_NAME).unlink()
        assert lock.verify() == lost  # once lost, it stays lost
    finally:
        lock.release()

    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        (tmp_path / LOCK_NAME).unlink()
        assert lock.verify() == f"the lock {tmp_path / LOCK_NAME} was deleted while this run held it"
    finally:
        lock.release()
