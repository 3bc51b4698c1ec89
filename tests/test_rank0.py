"""`distqa.rank0`: rank 0 does the file work, every rank returns its result or raises its one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from distqa.dist import DistInfo
from distqa.errors import ConfigError, DistqaError
from distqa.rank0 import on_rank0, raise_on_every_rank, reason

ONE = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def test_rank_0s_result_and_errors_in_one_process(tmp_path):
    assert on_rank0(ONE, lambda: 41 + 1) == 42
    with pytest.raises(ConfigError, match="^bad key$"):  # the class is kept
        on_rank0(ONE, lambda: (_ for _ in ()).throw(ConfigError("bad key")))
    missing = tmp_path / "no" / "such"
    with pytest.raises(DistqaError, match=r"^cannot read it \(No such file or directory\): fix it$"):
        on_rank0(ONE, missing.read_text, failure=lambda err: f"cannot read it ({reason(err)}): fix it")
    with pytest.raises(FileNotFoundError):  # without a failure line it is a bug: the traceback stays
        on_rank0(ONE, missing.read_text)
    raise_on_every_rank(None)
    with pytest.raises(DistqaError, match="^full disk$"):
        raise_on_every_rank("full disk")


def test_reason_is_one_line():
    assert reason(OSError(28, "No space left on device")) == "No space left on device"
    assert reason(RuntimeError("first\nsecond")) == "first"
    assert reason(ValueError()) == "ValueError"


TWO_RANKS = """
import os, torch, torch.distributed as dist
from distqa.dist import DistInfo
from distqa.errors import ConfigError, DistqaError
from distqa.rank0 import on_rank0

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
info = DistInfo(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"))
print("result:", on_rank0(info, lambda: f"made by rank {rank}"), flush=True)

def fail():
    raise ConfigError("rank 0 says no")

for work, failure in ((fail, None), (lambda: open("/nonexistent/x"), lambda err: f"cannot open ({err.strerror})")):
    try:
        on_rank0(info, work, failure=failure)
    except DistqaError as err:
        print("raised:", type(err).__name__, err, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.safety
def test_every_rank_learns_rank_0s_result_and_raises_its_error():
    from conftest import free_port, subprocess_env

    port = str(free_port())
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    procs = [
        subprocess.Popen(
            [sys.executable, "-W", "ignore", "-c", TWO_RANKS],
            env=subprocess_env(RANK=str(rank), **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        assert out.splitlines() == [
            "result: made by rank 0",
            "raised: ConfigError rank 0 says no",
            "raised: DistqaError cannot open (No such file or directory)",
        ]
