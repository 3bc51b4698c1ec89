"""scripts/run_docker_nodes.sh against a stand-in `docker` (tests/fakebin/docker) that records its calls."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAKEBIN, fakebin_env, sigint_default, wait_for_call

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "run_docker_nodes.sh"


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    defaults = {
        "RUN_NAME": "t1",
        "RESULTS_DIR": str(tmp_path / "results"),
        "DATA_DIR": str(tmp_path / "no-data"),
    }
    return fakebin_env(tmp_path, **{**defaults, **extra})


def calls(tmp_path: Path, cmd: str = "docker") -> list[list[str]]:
    lines = (tmp_path / "calls.jsonl").read_text().splitlines()
    return [c["argv"] for c in map(json.loads, lines) if c["cmd"] == cmd]


def run_script(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SCRIPT), *args], env=env_for(tmp_path, **env), capture_output=True, text=True, timeout=60, cwd=tmp_path
    )


def env_of(run: list[str]) -> dict[str, str]:
    return dict(run[i + 1].split("=", 1) for i, word in enumerate(run) if word == "-e")


def test_two_cpu_nodes_on_a_user_network(tmp_path):
    proc = run_script(tmp_path, "2", "model.name=tiny", "train.max_steps=3")
    assert proc.returncode == 0, proc.stderr
    docker = calls(tmp_path)
    assert docker[0] == ["network", "inspect", "t1-net"]
    assert docker[1] == ["network", "create", "t1-net"]
    runs = [c for c in docker if c[0] == "run"]
    assert len(runs) == 2
    for rank, run in enumerate(runs):
        name = f"t1-node{rank}"
        assert run[run.index("--name") + 1] == name
        assert run[run.index("--network") + 1] == "t1-net"
        assert run[run.index("--shm-size") + 1] == "8g"
        assert "--gpus" not in run  # no GPU on this host
        assert f"{tmp_path / 'results'}:/app/results" in run
        # The image, then the training arguments untouched, at the very end.
        assert run[-3:] == ["distqa", "model.name=tiny", "train.max_steps=3"]
        env = env_of(run)
        assert env["NNODES"] == "2" and env["NODE_RANK"] == str(rank)
        assert env["DISTQA_OUTPUT_ROOT"] == "/app/results"  # an output_dir elsewhere went with the container
    assert env_of(runs[0])["MASTER_ADDR"] == "self"
    assert env_of(runs[1])["MASTER_ADDR"] == "t1-node0"  # node 0's name on the user network
    assert ["logs", "--follow", "t1-node0"] in docker
    assert ["wait", "t1-node0"] in docker and ["wait", "t1-node1"] in docker
    # Everything it made is removed at the end.
    assert docker[-2:] == [["rm", "-f", "t1-node0", "t1-node1"], ["network", "rm", "t1-net"]]
    assert "step 1 loss" in proc.stdout


def test_gpus_are_split_between_nodes(tmp_path):
    proc = run_script(tmp_path, "2", FAKE_GPUS="4", SHM_SIZE="16g")
    assert proc.returncode == 0, proc.stderr
    runs = [c for c in calls(tmp_path) if c[0] == "run"]
    assert [r[r.index("--gpus") + 1] for r in runs] == ['"device=0,1"', '"device=2,3"']
    assert all(r[r.index("--shm-size") + 1] == "16g" for r in runs)


def test_counts_with_a_leading_zero_are_decimal(tmp_path):
    """GPUS_PER_NODE=08 was a bad octal number to bash: the GPU check and --gpus were skipped, and
    the containers would have trained on the CPU of a GPU host."""
    proc = run_script(tmp_path, "2", FAKE_GPUS="4", GPUS_PER_NODE="02")
    assert proc.returncode == 0, proc.stderr
    runs = [c for c in calls(tmp_path) if c[0] == "run"]
    assert [r[r.index("--gpus") + 1] for r in runs] == ['"device=0,1"', '"device=2,3"']
    proc = run_script(tmp_path, "2", FAKE_GPUS="4", GPUS_PER_NODE="08")
    assert proc.returncode == 2 and "GPUS_PER_NODE=8 x 2 nodes needs 16 GPUs; this host has 4" in proc.stderr


def test_too_few_gpus_is_an_error_before_anything_starts(tmp_path):
    proc = run_script(tmp_path, "3", FAKE_GPUS="2")
    assert proc.returncode == 2
    assert "cannot be split over 3 nodes" in proc.stderr
    assert not (tmp_path / "calls.jsonl").exists() or calls(tmp_path) == []


def test_a_failed_node_fails_the_run_and_everything_is_removed(tmp_path):
    proc = run_script(tmp_path, "3", FAKE_DOCKER_EXIT="t1-node2=1")
    assert proc.returncode == 1
    assert "t1-node2 (exit 1)" in proc.stderr
    docker = calls(tmp_path)
    assert ["rm", "-f", "t1-node0", "t1-node1", "t1-node2"] in docker
    assert docker[-1] == ["network", "rm", "t1-net"]


def test_ctrl_c_removes_every_container(tmp_path):
    proc = subprocess.Popen(
        [str(SCRIPT), "2"],
        env=env_for(tmp_path, FAKE_DOCKER_SLEEP="30"),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=sigint_default,
    )
    wait_for_call(tmp_path, '"wait"', "`docker wait`")
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends on Ctrl-C: the whole foreground group
    _, err = proc.communicate(timeout=20)
    assert proc.returncode != 0
    docker = calls(tmp_path)
    assert ["rm", "-f", "t1-node0", "t1-node1"] in docker
    assert docker[-1] == ["network", "rm", "t1-net"]


def cpuset_of(run: list[str]) -> str | None:
    return run[run.index("--cpuset-cpus") + 1] if "--cpuset-cpus" in run else None


def test_the_hosts_cpus_are_split_between_nodes_and_a_stop_waits_for_the_checkpoint(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))  # the script splits the CPUs it may run on
    proc = run_script(tmp_path, "2")
    assert proc.returncode == 0, proc.stderr
    runs = [c for c in calls(tmp_path) if c[0] == "run"]
    half = len(cpus) // 2
    if half:
        # Disjoint sets: each container's worker.sh gives its processes only its own cores' threads.
        assert [cpuset_of(r) for r in runs] == [
            ",".join(map(str, cpus[:half])),
            ",".join(map(str, cpus[half : 2 * half])),
        ]
        assert all("OMP_NUM_THREADS" not in env_of(r) for r in runs)  # worker.sh derives it from the set
    else:
        assert [env_of(r)["OMP_NUM_THREADS"] for r in runs] == ["1", "1"] and "not pinned" in proc.stderr
    # Docker's own 10 s is usually enough, but a node's checkpoint gets 60 s from a plain `docker stop`.
    assert all(r[r.index("--stop-timeout") + 1] == "60" for r in runs)

    proc = run_script(tmp_path, "2", CPUS_PER_NODE="0", STOP_TIMEOUT="15", OMP_NUM_THREADS="3")
    runs = [c for c in calls(tmp_path) if c[0] == "run"][2:]
    assert [cpuset_of(r) for r in runs] == [None, None]
    assert [env_of(r)["OMP_NUM_THREADS"] for r in runs] == ["3", "3"]  # the user's own choice is kept
    assert all(r[r.index("--stop-timeout") + 1] == "15" for r in runs)

    proc = run_script(tmp_path, "2", CPUS_PER_NODE=str(len(cpus)))
    assert proc.returncode == 2 and f"CPUS_PER_NODE={len(cpus)} x 2 nodes needs" in proc.stderr


def test_a_clean_preemption_of_every_node_is_reported_as_such(tmp_path):
    proc = run_script(tmp_path, "2", FAKE_DOCKER_EXIT="t1-node0=143,t1-node1=143")
    assert proc.returncode == 143, proc.stderr
    assert "all 2 nodes stopped by SIGTERM after a checkpoint (exit 143)" in proc.stderr
    assert "failed" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("distqa: preempted: ")
    # One node preempted, the other failed: a failure.
    proc = run_script(tmp_path, "2", FAKE_DOCKER_EXIT="t1-node0=143,t1-node1=137")
    assert proc.returncode == 1 and "failed: t1-node1 (exit 137)" in proc.stderr


def test_sigterm_to_the_script_stops_every_node_with_a_grace_period(tmp_path):
    proc = subprocess.Popen(
        [str(SCRIPT), "2"],
        env=env_for(tmp_path, FAKE_DOCKER_SLEEP="30", STOP_TIMEOUT="20"),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_call(tmp_path, '"wait"', "`docker wait`")
    proc.send_signal(signal.SIGTERM)  # to the script alone, as a scheduler stops a job
    _, err = proc.communicate(timeout=20)  # not after `docker wait`'s 30 s
    assert "stopping every node (docker stop, up to 20s)" in err
    docker = calls(tmp_path)
    # docker stop (SIGTERM, SIGKILL after the grace period) before anything is removed.
    stop = docker.index(["stop", "-t", "20", "t1-node0", "t1-node1"])
    assert stop < docker.index(["rm", "-f", "t1-node0", "t1-node1"])
    assert ["inspect", "--format", "{{.State.ExitCode}}", "t1-node1"] in docker


def test_usage_errors(tmp_path):
    assert run_script(tmp_path).returncode == 2
    proc = run_script(tmp_path, "two")
    assert proc.returncode == 2 and "NNODES must be a positive integer" in proc.stderr


# ---- scripts/build_image_local.sh without what it needs ---------------------------------------------

BUILD = ROOT / "scripts" / "build_image_local.sh"


def build_without(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """build_image_local.sh with the stand-in docker (no image exists) and only the commands it needs
    before the check that fails: no debootstrap, wherever the real one is installed."""
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").symlink_to(sys.executable)  # the stand-in docker's interpreter
    for tool in ("bash", "env", "dirname", "grep", "awk", "sort", "rm"):
        (bare / tool).symlink_to(shutil.which(tool))
    env = {**fakebin_env(tmp_path, **env), "PATH": f"{FAKEBIN}{os.pathsep}{bare}"}
    return subprocess.run([str(BUILD), *(args or ["distqa:x"])], env=env, capture_output=True, text=True, timeout=60)


def test_build_image_local_without_an_engine_is_one_line(tmp_path):
    proc = build_without(tmp_path, FAKE_DOCKER_INFO="1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "build_image_local.sh: error: no Docker engine answers ('docker info' failed): start dockerd, "
        "or use an account allowed to reach it"
    )
    assert [c[0] for c in calls(tmp_path)] == ["info"]  # nothing built


def test_build_image_local_without_debootstrap_for_the_base_is_one_line(tmp_path):
    proc = build_without(tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "build_image_local.sh: error: making the stand-in base distqa-stand-in-base:torch-2.13.0 needs "
        "debootstrap (apt-get install debootstrap)"
    )
    assert "build" not in [c[0] for c in calls(tmp_path)]


def test_build_image_local_base_only_makes_the_base_and_builds_no_image(tmp_path):
    base = "distqa-stand-in-base:torch-2.13.0"
    proc = build_without(tmp_path, "--base-only", FAKE_DOCKER_IMAGES=base)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"build_image_local.sh: stand-in base {base} ready; no image built (--base-only)"
    )
    assert [c[0] for c in calls(tmp_path)] == ["info", "image"]  # the base looked up, nothing built
    # Without the base, --base-only makes it, and needs what that needs.
    (tmp_path / "again").mkdir()
    proc = build_without(tmp_path / "again", "--base-only")
    assert proc.returncode == 2 and "needs debootstrap" in proc.stderr


@pytest.mark.parametrize("args", [[], ["--base"], ["a", "b"], [""]])
def test_build_image_local_usage(args):
    proc = subprocess.run([str(BUILD), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == "usage: build_image_local.sh TAG | --base-only"


# ---- the Dockerfile and the linters --------------------------------------------------------------


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = (ROOT / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_contract():
    ins = instructions()
    words = [w for w, _ in ins]
    arg_base = [a for w, a in ins if w == "ARG" and a.startswith("BASE_IMAGE=")]
    assert arg_base and arg_base[0].split("=", 1)[1].startswith("pytorch/pytorch:2.13.0-cuda")
    assert ("FROM", "${BASE_IMAGE}") in ins
    runs = " ".join(a for w, a in ins if w == "RUN")
    assert "--mount" not in runs  # Kaniko builds it on Neu.ro
    # torch is pinned to the base image's own build, never reinstalled from PyPI.
    assert "import torch; print(torch.__version__)" in runs and "-c /tmp/requirements.txt" in runs
    assert "--no-deps" in runs
    env = " ".join(a for w, a in ins if w == "ENV")
    assert "PYTHONUNBUFFERED=1" in env and "HF_HOME=/cache/huggingface" in env
    assert ("USER", "1000:1000") in ins and words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN")
    assert ("ENTRYPOINT", '["/app/scripts/worker.sh"]') in ins
    cmd = json.loads(dict(ins)["CMD"])
    # The default command trains the tiny model on the DummyDataset.
    from distqa.registry import load_config

    cfg = load_config(str(ROOT / cmd[cmd.index("--config") + 1]), [a for a in cmd if "=" in a])
    assert cfg.model.name == "tiny" and cfg.data.train == "dummy"
    # Every file the image copies exists, and the build context keeps them.
    copied = [a.split()[0] for w, a in ins if w == "COPY"]
    assert all((ROOT / path).exists() for path in copied), copied


def test_dockerignore_keeps_data_results_venv_git_and_secrets_out():
    patterns = {
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip() and line[0] != "#"
    }
    assert {".git", ".venv", "data", "results", "**/kaggle.json"} <= patterns
    copied = {a.split()[0].rstrip("/") for w, a in instructions() if w == "COPY"}
    assert not copied & patterns  # nothing the image needs is excluded


def test_neuroignore_lists_what_dockerignore_lists():
    """`neuro-flow build` uploads by .neuroignore, `docker build` by .dockerignore: a local cache/
    left out of one only went up as build context (found by a review)."""

    def patterns(name: str) -> set[str]:
        lines = (ROOT / name).read_text().splitlines()
        return {line.strip() for line in lines if line.strip() and not line.startswith("#")}

    assert patterns(".neuroignore") == patterns(".dockerignore")


def test_scripts_pass_shellcheck():
    shellcheck = Path(sys.executable).parent / "shellcheck"
    scripts = sorted(str(p) for p in (ROOT / "scripts").glob("*.sh")) + [str(ROOT / "deploy" / "slurm.sbatch")]
    proc = subprocess.run([str(shellcheck), "--shell=bash", *scripts], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


def test_dockerfile_passes_hadolint():
    hadolint = Path(sys.executable).parent / "hadolint"
    proc = subprocess.run(
        [str(hadolint), "--failure-threshold", "warning", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout
