"""`train.parallel=dp` and `distqa bench --dp` on CUDA GPUs (marker gpu; skipped without them).

torch.nn.DataParallel runs one process over every visible GPU: it must train the same model as
one DDP process given the same global batch. On one GPU DataParallel calls the module itself
(the same kernels: equal within FP32 rounding); on two it splits each batch in halves, runs the
halves on a copy of the model per GPU and sums the gradients on GPU 0 (another summation order,
so within the fp32 bound of tests/test_gpu.py). Every run goes through the user's command
(`torchrun -m distqa train`, `python -m distqa bench`) and is judged from its files.

The CPU side (refusals, the unwrapped checkpoint, resume, export, bench's rows): tests/test_dp.py.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, load_weights, subprocess_env, wait_for_step
from gpu_runs import BASE, DRY_RUN, LR, Run, max_rel, record, torchrun, trained, weights_rel

pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("dp")]  # pytest.mark.gpu(gpus=2) on a test: it needs two

# Real GPUs only: a dry run (DISTQA_GPU_DRY_RUN=1) runs on the CPU, where dp is refused by design.
GPUS = torch.cuda.device_count() if torch.cuda.is_available() and not DRY_RUN else 0

# fp32, TF32 off (train.deterministic=true), no dropout: one DDP process and DataParallel then
# differ only in the order of the sums (none on one GPU). Steps as in tests/test_gpu.py's 2-GPU
# proofs: losses agree to ~1e-6 and weights to ~1e-7 of their norm, while one AdamW step moves the
# tiny model's weights by ~2 % of their norm, so a lost half-batch or a doubled gradient is far out.
FP32_LOSS_RTOL = 1e-4
FP32_WEIGHTS_RTOL = 1e-4
DP_RUN = [*BASE, "model.name=tiny", LR["tiny"], "train.deterministic=true", "train.max_steps=6"]
BF16_LOSS_RTOL = 5e-3  # bf16's first step against fp32's: tests/test_gpu.py's LOSS_RTOL
# DataParallel's threads carry autocast's on/off but not its dtype, so a lost AutocastForward
# runs the copies in fp16, which lands nearer fp32 than bf16 does (2.5e-6 against 8.6e-5 for
# the tiny model, measured on H100s): nearness to fp32 cannot tell them apart (a review saw
# this). Nearness to one bf16 DDP process can: the two bf16 runs differ only in how the batch is
# split, far less than bf16 differs from fp32.
BF16_TWIN_SHARE = 0.25


@pytest.fixture(autouse=True)
def enough_gpus(request) -> None:
    """Skip a test, naming it and the reason, where fewer GPUs are visible than it needs (its
    launches start only in its body, after this)."""
    needed = max(marker.kwargs.get("gpus", 1) for marker in request.node.iter_markers("gpu"))
    if GPUS < needed:
        why = (
            "a dry run on the CPU"
            if DRY_RUN
            else "torch.cuda.is_available() is False"
            if GPUS == 0
            else f"{GPUS} visible"
        )
        pytest.skip(f"{request.node.name}: needs {needed} CUDA GPU{'s' if needed > 1 else ''} ({why})")


def launch(out: Path, args: list[str], gpus: int, timeout: int = 280) -> Run:
    """`torchrun --nproc-per-node 1 -m distqa train ARGS` seeing the first `gpus` GPUs."""
    cmd = torchrun(["-m", "distqa", "train", *args, f"output_dir={out}"])
    env = subprocess_env(CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(gpus)))
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return Run(out, time.monotonic() - start, proc.stdout)


class Reference:
    """The reference: one DDP process on one GPU, global batch 8; launched once, on first use."""

    def __init__(self, root: Path) -> None:
        self.root, self.run = root, None

    def get(self) -> Run:
        if self.run is None:
            self.run = launch(self.root / "ddp-1", DP_RUN, gpus=1)
        return self.run


@pytest.fixture(scope="module")
def ddp_one(tmp_path_factory) -> Reference:
    return Reference(tmp_path_factory.mktemp("dp"))


def compare(name: str, run: Run, ref: Run) -> None:
    """Every logged loss within FP32_LOSS_RTOL, the exported weights within FP32_WEIGHTS_RTOL; the
    checkpoint's keys the module's own, as DDP's."""
    losses = max_rel(run.losses, ref.losses)
    weights = weights_rel(run.out, ref.out)
    record(f"dp/{name}", loss_rel_diff=losses, weights_rel_diff=weights, tolerances=[FP32_LOSS_RTOL, FP32_WEIGHTS_RTOL])
    assert len(run.losses) == len(ref.losses) == 6
    assert losses <= FP32_LOSS_RTOL, (run.losses, ref.losses)
    assert weights <= FP32_WEIGHTS_RTOL
    keys = load_file(str(run.out / "checkpoints" / "step-6" / "model.safetensors")).keys()
    assert keys == load_file(str(ref.out / "checkpoints" / "step-6" / "model.safetensors")).keys()
    assert not any(key.startswith("module.") for key in keys)


def test_dp_on_one_gpu_equals_one_ddp_process(tmp_path, ddp_one):
    run = launch(tmp_path / "dp-1", [*DP_RUN, "train.parallel=dp"], gpus=1)
    assert "1 process(es) on cuda (DataParallel over 1 GPU)" in run.stdout, run.stdout[-2000:]
    compare("one_gpu_vs_ddp_1", run, ddp_one.get())


@pytest.mark.gpu(gpus=2)
def test_dp_on_two_gpus_equals_one_ddp_process_with_the_same_global_batch(tmp_path, ddp_one):
    """train.batch_size=8 split 4 + 4 over two GPUs against one DDP process's batch of 8."""
    run = launch(tmp_path / "dp-2", [*DP_RUN, "train.parallel=dp"], gpus=2)
    assert "1 process(es) on cuda (DataParallel over 2 GPUs)" in run.stdout, run.stdout[-2000:]
    compare("two_gpus_vs_ddp_1", run, ddp_one.get())


@pytest.mark.gpu(gpus=2)
def test_dp_bf16_on_two_gpus_computes_in_bf16_and_trains(tmp_path, ddp_one):
    """bf16 autocast inside each GPU's copy: the first step's loss within BF16_LOSS_RTOL of the
    fp32 reference's, and nearer one bf16 DDP process's than that one is to fp32 (fp16 in the
    copies would be nearer fp32); then the loss falls."""
    args = [*BASE, "model.name=tiny", LR["tiny"], "train.precision=bf16", "train.max_steps=30"]
    run = launch(tmp_path / "dp-bf16", [*args, "train.parallel=dp"], gpus=2)
    twin = launch(tmp_path / "ddp-bf16", args, gpus=1)
    fp32 = ddp_one.get().losses[:1]
    diff, apart = max_rel(run.losses[:1], fp32), max_rel(twin.losses[:1], fp32)
    twin_diff = max_rel(run.losses[:1], twin.losses[:1])
    first, last = trained(run.losses)
    record(
        "dp/two_gpus_bf16",
        first_loss_rel_diff=diff,
        bf16_ddp_rel_diff_from_fp32=apart,
        rel_diff_from_bf16_ddp=twin_diff,
        tolerances=[BF16_LOSS_RTOL, BF16_TWIN_SHARE],
        first5_mean=first,
        last5_mean=last,
    )
    assert diff <= BF16_LOSS_RTOL and all(math.isfinite(x) for x in run.losses)
    assert twin_diff <= BF16_TWIN_SHARE * apart, "DataParallel's copies did not compute in bf16"
    assert last < 0.9 * first, run.losses


# Dropout on: each GPU's copy draws its masks from its own GPU's generator, so an exact resume needs
# every one of them saved (checkpoint's rng-rank0.pt, "cuda_replicas") and restored.
DP_TERM_STEPS = 300
DP_TERM_RUN = [*DP_RUN[:-1], "model.dropout=0.1", "data.num_workers=2", f"train.max_steps={DP_TERM_STEPS}"]


@pytest.mark.gpu(gpus=2)
def test_dp_sigterm_and_resume_on_two_gpus_is_exact_with_dropout(tmp_path):
    straight = launch(tmp_path / "straight", [*DP_TERM_RUN, "train.parallel=dp"], gpus=2)
    out = tmp_path / "preempted"
    cmd = torchrun(["-m", "distqa", "train", *DP_TERM_RUN, "train.parallel=dp", f"output_dir={out}"])
    env = subprocess_env(CUDA_VISIBLE_DEVICES="0,1")
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(proc, out, 20)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # (a failed wait: no 2-GPU run left behind)
            proc.kill()
            proc.communicate()
    lines = [x for x in stderr.splitlines() if x.startswith("distqa: preempted:")]
    assert proc.returncode != 0 and lines, f"no preemption ({proc.returncode}):\n{stderr[-3000:]}"
    step = int(re.search(r"at step (\d+)", lines[0]).group(1))
    assert 20 <= step < DP_TERM_STEPS, lines[0]
    rng = torch.load(out / "checkpoints" / f"step-{step}" / "rng-rank0.pt", weights_only=True)
    assert list(rng["cuda_replicas"]) == [1]
    resumed = launch(out, [*DP_TERM_RUN, "train.parallel=dp"], gpus=2)
    assert "resumed from" in resumed.stdout and "seeded afresh" not in resumed.stdout, resumed.stdout[-2000:]
    ours, theirs = load_weights(out), load_weights(straight.out)
    diff = max(float((ours[k].float() - theirs[k].float()).abs().max()) for k in ours)
    record("dp/two_gpus_sigterm_resume", preempted_at_step=step, weights_max_abs_diff=diff, tolerance=0.0)
    assert diff == 0.0


def test_bench_dp_gives_a_dp_row_per_gpu_count(tmp_path):
    nproc = ",".join(str(n) for n in range(1, min(GPUS, 2) + 1))
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "distqa", "bench", "--nproc", nproc, "--output", str(out), "--dp"]
    cmd += ["--repeats", "1", "--warmup", "2", "--steps", "3", "model.name=tiny", "task.max_seq_len=64"]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    counts = [int(n) for n in nproc.split(",")]
    assert [(r["parallel"], r["nproc"]) for r in result["runs"]] == [("ddp", n) for n in counts] + [
        ("dp", n) for n in counts
    ]
    dp = [r for r in result["runs"] if r["parallel"] == "dp"]
    record(
        "dp/bench",
        rows={r["nproc"]: {"samples_per_s": r["samples_per_s"], "dp_over_ddp": r["dp_over_ddp"]} for r in dp},
    )
    assert all(r["samples_per_s"] > 0 and r["step_breakdown_ms"]["forward_backward"] > 0 for r in dp)
    # The dp launch ran one process with the batch of all its GPUs.
    raw = json.loads((out / "runs" / f"np{counts[-1]}-dp-0.json").read_text())
    assert raw["world_size"] == 1 and raw["dp_gpus"] == counts[-1] and raw["batch_size"] == 8 * counts[-1]
