"""Promises of docs/reliability.md that no other test reached, each checked on the trainer's own
path: settings changed on resume take effect from the resume step (weight decay, momentum), the
trainer's DataLoader starts its workers with SIGTERM held, `train.deterministic=true` takes effect
before the first kernel, and a run whose lock another run took over stops at its next step having
written nothing more."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import Dataset

from conftest import ROOT, checkpoint_weights, metrics_rows, subprocess_env
from distqa import runlock, sampler
from distqa.config import Config
from distqa.dist import DistInfo, cleanup, init_distributed
from distqa.registry import load_config
from distqa.task import Batch
from distqa.trainer import Trainer, train
from distqa.worker_signals import loader_worker_init
from toy_task import ToyClassificationTask

# The toy task (tests/toy_task.py): a 2-layer classifier, a step takes a millisecond.
TOY = ["data.num_workers=0", "train.log_every=1", "task.size=256", "train.batch_size=8"]


def run(out: Path, *overrides: str) -> Path:
    try:
        train(load_config(None, ["task=toy_task:ToyClassificationTask", f"output_dir={out}", *TOY, *overrides]))
    finally:
        torch.use_deterministic_algorithms(False)  # train.deterministic sets it process-wide
    return out


# ---------------------------------------------------------------------------- M2: settings on resume
# SGD at a constant rate, no clipping, momentum or decay: an update is -LR * gradient, so what a
# setting changed on resume adds to it follows from the straight run's weights alone.
LR = 0.1
PLAIN_SGD = [
    "train.optimizer=sgd",
    f"train.lr={LR}",
    "train.lr_schedule=constant",
    "train.warmup_ratio=0",
    "train.max_grad_norm=0",
    "train.momentum=0",
    "train.weight_decay=0",
    "train.max_steps=4",
    "train.checkpoint_every=1",
    "train.keep_checkpoints=0",
]


@pytest.fixture(scope="module")
def sgd_straight(tmp_path_factory) -> Path:
    """4 uninterrupted steps with a checkpoint after each."""
    return run(tmp_path_factory.mktemp("sgd") / "straight", *PLAIN_SGD)


def resumed_from_step_2(straight: Path, tmp_path: Path, *changed: str) -> Path:
    """The straight run cut back to its step-2 checkpoint, then resumed to step 4 with `changed`."""
    out = tmp_path / "resumed"
    shutil.copytree(straight, out)
    for later in ("step-3", "step-4"):
        shutil.rmtree(out / "checkpoints" / later)
    shutil.rmtree(out / "model")
    run(out, *PLAIN_SGD, *changed)
    assert [r["step"] for r in metrics_rows(out)] == [1, 2, 3, 4]
    return out


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    # float32 rounding of the differences only: a missed setting is off by ~1e-2
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_a_weight_decay_changed_on_resume_takes_effect_from_the_resume_step(sgd_straight, tmp_path):
    """SGD's decay adds wd * w to the gradient: with the same gradient (same weights and data at
    step 3), the resumed step 3 moves each decayed tensor by a further -LR * wd * w2, and the
    biases (never decayed) exactly as the straight run did."""
    resumed = checkpoint_weights(resumed_from_step_2(sgd_straight, tmp_path, "train.weight_decay=0.5"), 3)
    w2, straight = checkpoint_weights(sgd_straight, 2), checkpoint_weights(sgd_straight, 3)
    assert {name for name in w2 if name.endswith("weight")}, w2.keys()  # some tensors are decayed
    for name, before in w2.items():
        decay = LR * 0.5 * before if name.endswith("weight") else torch.zeros_like(before)
        assert_close(name, resumed[name], straight[name] - decay)


def test_a_momentum_changed_on_resume_takes_effect_from_the_resume_step(sgd_straight, tmp_path):
    """The resumed step 3 starts the momentum buffer at its gradient g3 = (w2 - w3) / LR, so it moves
    as the straight run did; step 4 then adds 0.9 * g3 to its own gradient, a further 0.9 * (w3 - w2)."""
    resumed = checkpoint_weights(resumed_from_step_2(sgd_straight, tmp_path, "train.momentum=0.9"), 4)
    w2, w3, w4 = (checkpoint_weights(sgd_straight, step) for step in (2, 3, 4))
    for name in w2:
        expected = w4[name] + 0.9 * (w3[name] - w2[name])
        assert_close(name, resumed[name], expected)
    assert max(float((w3[n] - w2[n]).abs().max()) for n in w2) > 1e-3  # the change is visible


# ---------------------------------------------------------------------------- M5: the loader's workers and SIGTERM
# What each loader worker saw as it started (set in the worker, read by the dataset in the same worker).
_WORKER: dict[str, int | bool] = {}


def _observing_worker_init(worker_id: int) -> None:
    """The trainer's `loader_worker_init`, noting the process group the worker was born in and
    whether it trains with SIGTERM held."""
    _WORKER["born_in_group"] = os.getpgid(0)
    loader_worker_init(worker_id)
    _WORKER["held_after_init"] = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])


class WorkerReport(Dataset):
    """Each item: which worker made it, its parent, its process group now and at birth, and
    whether it held SIGTERM (`_observing_worker_init`)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> tuple[int, int, int, int, bool]:
        return os.getpid(), os.getppid(), os.getpgid(0), _WORKER["born_in_group"], _WORKER["held_after_init"]


@pytest.mark.safety  # about 6 s: make test-safety, for make test's 5 minutes
@pytest.mark.parametrize("world_size", [2, 1])
def test_the_trainers_loader_workers_are_never_in_the_training_process_group(monkeypatch, world_size):
    """`training_batches` as the trainer calls it, workers on. Across processes the workers come
    from the fork server (`distqa.loader_server`), not from the training process, born outside its
    process group (torchrun's SIGTERM to that group is meant for the training process alone); in
    one process they are forked and leave the group at once. Either way they take signals, and
    the training process is not left holding SIGTERM."""
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # else the check below is void
    monkeypatch.setattr(sampler, "loader_worker_init", _observing_worker_init)
    cfg = load_config(None, ["task=toy_task:ToyClassificationTask", *TOY, "data.num_workers=2", "train.batch_size=2"])
    info = DistInfo(rank=0, local_rank=0, world_size=world_size, device=torch.device("cpu"))
    batches = sampler.training_batches(WorkerReport(), list, cfg, info, 0, 0)
    # The hold ends with the workers' start: a SIGTERM for the training process is delayed, not lost.
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    items = [item for batch in batches for item in batch]
    assert len(items) == 32 // world_size and len({pid for pid, *_ in items}) == 2  # both workers made batches
    mine = os.getpgid(0)
    assert all(group == pid != mine for pid, _, group, _, _ in items), items
    if world_size > 1:
        assert all(parent != os.getpid() for _, parent, *_ in items), "a worker was forked from the training process"
        assert all(born != mine for _, _, _, born, _ in items), "a worker was born in the training process's group"
    else:
        assert all(parent == os.getpid() for _, parent, *_ in items), "one process: its workers are its own"
    assert not any(held for *_, held in items), "a loader worker kept SIGTERM held while it ran"


# A training process in a session of its own, as torchrun starts it. Each of the trainer's loader
# workers sends SIGTERM to the training process's group in its worker_init_fn, as it starts
# (tests/loader_probe.py): the moment of the race, made certain. The signal is meant for the
# training process alone, and no worker may die of it.
_GROUP_SIGTERM = """
import os, signal, sys
sys.path.insert(0, sys.argv.pop(1))  # tests/, for loader_probe
import torch
from distqa import sampler
from distqa.registry import load_config
from distqa.dist import DistInfo
from loader_probe import GROUP_ENV, group_sigterm_init

got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(1))  # as the trainer's StopSignal records it
os.environ[GROUP_ENV] = str(os.getpgid(0))
sampler.loader_worker_init = group_sigterm_init
world_size = int(sys.argv.pop(1))
cfg = load_config(None, sys.argv[1:])
info = DistInfo(rank=0, local_rank=0, world_size=world_size, device=torch.device("cpu"))
batches = sampler.training_batches(list(range(32)), list, cfg, info, 0, 0)
print(sum(1 for _ in batches), "batches; training process got SIGTERM:", bool(got), flush=True)
"""


@pytest.mark.safety
@pytest.mark.parametrize("world_size", [1, 2])  # forked workers; the fork server's
def test_a_sigterm_to_the_group_while_the_trainers_loader_starts_kills_no_worker(world_size):
    args = ["task=toy_task:ToyClassificationTask", *TOY, "data.num_workers=2", "train.batch_size=2"]
    proc = subprocess.run(
        [sys.executable, "-c", _GROUP_SIGTERM, str(ROOT / "tests"), str(world_size), *args],
        env=subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.strip() == f"{16 // world_size} batches; training process got SIGTERM: True"


# ---------------------------------------------------------------------------- M6: train.deterministic
class DeterminismProbe(ToyClassificationTask):
    """Notes, when the model is built and at every forward pass, whether deterministic kernels are
    enforced (not merely warned about) and the cuBLAS workspace fixed."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.seen: list[tuple[str, bool, bool, str | None]] = []

    def _note(self, when: str) -> None:
        self.seen.append(
            (
                when,
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
                os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            )
        )

    def build_model(self) -> nn.Module:
        self._note("build")
        return super().build_model()

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        self._note("forward")
        return super().loss(model, batch)


@pytest.mark.parametrize("deterministic", [True, False])
def test_train_deterministic_takes_effect_before_the_first_kernel(tmp_path, monkeypatch, deterministic):
    """cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it first allocates its workspace, so the trainer
    must set it (and switch deterministic kernels on) before the task builds or runs anything; with
    the switch off, neither is set (which shows the probe sees the trainer's doing)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # monkeypatch restores it afterwards
    cfg = load_config(
        None,
        [
            "task=toy_task:ToyClassificationTask",
            f"output_dir={tmp_path / 'run'}",
            *TOY,
            "train.max_steps=2",
            f"train.deterministic={str(deterministic).lower()}",
        ],
    )
    task = DeterminismProbe(cfg)
    info = init_distributed()
    try:
        Trainer(cfg, task, info).fit()
    finally:
        torch.use_deterministic_algorithms(False)  # process-wide: never leak into later tests
        cleanup()
    assert [when for when, *_ in task.seen][:3] == ["build", "forward", "forward"]
    for when, enforced, warn_only, workspace in task.seen:
        if deterministic:
            assert enforced and not warn_only, f"deterministic kernels not enforced at {when}"
            assert workspace in (":4096:8", ":16:8"), f"CUBLAS_WORKSPACE_CONFIG={workspace!r} at {when}"
        else:
            assert (enforced, workspace) == (False, None), when


# ---------------------------------------------------------------------------- M7: a lost run lock
TAKEOVER_STEP = 3
OTHER_RUN = {"host": "node-7", "pid": 4242, "proc_start": "1", "pidns": 1, "boot_id": "b", "token": "other-run"}


class TakeoverTask(ToyClassificationTask):
    """During step TAKEOVER_STEP (before any of its writes) another run takes output_dir over, as a
    run that judged this one dead does: a new run.lock with its own token. The holder's heartbeat
    is slowed to an hour, as for a holder paused across the takeover whose heartbeat has not run
    since: only a check of the lock before the step's writes can stop them."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.forwards = 0
        runlock.HEARTBEAT_S = 3600.0  # read by the heartbeat thread, which starts after this

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        self.forwards += 1  # train.grad_accum=1: one forward per step
        if self.forwards == TAKEOVER_STEP:
            lock = Path(self.cfg.output_dir) / runlock.LOCK_NAME
            fresh = lock.with_name("other-run.lock")
            fresh.write_text(json.dumps(OTHER_RUN) + "\n")
            os.replace(fresh, lock)  # the stale lock removed and a new one created, in one move
        return super().loss(model, batch)


@pytest.mark.safety
def test_a_holder_whose_lock_is_taken_over_stops_at_its_next_step_and_writes_nothing_more(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "distqa",
            "train",
            "task=test_reliability_promises:TakeoverTask",
            f"output_dir={out}",
            *TOY,
            "train.max_steps=6",
            "train.checkpoint_every=1",
            "train.keep_checkpoints=0",
        ],
        env=subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode not in (0, 143), proc.stdout + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("distqa: error: ") and "another run" in last and "took over" in last, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # Nothing of the step during which the lock was lost, nor after it: no metrics line, no
    # TensorBoard point, no checkpoint (not even a partial one), no model.
    kept = list(range(1, TAKEOVER_STEP))
    assert [r["step"] for r in metrics_rows(out)] == kept
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == kept
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{s}" for s in kept]
    assert not (out / "model").exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no hidden half-export
    # The other run's lock is left as it wrote it: this run neither deleted nor rewrote it.
    assert json.loads((out / runlock.LOCK_NAME).read_text()) == OTHER_RUN
