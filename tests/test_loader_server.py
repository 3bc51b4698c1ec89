"""The training DataLoader's workers start from a fork server (distqa.loader_server): what they
cannot receive is named in one line, and the server imports the task's modules once."""

from __future__ import annotations

import functools
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from conftest import subprocess_env
from distqa import sampler
from distqa.dist import DistInfo
from distqa.errors import ConfigError
from distqa.loader_server import _module_of
from distqa.nq.data import pad_collate
from distqa.nq.dummy import DummyDataset
from distqa.registry import load_config

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
print(forkserver._forkserver._forkserver_pid, *(w.pid for w in batches._workers), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_training_process_leaves_no_worker_or_server_behind(tmp_path):
    """The workers' parent is the fork server, which lives as long as any worker: without
    `end_with_training_process` both outlived a SIGKILLed training process for good, holding its
    output pipe open (a launcher reading it waited forever)."""
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED, *TOY[:1], "data.num_workers=2", "train.batch_size=2"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,  # also the proof that the pipe closed: run() reads it to its end
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    pids = [int(pid) for pid in proc.stdout.split()]
    assert len(pids) == 3, proc.stdout
    deadline = time.monotonic() + 20
    while (alive := [pid for pid in pids if Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"still running after the training process was killed: {alive}"


def test_one_process_forks_its_workers_itself():
    """Without a process group nothing calls into Python unlocked while the trainer forks: plain
    fork, no server to start (about 2 s a run); across processes, the server."""
    cfg = load_config(None, TOY)
    one = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    for info, method in ((one, "fork"), (RANK0_OF_2, "forkserver")):
        batches = sampler.training_batches(list(range(8)), list, cfg, info, 0, 0)
        assert batches._workers[0]._popen.method == method
