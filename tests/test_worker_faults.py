"""Faults seen through scripts/worker.sh, the container entrypoint: SIGTERM as platforms send it,
a killed torchrun, a second node 0, and thread counts across node layouts.

Every run uses DataLoader workers (data.num_workers=2) where signals are involved, and the
environment users have (OMP_NUM_THREADS unset: worker.sh picks it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FAULT_RUN, ROOT, free_port, last_step, load_weights, max_abs_diff, subprocess_env
from distqa.checkpoint import list_checkpoints, read_trainer_state, verify_checkpoint
from test_multinode import two_hosts  # noqa: F401  (a fixture)

WORKER = ROOT / "scripts" / "worker.sh"

# Not in `make test` (its 5-minute budget): `make test-launch` (in CI, part of `make test-suites`).
pytestmark = [pytest.mark.slow, pytest.mark.launch]


def worker_env(**extra: str) -> dict[str, str]:
    env = subprocess_env(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]), **extra)
    env.pop("OMP_NUM_THREADS")  # subprocess_env pins it; users do not
    return env


def start_worker(args: list[str], env: dict[str, str], new_session: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        [str(WORKER), *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=new_session,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended before {path.name}: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {path} within {timeout} s"
        time.sleep(0.05)


def test_sigterm_to_worker_sh_checkpoints_exits_143_and_resumes_exactly(tmp_path, fault_straight):
    """rel-preempt-workers: what `docker stop`, Kubernetes and Neu.ro do to the container's PID 1.
    worker.sh picks the thread count (OMP_NUM_THREADS unset): 1 per process, as the straight run had.
    (A SIGTERM to worker.sh's whole process group reaches only worker.sh, since torchrun runs in a
    session of its own: test_worker_env.py's test_sigterm_reaches_torchrun_once... shows it.)"""
    out = tmp_path / "run"
    args = [*FAULT_RUN, f"output_dir={out}"]
    env = worker_env(NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    proc = start_worker(args, env, new_session=True)
    wait_for(out / "checkpoints" / "step-8", proc)  # then inside the second epoch
    proc.send_signal(signal.SIGTERM)
    _, stderr = finish(proc, timeout=120)
    assert proc.returncode == 143, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("distqa: preempted: stopped by SIGTERM at step "), stderr[-3000:]
    step = int(last.split("at step ")[1].split()[0])
    assert 8 <= step < 20
    assert verify_checkpoint(out / "checkpoints" / f"step-{step}") is None

    proc = start_worker(args, env)
    stdout, stderr = finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"step-{step} at step {step}" in stdout, stdout[-2000:]
    assert max_abs_diff(load_weights(out), load_weights(fault_straight)) == 0.0


@pytest.mark.safety
def test_a_sigterm_after_the_export_is_a_success(tmp_path):
    """Must-work 7: a SIGTERM that reaches worker.sh once the last step's checkpoint and model/ are
    written (a platform stopping a job that just finished) ends with exit 0 and the run's ordinary
    last line, not "no checkpoint" and status 1."""
    out = tmp_path / "run"
    args = [*FAULT_RUN, "train.max_steps=4", f"output_dir={out}"]
    proc = start_worker(args, worker_env(NPROC_PER_NODE="2", MASTER_PORT=str(free_port())), new_session=True)
    wait_for(out / "model", proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = finish(proc, timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert stdout.strip().splitlines()[-1].startswith(f"metrics in {out / 'metrics.jsonl'}"), stdout[-2000:]
    assert "error" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert last_step(out) == 4 and verify_checkpoint(out / "checkpoints" / "step-4") is None


# ---- a killed torchrun ------------------------------------------------------------------------


def processes_of(marker: str) -> list[int]:
    """Live processes whose command line names this run (its unique output_dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(x for x in (entry / "status").read_text().splitlines() if x.startswith("State:"))
        except (OSError, StopIteration):
            continue  # ended while we looked
        if marker in cmdline and "zombie" not in state:
            found.append(int(entry.name))
    return found


def child_pids(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.fixture(scope="module")
def killed_torchrun(tmp_path_factory):
    """`kill -9` of the torchrun under worker.sh mid-training; what worker.sh did, and the run's
    command and environment to start it again."""
    tmp = tmp_path_factory.mktemp("orphans")
    out = tmp / "run"
    # Long enough that training processes left running would still be at it 30 s later.
    args = [*FAULT_RUN, "train.max_steps=600", f"output_dir={out}"]
    env = worker_env(NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    # A file, not a pipe: orphaned training processes would hold a pipe open (and keep writing to
    # it) after worker.sh is gone, and reading it to the end would wait for them.
    log = tmp / "stderr.txt"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [str(WORKER), *args], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
        )
    wait_for(out / "metrics.jsonl", proc)
    torchrun = [pid for pid in child_pids(proc.pid) if b"torch" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(torchrun) == 1, torchrun
    os.kill(torchrun[0], signal.SIGKILL)
    killed = time.monotonic()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    yield {
        "status": proc.returncode,
        "stderr": log.read_text(),
        "seconds": time.monotonic() - killed,
        "torchrun": torchrun[0],
        "args": args,
        "env": env,
        "out": out,
    }
    for pid in processes_of(str(out)):  # what outlived the test: this run's own processes only
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_worker_sh_says_torchrun_was_killed_and_exits(killed_torchrun):
    k = killed_torchrun
    assert k["status"] == 128 + signal.SIGKILL and k["seconds"] < 10, k
    # Its last words. Not "the last line": orphaned training processes, until they stop themselves,
    # may still write after it, and a progress bar's unfinished line may come before it.
    last = "worker.sh: " + k["stderr"].rsplit("worker.sh: ", 1)[-1]
    assert last.startswith(f"worker.sh: error: torchrun (pid {k['torchrun']}) was killed by SIGKILL"), last
    assert "Traceback" not in k["stderr"] and "Killed" not in k["stderr"]


def test_no_process_of_a_killed_run_survives_and_the_same_command_runs_again(killed_torchrun):
    """rel-orphans: the training processes notice that torchrun is gone and stop; then the same
    command, on the same MASTER_PORT, completes."""
    k = killed_torchrun
    deadline = time.monotonic() + 30
    while (alive := processes_of(str(k["out"]))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive == [], f"still running 30 s after torchrun was killed: {alive}"
    # The same command, but only 4 steps past the newest checkpoint: what matters is that it starts
    # (port free, run lock released by the dead run) and resumes; 600 steps would take a minute.
    done = list_checkpoints(k["out"] / "checkpoints")
    newest = read_trainer_state(done[-1])["step"] if done else 0
    proc = start_worker([*k["args"], f"train.max_steps={newest + 4}"], k["env"])
    stdout, stderr = finish(proc, timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert last_step(k["out"]) == newest + 4 and (not done or f"step-{newest} at step {newest}" in stdout)


def test_as_a_containers_first_process_worker_sh_waits_for_the_workers_checkpoint(tmp_path):
    """A SIGKILL to torchrun in a container: worker.sh, PID 1, returned at once, and the kernel
    killed the workers mid-checkpoint, while its last line promised that they checkpoint (found
    by a review: only the periodic checkpoints were there). Here PID 1 of a new PID namespace."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"no PID namespace here (unshare: {probe.stderr.decode(errors='replace').strip()[:120]})")
    out = tmp_path / "run"
    # No periodic checkpoint in reach: one at all is the workers' own, on torchrun's loss.
    args = [*FAULT_RUN, "train.max_steps=600", "train.checkpoint_every=1000", f"output_dir={out}"]
    env = worker_env(NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", str(WORKER), *args],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
        )  # fmt: skip
    wait_for(out / "metrics.jsonl", proc)
    launchers = (b"torch.distributed.run", b"distqa.torchrun")
    torchrun = [
        pid for pid in processes_of(str(out)) if any(m in Path(f"/proc/{pid}/cmdline").read_bytes() for m in launchers)
    ]
    assert len(torchrun) == 1, torchrun
    os.kill(torchrun[0], signal.SIGKILL)
    assert proc.wait(timeout=150) == 128 + signal.SIGKILL, log.read_text()[-3000:]
    said = log.read_text()
    assert "the workers left by torchrun have ended" in said, said[-3000:]
    done = list_checkpoints(out / "checkpoints")
    assert done and verify_checkpoint(done[-1]) is None, said[-3000:]
    assert processes_of(str(out)) == []


# ---- two node 0s ------------------------------------------------------------------------------


def in_namespace(host: dict, *cmd: str, **extra: str) -> subprocess.Popen:
    env = worker_env(GLOO_SOCKET_IFNAME=host["veth"], **extra)
    return subprocess.Popen(
        ["ip", "netns", "exec", host["ns"], *cmd],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_second_node_zero_or_a_wrong_address_is_one_line(two_hosts, tmp_path):  # noqa: F811
    hosts, nobody = two_hosts
    fake = tmp_path / "torchrun"
    fake.write_text(f'#!/bin/sh\ntouch "{tmp_path}/torchrun-started"\n')
    fake.chmod(0o755)
    # Node 0 already runs on host 0 (a listener on its rendezvous port stands in for its torchrun).
    first = in_namespace(
        hosts[0],
        sys.executable,
        "-c",
        "import socket, time\ns = socket.create_server(('', 29500))\nprint('up', flush=True)\ntime.sleep(120)",
    )
    try:
        assert first.stdout.readline().strip() == "up"
        second_zero = "another host answers at port 29500 (is a node 0 already running at that address?)"
        for master, rank, expected, remedy in [
            (hosts[0]["addr"], {"NODE_RANK": "0"}, second_zero, "only one node may have NODE_RANK=0"),
            (nobody, {"NODE_RANK": "0"}, "nothing answers at port 29500 from this host", "only one node may"),
            # A worker started without its NODE_RANK takes 0: the message names the missing variable.
            (hosts[0]["addr"], {}, second_zero, "NODE_RANK is not set on this node, so it took 0"),
        ]:
            start = time.monotonic()
            proc = in_namespace(
                hosts[1],
                str(WORKER),
                **rank,
                NNODES="2",
                MASTER_ADDR=master,
                MASTER_PORT="29500",
                RDZV_TIMEOUT="4",
                TORCHRUN=str(fake),
            )
            _, stderr = finish(proc, timeout=60)
            elapsed = time.monotonic() - start
            assert proc.returncode == 2, stderr
            errors = [line for line in stderr.splitlines() if "error" in line]
            assert len(errors) == 1 and errors[0].startswith("worker.sh: error: this is node 0, but MASTER_ADDR="), (
                stderr
            )
            assert master in errors[0] and expected in errors[0] and remedy in errors[0], errors[0]
            assert elapsed < 4 + 10 and not (tmp_path / "torchrun-started").exists()
    finally:
        first.kill()
        first.communicate()
