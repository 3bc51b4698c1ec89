"""scripts/run_distributed_on_platform.sh against stand-in `neuro-flow` and `neuro` executables
(tests/fakebin) that record their calls and print the real `neuro status` table layout."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

from conftest import fakebin_env, sigint_default, wait_for_call

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "run_distributed_on_platform.sh"
MASTER_HOST = "job-5f3c2a10-1b2c-4d5e-8f90-a1b2c3d4e5f6.platform-jobs"  # what the stand-in reports


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    defaults = {
        "RUN_NAME": "ddp7",
        "POLL_SECONDS": "0",
        "FAKE_STATUS": "pending,pending,running,running,succeeded",
    }
    return fakebin_env(tmp_path, **{**defaults, **extra})


def run_script(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SCRIPT), *args], env=env_for(tmp_path, **env), capture_output=True, text=True, timeout=60
    )


def calls(tmp_path: Path) -> list[tuple[str, list[str]]]:
    lines = (tmp_path / "calls.jsonl").read_text().splitlines()
    return [(c["cmd"], c["argv"]) for c in map(json.loads, lines)]


def params(argv: list[str]) -> dict[str, str]:
    return {argv[i + 1]: argv[i + 2] for i, word in enumerate(argv) if word == "--param"}


def runs(tmp_path: Path) -> list[list[str]]:
    return [argv for cmd, argv in calls(tmp_path) if cmd == "neuro-flow" and argv[0] == "run"]


def kills(tmp_path: Path) -> list[list[str]]:
    return [argv for cmd, argv in calls(tmp_path) if cmd == "neuro-flow" and argv[0] == "kill"]


def test_master_first_then_workers_pointed_at_its_hostname(tmp_path):
    proc = run_script(tmp_path, "3", "--", "--config", "configs/bert-base.yaml", "output_dir=/app/results/a b")
    assert proc.returncode == 0, proc.stderr
    history = calls(tmp_path)
    started = runs(tmp_path)
    assert [r[:4] for r in started] == [["run", "distributed_training", "--suffix", f"ddp7-n{i}"] for i in range(3)]
    p = [params(r) for r in started]
    assert [x["node_rank"] for x in p] == ["0", "1", "2"]
    assert all(x["nnodes"] == "3" and x["master_port"] == "29500" for x in p)
    assert [x["name"] for x in p] == ["ddp7-n0", "ddp7-n1", "ddp7-n2"]
    assert p[0]["master_addr"] == "self"
    # Not "Named", not cut short: the whole internal hostname from the status table.
    assert p[1]["master_addr"] == p[2]["master_addr"] == MASTER_HOST
    # The training arguments reach the job as one shlex-quoted parameter.
    assert shlex.split(p[0]["train_args"]) == ["--config", "configs/bert-base.yaml", "output_dir=/app/results/a b"]
    # Workers start only after node 0 was seen running.
    statuses = [i for i, (cmd, argv) in enumerate(history) if cmd == "neuro" and argv == ["status", "ddp7-n0"]]
    first_worker = history.index(("neuro-flow", started[1]))
    assert len([i for i in statuses if i < first_worker]) == 3  # pending, pending, running
    assert ("neuro-flow", ["logs", "distributed_training", "ddp7-n0"]) in history
    assert "step 1 loss" in proc.stdout
    assert sorted(k[2] for k in kills(tmp_path)) == ["ddp7-n0", "ddp7-n1", "ddp7-n2"]


def test_default_is_two_nodes_and_the_jobs_own_arguments(tmp_path):
    proc = run_script(tmp_path)
    assert proc.returncode == 0, proc.stderr
    p = [params(r) for r in runs(tmp_path)]
    assert [x["node_rank"] for x in p] == ["0", "1"]
    assert all("train_args" not in x for x in p)


def test_a_failed_status_call_is_retried(tmp_path):
    proc = run_script(tmp_path, "2", FAKE_STATUS="error,running,succeeded")
    assert proc.returncode == 0, proc.stderr
    assert "`neuro status ddp7-n0` failed; retrying" in proc.stderr
    assert params(runs(tmp_path)[1])["master_addr"] == MASTER_HOST


def test_master_that_fails_before_running_stops_everything(tmp_path):
    proc = run_script(tmp_path, "2", FAKE_STATUS="pending,failed")
    assert proc.returncode == 1
    assert "node 0 (ddp7-n0) is failed" in proc.stderr
    assert [params(r)["node_rank"] for r in runs(tmp_path)] == ["0"]  # no worker was started
    assert [k[2] for k in kills(tmp_path)] == ["ddp7-n0"]


def test_worker_that_cannot_start_kills_the_jobs_already_started(tmp_path):
    proc = run_script(tmp_path, "3", FAKE_RUN_FAIL_RANK="2")
    assert proc.returncode == 1
    assert "could not start node 2" in proc.stderr
    assert {k[2] for k in kills(tmp_path)} >= {"ddp7-n0", "ddp7-n1"}
    assert not any(argv[0] == "logs" for cmd, argv in calls(tmp_path) if cmd == "neuro-flow")


def test_master_failure_during_training_is_an_error(tmp_path):
    proc = run_script(tmp_path, "2", FAKE_STATUS="running,running,failed")
    assert proc.returncode == 1
    assert "node 0 (ddp7-n0) ended as 'failed'" in proc.stderr


def test_log_stream_that_breaks_while_the_master_runs_is_reconnected(tmp_path):
    proc = run_script(tmp_path, "2", FAKE_STATUS="running,running,running,succeeded", END_GRACE_SECONDS="0")
    assert proc.returncode == 0, proc.stderr
    logs = [argv for cmd, argv in calls(tmp_path) if cmd == "neuro-flow" and argv[0] == "logs"]
    assert len(logs) == 3
    assert proc.stderr.count("reconnecting") == 2


def test_master_that_never_runs_times_out(tmp_path):
    start = time.monotonic()
    proc = run_script(tmp_path, "2", FAKE_STATUS="pending", START_TIMEOUT="2", POLL_SECONDS="1")
    assert proc.returncode == 1
    assert "not running after 2s" in proc.stderr
    assert time.monotonic() - start < 15
    assert [k[2] for k in kills(tmp_path)] == ["ddp7-n0"]


def test_ctrl_c_while_streaming_logs_kills_every_job(tmp_path):
    proc = subprocess.Popen(
        [str(SCRIPT), "2"],
        env=env_for(tmp_path, FAKE_LOGS_SLEEP="30"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=sigint_default,
    )
    wait_for_call(tmp_path, '"logs"', "the log stream")
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground process group
    proc.communicate(timeout=20)
    assert proc.returncode == 130
    assert sorted(k[2] for k in kills(tmp_path)) == ["ddp7-n0", "ddp7-n1"]


def test_bad_arguments(tmp_path):
    proc = run_script(tmp_path, "x")
    assert proc.returncode == 1 and "NNODES must be a positive integer" in proc.stderr
    proc = run_script(tmp_path, "2", RUN_NAME="Bad_Name")
    assert proc.returncode == 1 and "RUN_NAME='Bad_Name'" in proc.stderr
    assert not (tmp_path / "calls.jsonl").exists()
