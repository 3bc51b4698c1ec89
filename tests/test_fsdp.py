"""train.parallel=fsdp (FSDP2) at two processes: the same weights as DDP (clipping included), a
sharded checkpoint resumed on one process, an export Hugging Face loads, an evaluation whose ranks
run different numbers of batches, and nodes without a shared output_dir. test_fsdp_resume.py has
the resumes and the bench figure.

`make perf-fsdp` (marker fsdp; in CI, part of make test-suites): about 2 minutes of torchrun launches.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (
    ROOT,
    SGD,
    SMALL,
    free_port,
    load_weights,
    max_abs_diff,
    metrics_rows,
    needs_root,
    run_train,
    sharded_checkpoint,
    subprocess_env,
)

pytestmark = [pytest.mark.fsdp, pytest.mark.slow]

FSDP = ["train.parallel=fsdp", "train.check_replicas=false"]  # the replica check needs whole replicas

# 4 SGD steps of global batch 4 (2 processes x 2 micro-batches of 1: FSDP's accumulation against
# DDP's), clipped, DataLoader workers on, no RNG in the result.
SGD_RUN = [
    *SGD,
    "task.dummy_size=64",
    "data.num_workers=2",
    "train.batch_size=1",
    "train.grad_accum=2",
    "train.max_steps=4",
    "train.max_grad_norm=0.1",  # below the gradients' norm: clipping over the shards is compared too
    "train.checkpoint_every=2",
    "train.keep_checkpoints=0",
]


@pytest.fixture(scope="module")
def sgd_runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sgd")
    runs = {name: root / name for name in ("fsdp", "ddp", "fsdp-ac", "ddp-ac", "fsdp-batch-2")}
    ac = "train.activation_checkpointing=true"
    run_train([*SGD_RUN, *FSDP, f"output_dir={runs['fsdp']}"], nproc=2)
    # The same global batch as one micro-batch of 2 per process (the resharding check).
    batch2 = ["train.batch_size=2", "train.grad_accum=1"]
    run_train([*SGD_RUN, *FSDP, *batch2, f"output_dir={runs['fsdp-batch-2']}"], nproc=2)
    run_train([*SGD_RUN, f"output_dir={runs['ddp']}"], nproc=2)
    run_train([*SGD_RUN, *FSDP, ac, f"output_dir={runs['fsdp-ac']}"], nproc=2)
    run_train([*SGD_RUN, ac, f"output_dir={runs['ddp-ac']}"], nproc=2)
    return runs


def sharded_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint (model and optimizer), whole, by its key."""
    state = sharded_checkpoint(checkpoint)
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
    start = sharded_state(sgd_runs["fsdp"] / "checkpoints" / "step-2")
    moved = max(float((fsdp[k] - start[f"/model/{k}"]).abs().max()) for k in fsdp if f"/model/{k}" in start)
    assert moved > 1e-3
    assert [r["loss"] for r in metrics_rows(sgd_runs["fsdp"])] == pytest.approx(
        [r["loss"] for r in metrics_rows(sgd_runs["ddp"])], abs=1e-5
    )


def test_activation_checkpointing_at_two_processes_changes_no_weight(sgd_runs):
    """Recomputed blocks inside FSDP's units (gathered again for the recomputation) and inside DDP."""
    for name in ("fsdp-ac", "ddp-ac"):
        assert max_abs_diff(load_weights(sgd_runs[name]), load_weights(sgd_runs["ddp"])) < 1e-5, name


def test_a_sharded_checkpoint_of_two_processes_resumes_on_one_with_grad_accum_two(sgd_runs, tmp_path):
    """2 processes x batch 2 to step 2, then 1 process x batch 2 x grad_accum 2 to step 4: the
    2-process run's weights. (Its split of the global batch does not matter either: it equals the
    1 x 2 micro-batches run of DDP.)"""
    out = tmp_path / "one"
    straight = sgd_runs["fsdp-batch-2"]
    step2 = straight / "checkpoints" / "step-2"
    args = [*SGD_RUN, *FSDP, "train.batch_size=2", "train.grad_accum=2", f"train.resume={step2}"]
    proc = run_train([*args, f"output_dir={out}"], nproc=1)
    assert f"resumed from {step2} at step 2" in proc.stdout
    assert max_abs_diff(load_weights(out), load_weights(straight)) < 1e-5
    assert max_abs_diff(load_weights(straight), load_weights(sgd_runs["ddp"])) < 1e-5


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


def test_evaluation_of_a_sharded_model_runs_in_step_when_shares_differ(tmp_path):
    """11 validation items on 2 ranks, one per batch: 6 forward passes on one rank, 5 on the other.
    A sharded forward is collective, so without the extra pass the run would hang."""
    out = tmp_path / "eval"
    args = ["task=toy_task:StackedEvalProbeTask", "train.max_steps=2", "train.batch_size=1", "data.num_workers=0"]
    run_train([*args, *FSDP, "train.eval_every=1", f"output_dir={out}"], nproc=2, timeout=120)
    rows = metrics_rows(out)  # an evaluation at step 1, training goes on, and another at step 2
    assert [r["eval_step_seen"] for r in rows] == [1.0, 2.0]
    assert all(r["eval_items_in_order"] == 1.0 and r["eval_any_grad"] == 0.0 for r in rows)


def test_nodes_that_do_not_share_output_dir_stop_at_start_naming_it(tmp_path):
    """Two nodes (two torchrun agents), where node 1 has a mount namespace of its own with an empty
    file system over output_dir: as two machines without shared storage. With fsdp every rank
    writes its shards there, so the run must stop before its first step, saying why."""
    needs_root("a node without the shared output_dir (a mount namespace)", "unshare", "mount")
    out = tmp_path / "run"
    out.mkdir()
    port = free_port()

    def node(rank: int) -> subprocess.Popen:
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"),
            *(f"--node-rank={rank}", "--master-addr=127.0.0.1", f"--master-port={port}"),
            *("-m", "distqa", "train", *SMALL, *FSDP, "train.max_steps=2", f"output_dir={out}"),
        ]
        if rank == 1:
            command = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', str(out), *command]
        return subprocess.Popen(
            command, env=subprocess_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    nodes = [node(0), node(1)]
    logs = [proc.communicate(timeout=120) for proc in nodes]
    assert all(proc.returncode != 0 for proc in nodes), logs
    stderr = logs[0][1]
    assert f"rank(s) 1 cannot see the files rank 0 writes in {out}" in stderr, stderr[-3000:]
    assert "step 1" not in logs[0][0] and not (out / "checkpoints").exists()


def test_an_fp16_overflow_in_one_ranks_shards_skips_the_step_on_every_rank(tmp_path):
    """Sharded, a rank sees only its own shards' gradients: the overflow on step 3 lies in rank 1's
    rows only. Every rank must skip that step (the scaler agrees across ranks), or rank 0's half of
    the weights would move while rank 1's did not."""
    out = tmp_path / "fp16"
    args = ["task=toy_task:ShardOverflowTask", "train.precision=fp16", "train.optimizer=sgd", "train.lr=0.1"]
    args += ["train.lr_schedule=constant", "train.warmup_ratio=0", "train.max_steps=5", "data.num_workers=0"]
    run_train([*args, *FSDP, "train.checkpoint_every=1", "train.keep_checkpoints=0", f"output_dir={out}"], nproc=2)
    steps = range(1, 6)
    states = {s: sharded_state(out / "checkpoints" / f"step-{s}") for s in steps}
    weights = {s: {k: v for k, v in states[s].items() if k.startswith("/model/")} for s in steps}
    assert max_abs_diff(weights[2], weights[3]) == 0.0  # skipped, both halves
    assert max_abs_diff(weights[1], weights[2]) > 1e-4 and max_abs_diff(weights[3], weights[4]) > 1e-4
    training = [torch.load(out / "checkpoints" / f"step-{s}" / "training_state.pt", weights_only=True) for s in steps]
    # The schedule waits on step 3 and goes on after it. (Step 1 may be skipped too: gradients are
    # computed in fp16 under FSDP's policy, and the scaler's first scale, 2**16, can overflow them.)
    epochs = [t["scheduler"]["last_epoch"] for t in training]
    assert epochs[2] == epochs[1] and epochs[3:] == [epochs[1] + 1, epochs[1] + 2], epochs
    scales = [t["scaler"]["scale"] for t in training]
    assert scales[2] == scales[1] / 2 and scales[3] == scales[2], scales


def test_gradient_accumulation_reduces_only_on_the_last_micro_batch(tmp_path):
    out = tmp_path / "accum"
    args = ["task=toy_task:SyncProbeTask", "train.grad_accum=3", "train.max_steps=2", "data.num_workers=0"]
    run_train([*args, *FSDP, f"output_dir={out}"], nproc=2)
    # Before micro-batches 1, 2, 3 of steps 1 and 2: no gradient reduced yet, each time (before the
    # first, the last step's were cleared; before the others, a backward has run without reducing).
    # That the last micro-batch does reduce, and right, is test_fsdp_equals_ddp_after_four_steps.
    assert json.loads((out / "model" / "reduced_before.json").read_text()) == [False] * 6
