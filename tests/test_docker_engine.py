"""The image built by a Docker engine and run the way platforms run it (`make test-docker`).

One build per session: `scripts/build_image_local.sh` builds the real Dockerfile on its CPU stand-in
for the pytorch/pytorch base (the first build makes the base, a few minutes; later ones reuse it and
Docker's layer cache). Where no engine answers, or the base cannot be made here, every test is skipped
with the reason. Not checked here: the real base tag, CUDA, `docker run --gpus`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOT, SGD, last_step, load_weights, max_abs_diff, run_train
from distqa.checkpoint import verify_checkpoint

pytestmark = pytest.mark.docker

SCRIPT = ROOT / "scripts" / "build_image_local.sh"
IMAGE = "distqa:test"
# Containers and networks of this session carry this prefix, so cleanup removes only our own.
PREFIX = f"distqa-test-{os.getpid()}"
TORCH_PIN = next(line for line in (ROOT / "requirements.txt").read_text().splitlines() if line.startswith("torch=="))


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def engine_missing() -> str | None:
    if shutil.which("docker") is None:
        return "no docker command (.ci/run installs docker.io and starts dockerd)"
    info = docker("info", "--format", "{{.ServerVersion}}", timeout=60, check=False)
    if info.returncode != 0:
        said = info.stderr.strip().splitlines()
        return f"no Docker engine answers (docker info): {said[-1] if said else info.returncode}"
    return None


@pytest.fixture(scope="session")
def build_log(tmp_path_factory) -> str:
    """Builds IMAGE once for the session; what the build printed."""
    reason = engine_missing()
    if reason:
        pytest.skip(reason)
    proc = subprocess.run(
        [str(SCRIPT), IMAGE], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=2400
    )
    (tmp_path_factory.mktemp("image") / "build.log").write_text(proc.stdout)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode in (2, 75):  # a missing tool, or no network to make the stand-in base
        pytest.skip(last)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return proc.stdout


def writable_results(path: Path) -> Path:
    """A host folder to mount at /app/results: the image's user (uid 1000) must write it."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)
    return path


def remove_containers(*names: str) -> None:
    docker("rm", "-f", *names, check=False)


def test_the_image_keeps_the_base_torch_runs_as_uid_1000_and_holds_only_the_app(build_log):
    def torch_of(image: str) -> str:
        return docker("run", "--rm", "--entrypoint", "python", image, "-c", "import torch; print(torch.__version__)")

    base = "distqa-stand-in-base:torch-" + TORCH_PIN.split("==")[1]
    base_torch = torch_of(base).stdout.strip()
    assert base_torch.startswith(TORCH_PIN.split("==")[1]), base_torch
    # The base's own torch build (the CPU one here, the CUDA one on pytorch/pytorch) is kept: pip
    # neither fetches another (a fresh build logs "Requirement already satisfied: torch==...") nor
    # replaces it.
    assert torch_of(IMAGE).stdout.strip() == base_torch
    assert not re.search(r"(Collecting|Downloading) torch\b", build_log), build_log[-3000:]
    if "(from -r /tmp/requirements.txt" in build_log:  # pip's output: the step ran (no layer cache)
        assert f"Requirement already satisfied: torch=={base_torch}" in build_log

    config = json.loads(docker("image", "inspect", "--format", "{{json .Config}}", IMAGE).stdout)
    assert config["User"] == "1000:1000"  # numeric: Kubernetes' runAsNonRoot can check it
    assert config["Entrypoint"] == ["/app/scripts/worker.sh"]
    assert config["Cmd"][:2] == ["--config", "configs/quickstart.yaml"]
    assert {"HF_HOME=/cache/huggingface", "PYTHONUNBUFFERED=1"} <= set(config["Env"])

    uid, *listing = docker("run", "--rm", "--entrypoint", "sh", IMAGE, "-c", "id -u; ls -A /app").stdout.split()
    assert uid == "1000"
    assert {"configs", "scripts", "results"} <= set(listing)
    # .dockerignore and the Dockerfile's clean-up: no history, environments, tests or build leftovers.
    for unwanted in (".git", ".venv", "tests", "docs", "build"):
        assert unwanted not in listing, f"/app/{unwanted} is in the image"


def test_docker_run_trains_as_uid_1000_into_a_mounted_folder(build_log, tmp_path):
    results = writable_results(tmp_path / "results")
    proc = docker(
        "run", "--rm", "-v", f"{results}:/app/results", IMAGE,
        "model.name=tiny", "data.train=dummy", "train.max_steps=3", "output_dir=results/one",
        timeout=900,
    )  # fmt: skip
    assert "worker.sh: node 0 of 1, 1 process(es)" in proc.stderr
    assert "1 process(es) on cpu" in proc.stdout + proc.stderr
    assert "model written to results/one/model" in proc.stdout + proc.stderr
    assert (results / "one" / "model" / "model.safetensors").is_file()
    owners = {path.relative_to(results): path.stat().st_uid for path in (results / "one").rglob("*")}
    assert owners and set(owners.values()) == {1000}, owners


def test_two_containers_equal_a_two_process_host_run(build_log, tmp_path):
    args = [*SGD, "train.max_steps=4"]
    host = tmp_path / "host"
    run_train([*args, f"output_dir={host}"], nproc=2)

    results = writable_results(tmp_path / "results")
    env = dict(os.environ, IMAGE=IMAGE, RESULTS_DIR=str(results), GPUS_PER_NODE="0", SHM_SIZE="1g",
               RUN_NAME=f"{PREFIX}-nodes", DATA_DIR=str(tmp_path / "no-data"))  # fmt: skip
    proc = subprocess.run(
        [str(ROOT / "scripts" / "run_docker_nodes.sh"), "2", *args, "output_dir=results/two"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all 2 nodes finished" in proc.stderr
    # Each container runs one process with its own thread count: equal within float noise.
    assert max_abs_diff(load_weights(results / "two"), load_weights(host)) < 1e-5


# Settings where 40 steps take seconds; dropout, AdamW, DataLoader workers and the thread count as
# users get them (nothing pinned), so the resume must restore every RNG and the data position.
STOP_RUN = [
    "model.name=tiny",
    "task.max_seq_len=64",
    "task.dummy_size=2048",
    "train.batch_size=4",
    "train.log_every=1",
    "train.max_steps=80",
    "train.checkpoint_every=40",
    "train.keep_checkpoints=0",
]


def test_docker_stop_is_a_preemption_and_the_same_docker_run_resumes_exactly(build_log, tmp_path):
    results = writable_results(tmp_path / "results")
    name = f"{PREFIX}-stop"

    def docker_run(out: str, *extra: str) -> list[str]:
        return ["docker", "run", *extra, "-v", f"{results}:/app/results", IMAGE, *STOP_RUN, f"output_dir=results/{out}"]

    straight = subprocess.run(docker_run("straight", "--rm"), capture_output=True, text=True, timeout=900)
    assert straight.returncode == 0, straight.stderr[-3000:]

    out = results / "stop"
    stderr_log = tmp_path / "stop.stderr"
    try:
        with stderr_log.open("w") as stderr:
            proc = subprocess.Popen(docker_run("stop", "--name", name), stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + 600
        while not ((out / "checkpoints" / "step-40").is_dir() and last_step(out) > 40):
            assert proc.poll() is None, f"the run ended before step 41: {stderr_log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no step 41 within 600 s"
            time.sleep(0.05)
        # SIGTERM to the container's PID 1 (worker.sh), then SIGKILL after 60 s: what platforms do.
        docker("stop", "-t", "60", name, timeout=120)
        assert proc.wait(timeout=60) == 143, stderr_log.read_text()[-3000:]
        assert docker("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip() == "143"
        last = stderr_log.read_text().strip().splitlines()[-1]
        assert last.startswith("distqa: preempted: stopped by SIGTERM at step "), last
        step = int(last.split("at step ")[1].split()[0])
        assert 40 < step < 80
        assert verify_checkpoint(out / "checkpoints" / f"step-{step}") is None
        remove_containers(name)

        # The same command again: it resumes from that checkpoint and ends where an uninterrupted run ends.
        resumed = subprocess.run(docker_run("stop", "--name", name), capture_output=True, text=True, timeout=900)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"resumed from results/stop/checkpoints/step-{step} at step {step}" in resumed.stdout + resumed.stderr
        assert max_abs_diff(load_weights(out), load_weights(results / "straight")) == 0.0
    finally:
        remove_containers(name)
