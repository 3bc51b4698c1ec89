"""scripts/bench_network.sh's promises about the machine it runs on (marker comm, root): one line and
exit 2 without root, a refusal when its namespaces exist, and no namespace or process left behind
after a failed run or a Ctrl-C. Its figures are `make bench-network`'s (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import ROOT, needs_root, sigint_default, subprocess_env

SCRIPT = ROOT / "scripts" / "bench_network.sh"
NAMESPACES = ("dqnet0", "dqnet1")
QUICK = ["--rates", "none", "--hooks", "fp16", "--steps", "2", "--warmup", "1"]
SETTINGS = ["--", "model.name=tiny", "task.max_seq_len=32", "train.batch_size=2", "data.num_workers=2"]

pytestmark = pytest.mark.comm


def namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()} & set(NAMESPACES)


def bench(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=subprocess_env(), **kwargs
    )


def leftovers() -> list[str]:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "distqa.bench.network launch" in line or "dqnet" in line]


def test_without_root_it_says_so_in_one_line(tmp_path):
    if os.geteuid() != 0:
        proc = bench("--output", str(tmp_path))
    else:  # as root: the same script as user nobody
        proc = bench("--output", str(tmp_path), preexec_fn=lambda: (os.setgid(65534), os.setuid(65534)))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "needs root" in proc.stderr


def test_taken_namespaces_are_refused_and_left_alone(tmp_path):
    needs_root("network namespaces", "ip", "tc")
    subprocess.run(["ip", "netns", "add", NAMESPACES[0]], check=True)
    try:
        proc = bench(*QUICK, "--output", str(tmp_path), *SETTINGS)
        assert proc.returncode == 2 and f"namespace {NAMESPACES[0]} exists" in proc.stderr
        assert namespaces() == {NAMESPACES[0]}  # not ours to remove
    finally:
        subprocess.run(["ip", "netns", "del", NAMESPACES[0]], check=False)


def test_a_failed_run_removes_its_namespaces(tmp_path):
    needs_root("network namespaces", "ip", "tc")
    proc = bench(*QUICK, "--output", str(tmp_path), *SETTINGS, "train.lr=-1")
    assert proc.returncode != 0 and "failed" in proc.stderr.splitlines()[-1]
    assert namespaces() == set() and leftovers() == []


def test_ctrl_c_mid_run_removes_namespaces_and_processes(tmp_path):
    needs_root("network namespaces", "ip", "tc")
    proc = subprocess.Popen(
        [str(SCRIPT), *QUICK, "--steps", "100000", "--output", str(tmp_path), *SETTINGS],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_default,  # Ctrl-C as a terminal sends it, whatever this runner inherited
    )
    deadline = time.monotonic() + 120
    # Wait until training runs inside the namespaces (node 0's log shows a worker line).
    log = tmp_path / "runs" / "none-fp16" / "node0.log"
    while not (log.is_file() and "node 0 of 2" in log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    time.sleep(1)
    assert namespaces() == set() and leftovers() == []


def test_an_earlier_call_s_runs_are_moved_aside_not_reported_as_this_one_s(tmp_path):
    """The report reads every run under DIR/runs: a second call into one folder (CI's, a user's
    `make bench-network` again with other rates) reported the first call's rows as its own."""
    needs_root("network namespaces", "ip", "tc")
    old = tmp_path / "runs" / "1gbit-bf16"
    old.mkdir(parents=True)
    (old / "result.json").write_text('{"stale": true}')
    (tmp_path / "network.json").write_text("{}")
    proc = bench(*QUICK, "--output", str(tmp_path), *SETTINGS)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["none-fp16"]
    runs = json.loads((tmp_path / "network.json").read_text())["runs"]
    assert [(run["rate"], run["hook"]) for run in runs] == [("none", "fp16")]
    (earlier,) = (tmp_path / "earlier").iterdir()
    assert (earlier / "runs" / "1gbit-bf16" / "result.json").read_text() == '{"stale": true}'
    assert (earlier / "network.json").read_text() == "{}"
    assert f"held an earlier benchmark's runs: moved to {earlier}" in proc.stderr
