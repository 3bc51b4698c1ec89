"""A process killed while it holds a folder's lock (`durable.held_exclusively`) leaves no lock behind,
even when it had forked: a `datasets` pool worker or its manager shared the flock, outlived the
killed `distqa prepare` (SIGKILL, the OOM killer), and every later build of that folder waited for
ever on "waiting for another process that is preparing features"."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TESTS, subprocess_env
from distqa.nq.feature_folder import LOCK_FILE

HOLDER = r"""
import os, sys, time
from pathlib import Path
from distqa.durable import held_exclusively
with held_exclusively(Path(sys.argv[1]), lambda: None):
    child = os.fork()
    if child == 0:  # as a pool worker: it lives on, doing its share
        os.write(1, b"child\n")  # (its at-fork hooks have run by now; one write: lines do not mix)
        time.sleep(60)
        os._exit(0)
    os.write(1, f"{child}\n".encode())
    time.sleep(60)
"""


def locked_by_someone(lock_file: Path) -> bool:
    fd = os.open(lock_file, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_the_lock_of_a_killed_holder_is_free_though_its_forked_child_lives(tmp_path):
    lock = tmp_path / "folder.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    said = {holder.stdout.readline().strip() for _ in range(2)}  # the child's pid, and the child under way
    child = int(next(line for line in said if line != "child"))
    try:
        assert locked_by_someone(lock)  # held while the holder lives
        holder.kill()
        holder.wait(timeout=10)
        os.kill(child, 0)  # the child lives on ...
        assert not locked_by_someone(lock)  # ... and holds no lock
    finally:
        holder.kill()
        os.kill(child, signal.SIGKILL)


def test_a_forked_child_that_leaves_the_lock_s_block_closes_nothing(tmp_path):
    """Its copy of the descriptor was closed at the fork, and the number may be another file's by
    then: the child's way out of the block must not close it again."""
    from distqa.durable import held_exclusively

    pid = None
    try:
        with held_exclusively(tmp_path / "folder.lock", lambda: None):
            pid = os.fork()
    except OSError:
        if pid == 0:
            os._exit(3)  # the child's close failed: EBADF
        raise
    if pid == 0:
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not locked_by_someone(tmp_path / "folder.lock")


def big_input(path: Path, copies: int) -> Path:
    """The 10 fixture documents `copies` times over, each copy's ids made unique."""
    lines = (TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl").read_text().splitlines()
    with path.open("w") as out:
        for copy in range(copies):
            for line in lines:
                record = json.loads(line)
                record["example_id"] = f"{record['example_id']}-{copy}"
                out.write(json.dumps(record) + "\n")
    return path


@pytest.mark.safety  # a real build of 1,000 documents killed and built again: about half a minute
def test_a_prepare_killed_mid_build_with_a_pool_is_built_again_by_the_same_command(tmp_path, minilm_dir):
    source, out = big_input(tmp_path / "big.jsonl", 100), tmp_path / "features"
    command = [sys.executable, "-m", "distqa", "prepare", "--input", str(source), "--output", str(out)]
    command += ["--num-proc", "2", "--mode", "eval", f"model.tokenizer={minilm_dir}", "task.max_seq_len=128"]
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=subprocess_env())
    children: list[int] = []
    deadline = time.monotonic() + 60
    while len(children) < 2 and time.monotonic() < deadline:  # its pool is at work
        time.sleep(0.2)
        task = Path(f"/proc/{first.pid}/task/{first.pid}/children")
        children = [int(pid) for pid in task.read_text().split()] if task.exists() else []
    try:
        assert len(children) >= 2 and first.poll() is None, "the build ended before its pool was seen"
        first.kill()  # the parent alone, as the OOM killer does
        first.wait(timeout=10)
        # Its pool's processes die with it: the workers, and the pool's manager, which was left an
        # idle orphan for good.
        deadline = time.monotonic() + 10
        while (alive := [pid for pid in children if running(pid)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in alive]
        again = subprocess.run(command, capture_output=True, text=True, timeout=120, env=subprocess_env())
        assert again.returncode == 0, again.stdout + again.stderr
        assert "waiting for another process" not in again.stdout and "wrote " in again.stdout
        assert not locked_by_someone(out / LOCK_FILE)
    finally:
        for pid in children:  # what outlived its parent is this test's to end
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def running(pid: int) -> bool:
    """The process exists and is no zombie (an orphan's end is reaped by init, maybe not at once)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
