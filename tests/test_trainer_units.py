"""The trainer in-process, as a single process (no torchrun, no process group): precision modes,
gradient clipping, determinism, and the errors a user meets before training starts."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from PIL import Image

from conftest import SMALL, load_weights, max_abs_diff
from distqa.errors import ConfigError, DistqaError
from distqa.registry import load_config
from distqa.trainer import train


def run(tmp_path, name, *overrides):
    cfg = load_config(None, [*SMALL, f"output_dir={tmp_path / name}", "train.batch_size=2", *overrides])
    train(cfg)
    return tmp_path / name


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, capsys):
    a = run(tmp_path, "a", "train.max_steps=2", "model.dropout=0.1")
    out, err = capsys.readouterr()
    b = run(tmp_path, "b", "train.max_steps=2", "model.dropout=0.1")
    c = run(tmp_path, "c", "train.max_steps=2", "model.dropout=0.1", "seed=7")
    assert max_abs_diff(load_weights(a), load_weights(b)) == 0.0
    assert max_abs_diff(load_weights(a), load_weights(c)) > 1e-3
    # The end-of-run plot of loss, learning rate and throughput, beside metrics.jsonl, titled after the run.
    png = (a / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    title = Image.open(a / "metrics.png").text["Title"]
    assert title.startswith("task nq, ") and "\nlr 3e-05 (linear), global batch 2; output" in title
    # Not a terminal: no progress bar, but a line per logged step (train.log_every=1), and the last
    # lines say where the results are.
    assert "\r" not in out + err
    assert [line.split(" (")[0] for line in out.splitlines() if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    assert "eval at step" not in out  # no data.valid: nothing evaluated, nothing said about it
    assert out.splitlines()[-2:] == [
        f"model written to {a / 'model'}",
        f"metrics in {a / 'metrics.jsonl'}, plotted in {a / 'metrics.png'} "
        f"(TensorBoard: tensorboard --logdir {a / 'tb'})",
    ]


@pytest.mark.launch  # about 5 s: make test-launch, for make test's 5 minutes
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs_under_autocast(tmp_path, precision):
    fp32 = run(tmp_path, "fp32", "train.max_steps=3", "model.dropout=0.0", "train.lr=1e-3")
    with warnings.catch_warnings():
        # The fp16 scaler skips steps whose gradients overflow; the LR schedule must skip them too
        # (torch warns when a scheduler steps past an optimizer that did not).
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*")
        mixed = run(
            tmp_path,
            precision,
            "train.max_steps=3",
            "model.dropout=0.0",
            "train.lr=1e-3",
            f"train.precision={precision}",
        )
    assert all(torch.isfinite(t).all() for t in load_weights(mixed).values())
    # Step 1 sees the same data and weights: its loss agrees to half-precision accuracy, but not
    # bit for bit (which would mean autocast never engaged).
    first32, first_mixed = losses(fp32)[0], losses(mixed)[0]
    assert first32 == pytest.approx(first_mixed, rel=1e-2)
    assert first32 != first_mixed
    # Weights are kept in fp32 whatever the compute precision.
    assert all(t.dtype == torch.float32 for t in load_weights(mixed).values())


def test_fp16_gradient_scaler_state_is_checkpointed(tmp_path):
    out = run(tmp_path, "fp16", "train.max_steps=2", "train.precision=fp16")
    state = torch.load(out / "checkpoints" / "step-2" / "training_state.pt", weights_only=True)
    assert state["scaler"]["scale"] > 0  # an enabled scaler has a scale; a disabled one saves {}
    state32 = torch.load(
        run(tmp_path, "fp32", "train.max_steps=1") / "checkpoints" / "step-1" / "training_state.pt", weights_only=True
    )
    assert state32["scaler"] == {}


def test_gradient_clipping_bounds_the_update(tmp_path):
    """With SGD at lr 1 and no momentum, one update is -grad: its norm is the clipped norm."""
    common = [
        "train.max_steps=1",
        "train.optimizer=sgd",
        "train.lr=1.0",
        "train.lr_schedule=constant",
        "train.warmup_ratio=0",
        "train.weight_decay=0",
        "model.dropout=0.0",
    ]
    initial = run(tmp_path, "init", *common, "train.lr=1e-30")  # same init, no real update
    clipped = run(tmp_path, "clipped", *common, "train.max_grad_norm=0.001")
    free = run(tmp_path, "free", *common, "train.max_grad_norm=0")

    def update_norm(out):
        w0, w1 = load_weights(initial), load_weights(out)
        return torch.sqrt(sum(((w1[k] - w0[k]) ** 2).sum() for k in w0)).item()

    assert update_norm(clipped) == pytest.approx(0.001, rel=1e-2)
    assert update_norm(free) > 0.01


def test_unwritable_output_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cfg = load_config(None, [*SMALL, f"output_dir={blocker / 'run'}", "train.max_steps=1"])
    with pytest.raises(DistqaError, match=r"run' lies under .*/file, which is a file: name another output_dir"):
        train(cfg)


def test_too_small_dataset_names_the_keys(tmp_path):
    cfg = load_config(None, [*SMALL, f"output_dir={tmp_path / 'x'}", "task.dummy_size=3", "train.batch_size=4"])
    with pytest.raises(ConfigError, match="train.batch_size=4"):
        train(cfg)


def test_real_data_needs_a_tokenizer(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    cfg = load_config(None, [*SMALL, f"output_dir={tmp_path / 'x'}", f"data.train={data}"])
    with pytest.raises(DistqaError, match="model.tokenizer"):
        train(cfg)


def test_malformed_training_file_names_file_and_line(tmp_path, minilm_dir):
    data = tmp_path / "train.jsonl"
    no_answer = {"start_token": -1, "end_token": -1, "candidate_index": -1}
    annotation = {"yes_no_answer": "NONE", "long_answer": no_answer, "short_answers": []}
    line = json.dumps(
        {
            "example_id": 1,
            "question_text": "q",
            "document_text": "a b",
            "long_answer_candidates": [],
            "annotations": [annotation],
        }
    )
    data.write_text(line + "\n{oops\n")
    cfg = load_config(
        None,
        [
            *SMALL,
            f"output_dir={tmp_path / 'x'}",
            f"data.train={data}",
            f"model.tokenizer={minilm_dir}",
            f"task.cache_dir={tmp_path / 'cache'}",
        ],
    )
    with pytest.raises(DistqaError, match=r"train\.jsonl, line 2: not valid JSON"):
        train(cfg)


def test_model_that_cannot_be_loaded_offline_names_it_and_what_to_do(tmp_path):
    cfg = load_config(None, [*SMALL, f"output_dir={tmp_path / 'x'}", "model.name=no-such-org/no-such-model"])
    with pytest.raises(DistqaError) as info:
        train(cfg)
    message = str(info.value)
    assert "'no-such-org/no-such-model'" in message and "HF_HUB_OFFLINE=1" in message
    assert "local folder" in message and "\n" not in message


def test_loader_workers_leave_the_process_group_but_still_die_on_their_parents_sigterm():
    """torchrun's group-wide SIGTERM must not reach the loader's workers (the training process
    would fail on its next batch), yet the loader's own SIGTERM at shutdown must still end them:
    a worker that ignored it kept an unfinished epoch's training process waiting at exit."""
    import os

    from torch.utils.data import DataLoader

    from distqa.worker_signals import loader_worker_init

    loader = DataLoader(list(range(64)), batch_size=2, num_workers=1, worker_init_fn=loader_worker_init)
    batches = iter(loader)
    next(batches)  # the worker has run its init by now
    (worker,) = batches._workers
    assert os.getpgid(worker.pid) == worker.pid != os.getpgid(0)
    worker.terminate()  # what DataLoader (and multiprocessing at exit) fall back to
    worker.join(timeout=10)
    assert worker.exitcode is not None, "the worker outlived its parent's SIGTERM"
    del batches


# A training process in a session of its own, as torchrun starts it: its loader's workers get a
# SIGTERM sent to the whole group as they start (in their worker_init_fn, before they leave the
# group: the moment the race needs), as torchrun's stop can arrive at an epoch's start.
_RACE = """
import os, signal, sys
from torch.utils.data import DataLoader
from distqa.worker_signals import loader_worker_init, sigterm_held

got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(1))

def init(worker_id):
    os.killpg(os.getpgid(0), signal.SIGTERM)  # still in the training process's group
    loader_worker_init(worker_id)

loader = DataLoader(list(range(32)), batch_size=2, num_workers=2, worker_init_fn=init, multiprocessing_context="fork")
with (sigterm_held() if sys.argv[1] == "held" else open(os.devnull)):
    batches = iter(loader)
print(len(list(batches)), "batches; training process got SIGTERM:", bool(got), flush=True)
"""


@pytest.mark.safety  # about 6 s: make test-safety, for make test's 5 minutes
@pytest.mark.parametrize("held", ["held", "not held"])
def test_a_sigterm_while_loader_workers_start_reaches_only_the_training_process(held):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _RACE, held], capture_output=True, text=True, timeout=120, start_new_session=True
    )
    if held == "held":
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == "16 batches; training process got SIGTERM: True"
    else:  # the race as it was: a worker dies of the signal meant for its parent
        assert proc.returncode != 0 and "exited unexpectedly" in proc.stderr, proc.stdout + proc.stderr[-2000:]


def test_the_replica_checksum_is_exact_whatever_the_thread_count():
    """Nodes may run other thread counts (their CPUs differ): a float sum of identical weights then
    differs in its last bits, and the replica check raised a false alarm (seen: spread 7e-15)."""
    from distqa.replicas import _checksum

    weights = torch.randn(1000, 384)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _checksum(weights)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(_checksum(weights), one)
    finally:
        torch.set_num_threads(threads)
    changed = weights.clone()
    changed.view(-1)[777] = torch.nextafter(changed.view(-1)[777], torch.tensor(10.0))  # one ulp
    assert not torch.equal(_checksum(changed), one)


@pytest.mark.launch  # about 6 s: make test-launch, for make test's 5 minutes
def test_samples_per_s_leaves_out_the_time_a_checkpoint_takes_to_save(tmp_path, monkeypatch):
    """A save inside a log window (checkpoint_every=2, log_every=2: step 2's save is in the window
    that ends at step 4) counted as training time, as evaluation does not: each window after a save
    showed a dip that was not the training's."""
    import time

    from distqa.checkpoint_manager import CheckpointManager

    slow_s, saved = 2.0, CheckpointManager.save

    def slow_save(self, *args, **kwargs):
        time.sleep(slow_s)
        return saved(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointManager, "save", slow_save)
    out = run(tmp_path, "slow", "train.max_steps=4", "train.log_every=2", "train.checkpoint_every=2")
    window = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1]
    assert window["step"] == 4
    # 2 steps of 2 examples each: the window's time follows from its rate. Two tiny steps take far
    # less than the save's sleep, which was counted in whole before.
    assert 4 / window["samples_per_s"] < slow_s / 2, window


def test_to_device_moves_the_tensors_of_nested_batches():
    """A batch of {"inputs": {...}} kept its inner tensors on the CPU (a device mismatch on a GPU)."""
    import torch

    from distqa.evaluation import to_device

    batch = {"inputs": {"ids": torch.ones(2)}, "pair": (torch.ones(1), [torch.ones(1)]), "id": ["a", "b"]}
    moved = to_device(batch, torch.device("meta"))
    assert moved["inputs"]["ids"].is_meta and moved["pair"][0].is_meta and moved["pair"][1][0].is_meta
    assert isinstance(moved["pair"], tuple) and moved["id"] == ["a", "b"]


def test_evaluation_batches_and_draws_alike_at_any_process_count(monkeypatch):
    """A fork's collate that masks in evaluation too (as an MLM collator does) scored eval_loss
    1.9615 at 1 process and 1.9908 at 2 on equal weights: rank 1's batches began mid-set and drew
    from its own dropout stream. Each rank's share is run here as that rank would run it."""
    import torch

    from distqa import evaluation
    from distqa.dist import DistInfo
    from distqa.registry import load_config, load_task

    cfg = load_config(None, ["task.name=toy_data_tasks:MaskedEvalTask", "task.size=64", "train.batch_size=4"])
    task = load_task(cfg)
    model = task.build_model().eval()
    dataset = task.eval_dataset()
    shares: dict[tuple[int, int], list] = {}
    monkeypatch.setattr(evaluation, "raise_on_any_rank", lambda problem, info: None)

    def gather(outputs, info):
        shares[(info.world_size, info.rank)] = list(outputs)
        return [outputs]

    monkeypatch.setattr(evaluation, "gather_to_main", gather)
    before = torch.get_rng_state()
    for world in (1, 2, 3):
        for rank in range(world):
            info = DistInfo(rank=rank, local_rank=rank, world_size=world, device=torch.device("cpu"))
            evaluation.evaluate_dataset(task, model, dataset, info, step=0)
    assert torch.equal(torch.get_rng_state(), before)  # the process's own stream did not move
    one = shares[(1, 0)]
    assert len(one) == 30 and len(set(one)) > 20
    for world in (2, 3):
        assert [x for rank in range(world) for x in shares[(world, rank)]] == one, world
