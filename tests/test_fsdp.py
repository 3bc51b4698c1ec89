"""train.parallel=fsdp (FSDP2) at two processes: the same weights as DDP, exact resume from sharded
checkpoints (also onto one process), the SIGTERM checkpoint, an export Hugging Face loads, an
evaluation whose ranks run different numbers of batches, and the memory figure of `distqa bench`.

`make perf-fsdp` (marker fsdp; its own step in .ci/run): about 2 minutes of torchrun launches.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import (
    FAULT_RUN,
    ROOT,
    SGD,
    launch,
    load_weights,
    max_abs_diff,
    metrics_rows,
    run_train,
    subprocess_env,
    wait_for_step,
)

pytestmark = [pytest.mark.fsdp, pytest.mark.slow]

FSDP = ["train.parallel=fsdp", "train.check_replicas=false"]  # the replica check needs whole replicas

# 4 SGD steps of global batch 4 (2 processes x 2), clipped, DataLoader workers on, no RNG in the result.
SGD_RUN = [
    *SGD,
    "task.dummy_size=64",
    "data.num_workers=2",
    "train.batch_size=2",
    "train.max_steps=4",
    "train.max_grad_norm=0.1",  # below the gradients' norm: clipping over the shards is compared too
    "train.checkpoint_every=2",
    "train.keep_checkpoints=0",
]

# AdamW, dropout, gradient accumulation and DataLoader workers (conftest's fault run), 12 steps:
# one epoch is 8 steps, so the resumes below cross an epoch boundary.
ADAMW_RUN = [*FAULT_RUN, *FSDP, "train.max_steps=12", "train.checkpoint_every=2"]


@pytest.fixture(scope="module")
def sgd_runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sgd")
    runs = {"fsdp": root / "fsdp", "ddp": root / "ddp"}
    run_train([*SGD_RUN, *FSDP, f"output_dir={runs['fsdp']}"], nproc=2)
    run_train([*SGD_RUN, f"output_dir={runs['ddp']}"], nproc=2)
    return runs


@pytest.fixture(scope="module")
def adamw_straight(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("adamw") / "straight"
    run_train([*ADAMW_RUN, f"output_dir={out}"], nproc=2)
    return out


def sharded_state(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint (model and optimizer), whole, by its key."""
    target = tmp_path / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, target)
    state = torch.load(target, weights_only=False)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if torch.is_tensor(value):
            flat[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)

    walk("", state)
    return flat


def test_fsdp_equals_ddp_after_four_steps(sgd_runs):
    fsdp, ddp = load_weights(sgd_runs["fsdp"]), load_weights(sgd_runs["ddp"])
    assert max_abs_diff(fsdp, ddp) < 1e-5
    # The comparison can fail: 4 steps at SGD's rate 0.5 move the weights by far more.
    start = sharded_state(sgd_runs["fsdp"] / "checkpoints" / "step-2", sgd_runs["fsdp"])
    moved = max(float((fsdp[k] - start[f"/model/{k}"]).abs().max()) for k in fsdp if f"/model/{k}" in start)
    assert moved > 1e-3
    assert [r["loss"] for r in metrics_rows(sgd_runs["fsdp"])] == pytest.approx(
        [r["loss"] for r in metrics_rows(sgd_runs["ddp"])], abs=1e-5
    )


def test_a_sharded_checkpoint_of_two_processes_resumes_on_one_with_grad_accum_two(sgd_runs, tmp_path):
    out = tmp_path / "one"
    step2 = sgd_runs["fsdp"] / "checkpoints" / "step-2"
    proc = run_train([*SGD_RUN, *FSDP, "train.grad_accum=2", f"train.resume={step2}", f"output_dir={out}"], nproc=1)
    assert f"resumed from {step2} at step 2" in proc.stdout
    assert max_abs_diff(load_weights(out), load_weights(sgd_runs["fsdp"])) < 1e-5


def test_the_fsdp_export_is_whole_and_loads_with_hugging_face_and_bertjointqa(sgd_runs):
    from transformers import AutoModelForQuestionAnswering

    from distqa.nq.model import BertJointQA

    folder = sgd_runs["fsdp"] / "model"
    model, info = AutoModelForQuestionAnswering.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    exported = load_weights(sgd_runs["fsdp"])
    assert model.bert.embeddings.word_embeddings.weight.shape == (30522, 128)  # whole, not a shard
    assert torch.equal(model.qa_outputs.weight, exported["qa_outputs.weight"])
    joint = BertJointQA.from_pretrained(folder)
    assert torch.equal(joint.answer_type_head.weight, exported["answer_type_head.weight"])
    checkpoint = sgd_runs["fsdp"] / "checkpoints" / "step-4"
    assert (checkpoint / ".metadata").is_file() and not (checkpoint / "model.safetensors").exists()
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(json.loads((checkpoint / "manifest.json").read_text()))


def test_two_steps_then_a_resume_to_four_equals_four_straight(adamw_straight, tmp_path):
    out = tmp_path / "resumed"
    run_train([*ADAMW_RUN, "train.max_steps=2", f"output_dir={out}"], nproc=2)
    proc = run_train([*ADAMW_RUN, "train.max_steps=4", f"output_dir={out}"], nproc=2)
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout
    resumed = sharded_state(out / "checkpoints" / "step-4", tmp_path)
    straight = sharded_state(adamw_straight / "checkpoints" / "step-4", tmp_path)
    assert resumed.keys() == straight.keys() and any("exp_avg_sq" in k for k in straight)  # AdamW's moments too
    assert max_abs_diff(resumed, straight) < 1e-6
    before = sharded_state(adamw_straight / "checkpoints" / "step-2", tmp_path)
    assert max_abs_diff(before, straight) > 1e-4  # two steps of AdamW at 1e-3 show


def test_sigterm_checkpoints_a_sharded_model_and_the_resume_ends_with_the_straight_weights(adamw_straight, tmp_path):
    out = tmp_path / "preempted"
    proc = launch([*ADAMW_RUN, f"output_dir={out}"])
    wait_for_step(proc, out, 5)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-3000:]
    line = next(x for x in stderr.splitlines() if x.startswith("distqa: preempted:"))
    step = int(line.split("at step ")[1].split()[0])
    assert 5 <= step < 12
    run_train([*ADAMW_RUN, f"output_dir={out}"], nproc=2)
    assert max_abs_diff(load_weights(out), load_weights(adamw_straight)) < 1e-6


def test_evaluation_of_a_sharded_model_runs_in_step_when_shares_differ(tmp_path):
    """11 validation items on 2 ranks, one per batch: 6 forward passes on one rank, 5 on the other.
    A sharded forward is collective, so without the extra pass the run would hang."""
    out = tmp_path / "eval"
    args = ["task=toy_task:StackedEvalProbeTask", "train.max_steps=2", "train.batch_size=1", "data.num_workers=0"]
    run_train([*args, *FSDP, f"output_dir={out}"], nproc=2, timeout=120)
    last = metrics_rows(out)[-1]
    assert last["eval_items_in_order"] == 1.0 and last["eval_any_grad"] == 0.0 and last["eval_step_seen"] == 2.0


def bench(tmp_path: Path, parallel: str) -> dict:
    out = tmp_path / parallel
    args = [
        *("--nproc", "2", "--output", str(out), "--warmup", "2", "--steps", "1", "--repeats", "1"),
        *("model.name=bert-base-random", "task.max_seq_len=64", "train.batch_size=2", f"train.parallel={parallel}"),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "distqa", "bench", *args],
        env=subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((out / "bench.json").read_text())


def test_bench_records_that_fsdp_holds_about_half_the_state_per_rank_of_ddp(tmp_path):
    rows = {p: bench(tmp_path, p)["runs"] for p in ("ddp", "fsdp")}
    ddp, fsdp = (next(r for r in rows[p] if r["nproc"] == 2) for p in ("ddp", "fsdp"))
    # bert-base: 110M parameters, AdamW: 16 bytes each (weights, gradients, two moments) in DDP.
    assert 1600 < ddp["state_mib_per_rank"] < 1750
    assert fsdp["state_mib_per_rank"] <= 0.6 * ddp["state_mib_per_rank"]
    assert fsdp["state_mib_breakdown"]["optimizer"] == pytest.approx(ddp["state_mib_breakdown"]["optimizer"] / 2, 0.01)
