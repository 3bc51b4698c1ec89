"""A run continues one line of checkpoints: a resume from an earlier checkpoint than the newest sets
the later ones aside (auto-resume, pruning and `checkpoints/best` then see one line), and only what a
checkpoint's manifest vouches for is loaded. In-process, one process, on the toy task: a few seconds."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from distqa.best import pointed
from distqa.checkpoint import load_checkpoint, read_trainer_state
from distqa.dist import DistInfo
from distqa.errors import ConfigError, Preempted
from distqa.export import export_checkpoint
from distqa.registry import load_config
from distqa.resume import check_continuation
from distqa.set_aside import set_aside_other_line
from distqa.trainer import train
from test_output_safety import rehash, save, tiny_parts
from toy_task import BlobsDataset, ToyClassificationTask


class PreemptedTask(ToyClassificationTask):
    """An evaluation scored by step (the best is step 4), and a SIGTERM to this process during the
    PREEMPT_AT-th step this process trains, as a platform would send it."""

    SCORES = {2: 0.5, 4: 0.9, 6: 0.7, 8: 0.6}
    PREEMPT_AT: int | None = None

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.calls = 0

    def build_eval_dataset(self):
        return BlobsDataset(4, seed=3)

    def eval_step(self, model, batch):
        return [0] * len(batch["label"])

    def compute_metrics(self, outputs, step):
        return {"eval_score": self.SCORES[step]}

    def loss(self, model, batch):
        self.calls += 1
        if self.calls == self.PREEMPT_AT:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().loss(model, batch)


ONE = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
BASE = [
    "task.name=test_resume_lines:PreemptedTask",
    "task.size=256",
    "data.num_workers=0",
    "train.batch_size=8",
    "train.lr_schedule=constant",
    "train.warmup_ratio=0",
    "train.log_every=1",
    "train.eval_every=2",
    "train.checkpoint_every=2",
    "train.best_metric=eval_score",
    "train.best_mode=max",  # a toy task declares no direction for its metrics
]


def run(out: Path, *overrides: str) -> None:
    train(load_config(None, [*BASE, f"output_dir={out}", *overrides]))


def records(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["lr"]) for r in map(json.loads, path.read_text().splitlines())]


def test_a_resume_from_an_earlier_checkpoint_sets_the_later_line_aside(tmp_path, capsys, monkeypatch):
    """A case found by hand: 6 steps at lr 1e-2 (as if resumed at step 4 with 2e-2: config-history/4.yaml),
    then train.resume=step-2 at 3e-2 with keep_checkpoints=1, preempted at step 3, then
    train.resume=auto: it continues step-3, never the other line's step-6, and every record says
    what trained."""
    out, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    run(out, "train.max_steps=6", "train.lr=1e-2", "train.keep_checkpoints=0")
    assert pointed(root) == root / "step-4"  # the other line's best
    config = (out / "config.yaml").read_text()
    (out / "config-history").mkdir()
    (out / "config-history" / "4.yaml").write_text(config)
    (out / "config.yaml").write_text(config.replace("lr: 0.01\n", "lr: 0.02\n"))
    monkeypatch.setattr(PreemptedTask, "PREEMPT_AT", 1)
    named = ["train.max_steps=8", "train.lr=3e-2", "train.keep_checkpoints=1", f"train.resume={root / 'step-2'}"]
    capsys.readouterr()
    with pytest.raises(Preempted, match=r"train.resume=auto in place of train.resume=\S+step-2$"):
        run(out, *named)
    moved = next((out / "earlier-runs").iterdir())
    assert f"step-4, step-6 (another continuation of step 2) moved to {moved}" in capsys.readouterr().out
    assert sorted(p.name for p in root.iterdir()) == ["best", "step-2", "step-3"]
    assert pointed(root) == root / "step-2"  # this line's record, not the other line's
    assert sorted(p.name for p in (moved / "checkpoints").iterdir()) == ["best", "step-4", "step-6"]
    assert pointed(moved / "checkpoints") == moved / "checkpoints" / "step-4"  # still names its step there
    assert (moved / "model").is_dir() and not (out / "model").exists()
    assert records(moved / "metrics.jsonl") == [(s, 1e-2) for s in range(1, 7)]
    assert os.listdir(moved / "config-history") == ["4.yaml"]

    monkeypatch.setattr(PreemptedTask, "PREEMPT_AT", None)
    run(out, "train.max_steps=8", "train.lr=3e-2", "train.keep_checkpoints=1")
    assert f"resumed from {root / 'step-3'} at step 3" in capsys.readouterr().out
    assert records(out / "metrics.jsonl") == [(1, 1e-2), (2, 1e-2)] + [(s, 3e-2) for s in range(3, 9)]
    # What trained up to step 2 (lr 1e-2), not the other line's last settings (2e-2, config.yaml's).
    assert "lr: 0.01\n" in (out / "config-history" / "2.yaml").read_text()
    assert not (out / "config-history" / "4.yaml").exists()
    assert pointed(root) == root / "step-4" and read_trainer_state(root / "step-4")["config"]["train"]["lr"] == 3e-2


def test_an_export_goes_with_its_line_and_a_finished_resume_cuts_the_records(tmp_path, capsys):
    """`distqa export`'s default folder (model-step-N, in output_dir) stayed there when its
    checkpoint's line was set aside or the run moved by `never`: predict read another line's
    weights under the name of this one's step. And a resume from an earlier step that is the
    last (nothing to train, only the export) left the set-aside line's steps in metrics.jsonl."""
    out, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    run(out, "train.max_steps=6", "train.keep_checkpoints=0")
    for step in (2, 6):
        assert export_checkpoint(str(root / f"step-{step}")) == out / f"model-step-{step}"
    capsys.readouterr()
    run(out, "train.max_steps=4", f"train.resume={root / 'step-4'}")  # finished at 4: export only
    moved = next((out / "earlier-runs").iterdir())
    assert "their exports" in capsys.readouterr().out
    assert (moved / "model-step-6").is_dir() and not (out / "model-step-6").exists()
    assert (out / "model-step-2").is_dir()  # step 2 is this line's too
    assert [step for step, _ in records(out / "metrics.jsonl")] == [1, 2, 3, 4]  # 5, 6 were the other line's
    assert [step for step, _ in records(moved / "metrics.jsonl")] == list(range(1, 7))
    assert (out / "model").is_dir()
    run(out, "train.max_steps=2", "train.resume=never")
    whole = next(p for p in (out / "earlier-runs").iterdir() if "-after-step-" not in p.name)
    assert (whole / "model-step-2").is_dir() and not (out / "model-step-2").exists()


def test_a_checkpoint_from_elsewhere_moves_the_run_in_output_dir_aside(tmp_path):
    """train.resume=PATH outside output_dir: the run there is another line (as with `never`); a PATH
    inside what would be moved is refused in one line."""
    out, elsewhere = tmp_path / "run", tmp_path / "other" / "checkpoints" / "step-2"
    (out / "checkpoints" / "step-6").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 6}\n')
    moved = set_aside_other_line(out, elsewhere, str(elsewhere), ONE)
    assert moved is not None and sorted(os.listdir(moved)) == ["checkpoints", "metrics.jsonl"]
    assert sorted(os.listdir(out)) == ["earlier-runs"]
    inside = out / "tb" / "step-2"
    inside.mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"lies in \S+/tb, which holds another run: copy the checkpoint out"):
        set_aside_other_line(out, inside, str(inside), ONE)
    assert set_aside_other_line(out, elsewhere, "auto", ONE) is None  # auto and never choose their own


def test_a_resume_folder_that_is_no_checkpoint_is_not_called_damaged(tmp_path):
    """train.resume= a run's output_dir, its checkpoints/ or model/ (easy mistakes) said "the
    checkpoint is damaged (no manifest)", and a user may delete a good run for it (a review)."""
    done = tmp_path / "done"
    run(done, "train.max_steps=4")
    newest = done / "checkpoints" / "step-4"
    for folder in (done, done / "checkpoints"):
        with pytest.raises(ConfigError) as refused:
            run(tmp_path / "new", f"train.resume={folder}", "train.max_steps=6")
        assert str(refused.value) == (
            f"train.resume={folder}: this folder is not a checkpoint (a step-N folder under an output_dir's "
            f"checkpoints/): name one of its checkpoints, the newest {newest}"
        )
    with pytest.raises(ConfigError, match=r"model: this folder is not a checkpoint .*: it holds none$"):
        run(tmp_path / "new", f"train.resume={done / 'model'}", "train.max_steps=6")
    (newest / "manifest.json").unlink()  # a step-N folder without its manifest is a damaged checkpoint
    with pytest.raises(ConfigError, match=r"step-4: the checkpoint is damaged \(no manifest\)$"):
        run(tmp_path / "new", f"train.resume={newest}", "train.max_steps=6")


def test_an_attention_kernel_changed_on_resume_is_named_as_applied(capsys):
    """eager and SDPA round differently (3.7e-9 on the tiny model): no silent change."""
    before = load_config()
    state = {"step": 2, "config": dataclasses.asdict(before), "data": None}
    assert not check_continuation(
        Path("ckpt"), state, load_config(None, ["model.attn_implementation=eager"]), total_steps=4, data={}
    )
    assert "applied from step 2 on: model.attn_implementation (None -> 'eager')" in capsys.readouterr().out


def test_compile_turned_on_at_a_resume_is_named_as_applied(capsys):
    """Compiled code draws other dropout masks (2e-3 apart in 4 steps of the tiny model, found by a
    review): not a silent setting."""
    state = {"step": 2, "config": dataclasses.asdict(load_config()), "data": None}
    compiled = load_config(None, ["train.compile=true"])
    assert not check_continuation(Path("ckpt"), state, compiled, total_steps=4, data={})
    assert "applied from step 2 on: train.compile (False -> True)" in capsys.readouterr().out


def test_another_length_at_a_resume_names_the_rate_it_gives(capsys):
    """8 steps at warm-up 0.05 (1 step) made 200 at step 4: the warm-up becomes 10 steps, so step 5's
    rate drops from 5.71e-4 to 4e-4 and warms up again (a review saw it done without a word)."""
    settings = ["train.lr=1e-3", "train.warmup_ratio=0.05"]
    state = {"step": 4, "config": dataclasses.asdict(load_config(None, settings)), "data": None, "total_steps": 8}
    longer = load_config(None, [*settings, "train.max_steps=200"])
    assert not check_continuation(Path("ckpt"), state, longer, total_steps=200, data={})
    line = capsys.readouterr().out
    assert "with another length, applied from step 4 on: 8 -> 200 steps" in line
    assert "step 5's rate is 0.0004 (0.000571 in 8 steps); its warm-up now ends at step 10, not 1" in line
    assert not check_continuation(Path("ckpt"), state, load_config(None, settings), total_steps=8, data={})
    assert "another length" not in capsys.readouterr().out
    # With the warm-up changed too, the "before" figures are the run's own (a review saw this run's).
    other = load_config(None, ["train.lr=1e-3", "train.warmup_ratio=0.5", "train.max_steps=20"])
    assert not check_continuation(Path("ckpt"), state, other, total_steps=20, data={})
    assert "step 5's rate is 0.0004 (0.000571 in 8 steps); its warm-up now ends at step 10, not 1" in (
        capsys.readouterr().out
    )
    # A finished run made longer (the review of the first version saw it said nothing).
    finished = {**state, "step": 8}
    assert not check_continuation(Path("ckpt"), finished, longer, total_steps=200, data={})
    assert (
        "8 -> 200 steps; the learning-rate schedule is the new length's: step 9's rate is 0.0008; its "
        "warm-up now ends at step 10, not 1" in capsys.readouterr().out
    )


def test_rng_and_comm_files_the_manifest_does_not_list_are_not_loaded(tmp_path):
    """A rank's RNG or communication state in the folder but not in the manifest (its hash vouches
    for nothing) is absent: the rank is seeded afresh, as on more processes than saved. Listed, it loads."""
    checkpoint = save(tmp_path / "checkpoints", 1)  # one process: rng-rank0.pt alone is listed
    shutil.copy(checkpoint / "rng-rank0.pt", checkpoint / "rng-rank1.pt")
    torch.save({"memories": torch.ones(2)}, checkpoint / "comm-rank1.pt")
    rank1 = DistInfo(rank=1, local_rank=1, world_size=2, device=torch.device("cpu"))
    kept = random.getstate(), np.random.get_state(), torch.get_rng_state()  # a restore resets them
    try:
        state = load_checkpoint(checkpoint, **tiny_parts(), info=rank1)
        assert not state["rng_restored"] and state["comm_hook"] is None
        rehash(checkpoint, "rng-rank1.pt")
        rehash(checkpoint, "comm-rank1.pt")
        state = load_checkpoint(checkpoint, **tiny_parts(), info=rank1)
        assert state["rng_restored"] and torch.equal(state["comm_hook"]["memories"], torch.ones(2))
    finally:
        random.setstate(kept[0])
        np.random.set_state(kept[1])
        torch.set_rng_state(kept[2])
