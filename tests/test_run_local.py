"""scripts/run_local.sh (what `make train` runs) checks the settings once before torchrun starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, free_port, stop_and_wait, subprocess_env, wait_for_step

RUN_LOCAL = ROOT / "scripts" / "run_local.sh"


def run_local(tmp_path: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess:
    """run_local.sh with a stand-in torchrun first on PATH that records that it was started."""
    fake = tmp_path / "bin" / "torchrun"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/torchrun-args.txt"\n')
    fake.chmod(0o755)
    env = {
        "PATH": os.pathsep.join([str(fake.parent), str(Path(sys.executable).parent), "/usr/bin", "/bin"]),
        "HOME": str(tmp_path),
        "NPROC_PER_NODE": "2",
        # The distqa under test (a checkout's src/ may come before the installed one).
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        **extra_env,
    }
    return subprocess.run(
        ["bash", str(RUN_LOCAL), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_a_bad_key_is_one_line_and_torchrun_never_starts(tmp_path):
    proc = run_local(tmp_path, "--config", "configs/quickstart.yaml", "train.batchsize=4")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "distqa: error: unknown config key 'train.batchsize' in the command line (did you mean train.batch_size?)"
    ]
    assert not (tmp_path / "torchrun-args.txt").exists()


def test_good_settings_start_torchrun_with_them(tmp_path):
    proc = run_local(tmp_path, "--config", "configs/quickstart.yaml", "train.lr=1e-4")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "torchrun-args.txt").read_text().split() == [
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "distqa",
        "train",
        "--config",
        "configs/quickstart.yaml",
        "train.lr=1e-4",
    ]


def test_the_check_imports_no_torch():
    """The check runs before every launch: importing torch would cost seconds each time."""
    code = (
        "import sys\n"
        "from distqa.cli import main\n"
        "rc = main(['train', '--check-config', '--config', 'configs/quickstart.yaml', 'train.lr=1e-4'])\n"
        "print(rc, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0 []"


def test_master_port_gives_a_rendezvous_hosted_here_at_that_port(tmp_path):
    """Two users of one host each pick a port; MASTER_ADDR defaults to localhost."""
    port = free_port()
    proc = run_local(tmp_path, "--config", "configs/quickstart.yaml", MASTER_PORT=str(port))
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "torchrun-args.txt").read_text().split()
    assert "--standalone" not in args
    assert args[: args.index("--nproc-per-node")] == [
        "--nnodes",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"localhost:{port}",
        "--rdzv-conf",
        "is_host=1",
    ]
    proc = run_local(tmp_path, "--config", "configs/quickstart.yaml", MASTER_PORT=str(port), MASTER_ADDR="127.0.0.1")
    assert proc.returncode == 0, proc.stderr
    assert f"127.0.0.1:{port}" in (tmp_path / "torchrun-args.txt").read_text().split()


def test_a_taken_master_port_is_one_line_and_torchrun_never_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_local(tmp_path, "--config", "configs/quickstart.yaml", MASTER_PORT=str(port))
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"run_local.sh: error: port {port} is already in use") and "MASTER_PORT" in line
    assert not (tmp_path / "torchrun-args.txt").exists()


@pytest.mark.parametrize("port", ["abc", "0", "65536", "29500x"])
def test_a_master_port_that_is_no_port_number_is_one_line(tmp_path, port):
    proc = run_local(tmp_path, "--config", "configs/quickstart.yaml", MASTER_PORT=port)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"run_local.sh: error: MASTER_PORT={port} is not a port number (1-65535): "
        "set a free port, or unset it for any free one"
    ]
    assert not (tmp_path / "torchrun-args.txt").exists()


@pytest.mark.parametrize("nproc", ["0", "-1", "abc", ""])
def test_a_process_count_that_is_no_positive_number_is_one_line(tmp_path, nproc):
    """NPROC_PER_NODE=0 was torchrun's 25-line traceback ending in a bare AssertionError. (An empty
    one means unset: one per GPU, 2 without.)"""
    proc = run_local(tmp_path, "--config", "configs/quickstart.yaml", NPROC_PER_NODE=nproc)
    if nproc == "":
        assert proc.returncode == 0, proc.stderr
        return
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"run_local.sh: error: NPROC_PER_NODE={nproc} is not a positive number of processes: "
        "set it, or unset it for one per GPU (2 without)"
    ]
    assert not (tmp_path / "torchrun-args.txt").exists()


def test_help_prints_once_and_launches_nothing(tmp_path):
    proc = run_local(tmp_path, "--help", NPROC_PER_NODE="08")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("usage: distqa train") == 1
    assert not (tmp_path / "torchrun-args.txt").exists()
    proc = run_local(tmp_path, "--config", "configs/quickstart.yaml", NPROC_PER_NODE="08")
    assert (tmp_path / "torchrun-args.txt").read_text().split()[:3] == ["--standalone", "--nproc-per-node", "8"]


@pytest.mark.launch  # a two-process launch under a signal, as worker.sh's: make test-launch
def test_a_sigterm_that_ends_in_a_checkpoint_exits_143_as_worker_sh_does(tmp_path):
    """README: SIGTERM makes every rank checkpoint and exit 143. run_local.sh (which execs
    distqa.torchrun) exited 1 after it, the status of a failure, while worker.sh exited 143."""
    out = tmp_path / "run"
    env = subprocess_env(NPROC_PER_NODE="2")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # the real torchrun
    args = ["model.name=tiny", "task.dummy_size=64", "data.num_workers=0", "train.batch_size=2", "train.log_every=1"]
    cmd = ["bash", str(RUN_LOCAL), *args, "train.max_steps=100000", f"output_dir={out}"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(proc, out, 2)
    finally:
        err = stop_and_wait(proc)  # SIGTERM to run_local.sh, which is torchrun by now (exec)
    assert proc.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("distqa: preempted: stopped by SIGTERM at step "), err[-3000:]


def _ranks_of(out: Path) -> list[int]:
    """The pids of the processes torchrun started for the run writing to `out` (`-u -m distqa train`)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-u" in argv[:2] and b"distqa" in argv and f"output_dir={out}".encode() in argv:
            pids.append(int(entry.name))
    return pids


def _torchrun_of(out: Path) -> int:
    """The pid of the `python -m distqa.torchrun` running the run that writes to `out`."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"distqa.torchrun" in argv and f"output_dir={out}".encode() in argv:
            return int(entry.name)
    raise AssertionError("no distqa.torchrun process found")


@pytest.mark.launch  # a two-process launch under a signal: make test-launch
@pytest.mark.parametrize(
    ("script", "to_torchrun"), [("run_local.sh", False), ("worker.sh", False), ("worker.sh", True)]
)
def test_a_sigterm_while_the_ranks_load_is_a_stop_that_lost_nothing(tmp_path, script, to_torchrun):
    """A SIGTERM once torchrun had started its ranks, before any could checkpoint (each still
    importing: its handler not installed, no `distqa: training:` line), ended every rank at once,
    and torchrun ended in its SignalException's traceback, exit 1: a failure's status, which a
    platform's restart policy may take as final. Now: exit 143 and one line, as before torchrun starts.
    `to_torchrun`: the SIGTERM goes to torchrun itself, not through worker.sh's trap (`kill`, a
    group-wide signal): worker.sh said torchrun was killed and the workers would checkpoint."""
    out = tmp_path / "run"
    env = subprocess_env(NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # the real torchrun
    args = ["model.name=tiny", "task.dummy_size=64", "train.batch_size=2", "train.max_steps=100000"]
    cmd = ["bash", str(ROOT / "scripts" / script), *args, f"output_dir={out}"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(_ranks_of(out)) < 2:  # both ranks exist; importing torch takes them seconds more
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "torchrun started no ranks within 60 s"
            time.sleep(0.02)
        os.kill(_torchrun_of(out) if to_torchrun else proc.pid, signal.SIGTERM)
        printed, err = proc.communicate(timeout=120)
    finally:
        if proc.returncode is None:  # the test failed before its signal, or the launch did not end
            stop_and_wait(proc)
    both = f"stdout:\n{printed[-2000:]}\nstderr:\n{err[-3000:]}"  # the ranks print to stdout
    assert proc.returncode == 143, both
    said = "stopped by SIGTERM before training started: nothing to checkpoint"
    launcher = "distqa" if script == "run_local.sh" else "worker.sh"
    assert err.strip().splitlines()[-1] == f"{launcher}: {said}", both
    assert "Traceback" not in err, both
    assert not out.exists() or not list(out.glob("checkpoints/*"))
