"""Issue 24, must-work 8: what used to end in a traceback or a pile of repeated lines is one line,
naming the file or key and the fix: a CSV that is not UTF-8, a Hugging Face hub out of reach in
`distqa prepare`; an error every rank meets is printed once per node; and after distqa's own
line the launch scripts add no torchrun failure report (but keep it for a crash that said nothing).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, TESTS, run_train, subprocess_env
from distqa import outcome
from distqa.errors import DistqaError
from distqa.registry import load_config

NQ_SAMPLE = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"

# Every rank meets it before training: 4 examples, a global batch of 16.
TOO_BIG_BATCH = ["model.name=tiny", "task.dummy_size=4", "train.batch_size=8", "data.num_workers=0"]
TOO_BIG_LINE = "error: the training set has 4 examples, fewer than one global batch"


# ---- input files and downloads ------------------------------------------------------------------


def test_a_textcls_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    from distqa.textcls.data import read_examples

    settings = load_config(None, ["task=textcls", "task.labels=a,b"]).task
    csv, jsonl = tmp_path / "data.csv", tmp_path / "data.jsonl"
    csv.write_bytes(b"text,label\nhello,a\ncaf\xe9,b\n")  # cp1252, as a spreadsheet may save it
    jsonl.write_bytes(b'{"text": "a", "label": "a"}\n{"text": "caf\xe9", "label": "b"}\n')
    for path, line, offset in [(csv, 3, 22), (jsonl, 2, 41)]:
        with pytest.raises(DistqaError) as info:
            read_examples(path, "data.train", settings)
        message = str(info.value)
        assert message.startswith(
            f"data.train={str(path)!r} is not UTF-8 text (line {line}, byte offset {offset}: 0xe9)"
        )
        assert "save it as UTF-8" in message and "\n" not in message


def test_prepare_with_the_hub_offline_and_no_cache_is_one_line(tmp_path):
    """HF_HUB_OFFLINE=1 (the tests' setting, conftest.py) and an id that is in no cache."""
    from distqa.nq.features import FeatureSettings
    from distqa.nq.prepare import prepare_features

    with pytest.raises(DistqaError) as info:
        prepare_features(
            NQ_SAMPLE, tmp_path / "f", tokenizer_name="no-such-org/no-such-tokenizer", settings=FeatureSettings()
        )
    message = str(info.value)
    assert message.startswith("cannot load tokenizer 'no-such-org/no-such-tokenizer' (OSError: "), message
    assert "HF_HUB_OFFLINE=1 is set" in message and "HF_HOME" in message and "\n" not in message
    assert message.endswith("or set model.tokenizer to a local folder")


def test_a_model_folder_that_is_not_there_is_named_as_a_missing_folder_not_a_network_fault(tmp_path):
    """A path (absolute, ./, ../, ~) is never a hub id: a folder moved since, or a volume not mounted."""
    from distqa.config import ModelConfig
    from distqa.models import load_tokenizer

    for name in (str(tmp_path / "moved"), "./moved-model"):
        with pytest.raises(DistqaError) as info:
            load_tokenizer(ModelConfig(name=name))
        message = str(info.value)
        assert message.startswith(f"cannot load tokenizer from the folder {name}: there is no such folder"), message
        assert "network" not in message and "set model.name to the folder that holds it now" in message


# The hub's client retries a refused connection with a back-off (about 45 s in all): skipped here,
# what the user finally reads is the same.
UNREACHABLE = (
    "import sys, time\ntime.sleep = lambda seconds: None\nfrom distqa.cli import main\nsys.exit(main(sys.argv[1:]))\n"
)


@pytest.mark.safety
def test_prepare_with_the_hub_unreachable_is_one_line(tmp_path):
    env = subprocess_env(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    env.pop("HF_HUB_OFFLINE")
    cmd = [sys.executable, "-c", UNREACHABLE, "prepare", "--input", str(NQ_SAMPLE), "--output", str(tmp_path / "f")]
    proc = subprocess.run(
        [*cmd, "model.tokenizer=bert-base-cased"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("distqa: error: cannot load tokenizer 'bert-base-cased' ("), last
    assert "Check the network: the Hugging Face hub (http://127.0.0.1:9, HF_ENDPOINT) must be reachable" in last
    assert f"HF_HOME to a cache that holds it (now {tmp_path / 'hf'})" in last


# ---- one line per node -----------------------------------------------------------------------


def as_rank(monkeypatch, rank: int, local_rank: int, **env: str) -> None:
    for key, value in dict(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE="2", **env).items():
        monkeypatch.setenv(key, value)


def test_identical_errors_of_a_node_print_once_and_a_different_one_still_prints(tmp_path, monkeypatch, capsys):
    file = tmp_path / "node.txt"
    monkeypatch.setenv("DISTQA_ERROR_FILE", str(file))
    lines = ["distqa [rank 0]: error: batch too large", "distqa [rank 1]: error: batch too large"]
    for line in lines:
        outcome.report(line)
    outcome.report("distqa [rank 1]: error: something else")
    assert (
        capsys.readouterr().err == "distqa [rank 0]: error: batch too large\ndistqa [rank 1]: error: something else\n"
    )
    written = [line for line in file.read_text().splitlines() if not line.startswith("#")]
    assert written == [*lines, "distqa [rank 1]: error: something else"]  # every rank's, for the launcher
    said = outcome.read(file)
    assert said.error_ranks == {0, 1} and not said.preempted and not said.all_finished


def test_a_line_another_rank_kept_to_itself_is_still_printed_by_the_rank_that_shows_it(tmp_path, monkeypatch, capsys):
    """Rank 1 writes the preempted line (or a lost peer's) without printing it, before rank 0 does."""
    monkeypatch.setenv("DISTQA_ERROR_FILE", str(tmp_path / "node.txt"))
    outcome.report("distqa: preempted: stopped at step 3", show=False)
    outcome.report("distqa: preempted: stopped at step 3")
    outcome.report("distqa: preempted: stopped at step 3")
    assert capsys.readouterr().err == "distqa: preempted: stopped at step 3\n"
    assert outcome.read(tmp_path / "node.txt").preempted


def test_only_the_last_restart_rounds_lines_say_how_the_run_ended(tmp_path, monkeypatch, capsys):
    """A launcher's file keeps every restart round's lines: round 0 checkpointed for a joining node
    (preempted), round 1 lost a peer. The run failed; and round 1's line is printed though round
    0 printed the same words. (torch's restart count stays 0 across a join: the agent marks rounds.)"""
    file = tmp_path / "node.txt"
    monkeypatch.setenv("DISTQA_ERROR_FILE", str(file))
    outcome.new_round(0)
    outcome.report("distqa: preempted: stopped at step 40")
    outcome.report("distqa [rank 0]: error: lost a peer")
    outcome.new_round(1)
    outcome.report("distqa [rank 0]: error: lost a peer")
    assert capsys.readouterr().err.count("lost a peer") == 2
    said = outcome.read(file)
    assert said.error_ranks == {0} and not said.preempted
    assert outcome.this_round(["a", "b"]) == ["a", "b"]
    assert outcome.this_round(["a", "distqa: round: 0", "b", "distqa: round: 1", "c"]) == ["c"]


@pytest.mark.launch  # torchrun's agent and two workers: seconds
def test_distqa_torchrun_marks_each_worker_group_it_starts(tmp_path):
    """The agent writes `distqa: round: K` before each worker group, a restart's too."""
    script = tmp_path / "fail_once.py"
    script.write_text("import os, sys\nsys.exit(1 if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' else 0)\n")
    file = tmp_path / "node.txt"
    env = {**os.environ, "DISTQA_ERROR_FILE": str(file)}
    args = ["--standalone", "--nproc-per-node", "1", "--max-restarts", "1", "--monitor-interval", "0.1", str(script)]
    proc = subprocess.run([sys.executable, "-m", "distqa.torchrun", *args], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line for line in file.read_text().splitlines() if line.startswith("distqa: round:")] == [
        "distqa: round: 0",
        "distqa: round: 1",
    ]


def test_without_a_launcher_the_ranks_of_one_torchrun_share_a_file_of_their_own(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("DISTQA_ERROR_FILE", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
    for _ in range(2):
        outcome.report("distqa [rank 0]: error: same")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a new round: its own file, said again
    outcome.report("distqa [rank 0]: error: same")
    assert capsys.readouterr().err == "distqa [rank 0]: error: same\n" * 2
    assert len(list(tmp_path.glob("distqa-node-*"))) == 2
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # a single process: printed, no file
    outcome.report("distqa: error: alone")
    assert capsys.readouterr().err == "distqa: error: alone\n" and len(list(tmp_path.glob("distqa-node-*"))) == 2


def test_finished_lines_tell_a_complete_node(tmp_path, monkeypatch):
    file = tmp_path / "node.txt"
    monkeypatch.setenv("DISTQA_ERROR_FILE", str(file))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(outcome, "_said", set())
    monkeypatch.setenv("LOCAL_RANK", "1")
    outcome.finished()
    outcome.finished()  # once per process: the trainer and the CLI may both say it
    assert file.read_text() == "distqa: finished: local rank 1 of 2\n"
    assert not outcome.read(file).all_finished
    monkeypatch.setattr(outcome, "_said", set())  # another process: local rank 0
    monkeypatch.setenv("LOCAL_RANK", "0")
    outcome.finished()
    assert outcome.read(file).all_finished


def test_a_rank_says_once_when_sigterm_starts_to_mean_a_checkpoint(tmp_path, monkeypatch):
    """worker.sh tells a stop while the ranks load (nothing lost: 143) from one after training began
    (no checkpoint confirmed: a failure) by this line."""
    import torch

    from distqa.dist import DistInfo
    from distqa.stop_signal import StopSignal

    file = tmp_path / "node.txt"
    monkeypatch.setenv("DISTQA_ERROR_FILE", str(file))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(outcome, "_said", set())
    stops = [StopSignal(DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))) for _ in range(2)]
    for stop in reversed(stops):
        stop.close()
    assert file.read_text() == "distqa: training: local rank 0 of 1\n"


# ---- torchrun's report: left out after distqa's line, kept after a crash ------------------------


@pytest.mark.parametrize(
    "lines, failures, quiet",
    [
        (["distqa [rank 0]: error: x", "distqa [rank 1]: error: x"], {0: 2, 1: 2}, 1),
        (["distqa [rank 0]: error: lost a peer"], {0: 1, 1: -9}, None),  # rank 1 crashed: report kept
        ([], {0: 1}, None),  # a crash that wrote nothing
        # Every rank checkpointed on a SIGTERM that reached them, not torchrun: the stop's 143, as worker.sh's.
        (["distqa: preempted: stopped"], {0: 143, 1: 143}, 143),
        (["distqa: preempted: stopped", "distqa [rank 1]: error: x"], {0: 143, 1: 1}, 1),
    ],
)
def test_distqa_torchrun_keeps_torchrun_s_report_only_for_what_distqa_did_not_explain(
    tmp_path, monkeypatch, lines, failures, quiet
):
    """`quiet`: the exit status once distqa explained the failure (None: torchrun's report, raised)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from distqa import torchrun

    file = tmp_path / "node.txt"
    file.write_text("".join(f"{line}\n" for line in lines))
    monkeypatch.setenv("DISTQA_ERROR_FILE", str(file))
    failed = {rank: ProcessFailure(rank, 1000 + rank, code, "<N/A>") for rank, code in failures.items()}
    error = ChildFailedError("distqa", failed)

    def failing(argv):
        raise error

    monkeypatch.setattr("torch.distributed.run.main", failing)
    monkeypatch.setattr(sys, "argv", ["x"])
    if quiet is not None:
        assert torchrun.main(["--standalone"]) == quiet
    else:
        with pytest.raises(ChildFailedError):
            torchrun.main(["--standalone"])


@pytest.mark.parametrize(
    "lines, sigval, result",
    [
        (["distqa: finished: local rank 0 of 1"], 15, 0),
        # scripts/run_local.sh execs distqa.torchrun: a checkpointed stop was its exit 1, a failure's.
        (["distqa: preempted: x"], 15, 143),
        (["distqa: preempted: x"], 2, 130),  # Ctrl-C, as worker.sh says it
        (["distqa: preempted: x", "distqa [rank 0]: error: y"], 15, 1),
    ],
)
def test_distqa_torchrun_after_a_sigterm(tmp_path, monkeypatch, lines, sigval, result):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from distqa import torchrun

    monkeypatch.setattr(sys, "argv", ["x"])
    monkeypatch.setenv("DISTQA_ERROR_FILE", str(tmp_path / "node.txt"))

    def stopped(argv):
        raise SignalException(f"Process 1 got signal: {sigval}", sigval=signal.Signals(sigval))

    monkeypatch.setattr("torch.distributed.run.main", stopped)
    (tmp_path / "node.txt").write_text("distqa: training: local rank 0 of 1\n")
    with pytest.raises(SignalException):  # a rank trained and said nothing more: torchrun's own traceback
        torchrun.main([])
    (tmp_path / "node.txt").write_text("".join(f"{line}\n" for line in lines))
    assert torchrun.main([]) == result


@pytest.mark.launch  # about 20 s: make test-launch, for make test's 5 minutes
@pytest.mark.parametrize("sigval", [15, 2])
@pytest.mark.parametrize("launcher", [True, False])
def test_a_signal_before_any_rank_trained_is_a_stop_not_torchrun_s_traceback(
    tmp_path, monkeypatch, capfd, sigval, launcher
):
    """No rank wrote `distqa: training:` (each still loading, its SIGTERM handler not installed):
    the signal's status, as a shell gives it, and one line; worker.sh (a launcher with its own file)
    says the line itself. A round before the last one that trained does not count."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from distqa import torchrun

    monkeypatch.setattr(sys, "argv", ["x"])
    if launcher:
        (tmp_path / "node.txt").write_text("distqa: round: 0\ndistqa: training: local rank 0 of 1\ndistqa: round: 1\n")
        monkeypatch.setenv("DISTQA_ERROR_FILE", str(tmp_path / "node.txt"))
    else:
        monkeypatch.delenv("DISTQA_ERROR_FILE", raising=False)

    def stopped(argv):
        raise SignalException(f"Process 1 got signal: {sigval}", sigval=signal.Signals(sigval))

    monkeypatch.setattr("torch.distributed.run.main", stopped)
    assert torchrun.main([]) == 128 + sigval
    # Its own file was this call's: later launches of this process must not inherit it.
    assert os.environ.get("DISTQA_ERROR_FILE") == (str(tmp_path / "node.txt") if launcher else None)
    name = signal.Signals(sigval).name
    said = [] if launcher else [f"distqa: stopped by {name} before training started: nothing to checkpoint"]
    assert capfd.readouterr().err.splitlines() == said
    if launcher:  # for worker.sh, which says it, also when the signal did not pass its trap
        assert (tmp_path / "node.txt").read_text().splitlines()[-1] == f"distqa: stopped before training: {name}"


@pytest.mark.parametrize("closed", [True, False])
def test_a_store_closed_during_torchrun_s_exit_barrier_is_one_line(tmp_path, monkeypatch, capfd, caplog, closed):
    """pytorch/pytorch#69520, seen in make test-nodes: node 0's agent left as the exit barrier
    completed and node 1's torchrun logged a connection traceback, then exited 0. torchrun's own
    _exit_barrier runs here on a store whose server is gone (closed) or alive with no other node
    (a timeout: torchrun's record stays)."""
    import types

    from torch.distributed import TCPStore
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from distqa import torchrun

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    agent = object.__new__(LocalElasticAgent)  # only what _exit_barrier reads
    agent._store = TCPStore("127.0.0.1", server.port, is_master=False)
    agent._worker_group = types.SimpleNamespace(group_world_size=2, state="SUCCEEDED")
    agent._exit_barrier_timeout = 1
    agent._in_exit_barrier = False
    if closed:
        del server
    monkeypatch.setattr("torch.distributed.run.main", lambda argv: agent._exit_barrier())
    monkeypatch.setattr(sys, "argv", ["x"])
    monkeypatch.setenv("DISTQA_ERROR_FILE", str(tmp_path / "node.txt"))
    with caplog.at_level(logging.INFO, logger="torch.distributed.elastic.agent.server.api"):
        assert torchrun.main([]) == 0
    said = capfd.readouterr().err.count("distqa: the master node's store closed during torchrun's exit barrier")
    logged = [r for r in caplog.records if r.getMessage().startswith("Error waiting on exit barrier")]
    assert (said, len(logged)) == ((1, 0) if closed else (0, 1)), caplog.text


# ---- the real thing: 2 processes ---------------------------------------------------------------


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error" in line.lower()]


@pytest.mark.safety
def test_an_error_of_every_rank_is_printed_once_under_plain_torchrun(tmp_path):
    proc = run_train([*TOO_BIG_BATCH, f"output_dir={tmp_path / 'run'}"], nproc=2, check=False)
    assert proc.returncode != 0
    said = [line for line in proc.stderr.splitlines() if outcome.ERROR.match(line)]
    assert len(said) == 1 and TOO_BIG_LINE in said[0], proc.stderr[-3000:]


def script_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = subprocess_env(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]), **extra)
    env["TMPDIR"] = str(tmp_path)  # where the node's file goes: checked to be gone afterwards
    return env


@pytest.mark.safety
@pytest.mark.parametrize("script", ["worker.sh", "run_local.sh"])
def test_the_launch_scripts_end_with_distqa_s_one_line_and_no_torchrun_report(tmp_path, script):
    from conftest import free_port

    env = script_env(tmp_path, NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    cmd = [str(ROOT / "scripts" / script), *TOO_BIG_BATCH, f"output_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and TOO_BIG_LINE in errors[0], proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == errors[0]
    for torchrun_report in ("Traceback", "ChildFailedError", "Failures:", "failed (exitcode", "closing signal"):
        assert torchrun_report not in proc.stderr, proc.stderr[-3000:]
    assert not list(tmp_path.glob("distqa-*")), list(tmp_path.iterdir())  # the node's file is removed


def test_torchrun_s_failure_lines_are_left_out_after_the_preempted_line_unless_another_code_says_a_crash(tmp_path):
    """A node whose workers checkpointed for another node's SIGTERM: its torchrun saw them end with
    143 and logged `failed (exitcode: 143)` after distqa's preempted line, the last line a user read."""
    import logging

    from distqa.torchrun import _QuietOnceExplained

    path = tmp_path / "node.txt"
    path.write_text("")
    quiet = _QuietOnceExplained(path)

    def shown(message: str, *args: object) -> bool:
        return quiet.filter(logging.LogRecord("torchrun", logging.ERROR, __file__, 1, message, args, None))

    failed = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
    assert shown(failed, 143, 0, 99, "python")  # nothing said by distqa: torchrun's report stays
    path.write_text("distqa: preempted: stopped by SIGTERM at step 21 of 60; ...\n")
    assert not shown(failed, 143, 0, 99, "python")
    assert not shown("Sending process %s closing signal %s", 99, "SIGTERM")
    assert shown(failed, -11, 1, 98, "python")  # a crash beside the preemption
    path.write_text("distqa [rank 1]: error: something\n")
    assert not shown(failed, 1, 1, 98, "python")


@pytest.mark.safety  # (about 5 s: make test keeps its 5 minutes)
def test_a_node_that_never_joins_the_rendezvous_is_one_line(tmp_path):
    """Node 0 of 2 alone: torchrun's static rendezvous gave up with a 45-line traceback of its
    store's internals (DistStoreError: ... 1/2 clients joined)."""
    from conftest import free_port

    cmd = [sys.executable, "-m", "distqa.torchrun", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_port()), "--rdzv-backend", "static", "--rdzv-conf", "timeout=3"]
    cmd += ["--nproc-per-node", "1", "-m", "distqa", "train", "model.name=tiny", f"output_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, env=subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("distqa: error: the nodes did not all meet in torchrun's rendezvous (") and "1/2" in line
    assert line.endswith(
        "): start every node, each with its own NODE_RANK from 0 to NNODES-1, within RDZV_TIMEOUT of each "
        "other and pointed at node 0's MASTER_ADDR:MASTER_PORT"
    )


def test_torchrun_s_store_lost_with_node_0_is_one_line(tmp_path, monkeypatch, capfd):
    """Node 0 (the rendezvous store's host) lost mid-run: the other nodes' torchrun ended in about
    70 lines and a RendezvousConnectionError traceback (found by a review)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from distqa import torchrun

    monkeypatch.setattr(sys, "argv", ["x"])
    monkeypatch.setenv("DISTQA_ERROR_FILE", str(tmp_path / "node.txt"))

    def lost(argv):
        raise RendezvousConnectionError("The connection to the C10d store has failed. See inner exception for details.")

    monkeypatch.setattr("torch.distributed.run.main", lost)
    assert torchrun.main([]) == 1
    (line,) = capfd.readouterr().err.splitlines()
    assert line.startswith(
        "distqa: error: the connection to torchrun's rendezvous store on node 0 (MASTER_ADDR) failed (The connection "
        "to the C10d store has failed. See inner exception for details.): node 0 is gone"
    ), line


@pytest.mark.safety  # 3 launches of ~4 s each: make test-safety
@pytest.mark.parametrize(("handed_down", "agent_s"), [(True, 0.0), (True, 0.5), (False, 0.5)])
def test_a_worker_whose_agent_died_before_its_watch_started_stops(tmp_path, handed_down, agent_s):
    """torchrun killed while its workers still imported torch: each started its watch of the agent
    after it had been re-parented, took the new parent for the agent, and waited in the rendezvous
    for ever, holding the launch's output pipes (a test launch hung, found while testing a SIGTERM
    during loading). `handed_down`: distqa.torchrun's pid in DISTQA_AGENT_PID; without it (a plain
    torchrun) the parent noted when the module was imported, before the imports that take seconds.
    `agent_s`: how long the agent outlives the start (0: it is gone before that import)."""
    import subprocess
    import time

    # As `python -m distqa` does: the watch's module first (it notes the parent), then the imports.
    worker = (
        "from distqa.parent_watch import watch_parent; import time; time.sleep(1.5); watch_parent(grace_s=1); "
        "time.sleep(60)"
    )
    agent = (
        "import os, subprocess, sys\n"
        f"env = dict(os.environ, TORCHELASTIC_RUN_ID='x', DISTQA_AGENT_PID=str(os.getpid()) if {handed_down} else '')\n"
        f"subprocess.Popen([sys.executable, '-c', {worker!r}], env=env, start_new_session=True)\n"
        f"import time; time.sleep({agent_s})\n"
    )
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", agent], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=30)  # the pipes close when the worker ends too
    assert time.monotonic() - started < 15, err
    assert "torchrun (pid" in err and "is gone: stopping this worker" in err, err


@pytest.mark.safety  # 2 launches of ~4 s each: make test-safety
@pytest.mark.parametrize("stale", [False, True])
def test_a_worker_under_any_live_launcher_keeps_running(stale):
    """The first version of the watch took a parent whose command line named no torchrun for a dead
    agent: under `python -mtorch.distributed.run`, `torch.distributed.launch` or a launcher calling
    torch's elastic_launch (as accelerate does), every worker stopped at once (found by a review).
    `stale`: a DISTQA_AGENT_PID inherited from an outer launch that still runs (this test)."""
    import subprocess

    worker = (
        "from distqa.parent_watch import watch_parent; import time; watch_parent(grace_s=1); time.sleep(3); "
        "print('worked', flush=True)"
    )
    agent = (
        "import os, subprocess, sys\n"
        f"env = dict(os.environ, TORCHELASTIC_RUN_ID='x', DISTQA_AGENT_PID=str(os.getppid()) if {stale} else '')\n"
        f"sys.exit(subprocess.run([sys.executable, '-c', {worker!r}], env=env, start_new_session=True).returncode)\n"
    )
    proc = subprocess.run([sys.executable, "-c", agent], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "worked\n" and "is gone" not in proc.stderr, proc.stderr
