"""The training DataLoader's workers start from a fork server (distqa.loader_server): what they
cannot receive is named in one line, and the server imports the task's modules once."""

from __future__ import annotations

import functools
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from conftest import only_this_process_finalizes, subprocess_env
from distqa import sampler
from distqa.dist import DistInfo
from distqa.errors import ConfigError
from distqa.loader_server import _module_of, as_worker_loss
from distqa.nq.data import pad_collate
from distqa.nq.dummy import DummyDataset
from distqa.registry import load_config
from distqa.runlock import proc_stat

TOY = ["task=toy_task:ToyClassificationTask", "data.num_workers=1", "train.batch_size=2"]
# Rank 0 of 2: the loader of a distributed run, whose workers come from the fork server.
RANK0_OF_2 = DistInfo(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))


def test_a_dataset_that_does_not_pickle_stops_the_run_in_one_line():
    class Local(Dataset):  # a class inside a function: pickle cannot name it
        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> int:
            return index

    cfg = load_config(None, TOY)
    with pytest.raises(ConfigError) as caught:
        sampler.training_batches(Local(), list, cfg, RANK0_OF_2, 0, 0)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("the training dataset (") and "Local" in message
    assert "data.num_workers=0" in message


def test_a_collate_that_does_not_pickle_is_named():
    cfg = load_config(None, TOY)
    with pytest.raises(ConfigError, match=r"^the task's collate_fn \(function\) cannot be pickled"):
        sampler.training_batches(list(range(8)), lambda items: items, cfg, RANK0_OF_2, 0, 0)


def test_without_workers_nothing_is_pickled():
    class Local(Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> int:
            return index

    cfg = load_config(None, [*TOY, "data.num_workers=0"])
    batches = list(sampler.training_batches(Local(), lambda items: items, cfg, RANK0_OF_2, 0, 0))
    assert len(sum(batches, [])) == 4  # rank 0's half, in the workers-off loader


class _CollectsFirst(Dataset):
    """Items whose reading starts with a garbage collection, as a worker's allocations may start one."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        gc.collect()
        return index


def test_a_one_process_run_s_forked_workers_finalize_nothing_they_inherited(tmp_path):
    """One process forks its loader's workers without exec: garbage it had not collected at the fork
    (an earlier epoch's loader iterator, whose finalizer shuts down that epoch's workers) must not be
    finalized in them, even by a collection there (prepare's pool died of that once)."""
    cfg = load_config(None, [*TOY, "data.num_workers=2"])
    one = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    with only_this_process_finalizes(tmp_path / "finalized-by"):
        batches = sampler.training_batches(_CollectsFirst(), list, cfg, one, 0, 0)
        assert batches.iterator._workers[0]._start_method == "fork"  # (the case: a fork server execs)
        assert sorted(sum(batches, [])) == list(range(8))


def test_the_server_preloads_the_modules_a_worker_unpickles():
    partial = functools.partial(pad_collate, pad_id=0, max_len=8)
    assert _module_of(partial) == "distqa.nq.data"
    assert _module_of(DummyDataset(4, 16, vocab_size=2000, seed=0)) == "distqa.nq.dummy"
    assert _module_of(DummyDataset) == "distqa.nq.dummy"
    assert _module_of(DummyDataset(4, 16, vocab_size=2000, seed=0).fingerprint) == "distqa.nq.dummy"
    assert _module_of(list) is None and _module_of([1, 2]) is None  # builtins: nothing to import


# A training process whose loader has started its workers, then killed with SIGKILL (as the OOM
# killer does): it prints its workers' pids and its fork server's first.
_KILLED = """
import os, signal, sys
import torch
from multiprocessing import forkserver
from distqa import sampler
from distqa.registry import load_config
from distqa.dist import DistInfo

cfg = load_config(None, sys.argv[1:])
info = DistInfo(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))  # rank 0 of 2: the server
batches = sampler.training_batches(list(range(64)), list, cfg, info, 0, 0)
next(batches)
print(forkserver._forkserver._forkserver_pid, *(w.pid for w in batches.iterator._workers), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _nothing_left_once_killed(script: str, *args: str, processes: int) -> None:
    """Run `script` (it prints the pids of its loader's processes, then SIGKILLs itself): each of
    them must be gone within 20 s, and the output pipe closed."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *TOY[:1], "data.num_workers=2", *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,  # also the proof that the pipe closed: run() reads it to its end
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    pids = [int(pid) for pid in proc.stdout.split()]
    assert len(pids) == processes, proc.stdout
    deadline = time.monotonic() + 20
    while (alive := [pid for pid in pids if Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"still running after the training process was killed: {alive}"


@pytest.mark.safety  # about 9 s: make test-safety, for make test's 5 minutes
def test_a_killed_training_process_leaves_no_worker_or_server_behind(tmp_path):
    """The workers' parent is the fork server, which lives as long as any worker: without
    `end_with_training_process` both outlived a SIGKILLed training process for good, holding its
    output pipe open (a launcher reading it waited forever)."""
    _nothing_left_once_killed(_KILLED, "train.batch_size=2", processes=3)


# One process (workers forked by it): each worker reads its first item, then hangs in the next (a
# stale network mount); the training process prints its workers' pids and is SIGKILLed.
_HUNG = """
import os, signal, sys, time
import torch
from distqa import sampler
from distqa.registry import load_config
from distqa.dist import DistInfo

class Hangs(torch.utils.data.Dataset):
    served = 0
    def __len__(self):
        return 64
    def __getitem__(self, index):
        Hangs.served += 1
        if Hangs.served > 1:
            time.sleep(300)  # (long past the test: a leftover of a failing run goes by itself)
        return index

cfg = load_config(None, sys.argv[1:])
info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
batches = sampler.training_batches(Hangs(), list, cfg, info, 0, 0)
next(batches)
print(*(w.pid for w in batches.iterator._workers), flush=True)
time.sleep(0.5)  # the workers are in their second item
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.safety  # about 6 s: make test-safety, for make test's 5 minutes
def test_a_worker_stuck_in_an_item_ends_with_its_killed_training_process(tmp_path):
    """PyTorch's watchdog looks for the parent only between two items: a worker stuck in one
    outlived the SIGKILLed training process, holding its output pipe open (found by a review)."""
    _nothing_left_once_killed(_HUNG, "train.batch_size=1", processes=2)


# A worker serves a batch's tensors to its training process through a socket (multiprocessing's
# resource_sharer, as torch's file-descriptor sharing does); the training process connects, takes
# the challenge, and is SIGKILLed before it answers: the worker's serving thread fails. With
# `alive`, the process lives instead, and the worker's own thread fails.
_KILLED_IN_A_HANDSHAKE = """
import multiprocessing, os, signal, socket, sys, threading, time
from multiprocessing import resource_sharer
from distqa.worker_signals import loader_worker_init

def worker(queue):
    loader_worker_init(0)
    resource_sharer.DupFd(os.open(os.devnull, os.O_RDONLY))
    queue.put((os.getpid(), resource_sharer._resource_sharer._address))
    queue.close()
    queue.join_thread()  # (sent before anything here can end this process)
    if sys.argv[1] == "alive":
        start = time.monotonic()
        failing = threading.Thread(target=lambda: 1 / 0)
        failing.start()
        failing.join()
        print(f"{time.monotonic() - start:.3f}", flush=True)
        return
    time.sleep(30)

if __name__ == "__main__":
    queue = multiprocessing.get_context("fork").Queue()
    process = multiprocessing.get_context("fork").Process(target=worker, args=(queue,))
    process.start()
    pid, address = queue.get()
    print(pid, flush=True)
    if sys.argv[1] == "alive":
        process.join()
        sys.exit(process.exitcode)
    peer = socket.socket(socket.AF_UNIX)
    peer.connect(address)
    peer.recv(1)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _handshake(case: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, int]:
    script = tmp_path / "killed.py"  # (a file: the fork context needs a main module to find worker in)
    script.write_text(_KILLED_IN_A_HANDSHAKE)
    proc = subprocess.run(
        [sys.executable, str(script), case], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    # The worker's pid, printed by the parent; with `alive`, the forked worker's own line (its seconds,
    # "0.001") may come first under load.
    return proc, int(next(word for word in proc.stdout.split() if word.isdigit()))


def test_a_training_process_killed_while_taking_a_batch_leaves_no_traceback_in_the_log(tmp_path):
    """Seen in a two-node run whose training process was SIGKILLed: the worker's serving thread
    printed "Traceback (most recent call last):" ... (cut off by the worker's exit) into the node's
    log, which a platform's reader takes for the cause. 5 runs in 6 did before the fix."""
    for _ in range(3):
        proc, worker = _handshake("killed", tmp_path)
        assert proc.returncode == -signal.SIGKILL
        assert "Traceback" not in proc.stderr, proc.stderr
        deadline = time.monotonic() + 20  # (its pipes close as it exits, a moment before it has ended)
        while (proc_stat(worker) or ["X"])[0] not in ("Z", "X") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (proc_stat(worker) or ["X"])[0] in ("Z", "X"), f"worker {worker} still running"


# A new worker reads what the training process writes (the dataset, the collate); the process is
# SIGKILLed while it writes: the worker, slow to read (`Slow`), finds the pickle truncated.
_KILLED_WHILE_STARTING_A_WORKER = """
import os, signal, sys, threading
from distqa.loader_server import loader_context
import slow_to_unpickle

if __name__ == "__main__":
    sleep_s, payload = float(sys.argv[1]), int(sys.argv[2])
    context = loader_context(1, distributed=True)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    context.Process(target=print, args=(slow_to_unpickle.Slow(sleep_s), b"x" * payload)).start()
"""
_SLOW = """
import time

class Slow:
    def __init__(self, sleep_s):
        self.sleep_s = sleep_s

    def __setstate__(self, state):
        time.sleep(state["sleep_s"])
"""


def _start_and_die(tmp_path: Path, sleep_s: float, payload: int) -> tuple[subprocess.CompletedProcess, float]:
    (tmp_path / "slow_to_unpickle.py").write_text(_SLOW)
    (tmp_path / "starts.py").write_text(_KILLED_WHILE_STARTING_A_WORKER)
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "starts.py"), str(sleep_s), str(payload)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # run() reads the pipes to their end: every process holding them is gone
    )
    return proc, time.monotonic() - start


@pytest.mark.safety  # (about 3 s)
def test_a_training_process_killed_while_it_starts_a_worker_leaves_no_traceback(tmp_path):
    """The fork server's child printed `UnpicklingError: pickle data was truncated` with its stack
    into the node's log (found by a review: a dataset held in memory, 20 MB, takes 2 s to start
    2 workers, at every epoch)."""
    proc, _ = _start_and_die(tmp_path, sleep_s=1.5, payload=20_000_000)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.safety  # (about 5 s)
def test_a_worker_whose_dataset_hangs_in_unpickling_ends_with_its_killed_training_process(tmp_path):
    """A fork server's child reads its dataset before `worker_init_fn` starts its watch: one whose
    `__setstate__` hung (a stale mount) outlived the SIGKILLed training process and held its output
    pipe (found by a review: 29 s for a 25 s hang; for ever for a mount that stays stale)."""
    proc, took_s = _start_and_die(tmp_path, sleep_s=60, payload=0)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert took_s < 30, f"the output pipe was held {took_s:.0f} s"


def test_a_worker_s_own_thread_failing_still_prints_its_traceback_at_once(tmp_path):
    """A dataset's own thread failing in a worker is the cause a user needs. A first version of the
    fix waited 2 s for the training process to end before printing any traceback, and a training
    process that ended meanwhile (on the worker's next, secondary error) silenced it (found by a
    review)."""
    proc, _ = _handshake("alive", tmp_path)
    assert proc.returncode == 0
    assert "ZeroDivisionError" in proc.stderr and "Traceback" in proc.stderr, proc.stderr
    assert float(next(word for word in proc.stdout.split() if "." in word)) < 1.0  # printed at once, not after a wait


def test_one_process_forks_its_workers_itself():
    """Without a process group nothing calls into Python unlocked while the trainer forks: plain
    fork, no server to start (about 2 s a run); across processes, the server."""
    cfg = load_config(None, TOY)
    one = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    for info, method in ((one, "fork"), (RANK0_OF_2, "forkserver")):
        batches = sampler.training_batches(list(range(8)), list, cfg, info, 0, 0)
        assert batches.iterator._workers[0]._popen.method == method


@pytest.mark.parametrize(
    "text, said",
    [
        ("DataLoader worker (pid 31952) exited unexpectedly", "(pid 31952) exited unexpectedly: most often the out-of"),
        ("DataLoader worker (pid(s) 12, 13) exited unexpectedly", "(pid 12, 13) exited unexpectedly: most often"),
        ("DataLoader worker (pid 9) is killed by signal: Killed. ", "(pid 9) was killed by signal Killed: most often"),
        (
            "DataLoader worker (pid 9) is killed by signal: Bus error. It is possible that dataloader's workers are "
            "out of shared memory. Please try to raise your shared memory limit.",
            "(pid 9) was killed by signal Bus error: the workers ran out of shared memory (/dev/shm",
        ),
    ],
)
def test_torch_s_words_for_a_dead_worker_become_one_line(text, said):
    """torch's own messages (torch/utils/data/dataloader.py, libtorch_python's signal handling)."""
    line = str(as_worker_loss(RuntimeError(text)))
    assert said in line and line.endswith("then run the same command again to resume from the newest checkpoint")
    assert as_worker_loss(RuntimeError("CUDA out of memory")) is None


@pytest.mark.safety  # a real run, one of its loader workers killed: about 15 seconds
def test_a_loader_worker_killed_mid_run_is_one_line_and_the_same_command_resumes(tmp_path):
    """The OOM killer's usual victim: the run ended in a traceback of some 75 lines."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "distqa", "train", "model.name=tiny", "task.max_seq_len=64"]
    cmd += ["task.dummy_size=4096", "data.num_workers=2", "train.log_every=1", "train.checkpoint_every=10"]
    run = subprocess.Popen(
        [*cmd, "train.max_steps=400", f"output_dir={out}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "step-10").is_dir() and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = [
            pid
            for pid in map(int, subprocess.run(["pgrep", "-f", "."], capture_output=True, text=True).stdout.split())
            if Path(f"/proc/{pid}/comm").exists()
            and Path(f"/proc/{pid}/comm").read_text().strip() == "pt_data_worker"
            and _descends_from(pid, run.pid)
        ]
        assert workers, "no loader worker of the run was found"
        os.kill(workers[0], signal.SIGKILL)
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()
    lines = err.strip().splitlines()
    assert run.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert lines[-1].startswith(f"distqa: error: a DataLoader worker (pid {workers[0]}) "), lines[-1]
    resumed = subprocess.run(
        [*cmd, "train.max_steps=30", f"output_dir={out}"], capture_output=True, text=True, env=subprocess_env()
    )
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-2000:]


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


@pytest.mark.safety  # about 7 s: make test-safety, for make test's 5 minutes
def test_workers_that_read_other_items_than_their_process_stop_the_run_in_one_line(monkeypatch):
    """A module-level value the task set at run time never reached the fork server's workers: they
    trained on scale-1 features while the run recorded scale 10 (config, fingerprint), exit 0."""
    import toy_data_tasks
    from distqa.data_agreement import workers_differ

    cfg = load_config(None, TOY)
    monkeypatch.setattr(toy_data_tasks, "SCALE", 10.0)  # as ScaledTask.build_train_dataset sets it
    dataset = toy_data_tasks.ScaledBlobs(64, seed=1)
    said = workers_differ(dataset, (list, cfg), RANK0_OF_2)
    assert said is not None and "\n" not in said
    assert said.startswith("rank 0: its DataLoader workers make other batches than the process itself")
    assert "module-level value set at run time" in said and "data.num_workers=0" in said
    # The same items there: nothing to say; plain fork (one process) or no workers: never checked.
    monkeypatch.setattr(toy_data_tasks, "SCALE", 1.0)
    assert workers_differ(dataset, (list, cfg), RANK0_OF_2) is None
    monkeypatch.setattr(toy_data_tasks, "SCALE", 10.0)
    one = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    assert workers_differ(dataset, (list, cfg), one) is None
    off = load_config(None, [*TOY, "data.num_workers=0"])
    assert workers_differ(dataset, (list, off), RANK0_OF_2) is None
    # The collate reads it: the same.
    monkeypatch.setattr(toy_data_tasks, "SCALE", 10.0)
    plain = toy_data_tasks.BlobsDataset(64, seed=1)
    said = workers_differ(plain, (toy_data_tasks.scaled_collate, cfg), RANK0_OF_2)
    assert said is not None and "make other batches than the process itself" in said
    # A dataset drawing from a generator of its own: both read the same copy, so the same draws.
    monkeypatch.setattr(toy_data_tasks, "SCALE", 1.0)
    jittered = toy_data_tasks.JitteredBlobs(64, seed=1)
    assert workers_differ(jittered, (list, cfg), RANK0_OF_2) is None


def test_the_workers_check_reads_on_one_thread_as_a_worker_does():
    """Items whose last bits depend on the thread count (a sum over 1M floats) were refused on a
    process with 2 threads, though every training item is made on a worker's one (found by a review)."""
    import toy_data_tasks
    from distqa.data_agreement import sample_digest, workers_differ

    cfg = load_config(None, TOY)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    summing = toy_data_tasks.SummingBlobs(64, seed=1)
    try:
        assert workers_differ(summing, (list, cfg), RANK0_OF_2) is None
        # The ranks' own samples too: two nodes on other thread counts (OMP_NUM_THREADS) agree.
        on_two = sample_digest(summing)
    finally:
        torch.set_num_threads(threads)
    torch.set_num_threads(1)
    try:
        assert sample_digest(summing) == on_two
    finally:
        torch.set_num_threads(threads)


@pytest.mark.safety  # (about 5 s: the server's start, a worker's stall)
def test_a_fork_server_s_worker_killed_is_seen_at_once_not_after_data_timeout_s():
    """A worker from the fork server is not the training process's child (no SIGCHLD), and torch
    looks at its workers only when the DataLoader's timeout ends: with that timeout at
    data.timeout_s, a worker the OOM killer took held the rank 600 s (found by a review)."""
    import toy_data_tasks

    cfg = load_config(None, [*TOY, "data.timeout_s=600"])
    batches = sampler.training_batches(toy_data_tasks.StallingBlobs(64, seed=1), list, cfg, RANK0_OF_2, 0, 0)
    next(batches), next(batches)
    (worker,) = batches.iterator._workers
    time.sleep(0.5)  # in its 5th item: stalled
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid\(s\) \d+\) exited unexpectedly"):
        for _ in batches:
            pass
    assert time.monotonic() - start < 10


class _Worker:
    def __init__(self, pid: int, alive: bool) -> None:
        self.pid, self.alive = pid, alive

    def is_alive(self) -> bool:
        return self.alive


class _Handover:
    """A DataLoader iterator whose batch's tensors could not be fetched: its worker's socket reset."""

    def __init__(self, *workers: _Worker) -> None:
        self._workers = list(workers)

    def __next__(self):
        raise ConnectionResetError(104, "Connection reset by peer")


def test_a_worker_killed_while_it_hands_over_a_batch_is_named_in_one_line(monkeypatch):
    """torch names a dead worker only once it sees it dead; killed mid-handover, the rank ended in a
    ConnectionResetError traceback (seen in a test that killed a worker)."""
    from distqa import loader_server

    monkeypatch.setattr(loader_server, "LIVENESS_S", 0.05)
    with pytest.raises(RuntimeError) as killed:
        next(loader_server.Patient(_Handover(_Worker(7, True), _Worker(8, False)), 600))
    assert "(pid 8) exited unexpectedly: most often the out-of-memory killer" in str(as_worker_loss(killed.value))
    with pytest.raises(ConnectionResetError):  # every worker alive: the error itself
        next(loader_server.Patient(_Handover(_Worker(7, True)), 600))


class _QuotesATimeout(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        if index == 4:  # (a storage library's own words)
            raise RuntimeError("shard 7: DataLoader timed out after 30 seconds")
        return index


def test_a_worker_s_error_that_quotes_torch_s_timeout_stops_the_run_and_skips_no_batch():
    """The first `Patient` asked again on any error holding torch's timeout words: a worker's error
    (its traceback comes back as a RuntimeError's text) then skipped its batch, exit 0 (found by a
    review: batches [0, 1], [2, 3], [6, 7])."""
    one = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    batches = sampler.training_batches(_QuotesATimeout(), list, load_config(None, TOY), one, 0, 0)
    with pytest.raises(RuntimeError, match="Caught RuntimeError in DataLoader worker"):
        list(batches)


class _TimesOut:
    """torch's iterator waiting for a batch, its pin-memory thread dead (CUDA)."""

    def __init__(self, *workers: _Worker) -> None:
        self._workers = list(workers)
        self._pin_memory_thread = threading.Thread(target=lambda: None)
        self._pin_memory_thread.start()
        self._pin_memory_thread.join()

    def __next__(self):
        raise RuntimeError("DataLoader timed out after 1.0 seconds")


def test_a_dead_pin_memory_thread_is_an_error_not_a_wait(monkeypatch):
    """torch looks at that thread only without a timeout: with data.timeout_s=0 the rank waited for
    ever, otherwise for data.timeout_s, then blamed a stuck worker (found by a review)."""
    from distqa import loader_server

    monkeypatch.setattr(loader_server, "LIVENESS_S", 0.05)
    with pytest.raises(RuntimeError, match="^Pin memory thread exited unexpectedly$"):
        next(loader_server.Patient(_TimesOut(_Worker(7, True)), 5))
    with pytest.raises(RuntimeError, match=r"^DataLoader worker \(pid\(s\) 8\) exited unexpectedly$"):
        next(loader_server.Patient(_TimesOut(_Worker(7, True), _Worker(8, False)), 5))


@pytest.mark.safety
def test_a_worker_stuck_in_the_workers_check_stops_at_data_timeout_s():
    """Without the timeout the check held its rank for good, the peers until the process group's
    timeout, then a gloo traceback (found by a review). (Marked: PyTorch gives the stuck worker 5 s
    to end before it is killed.)"""
    import toy_data_tasks
    from distqa.data_agreement import workers_differ

    stalls = load_config(None, [*TOY, "data.timeout_s=2"])
    said = workers_differ(toy_data_tasks.StallingBlobs(64, seed=1), (list, stalls), RANK0_OF_2)
    assert said is not None and said.startswith("rank 0: waited 2 s for a batch from the DataLoader workers")


@pytest.mark.safety
def test_a_task_whose_workers_read_other_data_is_refused_before_any_step(tmp_path):
    """The same at two processes under torchrun, with the workers a user runs with."""
    from conftest import run_train

    args = ["task.name=toy_data_tasks:ScaledTask", "task.size=64", "data.num_workers=1", "train.batch_size=4"]
    proc = run_train([*args, "train.max_steps=2", f"output_dir={tmp_path / 'run'}"], nproc=2, timeout=120, check=False)
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert "its DataLoader workers make other batches than the process itself" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.safety  # about 7 s: make test-safety, for make test's 5 minutes
def test_a_worker_stalled_in_an_item_stops_the_rank_in_one_line_after_data_timeout_s(tmp_path):
    """No timeout: the rank waited for the stuck worker for good (SIGTERM unanswered), its peers
    until the process group's timeout, then a gloo traceback (found by a review)."""
    from distqa.errors import DistqaError
    from distqa.trainer import train

    args = ["task.name=toy_data_tasks:StallingTask", "task.size=64", "data.num_workers=1", "train.batch_size=2"]
    cfg = load_config(None, [*args, "data.timeout_s=2", "train.max_steps=20", f"output_dir={tmp_path / 'run'}"])
    began = time.monotonic()
    with pytest.raises(DistqaError) as caught:
        train(cfg)
    said = str(caught.value)
    assert said.startswith("waited 2 s for a batch from the DataLoader workers (data.timeout_s): a worker is stuck")
    assert "\n" not in said and time.monotonic() - began < 60
    with pytest.raises(ConfigError, match=r"data\.timeout_s"):
        load_config(None, [*args, "data.timeout_s=-1"])


def test_a_stall_names_a_full_dev_shm(tmp_path, monkeypatch):
    """A batch that does not fit in /dev/shm fails in the worker's feeder thread, and the worker
    lives on: the run waited out data.timeout_s, blamed on the data's storage (a review)."""
    import shutil

    from distqa.loader_server import as_worker_loss

    timed_out = RuntimeError("DataLoader timed out after 600 seconds")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(total=2**20, free=2**18))
    said = str(as_worker_loss(timed_out))
    assert "or /dev/shm is full (0.2 of 1.0 MiB free)" in said and "docker run --shm-size" in said
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(total=2**30, free=2**29 + 1))
    assert "/dev/shm" not in str(as_worker_loss(timed_out))
