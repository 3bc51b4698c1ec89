"""Faults that must lose nothing: a killed worker, SIGTERM, a damaged or unwritable checkpoint,
replicas that drift apart, and a peer that is gone while this rank waits in a collective."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as torch_dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import (
    FAULT_RUN,
    ROOT,
    SMALL,
    checkpoint_weights,
    free_port,
    last_step,
    launch,
    load_weights,
    max_abs_diff,
    metrics_rows,
    run_train,
    stop_and_wait,
    subprocess_env,
    tmpfs,
    wait_for_step,
)
from distqa import peer_watch
from distqa.checkpoint import list_checkpoints, read_trainer_state, verify_checkpoint
from distqa.errors import DistqaError
from distqa.peer_watch import PeerWatch
from distqa.registry import load_config
from distqa.trainer import train


def workers_of(agent_pid: int) -> list[int]:
    """The worker processes torchrun started (its children running distqa)."""
    children = Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()
    return [int(pid) for pid in children if "distqa" in Path(f"/proc/{pid}/cmdline").read_text()]


@pytest.mark.slow
@pytest.mark.safety  # about a minute with its straight run: make test-safety, not make test's budget
def test_sigkill_of_a_worker_restarts_from_an_earlier_checkpoint_and_ends_with_the_same_weights(
    tmp_path, fault_straight
):
    """A worker killed inside FAULT_RUN's second epoch (8 steps each): the next round resumes from
    step-8, the epoch's first step, while steps past it were already logged. The result is the
    uninterrupted run's, bit for bit, and metrics.jsonl and TensorBoard show each step once, with
    the straight run's loss (the resume rewrote the steps after its checkpoint, not repeated them).
    Run with train.resume=never over an earlier run: the first round moves it aside, and the next
    round continues this launch's checkpoints (it moved them aside too, and trained from step 0)."""
    out = tmp_path / "killed"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')  # the earlier run's record
    proc = launch([*FAULT_RUN, "train.resume=never", f"output_dir={out}"], max_restarts=1)
    wait_for_step(proc, out, 9)  # 3 steps before the step-12 checkpoint
    victim = workers_of(proc.pid)[-1]
    os.kill(victim, signal.SIGKILL)
    # Rank 0 waits for its dead peer inside the step's all-reduce: nothing more gets logged.
    logged = last_step(out)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert stdout.count("was moved to") == 1 and "continues from output_dir's newest checkpoint" in stdout, stdout
    resumed = int(stdout.split("resumed from ")[1].split(" at step ")[1].split()[0])
    # The new round really restarted from a checkpoint, one older than the last logged step.
    assert resumed % 4 == 0 and 8 <= resumed < logged, (resumed, logged, stdout[-2000:])
    assert max_abs_diff(load_weights(out), load_weights(fault_straight)) == 0.0
    # The comparison is not trivial: the checkpoint holds a mid-run state.
    assert max_abs_diff(checkpoint_weights(out, resumed), checkpoint_weights(out, 20)) > 1e-4
    straight = [(r["step"], r["loss"]) for r in metrics_rows(fault_straight)]
    assert [(r["step"], r["loss"]) for r in metrics_rows(out)] == straight
    shown = tensorboard_losses(out)
    assert [step for step, _ in shown] == [step for step, _ in straight]
    assert [loss for _, loss in shown] == pytest.approx([loss for _, loss in straight], abs=1e-6)  # float32 in events
    # Each of the 2 ranks saved its RNG streams (dropout differs per rank).
    saved = {p.name for p in (out / "checkpoints" / "step-20").glob("rng-rank*.pt")}
    assert saved == {"rng-rank0.pt", "rng-rank1.pt"}


def tensorboard_losses(output_dir: Path) -> list[tuple[int, float]]:
    """The loss curve as TensorBoard shows it (its reader drops events a resume purged)."""
    events = EventAccumulator(str(output_dir / "tb"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("train/loss")]


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig",
    # Both launches (25 s each) in make test-safety, beyond make test's 5 minutes (SIGTERM's moved
    # there at 1176 tests; test_run_local.py's SIGTERM, in make test-launch, covers the launch script)
    [pytest.param(signal.SIGTERM, marks=pytest.mark.safety), pytest.param(signal.SIGINT, marks=pytest.mark.safety)],
    ids=["SIGTERM", "SIGINT"],
)
def test_sigterm_to_torchrun_checkpoints_the_current_step(tmp_path, sig):
    """torchrun run directly (not through worker.sh): SIGTERM to it, as a platform stopping the job
    does, reaches every rank, which finishes its step and checkpoints. SIGINT (Ctrl-C on
    scripts/run_local.sh, which execs torchrun) does the same: it was a KeyboardInterrupt traceback
    from every rank, and the steps since the last checkpoint lost. The resume from such a
    checkpoint, to the uninterrupted run's weights, is test_worker_faults.py's (worker.sh forwards
    its SIGTERM to the same torchrun)."""
    out = tmp_path / "preempted"
    proc = launch([*FAULT_RUN, f"output_dir={out}"])
    wait_for_step(proc, out, 10)  # inside the second epoch of 8 steps
    stderr = stop_and_wait(proc, sig)
    # torchrun itself ends with its SignalException's status 1, which worker.sh, the containers'
    # entrypoint, turns into 143.
    assert proc.returncode == 1, stderr[-3000:]
    line = next(x for x in stderr.splitlines() if x.startswith("distqa: preempted:"))
    step = int(line.split("at step ")[1].split()[0])
    assert 10 <= step < 20 and "Traceback" not in line and f"stopped by {sig.name} at step" in line
    assert "KeyboardInterrupt" not in stderr
    assert verify_checkpoint(out / "checkpoints" / f"step-{step}") is None
    assert read_trainer_state(out / "checkpoints" / f"step-{step}")["step"] == step


def in_process(tmp_path: Path, name: str, *extra: str) -> Path:
    out = tmp_path / name
    train(
        load_config(
            None,
            [
                *SMALL,
                "train.batch_size=2",
                "train.lr=1e-3",
                "train.lr_schedule=constant",
                "train.warmup_ratio=0",
                f"output_dir={out}",
                *extra,
            ],
        )
    )
    return out


@pytest.mark.safety  # about 7 s: make test-safety, for make test's 5 minutes
def test_damaged_checkpoint_is_reported_and_the_previous_one_used(tmp_path, capsys):
    ref = in_process(tmp_path, "ref", "train.max_steps=6", "train.checkpoint_every=2")
    out = in_process(tmp_path, "run", "train.max_steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=0")
    newest = out / "checkpoints" / "step-4" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated, as by a full disk
    assert "model.safetensors has" in verify_checkpoint(newest.parent)
    capsys.readouterr()
    in_process(tmp_path, "run", "train.max_steps=6", "train.checkpoint_every=2", "train.keep_checkpoints=0")
    text = capsys.readouterr().out
    assert "skipping checkpoint" in text and "step-4" in text and "resumed from" in text and "step-2" in text
    assert max_abs_diff(load_weights(out), load_weights(ref)) == 0.0
    # An explicitly named damaged checkpoint is an error, not a silent fallback.
    newest = out / "checkpoints" / "step-6" / "training_state.pt"
    newest.write_bytes(b"x" + newest.read_bytes()[1:])
    with pytest.raises(DistqaError, match="damaged.*does not match its hash"):
        in_process(tmp_path, "run", "train.max_steps=8", f"train.resume={newest.parent}")


@pytest.mark.safety  # about 8 s: make test-safety, for make test's 5 minutes
@pytest.mark.parametrize("keep", [2, 0])
def test_only_the_newest_checkpoints_are_kept_and_tmp_folders_ignored(tmp_path, capsys, keep):
    """What kills left (a save cut short, a removal cut short) is ignored by resume, and removed by
    the next save once the run is past it: it stayed for good, gigabytes each at bert-large size (a
    review). A `.old-step-N` goes only where step-N is whole (else it is the one whole copy)."""
    saving = ["train.checkpoint_every=1", f"train.keep_checkpoints={keep}"]
    out = in_process(tmp_path, "keep", "train.max_steps=5", *saving)
    root = out / "checkpoints"
    assert [p.name for p in list_checkpoints(root)][-2:] == ["step-4", "step-5"]
    assert len(list_checkpoints(root)) == (keep or 5)
    gone = [".tmp-step-3", "step-1" if keep else "step-0", ".old-step-5", *([] if keep else [".old-step-2"])]
    kept = [".tmp-step-9", "step-9", *([".old-step-2"] if keep else [])]  # past step 6, or step-2 pruned
    for name in gone + kept:
        (root / name).mkdir(exist_ok=True)
        (root / name / "model.safetensors").write_bytes(b"partial")
    (root / "notes").mkdir()  # not distqa's: left alone
    assert [p.name for p in list_checkpoints(root)][-2:] == ["step-4", "step-5"]
    capsys.readouterr()
    in_process(tmp_path, "keep", "train.max_steps=6", *saving)
    assert "resumed from" in capsys.readouterr().out
    assert [name for name in gone if (root / name).exists()] == []
    assert [name for name in kept if not (root / name).exists()] == []
    assert (root / "notes").is_dir()
    expected = ["step-5", "step-6"] if keep else [f"step-{i}" for i in range(1, 7)]
    assert [p.name for p in list_checkpoints(root)] == expected


def test_a_leftover_the_run_resumed_from_is_kept(tmp_path):
    """train.resume=PATH may name one (a user's copy back of a `.old-step-N`): it is theirs."""
    from distqa.checkpoint import _remove_leftovers

    for name in (".old-step-2", ".tmp-step-3", "step-2"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-2" / "trainer_state.json").write_text("{}")
    _remove_leftovers(tmp_path, {".old-step-2"}, upto=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".old-step-2", "step-2"]


@pytest.fixture
def small_disk(tmp_path):
    """A 26 MB tmpfs (root only): one tiny-model checkpoint fits, two do not."""
    with tmpfs(tmp_path / "small-disk", "size=26m", "a small disk (a tmpfs mount)") as disk:
        yield disk


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_full_disk_keeps_the_previous_checkpoint(small_disk, parallel):
    disk = small_disk
    # The tiny model's checkpoint is ~17.6 MB with SGD: the first fits, the second does not. With
    # fsdp the weights are DCP's shards (one here), written by torch.distributed.checkpoint.
    mode = [f"train.parallel={parallel}", "train.check_replicas=false"]
    with pytest.raises(
        DistqaError,
        match=r"cannot write checkpoint .*step-2 \(.*; [0-9.]+ MiB free there\); the previous checkpoint step-1 is",
    ):
        in_process(disk, "run", "train.max_steps=3", "train.checkpoint_every=1", "train.optimizer=sgd", *mode)
    assert [p.name for p in list_checkpoints(disk / "run" / "checkpoints")] == ["step-1"]
    assert verify_checkpoint(disk / "run" / "checkpoints" / "step-1") is None
    assert not list((disk / "run" / "checkpoints").glob(".tmp-*"))


@pytest.mark.safety  # about 13 s: make test-safety, for make test's 5 minutes
@pytest.mark.slow
def test_replica_check_catches_ranks_that_drift_apart(tmp_path):
    args = [
        "task=toy_task:DivergentTask",
        "data.num_workers=0",
        "train.max_steps=3",
        "train.batch_size=4",
        "train.optimizer=sgd",
        "train.lr=0.1",
    ]
    proc = run_train([*args, f"output_dir={tmp_path / 'a'}", "train.check_replicas=true"], nproc=2, check=False)
    assert proc.returncode != 0
    assert "parameters differ across ranks after step 1 (first: offset" in proc.stderr
    # No false alarm: every run of the suite's SMALL settings has the check on, and passes.


def worker(args: list[str]) -> subprocess.Popen:
    env = subprocess_env(
        NPROC_PER_NODE="2",
        MASTER_PORT=str(free_port()),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    )
    return subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "worker.sh"), *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_worker_sh_ends_with_distqa_own_line(tmp_path):
    """Through the container entrypoint, the last line is distqa's message, not torchrun's report."""
    proc = worker([*SMALL, "train.batchsize=4", f"output_dir={tmp_path / 'bad'}"])
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert (
        stderr.strip()
        .splitlines()[-1]
        .endswith("unknown config key 'train.batchsize' in the command line (did you mean train.batch_size?)")
    )
    # SIGTERM through worker.sh ends with distqa's own line too: tests/test_worker_faults.py.


def test_full_disk_during_the_final_export_leaves_no_half_model(small_disk):
    disk = small_disk
    # The step-1 checkpoint (~17.7 MB with SGD) fits; the 17.6 MB export beside it does not.
    args = ["train.max_steps=1", "train.optimizer=sgd"]
    with pytest.raises(
        DistqaError, match=r"cannot write .*/model \(.*No space left on device.*\): the final checkpoint"
    ):
        in_process(disk, "run", *args)
    assert not (disk / "run" / "model").exists() and not list((disk / "run").glob(".tmp-*"))
    # With room again, the same command only writes model/ (the final checkpoint is there).
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
    in_process(disk, "run", *args)
    assert load_weights(disk / "run").keys()


@pytest.fixture
def fast_peer_watch(monkeypatch) -> torch_dist.TCPStore:
    """A store that peer watches count in, ticking every 50 ms instead of 2 s."""
    port = free_port()
    store = torch_dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr(PeerWatch, "INTERVAL_S", 0.05)
    return store


def watching(rank: int, prefix: str, timeout_s: float = 0.5) -> tuple[PeerWatch, list[list[int]]]:
    """Rank `rank` of 2 watching the other, giving up after `timeout_s`; what it would call lost, kept."""
    watch, lost = PeerWatch(rank, 2, timeout_s=timeout_s, prefix=prefix), []
    watch._lost = lambda silent, **_: (lost.append(silent), watch.stopped.set())  # type: ignore[method-assign]
    # As `start` does: `stop` then lets the loop end before its last write (one client, one thread).
    watch.thread = threading.Thread(target=watch._run, daemon=True)
    watch.thread.start()
    return watch, lost


def counting(store: torch_dist.TCPStore, key: str) -> None:
    """Until the watch has counted once: its store client is connected. (At the fixture's 50 ms
    interval a connect on a loaded machine may time out; the next tick connects again.)"""
    deadline = time.monotonic() + 10
    while store.add(key, 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.add(key, 0) > 0, f"{key} never counted"


def test_peer_watch_ends_a_rank_whose_peer_is_gone_and_spares_live_and_finished_ones(
    fast_peer_watch, monkeypatch, tmp_path, capsys
):
    """The gloo hang of a peer lost mid-message (peer_watch.PeerWatch): a rank's neighbour that stops
    counting is lost within the timeout; one that counts, or said it stops on purpose, is not."""
    gone, lost = watching(0, "gone/")  # rank 1 never starts counting
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lost == [[1]]

    # A timeout of 1 s: a loaded machine may hold a thread a few hundred ms (see the test below).
    (zero, lost_by_zero), (one, lost_by_one) = watching(0, "live/", 1.0), watching(1, "live/", 1.0)
    time.sleep(2.1)  # two timeouts: both count
    one.stop()  # rank 1 ends on purpose
    time.sleep(2.1)
    zero.stop()
    assert lost_by_zero == [] and lost_by_one == []

    # What a lost peer looks like: one line, also for worker.sh's error file, then a hard exit.
    monkeypatch.setenv("DISTQA_ERROR_FILE", str(tmp_path / "error"))
    monkeypatch.setattr(peer_watch.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    with pytest.raises(SystemExit, match="1"):
        PeerWatch._lost(gone, [1])
    line = capsys.readouterr().err.strip()
    assert line.startswith("distqa [rank 0]: error: lost a peer: rank(s) 1 gave no sign of life for 0.5 s"), line
    assert (tmp_path / "error").read_text().strip() == line


@pytest.mark.parametrize(
    ("value", "expected"),
    [("", 60.0), ("0", 0.0), ("6", 6.0), ("90.5", 90.5), ("abc", "is not a number"), ("2", "at least 6 s"),
     ("-1", "at least 6 s"), ("nan", "at least 6 s"), ("inf", "at least 6 s")],
)  # fmt: skip
def test_the_peer_timeout_is_off_or_long_enough_to_fire(monkeypatch, value, expected):
    monkeypatch.setenv("DISTQA_PEER_TIMEOUT_S", value)
    if isinstance(expected, float):
        assert PeerWatch.timeout_from_env() == expected
        return
    with pytest.raises(DistqaError) as refused:
        PeerWatch.timeout_from_env()
    message = str(refused.value)
    assert message.startswith("DISTQA_PEER_TIMEOUT_S=") and value in message and expected in message, message


def test_a_peer_timeout_under_the_least_would_never_report_a_gone_peer(fast_peer_watch, monkeypatch):
    """Why timeout_from_env refuses one under 3 intervals: under 2, every tick looks like a pause."""
    monkeypatch.setattr(PeerWatch, "INTERVAL_S", 0.2)  # a tick late by 0.1 s still counts at 3 intervals
    short, lost_by_short = watching(0, "short/", timeout_s=1.5 * PeerWatch.INTERVAL_S)  # rank 1 never counts
    least, lost_by_least = watching(0, "least/", timeout_s=3 * PeerWatch.INTERVAL_S)
    deadline = time.monotonic() + 10
    while not lost_by_least and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    short.stop(), least.stop()
    assert lost_by_least == [[1]] and lost_by_short == []


@pytest.mark.parametrize("where", ["between-ticks", "mid-read"])
def test_peer_watch_after_the_whole_process_was_paused_reports_nobody(fast_peer_watch, monkeypatch, where):
    """A job paused as a whole (SIGSTOP, `docker pause`) for longer than the timeout, then resumed,
    wherever the watch thread was (asleep between ticks, or inside a read of the store): the first
    thread to wake must not take its neighbour, not yet awake, for lost."""
    offset, awake, reads_after = [0.0], threading.Event(), [0]
    awake.set()
    real = time.monotonic
    monkeypatch.setattr(peer_watch.time, "monotonic", lambda: real() + offset[0])
    # Rank 1 is held by events, not sleeps, and the timeout is 4 s against a pause of 30: a loaded
    # machine (CI runs this at the lowest priority beside other tests) that delays a thread by a few
    # hundred ms must not fail it (it did with a 0.5 s timeout and sleeps).
    (zero, lost_by_zero), (one, lost_by_one) = watching(0, "paused/", 4.0), watching(1, "paused/", 4.0)
    count_zero, count_one = zero._add, one._add

    def zero_reads(rank: int, amount: int) -> int:
        if rank == 1 and where == "mid-read" and not awake.is_set():
            offset[0] = 30.0  # the pause lands inside this read of rank 1's counter
        value = count_zero(rank, amount)
        reads_after[0] += rank == 1 and offset[0] == 30.0
        return value

    zero._add = zero_reads  # type: ignore[method-assign]
    one._add = lambda rank, amount: (awake.wait(), count_one(rank, amount))[1]  # type: ignore[method-assign]
    time.sleep(0.3)
    awake.clear()  # rank 1 wakes later than rank 0 ...
    if where == "between-ticks":
        offset[0] = 30.0  # ... from a pause of 30 s of every thread
    deadline = real() + 10
    while reads_after[0] < 3 and real() < deadline:  # rank 0 looks at rank 1 three times after it
        time.sleep(0.01)
    assert reads_after[0] >= 3 and not lost_by_zero
    awake.set()
    time.sleep(0.3)
    zero.stop()
    one.stop()
    assert lost_by_zero == [] and lost_by_one == []


def test_a_rank_that_failed_alone_is_not_taken_for_one_that_stopped_on_purpose(fast_peer_watch):
    """cleanup(ended_well=False): the neighbours keep watching it, and its silence ends their wait."""
    failed, _ = watching(0, "failed/")
    counting(fast_peer_watch, "failed/alive/0")
    failed.stop(done=False)
    assert fast_peer_watch.add("failed/alive/0", 0) < PeerWatch.DONE
    finished, _ = watching(0, "finished/")
    counting(fast_peer_watch, "finished/alive/0")
    finished.stop()
    assert fast_peer_watch.add("finished/alive/0", 0) >= PeerWatch.DONE


@pytest.mark.safety  # two launches of 2 processes (~20 s): make test-safety
def test_a_rank_0_without_the_run_s_checkpoints_refuses_to_start_over(tmp_path):
    """Nodes that do not share output_dir, relaunched with rank 0 on another host (or an elastic
    round whose rank 0 is a node that joined): rank 0 found no checkpoint and the run started from
    step 0 beside the other node's, exit 0 (found by a review). Each rank's own output_dir here:
    LOCAL_RANK in the path, the second launch with rank 1's folder holding the first run."""
    first = [*SMALL, "train.max_steps=2", "train.checkpoint_every=2", "train.check_replicas=false"]
    run_train([*first, f"output_dir={tmp_path}/r${{oc.env:LOCAL_RANK}}"], nproc=2)
    assert (tmp_path / "r0" / "checkpoints" / "step-2").is_dir()
    (tmp_path / "s0").mkdir()
    (tmp_path / "s1").symlink_to(tmp_path / "r0")
    second = [*SMALL, "train.max_steps=4", "train.checkpoint_every=2", f"output_dir={tmp_path}/s${{oc.env:LOCAL_RANK}}"]
    proc = run_train(second, nproc=2, check=False)
    assert proc.returncode != 0
    assert (
        f"rank 0 finds no checkpoint in {tmp_path}/s0/checkpoints, but rank 1 in {tmp_path}/s1/checkpoints "
        "(newest step-2) sees one: this run would start from step 0 beside them" in proc.stderr
    ), proc.stderr[-3000:]
    assert not (tmp_path / "s0" / "checkpoints").exists()


def test_no_checkpoint_on_any_rank_is_checked_on_every_rank(monkeypatch, tmp_path):
    """The check itself, at 3 ranks, without a launch: rank 2 alone sees a step folder."""
    import torch

    from distqa import checkpoint_verify
    from distqa.dist import DistInfo
    from distqa.errors import ConfigError

    views = [([], "/a/checkpoints", None), ([], "/b/checkpoints", None), (["step-8"], "/c/checkpoints", None)]
    monkeypatch.setattr(checkpoint_verify, "all_gather_objects", lambda obj, info: views)
    info = DistInfo(rank=1, local_rank=0, world_size=3, device=torch.device("cpu"))
    said = r"^rank 0 finds no checkpoint in /a/checkpoints, but rank 2 in /c/checkpoints \(newest step-8\) sees one"
    with pytest.raises(ConfigError, match=said):
        checkpoint_verify.none_on_any_rank(tmp_path, info)
    views[2] = ([], "/c/checkpoints", None)
    checkpoint_verify.none_on_any_rank(tmp_path, info)
    # A rank that cannot read its folder says so on every rank, not alone (the others would wait in the gather).
    views[1] = ([], "/b/checkpoints", "cannot read it (Stale file handle)")
    with pytest.raises(ConfigError, match=r"not every rank can look for one .*rank 1: /b/checkpoints cannot read it"):
        checkpoint_verify.none_on_any_rank(tmp_path, info)

    def unreadable(root):
        raise OSError(116, "Stale file handle")

    seen = []
    monkeypatch.setattr(checkpoint_verify, "step_folders", unreadable)
    monkeypatch.setattr(checkpoint_verify, "all_gather_objects", lambda obj, info: seen.append(obj) or [obj] * 3)
    with pytest.raises(ConfigError, match="cannot read it"):
        checkpoint_verify.none_on_any_rank(tmp_path, info)
    assert seen and seen[0][2] == "cannot read it (Stale file handle)"  # gathered, not raised alone
