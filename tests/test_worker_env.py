"""scripts/worker.sh: how the rendezvous is resolved from the environment.

Most tests use WORKER_DRY_RUN=1, which prints the torchrun command line instead of running it, in a
clean environment (no variable of this machine leaks in). Two tests run the real wait-for-master
path against 127.0.0.1 with a stand-in torchrun.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import fakebin_env, free_port, sigint_default

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "scripts" / "worker.sh"


def base_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Only what a container would have: PATH (stand-in nvidia-smi first) and a log for it."""
    defaults = {
        "WORKER_DRY_RUN": "1",
    }
    return fakebin_env(tmp_path, **{**defaults, **extra})


def worker(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(WORKER), *args], env=base_env(tmp_path, **env), capture_output=True, text=True, timeout=30
    )


def resolved(tmp_path: Path, *args: str, **env: str) -> dict[str, object]:
    """Run the dry run and return torchrun's flags as a dict, plus the training arguments."""
    proc = worker(tmp_path, *args, **env)
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    assert words[0] == "torchrun"
    split = words.index("-m")
    assert words[split : split + 3] == ["-m", "distqa", "train"], words
    flags = words[1:split]
    assert len(flags) % 2 == 0, flags
    out: dict[str, object] = dict(zip(flags[::2], flags[1::2], strict=True))
    out["train_args"] = words[split + 3 :]
    return out


def test_defaults_single_node_on_cpu(tmp_path):
    r = resolved(tmp_path)
    assert r == {
        "--nnodes": "1",
        "--node-rank": "0",
        "--nproc-per-node": "1",
        "--rdzv-backend": "static",
        "--master-addr": "127.0.0.1",
        "--master-port": "29500",
        "--rdzv-conf": "timeout=600",
        "--max-restarts": "0",
        "train_args": [],
    }


def test_train_arguments_pass_through_unchanged(tmp_path):
    args = ["--config", "configs/quickstart.yaml", "output_dir=/runs/a b", "train.lr=1e-4"]
    assert resolved(tmp_path, *args)["train_args"] == args


def test_one_process_per_gpu(tmp_path):
    assert resolved(tmp_path, FAKE_GPUS="4")["--nproc-per-node"] == "4"
    # MIG instances count as one device (CUDA enumerates one): 2 whole GPUs and 2 split, 3 in all.
    assert resolved(tmp_path, FAKE_GPUS="4", FAKE_MIG="2")["--nproc-per-node"] == "3"
    # A scheduler's CUDA_VISIBLE_DEVICES is what this node may use, whatever nvidia-smi lists.
    assert resolved(tmp_path, FAKE_GPUS="8", CUDA_VISIBLE_DEVICES="2,5")["--nproc-per-node"] == "2"
    assert resolved(tmp_path, FAKE_GPUS="8", CUDA_VISIBLE_DEVICES="")["--nproc-per-node"] == "1"
    # Counted as CUDA reads the list: up to the first entry that names no device (",0" counted 2).
    for visible, count in (
        (",0", "1"),
        ("0,,1", "1"),
        ("-1,0", "1"),
        ("GPU-8a1f,MIG-2b3c", "2"),
        (" 1, 3", "2"),
        ("MIG-2b3c,MIG-4d5e", "1"),
    ):
        assert resolved(tmp_path, FAKE_GPUS="8", CUDA_VISIBLE_DEVICES=visible)["--nproc-per-node"] == count, visible


@pytest.mark.parametrize("value", ["cpu", "auto"])
def test_cpu_processes_are_one_per_cpu_this_node_may_use_not_per_host_cpu(tmp_path, value):
    """torchrun's cpu (and auto without a GPU) starts os.cpu_count() processes: the host's every CPU,
    not the container's or cpuset's. worker.sh counts those it may use, as for the threads."""
    cpus = len(os.sched_getaffinity(0))
    assert resolved(tmp_path, NPROC_PER_NODE=value)["--nproc-per-node"] == str(cpus)
    if shutil.which("taskset") is None:
        pytest.skip("util-linux's taskset is not installed")
    proc = subprocess.run(
        ["taskset", "-c", "0", str(WORKER)], env=base_env(tmp_path, NPROC_PER_NODE=value), capture_output=True,
        text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 0 and " --nproc-per-node 1 " in proc.stdout, proc.stdout + proc.stderr
    # With GPUs, auto is torchrun's: one process per GPU.
    if value == "auto":
        assert resolved(tmp_path, NPROC_PER_NODE=value, FAKE_GPUS="4")["--nproc-per-node"] == "auto"


def test_explicit_variables(tmp_path):
    r = resolved(
        tmp_path,
        NNODES="4",
        NODE_RANK="3",
        MASTER_ADDR="10.0.0.1",
        MASTER_PORT="12345",
        NPROC_PER_NODE="8",
        RDZV_TIMEOUT="45",
        MAX_RESTARTS="2",
    )
    assert r["--nnodes"] == "4" and r["--node-rank"] == "3" and r["--nproc-per-node"] == "8"
    assert r["--master-addr"] == "10.0.0.1" and r["--master-port"] == "12345"
    assert r["--rdzv-conf"] == "timeout=45" and r["--max-restarts"] == "2"


def test_master_addr_self_on_node_zero(tmp_path):
    r = resolved(tmp_path, NNODES="2", NODE_RANK="0", MASTER_ADDR="self")
    assert r["--master-addr"] == "127.0.0.1"
    assert r["--nnodes"] == "2"


def test_neuro_internal_hostname_is_this_host(tmp_path):
    host = "job-1234.platform-jobs"
    r = resolved(tmp_path, NNODES="2", MASTER_ADDR="self", NEURO_JOB_INTERNAL_HOSTNAME=host)
    assert r["--master-addr"] == host
    assert resolved(tmp_path, NEURO_JOB_INTERNAL_HOSTNAME=host)["--master-addr"] == host
    # On a worker, NEURO_JOB_INTERNAL_HOSTNAME is the worker itself, never the master.
    r = resolved(
        tmp_path, NNODES="2", NODE_RANK="1", MASTER_ADDR="job-0.platform-jobs", NEURO_JOB_INTERNAL_HOSTNAME=host
    )
    assert r["--master-addr"] == "job-0.platform-jobs"


def test_kubeflow_pytorchjob_pods(tmp_path):
    # Older training operators: WORLD_SIZE and RANK count pods, MASTER_ADDR names the master's service.
    r = resolved(tmp_path, WORLD_SIZE="3", RANK="2", MASTER_ADDR="job-master-0", MASTER_PORT="23456")
    assert (r["--nnodes"], r["--node-rank"]) == ("3", "2")
    assert (r["--master-addr"], r["--master-port"]) == ("job-master-0", "23456")


def test_kubeflow_pet_variables(tmp_path):
    r = resolved(
        tmp_path,
        PET_NNODES="4",
        PET_NODE_RANK="1",
        PET_MASTER_ADDR="job-master-0",
        PET_MASTER_PORT="23456",
        PET_NPROC_PER_NODE="2",
        # A newer operator may count processes in WORLD_SIZE: PET_* win.
        WORLD_SIZE="8",
        RANK="2",
    )
    assert (r["--nnodes"], r["--node-rank"], r["--nproc-per-node"]) == ("4", "1", "2")
    assert (r["--master-addr"], r["--master-port"]) == ("job-master-0", "23456")


def test_pet_variables_do_not_reach_torchrun(tmp_path):
    """torchrun reads PET_* as flag defaults (PET_RDZV_ENDPOINT would switch rendezvous): unset them."""
    fake = tmp_path / "torchrun"
    fake.write_text(
        '#!/bin/sh\nenv | grep "^PET_" > "$(dirname "$0")/pet.txt"\necho "$@" > "$(dirname "$0")/args.txt"\n'
    )
    fake.chmod(0o755)
    proc = worker(
        tmp_path,
        "train.lr=1e-4",
        WORKER_DRY_RUN="0",
        TORCHRUN=str(fake),
        PET_NNODES="1",
        PET_RDZV_ENDPOINT="elsewhere:1234",
        MASTER_ADDR="localhost",  # node 0 checks that it leads here
        MASTER_PORT=str(free_port()),
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "pet.txt").read_text() == ""
    assert (tmp_path / "args.txt").read_text().split()[-3:] == ["distqa", "train", "train.lr=1e-4"]


def test_slurm(tmp_path):
    r = resolved(tmp_path, SLURM_NNODES="4", SLURM_NODEID="2", SLURM_JOB_NODELIST="gpu[01-04,07],cpu1")
    assert (r["--nnodes"], r["--node-rank"], r["--master-addr"]) == ("4", "2", "gpu01")
    # A torch-on-Slurm script's own exports (WORLD_SIZE: its process count) are no Kubeflow pod count:
    # --nnodes was 16 here.
    both = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7"}
    r = resolved(tmp_path, **both, MASTER_ADDR="10.0.0.1", WORLD_SIZE="16", RANK="9")
    assert (r["--nnodes"], r["--node-rank"], r["--master-addr"]) == ("2", "1", "10.0.0.1")


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("node7", "node7"),
        ("node7,node9", "node7"),
        ("gpu[07-09]", "gpu07"),
        ("gpu[12,3-4]", "gpu12"),
        ("rack[2-3]-n[007-009],login1", "rack2-n007"),
        ("a-b-[10-11]", "a-b-10"),
    ],
)
def test_slurm_nodelist_first_host_in_bash(tmp_path, nodelist, first):
    r = resolved(tmp_path, SLURM_NNODES="2", SLURM_NODEID="1", SLURM_JOB_NODELIST=nodelist)
    assert r["--master-addr"] == first


def test_slurm_uses_scontrol_when_present(tmp_path):
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "from-scontrol-1\\nfrom-scontrol-2\\n"\n')
    fake.chmod(0o755)
    env = base_env(tmp_path, SLURM_NNODES="2", SLURM_NODEID="1", SLURM_JOB_NODELIST="weird{form}")
    env["PATH"] = f"{fake.parent}{os.pathsep}{env['PATH']}"
    proc = subprocess.run([str(WORKER)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "--master-addr from-scontrol-1 " in proc.stdout


def test_skypilot(tmp_path):
    r = resolved(
        tmp_path, SKYPILOT_NUM_NODES="3", SKYPILOT_NODE_RANK="2", SKYPILOT_NODE_IPS="10.1.0.5\n10.1.0.6\n10.1.0.7\n"
    )
    assert (r["--nnodes"], r["--node-rank"], r["--master-addr"]) == ("3", "2", "10.1.0.5")


@pytest.mark.parametrize("ips", ["10.1.0.5 10.1.0.6", "\n10.1.0.5\n10.1.0.6", " 10.1.0.5\t10.1.0.6\n"])
def test_skypilot_addresses_in_other_layouts_give_the_first_one(tmp_path, ips):
    """Spaces were deleted, not split on: `10.1.0.5 10.1.0.6` became master 10.1.0.510.1.0.6, and
    a leading blank line gave no master at all (a review)."""
    r = resolved(tmp_path, SKYPILOT_NUM_NODES="2", SKYPILOT_NODE_RANK="1", SKYPILOT_NODE_IPS=ips)
    assert r["--master-addr"] == "10.1.0.5"


def test_the_start_line_says_where_node_counts_came_from_when_no_nnodes_said_it(tmp_path):
    """WORLD_SIZE, which some launchers export as a process count, is read as Kubeflow's pod count:
    the run then waited for nodes that never came, and nothing said where the count came from."""
    fake = recording_torchrun(tmp_path)
    common = dict(WORKER_DRY_RUN="0", TORCHRUN=str(fake), MASTER_ADDR="localhost", MASTER_PORT=str(free_port()))
    proc = worker(tmp_path, **common, WORLD_SIZE="2", RANK="0")
    assert proc.returncode == 0, proc.stderr
    assert "worker.sh: node 0 (from RANK (Kubeflow)) of 2 (from WORLD_SIZE (Kubeflow)), 1 process(es)" in proc.stderr
    common = dict(WORKER_DRY_RUN="0", TORCHRUN=str(fake), MASTER_ADDR="localhost", MASTER_PORT=str(free_port()))
    proc = worker(tmp_path, **common, NNODES="2", NODE_RANK="0")
    assert "worker.sh: node 0 of 2, 1 process(es)" in proc.stderr, proc.stderr


def test_explicit_variables_win_over_schedulers(tmp_path):
    schedulers = dict(
        PET_NNODES="8",
        PET_NODE_RANK="5",
        PET_MASTER_ADDR="kf-master",
        PET_MASTER_PORT="23456",
        SLURM_NNODES="6",
        SLURM_NODEID="4",
        SLURM_JOB_NODELIST="slurm[1-6]",
        SKYPILOT_NUM_NODES="7",
        SKYPILOT_NODE_RANK="6",
        SKYPILOT_NODE_IPS="10.9.9.9",
    )
    r = resolved(tmp_path, NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="29600", **schedulers)
    assert (r["--nnodes"], r["--node-rank"], r["--master-addr"], r["--master-port"]) == ("2", "1", "10.0.0.1", "29600")
    # Kubeflow's PET_* come before Slurm and SkyPilot, Slurm before SkyPilot.
    r = resolved(tmp_path, **schedulers)
    assert (r["--nnodes"], r["--node-rank"], r["--master-addr"]) == ("8", "5", "kf-master")
    no_kf = {k: v for k, v in schedulers.items() if not k.startswith("PET_")}
    r = resolved(tmp_path, **no_kf)
    assert (r["--nnodes"], r["--node-rank"], r["--master-addr"]) == ("6", "4", "slurm1")


def test_an_elastic_node_count_uses_the_c10d_rendezvous_on_node_zero(tmp_path):
    """NNODES=MIN:MAX (also Kubeflow's PET_NNODES of an elastic PyTorchJob): torchrun's c10d
    rendezvous at MASTER_ADDR:MASTER_PORT, hosted by node 0; each node says the address the others
    reach it at (the one it reaches node 0 from), and each round gets a store of its own."""
    r = resolved(tmp_path, "train.lr=1", NNODES="1:2", NODE_RANK="0", MASTER_ADDR="127.0.0.1", RDZV_LAST_CALL="5")
    assert "--node-rank" not in r and "--master-addr" not in r
    assert (r["--nnodes"], r["--rdzv-backend"], r["--rdzv-endpoint"]) == ("1:2", "c10d", "127.0.0.1:29500")
    assert r["--rdzv-conf"] == "join_timeout=600,last_call_timeout=5,is_host=1"
    assert r["--local-addr"] == "127.0.0.1" and r["train_args"] == ["train.lr=1"]
    r = resolved(tmp_path, PET_NNODES="01:4", NODE_RANK="3", MASTER_ADDR="127.0.0.1", LOCAL_ADDR="10.1.2.3")
    assert (r["--nnodes"], r["--local-addr"]) == ("1:4", "10.1.2.3")
    assert r["--rdzv-conf"] == "join_timeout=600,last_call_timeout=30,is_host=0"
    proc = worker(tmp_path, NNODES="1:2", NODE_RANK="1", MASTER_ADDR="no-such-host.invalid")
    assert proc.returncode == 2 and "set LOCAL_ADDR" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, "NODE_RANK=2 (from NODE_RANK) must be below NNODES=2"),
        ({"SLURM_NNODES": "2", "SLURM_NODEID": "3", "SLURM_JOB_NODELIST": "n[1-2]"}, "from SLURM_NODEID"),
        ({"NNODES": "2", "NODE_RANK": "1"}, "no master address is set: set MASTER_ADDR"),
        ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "self"}, "MASTER_ADDR=self"),
        # An address that is no host: a worker waited RDZV_TIMEOUT (600 s) for it (found by a review).
        (
            {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1:29500"},
            "MASTER_ADDR=10.0.0.1:29500 (from MASTER_ADDR) holds a port: give the host alone (10.0.0.1), "
            "and the port as MASTER_PORT",
        ),
        (
            {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1 "},
            "MASTER_ADDR='10.0.0.1 ' (from MASTER_ADDR) holds a space",
        ),
        (
            {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "tcp://node0"},
            "MASTER_ADDR=tcp://node0 (from MASTER_ADDR) is a URL",
        ),
        (
            {"NNODES": "2", "NODE_RANK": "1", "PET_MASTER_ADDR": "h:1"},
            "MASTER_ADDR=h:1 (from PET_MASTER_ADDR) holds a port",
        ),
        ({"MASTER_ADDR": "node0:29500"}, "MASTER_ADDR=node0:29500 (from MASTER_ADDR) holds a port"),
        (
            {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "[::1]:29500"},
            "MASTER_ADDR=[::1]:29500 (from MASTER_ADDR) holds a port: give the host alone ([::1])",
        ),
        ({"NNODES": "zero"}, "NNODES=zero (from NNODES) is not a positive integer"),
        ({"NNODES": "3:2"}, "NNODES=3:2 (from NNODES) is not a node count N or a range MIN:MAX"),
        ({"NNODES": "1:2", "RDZV_LAST_CALL": "soon"}, "RDZV_LAST_CALL=soon"),
        ({"NNODES": "0"}, "NNODES=0"),
        ({"NODE_RANK": "-1"}, "NODE_RANK=-1"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
        ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE=0"),
        ({"NPROC_PER_NODE": "gpu"}, "NPROC_PER_NODE=gpu (from NPROC_PER_NODE), but no GPU is visible here"),
        ({"RDZV_TIMEOUT": "soon"}, "RDZV_TIMEOUT=soon"),
        ({"MAX_RESTARTS": "-3"}, "MAX_RESTARTS=-3"),
        # A misspelt name was ignored: each node trained alone as node 0 of 1, exit 0.
        ({"NNODE": "2"}, "NNODE=2 is set, but worker.sh reads NNODES (unset): did you mean NNODES?"),
        ({"nnodes": "2"}, "nnodes=2 is set, but worker.sh reads NNODES (unset)"),
        ({"NNODES": "2", "NODE_RNAK": "1", "MASTER_ADDR": "h"}, "NODE_RNAK=1 is set, but worker.sh reads NODE_RANK"),
        ({"MASTER_PROT": "29600"}, "did you mean MASTER_PORT?"),
        ({"MASTER_ADR": "10.0.0.1"}, "did you mean MASTER_ADDR?"),
        ({"NPROC_PER_NODES": "2"}, "did you mean NPROC_PER_NODE?"),
    ],
)
def test_errors_are_one_clear_line(tmp_path, env, message):
    proc = worker(tmp_path, **env)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("worker.sh: error: "), proc.stderr
    assert message in lines[0]


@pytest.mark.parametrize(
    "env", [{"NNODE": "2", "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "h"}, {"MASTER_HOST": "h", "RANK": "0"}]
)
def test_names_near_ours_pass_when_ours_is_set_or_they_are_not_one_letter_off(tmp_path, env):
    assert resolved(tmp_path, **env)["--nnodes"] == env.get("NNODES", "1")


# RDZV_TIMEOUT=08 waits its 8 s: make test-launch (the 2 s case stays in make test).
@pytest.mark.parametrize("timeout,seconds", [("2", 2), pytest.param("08", 8, marks=pytest.mark.launch)])
def test_unreachable_master_fails_in_time_with_the_address(tmp_path, timeout, seconds):
    """Nothing listens on the port: the worker gives up after RDZV_TIMEOUT, and never starts torchrun.
    08 is 8 s: bash read it as a bad octal number, skipped the wait, and started torchrun, whose
    traceback the wait exists to replace."""
    port = free_port()
    start = time.monotonic()
    proc = worker(
        tmp_path,
        WORKER_DRY_RUN="0",
        TORCHRUN=str(tmp_path / "must-not-run"),
        NNODES="2",
        NODE_RANK="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RDZV_TIMEOUT=timeout,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 3, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"worker.sh: error: master 127.0.0.1:{port} (from MASTER_ADDR) did not answer")
    assert last.endswith(f"within RDZV_TIMEOUT={seconds}s: is node 0 running, and is that its address?")
    assert seconds - 1 <= elapsed < seconds + 8  # (bash counts whole seconds from its start)


def test_help_prints_the_keys_and_launches_nothing(tmp_path):
    proc = worker(tmp_path, "--help", WORKER_DRY_RUN="0", TORCHRUN=str(tmp_path / "must-not-run"))
    assert proc.returncode == 0, proc.stderr
    assert "usage: distqa train" in proc.stdout and not (tmp_path / "torchrun-started").exists()


def test_numbers_with_a_leading_zero_are_decimal(tmp_path):
    r = resolved(tmp_path, MASTER_PORT="029501", RDZV_TIMEOUT="010", MAX_RESTARTS="02")
    assert (r["--master-port"], r["--rdzv-conf"], r["--max-restarts"]) == ("29501", "timeout=10", "2")


def test_worker_starts_torchrun_once_the_master_answers(tmp_path):
    """Node 0's store (torch's TCPStore, as torchrun's rendezvous hosts it) answers: torchrun starts."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    fake = tmp_path / "torchrun"
    fake.write_text('#!/bin/sh\necho "torchrun $*"\n')
    fake.chmod(0o755)
    port = free_port()
    store = TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    proc = worker(
        tmp_path,
        "train.lr=1e-4",
        WORKER_DRY_RUN="0",
        TORCHRUN=str(fake),
        NNODES="2",
        NODE_RANK="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RDZV_TIMEOUT="20",
    )
    del store
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("torchrun --nnodes 2 --node-rank 1 ")
    assert proc.stdout.split()[-3:] == ["distqa", "train", "train.lr=1e-4"]


def silent(connection: socket.socket) -> None:
    """Accept and never reply (a program that holds the port on node 0's host)."""


def http(connection: socket.socket) -> None:
    """Reply in another protocol and close (a proxy on the address)."""
    connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    connection.close()


# About 11 s each (the probe's least wait is 10 s): make test-launch, for make test's 5 minutes; the
# probe's success (a late store, one that answers at once) is make test's.
@pytest.mark.launch
@pytest.mark.parametrize("answer", [silent, http])
def test_a_port_that_accepts_but_is_not_node_0_s_store_fails_in_time_with_one_line(tmp_path, answer):
    """The silent one held torchrun's rendezvous for ever (RDZV_TIMEOUT does not bound the store's
    handshake); the other ended in a DistNetworkError traceback (`Ping failed ... Got: 1347703880`)."""
    held: list[socket.socket] = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        def serve() -> None:
            while True:
                try:
                    connection, _ = server.accept()
                except OSError:  # closed at the end of the test
                    return
                held.append(connection)
                answer(connection)

        threading.Thread(target=serve, daemon=True).start()
        start = time.monotonic()
        proc = worker(
            tmp_path,
            WORKER_DRY_RUN="0",
            TORCHRUN=str(tmp_path / "must-not-run"),
            NNODES="2",
            NODE_RANK="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RDZV_TIMEOUT="10",
        )
        elapsed = time.monotonic() - start
    for connection in held:
        connection.close()
    assert proc.returncode == 3, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"worker.sh: error: master 127.0.0.1:{port} (from MASTER_ADDR) accepts connections but did")
    assert "did not answer as node 0's rendezvous store within 10s" in last and "Traceback" not in proc.stderr
    assert "Alarm clock" not in proc.stderr  # bash's own line for the probe its alarm ended
    assert elapsed < 30


@pytest.mark.launch  # torch's import in the probe, then a signal: seconds
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_probe_waits_stops_at_once_leaving_no_probe(tmp_path, sig):
    """A platform's SIGTERM to worker.sh alone (PID 1) waited for the probe's end, up to
    RDZV_TIMEOUT (117 s in a review, past Docker's 10 s grace), and a Ctrl-C was lost."""
    with socket.socket() as server:  # accepts, never replies: the probe waits on it
        server.bind(("127.0.0.1", 0))
        server.listen()
        proc = subprocess.Popen(
            [str(WORKER)],
            env=node_1_env(tmp_path, server.getsockname()[1], "120", TORCHRUN=str(tmp_path / "must-not-run")),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        probe = None
        deadline = time.monotonic() + 60
        while probe is None and time.monotonic() < deadline:
            found = subprocess.run(
                ["pgrep", "-f", f"distqa.store_probe 127.0.0.1 {server.getsockname()[1]}"],
                capture_output=True,
                text=True,
            ).stdout.split()
            probe = int(found[0]) if found else time.sleep(0.2)
        assert probe is not None, "the probe never started"
        time.sleep(1)
        start = time.monotonic()
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - start < 5, stderr
    assert proc.returncode == 128 + sig, stderr
    name = signal.Signals(sig).name
    assert (
        stderr.strip().splitlines()[-1]
        == f"worker.sh: stopped by {name} before training started: nothing to checkpoint"
    )
    deadline = time.monotonic() + 2  # a killed process's end is at once; two seconds of slack
    while running(probe) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(probe), f"the probe {probe} outlived worker.sh"


def running(pid: int) -> bool:
    """Whether `pid` is a process that has not ended (a zombie, ended and not yet reaped, has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ---- the deploy/ examples, each as its scheduler would run it --------------------------------


def test_slurm_sbatch_example(tmp_path):
    """deploy/slurm.sbatch under a stand-in srun that runs the task once per node, as Slurm would."""
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text(
        '#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nfor id in 0 1; do SLURM_NODEID=$id "$@" || exit; done\n'
    )
    srun.chmod(0o755)
    env = base_env(
        tmp_path,
        SLURM_SUBMIT_DIR=str(ROOT),
        SLURM_JOB_ID="77",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="gpu[07-08]",
        CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7",
    )
    env["PATH"] = f"{srun.parent}{os.pathsep}{env['PATH']}"
    # A second submission (another job id) names the same folder, so that it resumes the first's run:
    # one per job id trained afresh each time, exit 0.
    for job in ("77", "78"):
        proc = subprocess.run(
            ["bash", str(ROOT / "deploy" / "slurm.sbatch")],
            env={**env, "SLURM_JOB_ID": job},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 0, proc.stderr
        nodes = [shlex.split(line) for line in proc.stdout.splitlines()]
        assert len(nodes) == 2
        for rank, words in enumerate(nodes):
            flags = dict(zip(words[1:17:2], words[2:17:2], strict=True))
            assert flags["--nnodes"] == "2" and flags["--node-rank"] == str(rank)
            assert flags["--master-addr"] == "gpu07" and flags["--nproc-per-node"] == "8"
            assert words[-2:] == ["configs/bert-base.yaml", f"output_dir={ROOT}/results/bert-base"]


def test_skypilot_example(tmp_path):
    import yaml

    task = yaml.safe_load((ROOT / "deploy" / "skypilot.yaml").read_text())
    env = base_env(
        tmp_path,
        **{k: str(v) for k, v in task["envs"].items()},
        SKYPILOT_NUM_NODES=str(task["num_nodes"]),
        SKYPILOT_NODE_RANK="1",
        SKYPILOT_NODE_IPS="10.2.0.4\n10.2.0.9",
    )
    proc = subprocess.run(["bash", "-c", task["run"]], env=env, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    assert words[words.index("--master-addr") + 1] == "10.2.0.4"
    assert words[words.index("--node-rank") + 1] == "1" and words[words.index("--nnodes") + 1] == "2"
    assert words[-3:] == ["--config", "configs/bert-base.yaml", "output_dir=/results/bert-base"]


def test_pytorchjob_example(tmp_path):
    """The elastic manifest's args reach worker.sh (the image's entrypoint) with what the operator
    sets (PET_*) and what the manifest takes from the pod (its replica index, its IP)."""
    import yaml

    job = yaml.safe_load((ROOT / "deploy" / "pytorchjob.yaml").read_text())
    elastic = job["spec"]["elasticPolicy"]
    assert elastic["rdzvBackend"] == "c10d" and list(job["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    spec = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert spec["restartPolicy"] == "OnFailure"
    container = spec["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and "command" not in container  # keep the entrypoint
    for index in range(spec["replicas"]):
        pod = {
            "metadata.labels['training.kubeflow.org/replica-index']": str(index),
            "status.podIP": f"10.8.0.{index + 1}",
        }
        env = {}
        for item in container["env"]:
            if "value" in item:
                env[item["name"]] = item["value"]
            elif "fieldRef" in item["valueFrom"]:
                env[item["name"]] = pod[item["valueFrom"]["fieldRef"]["fieldPath"]]
        r = resolved(
            tmp_path,
            *container["args"],
            **env,
            # what the operator sets in an elastic job's pods
            PET_NNODES=f"{elastic['minReplicas']}:{elastic['maxReplicas']}",
            PET_RDZV_BACKEND="c10d",
            PET_RDZV_ENDPOINT="distqa-bert-base-worker-0:23456",
            PET_MAX_RESTARTS=str(elastic["maxRestarts"]),
            PET_RDZV_ID="distqa-bert-base",
            FAKE_GPUS=str(container["resources"]["limits"]["nvidia.com/gpu"]),
        )
        assert (r["--nnodes"], r["--nproc-per-node"], r["--max-restarts"]) == ("1:2", "8", "20")
        assert (r["--rdzv-backend"], r["--rdzv-endpoint"]) == ("c10d", "distqa-bert-base-worker-0:23456")
        assert r["--rdzv-id"] == "distqa-bert-base" and r["--local-addr"] == f"10.8.0.{index + 1}"
        assert r["--rdzv-conf"] == f"join_timeout=1800,last_call_timeout=30,is_host={int(index == 0)}"
        assert r["train_args"] == container["args"]
    # Training downloads nothing: the Kaggle secret is not the training pods' to see.
    assert not [item for item in container["env"] if "KAGGLE" in item["name"]], container["env"]


# ---- checks before torchrun starts (all with a stand-in torchrun that records its start) --------


def node_1_env(tmp_path: Path, port: int, rdzv_timeout: str, **extra: str) -> dict[str, str]:
    """A worker node's environment (node 1 of 2, a recording torchrun) whose node 0 is 127.0.0.1:`port`."""
    return base_env(
        tmp_path,
        **{
            "WORKER_DRY_RUN": "0",
            "TORCHRUN": str(recording_torchrun(tmp_path)),
            "NNODES": "2",
            "NODE_RANK": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RDZV_TIMEOUT": rdzv_timeout,
            **extra,
        },
    )


def recording_torchrun(tmp_path: Path) -> Path:
    fake = tmp_path / "torchrun"
    fake.write_text(f'#!/bin/sh\necho "torchrun $*"\ntouch "{tmp_path}/torchrun-started"\n')
    fake.chmod(0o755)
    return fake


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The one `worker.sh: error:` line; the start note before it is allowed."""
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("worker.sh: node ")]
    assert len(lines) == 1 and lines[0].startswith("worker.sh: error: "), proc.stderr
    return lines[0]


def test_node_zero_says_when_the_port_is_in_use(tmp_path):
    with socket.socket() as other:  # another program holding the port, on one address only
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        start = time.monotonic()
        proc = worker(tmp_path, WORKER_DRY_RUN="0", TORCHRUN=str(recording_torchrun(tmp_path)), MASTER_PORT=str(port))
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert (
        f"port {port} is already in use on this host" in line
        and f"set MASTER_PORT to a free port, e.g. {port + 1}" in line
    )
    assert not (tmp_path / "torchrun-started").exists()
    assert time.monotonic() - start < 10


def test_node_zero_says_when_its_master_addr_does_not_resolve(tmp_path):
    start = time.monotonic()
    proc = worker(
        tmp_path,
        WORKER_DRY_RUN="0",
        TORCHRUN=str(recording_torchrun(tmp_path)),
        NNODES="2",
        MASTER_ADDR="no-such-host.invalid",
        MASTER_PORT=str(free_port()),
        RDZV_TIMEOUT="3",
    )
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "MASTER_ADDR=no-such-host.invalid (from MASTER_ADDR) does not resolve" in line, line
    assert line.endswith("set it to this host's name or address, or to `self`"), line
    assert not (tmp_path / "torchrun-started").exists()
    assert time.monotonic() - start < 3 + 10


def test_the_check_offers_self_only_to_a_caller_that_reads_it(capsys):
    """run_local.sh's check (no --knows-self) advised MASTER_ADDR=self, which only worker.sh reads."""
    from distqa import rdzv_check

    args = ["--prog", "run_local.sh", "--addr", "no-such-host.invalid", "--port", str(free_port()), "--timeout", "1"]
    assert rdzv_check.main(args) == 2
    line = capsys.readouterr().err.strip()
    assert "does not resolve" in line and line.endswith("set it to this host's name or address"), line


def test_node_zero_with_its_own_address_starts_torchrun(tmp_path):
    """The nonce check finds this host behind 127.0.0.1 and `localhost`, and frees the port for torchrun."""
    for addr in ("self", "localhost"):
        port = free_port()
        proc = worker(
            tmp_path,
            WORKER_DRY_RUN="0",
            TORCHRUN=str(recording_torchrun(tmp_path)),
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
        )
        assert proc.returncode == 0, proc.stderr
        with socket.socket() as again:  # what torchrun does next: the check left the port free
            again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            again.bind(("", port))


def test_a_bad_setting_is_one_line_before_torchrun(tmp_path):
    proc = worker(
        tmp_path,
        "train.batchsize=4",
        WORKER_DRY_RUN="0",
        TORCHRUN=str(recording_torchrun(tmp_path)),
        MASTER_PORT=str(free_port()),
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("worker.sh: node ")]
    assert lines == [
        "distqa: error: unknown config key 'train.batchsize' in the command line (did you mean train.batch_size?)"
    ]
    assert not (tmp_path / "torchrun-started").exists()


def test_worker_waits_for_a_master_that_starts_late(tmp_path):
    """Node 0's store opens its port 2 s after the worker started: the worker waits, then starts
    torchrun."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    port = free_port()
    start = time.monotonic()
    proc = subprocess.Popen(
        [str(WORKER), "train.lr=1e-4"],
        env=node_1_env(tmp_path, port, "20"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(2)
    assert proc.poll() is None and not (tmp_path / "torchrun-started").exists(), proc.communicate()
    store = TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    stdout, stderr = proc.communicate(timeout=120)  # CI runs this file at the lowest CPU priority
    del store
    assert proc.returncode == 0, stderr
    assert "waiting up to 20s for the master" in stderr
    assert stdout.startswith("torchrun --nnodes 2 --node-rank 1 ") and time.monotonic() - start >= 2


@pytest.mark.launch
def test_a_store_that_answers_is_found_however_long_the_probe_s_torch_import_takes(tmp_path):
    """The probe's seconds start after torch's import: at the lowest CPU priority on a busy machine
    the import took longer than the wait (CI's torch-floor step), and an answering store was called
    "not node 0's store". Here the import is made 12 s slower than RDZV_TIMEOUT=10 allows."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    slow = tmp_path / "slow-import"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import sys, time\nif 'distqa.store_probe' in sys.orig_argv:\n    time.sleep(12)\n"
    )
    port = free_port()
    store = TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    proc = subprocess.run(
        [str(WORKER), "train.lr=1e-4"],
        env={**node_1_env(tmp_path, port, "10"), "PYTHONPATH": str(slow)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    del store
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("torchrun --nnodes 2 --node-rank 1 "), proc.stdout


# ---- threads per process ---------------------------------------------------------------------


def threads(tmp_path: Path, *prefix: str, **env: str) -> str:
    """OMP_NUM_THREADS as the (dry-run) worker.sh reports it."""
    proc = subprocess.run(
        [*prefix, str(WORKER)], env=base_env(tmp_path, **env), capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def test_threads_share_the_cpus_this_node_may_use(tmp_path):
    cpus = len(os.sched_getaffinity(0))
    assert threads(tmp_path, NPROC_PER_NODE="1") == f"worker.sh: OMP_NUM_THREADS={cpus} ({cpus} CPU(s) / 1 process(es))"
    per = max(1, cpus // 2)
    assert threads(tmp_path, NPROC_PER_NODE="2") == f"worker.sh: OMP_NUM_THREADS={per} ({cpus} CPU(s) / 2 process(es))"
    # 010 is ten processes (bash read it as octal 8, and 08 as an error that left the threads unset).
    assert threads(tmp_path, NPROC_PER_NODE="010").endswith(" / 10 process(es))")
    assert threads(tmp_path, NPROC_PER_NODE="08").endswith(" / 8 process(es))")
    # More processes than CPUs: still one thread each, never zero.
    assert threads(tmp_path, NPROC_PER_NODE=str(cpus + 1)).startswith("worker.sh: OMP_NUM_THREADS=1 (")
    # An explicit value wins.
    assert threads(tmp_path, NPROC_PER_NODE="1", OMP_NUM_THREADS="3") == "worker.sh: OMP_NUM_THREADS=3 (set)"
    for bad in ("abc", "0", "4 "):  # OpenMP ignored it with a warning, and every CPU got a thread (a review)
        proc = worker(tmp_path, NPROC_PER_NODE="1", OMP_NUM_THREADS=bad)
        assert proc.returncode == 2 and f"OMP_NUM_THREADS={bad} is not a thread count" in proc.stderr


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_threads_follow_a_cgroup_cpu_quota(tmp_path, version):
    """`docker run --cpus 1`: a v1 host's quota (cpu/cpu.cfs_quota_us) was not read, and every CPU
    of the host got a thread (a review)."""
    root = tmp_path / "cgroup"
    (root / "cpu").mkdir(parents=True)
    cpus = len(os.sched_getaffinity(0))
    for quota, expected in (("100000", 1), ("max" if version == "v2" else "-1", cpus)):
        if version == "v2":
            (root / "cpu.max").write_text(f"{quota} 100000\n")
        else:
            (root / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
            (root / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
        said = threads(tmp_path, NPROC_PER_NODE="1", CGROUP_ROOT=str(root))
        assert said == f"worker.sh: OMP_NUM_THREADS={expected} ({expected} CPU(s) / 1 process(es))"


def test_threads_follow_the_cpu_affinity(tmp_path):
    """A node pinned to one CPU (taskset, a cpuset) gets one thread per process."""
    if shutil.which("taskset") is None:
        pytest.skip("util-linux's taskset is not installed")
    assert threads(tmp_path, "taskset", "-c", "0", NPROC_PER_NODE="1") == (
        "worker.sh: OMP_NUM_THREADS=1 (1 CPU(s) / 1 process(es))"
    )


# ---- SIGTERM, with a stand-in torchrun -------------------------------------------------------

# Records its process group and how many SIGTERMs reach it; then ends as torchrun does after one
# (status 1), leaving a preempted line in DISTQA_ERROR_FILE as distqa's ranks would when PREEMPTED=1.
TERM_COUNTING_TORCHRUN = """#!/bin/bash
n=0
trap 'n=$((n + 1))' TERM
read -r _ _ _ _ pgid _ </proc/$$/stat
echo "$pgid" >"$DIR/pgid"
echo "$DISTQA_ERROR_FILE" >"$DIR/outcome-file"
echo "${TMPDIR:-}" >"$DIR/tmpdir"
touch "$DIR/ready"
for _ in $(seq 100); do ((n > 0)) && break; sleep 0.1; done
for _ in $(seq 15); do sleep 0.1; done  # time for a second SIGTERM to arrive, if one does
echo "$n" >"$DIR/terms"
if [[ ${TRAINING:-1} == 1 ]]; then
  echo "distqa: training: local rank 0 of 2" >>"$DISTQA_ERROR_FILE"
fi
if [[ $PREEMPTED == 1 ]]; then
  echo "distqa: preempted: stopped by SIGTERM at step 7 of 9; ..." >>"$DISTQA_ERROR_FILE"
fi
for ((rank = 0; rank < ${FINISHED:-0}; rank++)); do
  echo "distqa: finished: local rank $rank of 2" >>"$DISTQA_ERROR_FILE"
done
exit 1
"""


def sigterm_twice(
    tmp_path: Path,
    preempted: str,
    finished: str = "0",
    first: signal.Signals = signal.SIGTERM,
    *,
    close_output: bool = False,
    **extra: str,
) -> tuple[subprocess.Popen, str]:
    fake = tmp_path / "torchrun"
    fake.write_text(TERM_COUNTING_TORCHRUN)
    fake.chmod(0o755)
    env = base_env(
        tmp_path,
        WORKER_DRY_RUN="0",
        TORCHRUN=str(fake),
        MASTER_PORT=str(free_port()),
        DIR=str(tmp_path),
        PREEMPTED=preempted,
        FINISHED=finished,
        **extra,
    )
    proc = subprocess.Popen(
        [str(WORKER)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=sigint_default,
    )
    deadline = time.monotonic() + 20
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    if close_output:  # what shows it is gone: a `| tee` ended, a terminal closed
        for stream in (proc.stdout, proc.stderr):
            stream.close()  # type: ignore[union-attr]
    os.killpg(proc.pid, first)  # the whole group, as a supervisor, `kill -- -PGID` or a terminal's Ctrl-C does
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)  # an impatient second one, to worker.sh only
    if close_output:
        proc.wait(timeout=20)
        return proc, ""
    _, stderr = proc.communicate(timeout=20)
    return proc, stderr


def test_sigterm_reaches_torchrun_once_and_143_needs_distqa_preempted_line(tmp_path):
    proc, stderr = sigterm_twice(tmp_path, preempted="1")
    # torchrun is outside worker.sh's process group, and the second SIGTERM was not passed on:
    # either would abort torchrun's wait for the workers' checkpoint.
    assert int((tmp_path / "pgid").read_text()) != proc.pid
    assert (tmp_path / "terms").read_text().strip() == "1"
    assert "SIGTERM again: ignored" in stderr
    assert proc.returncode == 143
    assert stderr.strip().splitlines()[-1] == "distqa: preempted: stopped by SIGTERM at step 7 of 9; ..."


@pytest.mark.launch  # about 4 s: make test-launch, for make test's 5 minutes
@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGHUP, 129)], ids=["SIGINT", "SIGHUP"])
def test_ctrl_c_stops_as_sigterm_does_with_a_checkpoint_and_130(tmp_path, sig, status):
    """SIGINT (Ctrl-C on an attached `docker run`) was passed on as SIGINT: a KeyboardInterrupt
    traceback from every rank, and the steps since the last checkpoint lost. SIGHUP (a terminal
    closed) killed the script and left torchrun, in its own session, training unseen."""
    proc, stderr = sigterm_twice(tmp_path, preempted="1", first=sig)
    assert (tmp_path / "terms").read_text().strip() == "1"  # torchrun got one SIGTERM
    assert proc.returncode == status
    assert stderr.strip().splitlines()[-1] == "distqa: preempted: stopped by SIGTERM at step 7 of 9; ..."


def test_a_hang_up_with_nobody_reading_still_waits_for_the_checkpoint(tmp_path):
    """The terminal closed: every line worker.sh wrote failed, and `set -e` (or SIGPIPE) ended it at
    once, exit 1, its second signal not ignored, torchrun's workers still checkpointing (a review)."""
    proc, _ = sigterm_twice(tmp_path, preempted="1", first=signal.SIGHUP, close_output=True)
    assert proc.returncode == 129
    assert (tmp_path / "terms").read_text().strip() == "1"


def test_the_outcome_file_falls_back_to_dev_shm_where_tmpdir_cannot_be_written(tmp_path):
    """A read-only root file system: the ranks could not say how the run ended, and a checkpointed
    preemption was reported as 'no checkpoint', exit 1."""
    proc, stderr = sigterm_twice(tmp_path, preempted="1", TMPDIR=str(tmp_path / "missing"))
    assert proc.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1] == "distqa: preempted: stopped by SIGTERM at step 7 of 9; ..."
    used = Path((tmp_path / "outcome-file").read_text().strip())
    assert used.parent == Path("/dev/shm") and used.name.startswith("distqa-error.")
    # torchrun's `import torch` found no temp folder either (a traceback): the run's TMPDIR is /dev/shm.
    assert (tmp_path / "tmpdir").read_text().strip() == "/dev/shm"
    assert f"{tmp_path / 'missing'} (TMPDIR) cannot be written (a read-only root file system?)" in stderr
    assert not used.exists()  # removed at the end


def test_sigterm_without_a_checkpoint_is_not_reported_as_143(tmp_path):
    proc, stderr = sigterm_twice(tmp_path, preempted="0")
    assert proc.returncode == 1
    assert (
        stderr.strip()
        .splitlines()[-1]
        .startswith("worker.sh: error: stopped by SIGTERM, but distqa confirmed no checkpoint (torchrun exited 1)")
    )


def test_sigterm_while_the_ranks_load_is_a_preemption_that_lost_nothing(tmp_path):
    """No rank had begun to train (none wrote `distqa: training:`): exit 143, not a failure's 1,
    which a platform's restart policy (Kubeflow's ExitCode) takes as permanent."""
    proc, stderr = sigterm_twice(tmp_path, preempted="0", TRAINING="0")
    assert proc.returncode == 143
    assert (
        stderr.strip().splitlines()[-1]
        == "worker.sh: stopped by SIGTERM before training started: nothing to checkpoint"
    )


@pytest.mark.launch  # about 4 s: make test-launch, for make test's 5 minutes
def test_sigterm_after_every_rank_finished_is_a_success(tmp_path):
    """Must-work 7: both local ranks wrote `distqa: finished:` before the SIGTERM: exit 0 and no line
    of worker.sh's own, whatever torchrun's status; one rank short of that is still a failure."""
    proc, stderr = sigterm_twice(tmp_path, preempted="0", finished="2")
    assert proc.returncode == 0, stderr
    assert [line for line in stderr.splitlines() if "error" in line] == []
    (tmp_path / "short").mkdir()
    proc, stderr = sigterm_twice(tmp_path / "short", preempted="0", finished="1")
    assert proc.returncode == 1 and "distqa confirmed no checkpoint" in stderr.splitlines()[-1], stderr


def test_sigterm_before_torchrun_starts_ends_at_once_with_143(tmp_path):
    """A node waiting for node 0 (or still checking its settings) has nothing to checkpoint: a SIGTERM
    ends it at once. Without a trap, bash as a container's PID 1 ignores SIGTERM, and `docker stop`
    would end in SIGKILL (137) after its grace period."""
    env = base_env(tmp_path, WORKER_DRY_RUN="0", NNODES="2", NODE_RANK="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()), RDZV_TIMEOUT="60")  # fmt: skip
    proc = subprocess.Popen([str(WORKER)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    while "waiting up to 60s for the master" not in (line := proc.stderr.readline()):
        assert line, "worker.sh ended before it waited for the master"
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 143
    assert time.monotonic() - started < 8  # within Docker's 10 s
    assert stderr.strip().splitlines()[-1] == (
        "worker.sh: stopped by SIGTERM before training started: nothing to checkpoint"
    )


# ---- restart rounds: only the last round's lines say how the run ended -------------------------

# Writes two restart rounds' lines as distqa's ranks would (FIRST, then LAST: "preempted" or
# "error"), and ends as torchrun does when its last round failed (status 1), no signal sent.
ROUNDS_TORCHRUN = """#!/bin/bash
say() {
  case $2 in
    preempted) echo "distqa: preempted: stopped at step $3 to restart with the nodes there are; ..." ;;
    error) echo "distqa [rank 0]: error: lost a peer at step $3: ..." ;;
  esac >>"$DISTQA_ERROR_FILE"
}
for round in 0 1; do
  echo "distqa: round: $round" >>"$DISTQA_ERROR_FILE"  # as distqa.torchrun's agent marks it
  echo "distqa: training: local rank 0 of 1" >>"$DISTQA_ERROR_FILE"
  if ((round == 0)); then say 0 "$FIRST" 40; else say 1 "$LAST" 74; fi
done
exit 1
"""


@pytest.mark.parametrize(
    ("first", "last", "status", "said"),
    [
        ("preempted", "error", 1, "distqa [rank 0]: error: lost a peer at step 74: ..."),
        ("error", "preempted", 143, "distqa: preempted: stopped at step 74 to restart with the nodes there are; ..."),
    ],
)
def test_an_earlier_restart_rounds_line_does_not_decide_how_the_run_ended(tmp_path, first, last, status, said):
    """A node joining made every rank checkpoint (a preempted line); a peer lost rounds later, with
    no restart left, exited 143, as if stopped after a checkpoint (found by a review)."""
    fake = tmp_path / "torchrun"
    fake.write_text(ROUNDS_TORCHRUN)
    fake.chmod(0o755)
    env = base_env(
        tmp_path, WORKER_DRY_RUN="0", TORCHRUN=str(fake), MASTER_PORT=str(free_port()), FIRST=first, LAST=last
    )
    proc = subprocess.run([str(WORKER)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == status, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == said


@pytest.mark.parametrize("addr", ["fd00::1", "[fd00::1]", "node-0.cluster.local", "10.0.0.1"])
def test_a_host_name_or_address_passes_the_address_check(tmp_path, addr):
    """The check for a port or URL in MASTER_ADDR takes an IPv6 address (two colons or more) as an address."""
    r = resolved(tmp_path, NNODES="2", NODE_RANK="1", MASTER_ADDR=addr, LOCAL_ADDR="10.1.2.3")
    assert r["--master-addr"] == addr


@pytest.mark.parametrize(
    ("args", "extra", "message"),
    [
        ([], {}, "NNODES=1:2 x NPROC_PER_NODE=1 lets the number of processes change (1, 2), and a checkpoint"),
        (
            ["train.global_batch=4", "train.batch_size=4"],
            {},
            "train.global_batch=4 cannot be split over 2 process(es) of train.batch_size=4",
        ),
        (
            ["train.global_batch=8", "train.batch_size=2", "train.grad_accum=4"],
            {},
            "train.grad_accum=4 contradicts train.global_batch=8 (2 process(es) x train.batch_size=2 need 2)",
        ),
        # One process per GPU, counted for the check (the first version stopped on `gpu` itself).
        (
            ["train.global_batch=8", "train.batch_size=4"],
            {"NPROC_PER_NODE": "gpu", "FAKE_GPUS": "2"},
            "train.global_batch=8 cannot be split over 4 process(es) of train.batch_size=4",
        ),
    ],
    ids=["no-global-batch", "global-batch-splits-one-count-only", "grad-accum-set-too", "one-per-gpu"],
)
def test_an_elastic_launch_whose_global_batch_a_node_count_breaks_is_refused_before_torchrun(
    tmp_path, args, extra, message
):
    """Found by reviews: the run trained alone until node 1 joined, then every round stopped on
    both nodes (a finished, exported run too), exit 1. Now worker.sh's settings check, before
    torchrun, is given every process count MIN..MAX allows and applies each round's rule to each."""
    env = {"NNODES": "1:2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "WORKER_DRY_RUN": "0", **extra}
    proc = worker(tmp_path, "model.name=tiny", f"output_dir={tmp_path / 'run'}", *args, **env)
    assert proc.returncode == 2 and f"distqa: error: {message}" in proc.stderr, proc.stderr
    assert "torchrun" not in proc.stderr and not (tmp_path / "run").exists()
