"""Launching and judging the GPU suite's runs (tests/test_gpu.py): `torchrun -m distqa train` on the
GPU or, with CUDA_VISIBLE_DEVICES="", on the CPU of the same machine; the loss curve, the exported
weights and how far two runs are apart; the figures file every verdict's numbers go to."""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from conftest import ROOT, load_weights, metrics_rows, subprocess_env

# DISTQA_GPU_DRY_RUN=1 checks the suite's own logic on a machine without a GPU: the "CUDA" launches
# run on the CPU as if on 2 GPUs (CPU autocast for bf16 and fp16); the assertions only a GPU can
# meet (fused AdamW, a peak memory figure) then fail.
DRY_RUN = os.environ.get("DISTQA_GPU_DRY_RUN") == "1"
GPUS = 2 if DRY_RUN else torch.cuda.device_count() if torch.cuda.is_available() else 0

# The CPU references' threads: enough that a BERT-base step takes a second, few enough that the
# xdist groups running beside them keep cores for their own launches.
CPU_THREADS = max(1, min(4, len(os.sched_getaffinity(0))))

# The tiny BERT on short DummyDataset sequences, AdamW at a constant rate, no dropout: no RNG enters
# the result, so CUDA and CPU runs of the same settings see the same weights and batches.
BASE = [
    "task.max_seq_len=64",
    "task.dummy_size=512",
    "data.num_workers=0",
    "model.dropout=0.0",
    "train.log_every=1",
    "train.batch_size=8",
    "train.lr_schedule=constant",
    "train.warmup_ratio=0",
    "train.checkpoint_every=1000",
]
LR = {"tiny": "train.lr=1e-3", "bert-base-random": "train.lr=1e-4"}
TRAIN_STEPS = 30  # enough for the loss to fall; seconds on a GPU
REFERENCE_STEPS = 3  # the fp32 CPU reference: its first steps are all the comparisons need


FIGURES = Path(os.environ.get("DISTQA_GPU_FIGURES", str(ROOT / "results" / "gpu" / "figures.json")))


def record(name: str, **figures: object) -> None:
    """Merge `figures` under `name` into the figures file, and print them (pytest -s, -rA).
    A read-merge-write under a lock: pytest-xdist workers share the file."""
    print(f"{name}: {json.dumps(figures)}")
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    with open(FIGURES.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(FIGURES.read_text()) if FIGURES.is_file() else {}
        data[name] = figures
        tmp = FIGURES.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        tmp.replace(FIGURES)


@dataclass
class Run:
    out: Path
    seconds: float  # the launch's wall time, start-up included
    stdout: str

    @property
    def losses(self) -> list[float]:
        return [row["loss"] for row in metrics_rows(self.out)]


def torchrun(args: list[str], *, nproc: int = 1) -> list[str]:
    """The documented launch, as a module: there may be no `distqa` or `torchrun` on PATH."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def launch_env(cpu: bool) -> dict[str, str]:
    # CUDA_VISIBLE_DEVICES="" hides every GPU: the trainer then runs on the CPU (gloo).
    if cpu or DRY_RUN:
        return subprocess_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=str(CPU_THREADS))
    return subprocess_env()


def train(out: Path, args: list[str], *, nproc: int = 1, cpu: bool = False, timeout: int = 280) -> Run:
    """`torchrun -m distqa train ARGS output_dir=OUT`, which must succeed on the device asked for."""
    cmd = torchrun(["-m", "distqa", "train", *args, f"output_dir={out}"], nproc=nproc)
    start = time.monotonic()
    proc = subprocess.run(cmd, env=launch_env(cpu), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    # The trainer's start line ("N process(es) on cuda, ..."): a CUDA run that fell back to the CPU
    # would otherwise pass every comparison with the CPU reference. (A start line worded otherwise
    # is no failure here: other tests own its wording.)
    expected = "cpu" if cpu or DRY_RUN else "cuda"
    found = re.search(r"process\(es\) on (\w+)", proc.stdout)
    assert found is None or found.group(1) == expected, f"not on {expected}:\n{proc.stdout[-2000:]}"
    return Run(out, seconds, proc.stdout)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) >= 1 and len(b) >= 1
    return max(rel(x, y) for x, y in zip(a, b))


def weights_rel(a: Path, b: Path) -> float:
    """|A - B| / |B| over all of model/'s weights: one number, where a rare element that Adam's
    normalisation amplifies (a gradient near 0 that rounds differently) cannot dominate."""
    wa, wb = load_weights(a), load_weights(b)
    assert wa.keys() == wb.keys()
    diff = sum(float((wa[k].double() - wb[k].double()).pow(2).sum()) for k in wa)
    norm = sum(float(wb[k].double().pow(2).sum()) for k in wb)
    return math.sqrt(diff / norm)


def trained(losses: list[float]) -> tuple[float, float]:
    """(mean of the first 5 losses, mean of the last 5)."""
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5


class Runs:
    """Launches shared by the tests of one xdist group, each made once, on first use. A launch that
    failed fails every test that needs it, without being tried again: GPU time is short."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, Run | BaseException] = {}

    def get(self, name: str, args: list[str], **kwargs) -> Run:
        if name not in self.done:
            try:
                self.done[name] = train(self.root / name, args, **kwargs)
            except (AssertionError, subprocess.TimeoutExpired) as err:
                self.done[name] = err
        found = self.done[name]
        if isinstance(found, BaseException):
            raise AssertionError(f"the run {name} failed: {found}")
        return found

    def cpu_reference(self, model: str) -> Run:
        """fp32 AdamW on the CPU, REFERENCE_STEPS steps."""
        args = [f"model.name={model}", LR[model], *BASE, f"train.max_steps={REFERENCE_STEPS}"]
        return self.get(f"cpu-{model}", args, cpu=True)

    def cuda(self, model: str, precision: str) -> Run:
        """TRAIN_STEPS steps at `precision` with SDPA attention, the reference's other settings."""
        args = [f"model.name={model}", LR[model], *BASE, f"train.precision={precision}"]
        return self.get(
            f"{model}-{precision}", [*args, f"train.max_steps={TRAIN_STEPS}", "model.attn_implementation=sdpa"]
        )


def predicted_gib(seq: int, batch: int) -> float:
    """`python -m distqa.bench.memory`'s figure for BERT-base on one GPU, DDP column (GiB)."""
    cmd = [sys.executable, "-m", "distqa.bench.memory", "--gpus", "1"]
    cmd += ["--seq", str(seq), "--batch", str(batch)]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| model"))
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| BERT-base"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    return float([cell.strip() for cell in row.strip("|").split("|")][columns.index("DDP")])
