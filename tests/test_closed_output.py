"""A run outlives what shows it: `distqa train | tee train.log` with the tee gone (Ctrl-C reaches
both; an ssh session closed), or a terminal hung up (SIGHUP). A write to the closed pipe raised
BrokenPipeError from the next print, and SIGHUP killed the process: either way the steps since
the last checkpoint were lost (a review saw `| tee` and Ctrl-C leave no checkpoint)."""

from __future__ import annotations

import errno
import io
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import sigint_default
from distqa.checkpoint import read_trainer_state
from distqa.checkpoint_verify import verify_checkpoint
from distqa.console import _OutlivesItsReader, outlive_closed_output
from toy_task import BlobsDataset, ToyClassificationTask

TESTS = Path(__file__).resolve().parent


class HangUpTask(ToyClassificationTask):
    """SIGHUP to this process during its HANG_UP_AT-th training step (env DISTQA_TEST_HANG_UP_AT),
    as a closing terminal sends it."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.calls = 0
        self.hang_up_at = int(os.environ.get("DISTQA_TEST_HANG_UP_AT", "0"))

    def loss(self, model, batch):
        self.calls += 1
        if self.calls == self.hang_up_at:
            os.kill(os.getpid(), signal.SIGHUP)
        return super().loss(model, batch)


class TalkingBlobs(BlobsDataset):
    """A dataset that prints as DataLoader workers read it (a fork's debugging line): in them only,
    where nothing else wrote to the pipe before (a process's first failed write moves its
    descriptor to /dev/null, which processes it starts later inherit)."""

    def __getitem__(self, index: int):
        if index % 16 == 0 and torch.utils.data.get_worker_info() is not None:
            print(f"reading item {index}", flush=True)
        return super().__getitem__(index)


class TalkingTask(ToyClassificationTask):
    def build_train_dataset(self):
        return TalkingBlobs(self.cfg.task.size, self.cfg.seed)


def test_a_write_to_a_pipe_nobody_reads_goes_to_dev_null_and_the_next_ones_too():
    read_end, write_end = os.pipe()
    stream = _OutlivesItsReader(io.TextIOWrapper(open(write_end, "wb", buffering=0), line_buffering=True))
    os.close(read_end)  # the tee is gone
    try:
        assert stream.write("step 5: loss 1.0\n") == len("step 5: loss 1.0\n")
        stream.flush()
        assert stat.S_ISCHR(os.fstat(write_end).st_mode)  # /dev/null now, the descriptor itself
        print("distqa: preempted: ...", file=stream, flush=True)
        assert stream.isatty() is False and stream.fileno() == write_end  # the rest is the stream's
    finally:
        stream.close()


class _Full(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_other_write_errors_are_not_hidden():
    with pytest.raises(OSError, match="No space left"):
        _OutlivesItsReader(_Full()).write("x\n")


def test_installed_once_over_the_process_streams(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    outlive_closed_output()
    outlive_closed_output()
    assert isinstance(sys.stdout, _OutlivesItsReader) and not isinstance(sys.stdout._stream, _OutlivesItsReader)
    print("x")
    assert sys.stdout.getvalue() == "x\n"


def _train(out: Path, hang_up_at: int, *, nohup: bool = False) -> int:
    """`distqa train` of the toy task, its stdout and stderr on a pipe closed at once (`nohup`:
    started with SIGHUP ignored, as `nohup` starts it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env["DISTQA_TEST_HANG_UP_AT"] = str(hang_up_at)
    args = [
        sys.executable, "-m", "distqa", "train", "task.name=test_closed_output:HangUpTask", "task.size=512",
        "data.num_workers=2", "train.batch_size=8", "train.max_steps=24", "train.log_every=1",
        "train.checkpoint_every=100", "train.eval_every=0", f"output_dir={out}",
    ]  # fmt: skip
    ignore = (lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if nohup else sigint_default
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, preexec_fn=ignore)
    assert proc.stdout is not None
    proc.stdout.close()
    return proc.wait(timeout=240)


@pytest.mark.safety  # three launches of `distqa train` (about 20 s): make test-safety
def test_a_run_whose_pipe_closed_goes_on_and_a_hang_up_checkpoints(tmp_path):
    assert _train(tmp_path / "whole", hang_up_at=0) == 0  # was 1: BrokenPipeError at the first line
    assert (tmp_path / "whole" / "model").is_dir()
    out = tmp_path / "hung-up"
    assert _train(out, hang_up_at=10) == 143  # was -1 (killed by SIGHUP), no checkpoint
    (step,) = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-")]
    assert step == "step-10" and verify_checkpoint(out / "checkpoints" / step) is None
    assert read_trainer_state(out / "checkpoints" / step)["step"] == 10
    # Under nohup a hang-up is ignored, as it always was: the run goes on to its end (a review saw
    # the first version of the SIGHUP stop replace nohup's "ignore" and stop such a run).
    assert _train(tmp_path / "nohup", hang_up_at=10, nohup=True) == 0
    assert (tmp_path / "nohup" / "model").is_dir()


@pytest.mark.safety  # a launch of 2 processes (about 20 s): make test-safety
def test_loader_workers_of_a_launch_outlive_the_pipe_too(tmp_path):
    """Under torchrun the DataLoader's workers come from a fork server, a fresh interpreter: a
    print there to the closed pipe stopped the run, blamed on the data (a review)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    args = [
        sys.executable, "-m", "distqa.torchrun", "--standalone", "--nproc-per-node", "2", "-m", "distqa", "train",
        "task.name=test_closed_output:TalkingTask", "task.size=512", "data.num_workers=1", "train.batch_size=8",
        "train.max_steps=12", "train.log_every=1", f"output_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert proc.stdout is not None
    proc.stdout.close()
    assert proc.wait(timeout=300) == 0
    assert (tmp_path / "run" / "model").is_dir()
