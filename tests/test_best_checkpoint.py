"""train.best_metric: the best checkpoint is kept (never pruned), named by checkpoints/best, its record
survives a resume, and `distqa export` writes its model; grad_norm in metrics.jsonl, TensorBoard and
metrics.png. In-process, one process, on the toy task: a few seconds."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from distqa.best import point_at, pointed, resolve_checkpoint
from distqa.cli import main
from distqa.errors import ConfigError, DistqaError
from distqa.export import export_checkpoint
from distqa.metrics import plot_metrics
from distqa.registry import load_config
from distqa.trainer import train
from toy_task import BlobsDataset, ToyClassificationTask, ToySettings


class ScriptedEvalTask(ToyClassificationTask):
    """The toy task with an evaluation whose score is scripted by step: the best is not the last."""

    SCORES = {2: 0.5, 4: 0.9, 6: 0.7, 8: 0.6, 10: 0.8, 12: 0.95}

    def build_eval_dataset(self):
        return BlobsDataset(4, seed=3)

    def eval_step(self, model, batch):
        return [0] * len(batch["label"])

    def compute_metrics(self, outputs, step):
        return {"eval_score": self.SCORES[step], "eval_other": 1.0}


class ScriptedLossTask(ScriptedEvalTask):
    """Scripted the other way: a validation loss, lowest at step 4, highest at step 12 (the last)."""

    LOSSES = {2: 0.5, 4: 0.1, 6: 0.3, 8: 0.4, 10: 0.2, 12: 0.6}

    def compute_metrics(self, outputs, step):
        return {"eval_loss": self.LOSSES[step], "eval_other": 1.0}


@dataclass
class DeclaredSettings(ToySettings):
    # A fork's declaration: eval_score improves downwards, eval_cut is no score.
    metric_names: ClassVar[dict[str, str | None]] = {"eval_score": "min", "eval_cut": None}


class DeclaredTask(ScriptedEvalTask):
    Config = DeclaredSettings


@dataclass
class NamesOnlySettings(ToySettings):
    metric_names: ClassVar[tuple[str, ...]] = ("eval_score", "eval_loss")  # names, no directions


class NamesOnlyTask(ScriptedEvalTask):
    Config = NamesOnlySettings


@dataclass
class MisdeclaredSettings(ToySettings):
    metric_names: ClassVar[dict[str, str | None]] = {"eval_score": "higher"}


class MisdeclaredTask(ScriptedEvalTask):
    Config = MisdeclaredSettings


BASE = [
    "task.name=test_best_checkpoint:ScriptedEvalTask",
    "task.size=256",
    "data.num_workers=0",
    "train.batch_size=8",
    "train.lr=1e-2",
    "train.eval_every=2",
    "train.log_every=1",
    "train.checkpoint_every=3",  # step 4, the best, is no planned checkpoint: it is saved for being the best
    "train.keep_checkpoints=1",
    "train.best_metric=eval_score",
    "train.best_mode=max",  # a toy task declares no direction for its metrics
]


def run(out, *overrides):
    train(load_config(None, [*BASE, f"output_dir={out}", *overrides]))
    return out / "checkpoints"


def names(root):
    return sorted(p.name for p in root.iterdir())


def test_the_best_checkpoint_is_kept_named_resumed_and_exported(tmp_path, capsys):
    root = run(tmp_path / "run", "train.max_steps=8")
    # keep_checkpoints=1: the newest, and the best (step 4), which step 6's save did not prune.
    assert names(root) == ["best", "step-4", "step-8"]
    assert os.readlink(root / "best") == "step-4" and resolve_checkpoint(root / "best") == root / "step-4"
    state = json.loads((root / "step-8" / "trainer_state.json").read_text())
    assert state["best"] == {"metric": "eval_score", "mode": "max", "value": 0.9, "step": 4}
    assert "new best eval_score=0.9 at step 4" in capsys.readouterr().out

    # Resumed to step 10 (0.8 < 0.9): the record came back from the checkpoint, so no new best.
    run(tmp_path / "run", "train.max_steps=10")
    assert names(root) == ["best", "step-10", "step-4"] and os.readlink(root / "best") == "step-4"

    # The export of the best checkpoint holds exactly its weights, not the final ones.
    target = export_checkpoint(str(root / "best"))
    assert target == tmp_path / "run" / "model-step-4"
    exported, saved = (
        load_file(str(target / "model.safetensors")),
        load_file(str(root / "step-4" / "model.safetensors")),
    )
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    final = load_file(str(tmp_path / "run" / "model" / "model.safetensors"))
    assert any(not torch.equal(final[k], saved[k]) for k in saved)
    assert (target / "toy.json").is_file() and (target / "distqa_task.json").is_file()
    # The same through the command line, elsewhere; "the best" as its own record knew it (a later
    # step may beat it: the line once called an older checkpoint "the best" after that).
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(root / "best"), "--output", str(tmp_path / "cli")]) == 0
    assert "(eval_score=0.9, the best up to step 4) to" in capsys.readouterr().out
    assert load_file(str(tmp_path / "cli" / "model.safetensors")).keys() == saved.keys()

    run(tmp_path / "run", "train.max_steps=12")  # 0.95: the new best; the old one goes at once
    assert names(root) == ["best", "step-12"] and os.readlink(root / "best") == "step-12"


def test_a_run_copied_with_its_links_followed_resumes_and_its_best_is_a_link_again(tmp_path):
    """`cp -rL` (or an object store's sync) makes checkpoints/best a folder: every resume then
    stopped at "cannot write .../best (Is a directory)", the same again each time."""
    import shutil

    root = run(tmp_path / "run", "train.max_steps=8")
    shutil.copytree(tmp_path / "run", tmp_path / "copy")  # follows the link: best is a folder there
    copied = tmp_path / "copy" / "checkpoints"
    assert (copied / "best").is_dir() and not (copied / "best").is_symlink()
    run(tmp_path / "copy", "train.max_steps=10")
    assert os.readlink(copied / "best") == "step-4" and names(copied) == ["best", "step-10", "step-4"]
    assert names(root) == ["best", "step-4", "step-8"]  # the original is untouched
    # A folder by that name that is no copy of a checkpoint is not removed: named instead.
    (copied / "best").unlink()
    (copied / "best").mkdir()
    (copied / "best" / "notes.txt").write_text("mine")
    with pytest.raises(
        DistqaError, match=r"checkpoints/best is a folder, not the link .*: move it away, then run again"
    ):
        run(tmp_path / "copy", "train.max_steps=12")
    assert (copied / "best" / "notes.txt").read_text() == "mine"


def test_a_checkpoint_gone_between_its_check_and_its_read_is_one_line(tmp_path, monkeypatch):
    """`distqa export` while a live run prunes (or sets aside) the checkpoint it just verified: a
    FileNotFoundError traceback from reading its trainer state."""
    import shutil

    from distqa import best

    root = run(tmp_path / "run", "train.max_steps=4")
    real = best.read_trainer_state

    def pruned_first(folder):
        shutil.rmtree(folder)
        return real(folder)

    monkeypatch.setattr(best, "read_trainer_state", pruned_first)
    with pytest.raises(DistqaError, match=r"checkpoint .*step-4 disappeared as it was read \(No such file"):
        resolve_checkpoint(root / "step-4")


def test_min_mode_and_a_new_best_moves_the_pointer(tmp_path):
    root = run(tmp_path / "run", "train.max_steps=8", "train.best_mode=min")
    assert os.readlink(root / "best") == "step-2"  # 0.5 is the lowest
    run(tmp_path / "run", "train.max_steps=12", "train.best_mode=max")  # another direction: a fresh record
    assert os.readlink(root / "best") == "step-12"
    assert "step-2" not in names(root)  # the old best is pruned once nothing names it


def test_best_metric_mistakes_are_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"train.best_metric='score' must name an evaluation metric, eval_KEY"):
        load_config(None, ["train.best_metric=score"])
    with pytest.raises(ConfigError, match=r"train.best_mode='up' is not one of auto, max, min"):
        load_config(None, ["train.best_mode=up"])
    toy = ["task.name=toy_task:ToyClassificationTask", "task.size=64", "data.num_workers=0", "train.max_steps=2"]
    with pytest.raises(ConfigError, match=r"needs an evaluation, and this task evaluates nothing: set data.valid"):
        given = ["train.best_metric=eval_f1", "train.best_mode=max"]
        train(load_config(None, [*toy, f"output_dir={tmp_path / 'a'}", *given]))
    # train.eval_every with nothing to evaluate was silently ignored: it is said, and the run trains.
    capsys.readouterr()
    train(load_config(None, [*toy, f"output_dir={tmp_path / 'e'}", "train.eval_every=1"]))
    assert "warning: train.eval_every=1, but this task evaluates nothing (no data.valid)" in capsys.readouterr().out
    with pytest.raises(
        DistqaError, match=r"'eval_f1' is not a metric of this task's evaluation: it reported eval_other"
    ):
        run(tmp_path / "b", "train.max_steps=2", "train.best_metric=eval_f1")
    # A task whose settings name its metrics: a misspelt one at once, not at the first evaluation.
    with pytest.raises(ConfigError) as misspelt:
        load_config(None, ["task.name=textcls", "task.labels=a,b", "train.best_metric=eval_acc"])
    assert str(misspelt.value) == (
        "train.best_metric='eval_acc' is not a metric this task reports (did you mean eval_accuracy?): one of "
        "eval_accuracy, eval_macro_f1"
    )
    load_config(None, ["train.best_metric=eval_micro_f1"])  # NQ's


def test_a_pointer_is_verified_on_read(tmp_path):
    root = run(tmp_path / "run", "train.max_steps=4", "train.keep_checkpoints=0")
    (root / "best").unlink()
    (root / "best").write_text("step-3\n")  # the pointer file of a file system without links
    assert pointed(root) == root / "step-3"
    with pytest.raises(DistqaError, match=r"names step-3, whose trainer state records another best"):
        resolve_checkpoint(root / "best")
    point_at(root, 1)  # a step that was never saved
    with pytest.raises(DistqaError, match=r"step-1 does not exist"):
        resolve_checkpoint(root / "best")
    point_at(root, 4)
    (root / "step-4" / "rng-rank0.pt").write_bytes(b"damaged")
    with pytest.raises(DistqaError, match=r"cannot be used \(rng-rank0.pt has"):
        resolve_checkpoint(root / "best")


def test_grad_norm_is_the_window_mean_before_clipping_in_every_view(tmp_path):
    clip = ["train.max_grad_norm=1e-3", "train.eval_every=0", "train.best_metric=null", "train.max_steps=4"]
    every = run(tmp_path / "every", *clip).parent
    pairs = run(tmp_path / "pairs", *clip, "train.log_every=2").parent
    norms = [json.loads(line)["grad_norm"] for line in (every / "metrics.jsonl").read_text().splitlines()]
    assert all(n > 1e-3 for n in norms)  # measured before clipping to 1e-3
    windows = [json.loads(line)["grad_norm"] for line in (pairs / "metrics.jsonl").read_text().splitlines()]
    assert windows == pytest.approx([(norms[0] + norms[1]) / 2, (norms[2] + norms[3]) / 2], rel=1e-9)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(every / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/grad_norm")] == pytest.approx(norms, rel=1e-6)
    # metrics.png has a panel more than the same records without grad_norm.
    bare = tmp_path / "bare.jsonl"
    rows = [json.loads(line) for line in (every / "metrics.jsonl").read_text().splitlines()]
    bare.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "grad_norm"}) + "\n" for r in rows))
    assert plot_metrics(bare, tmp_path / "bare.png")
    assert Image.open(every / "metrics.png").size[1] > Image.open(tmp_path / "bare.png").size[1]


def test_a_sharded_checkpoint_exports_in_one_process(tmp_path):
    # train.parallel=fsdp on one process (a world of one): the checkpoints hold DCP shards.
    fsdp = ["task.name=toy_task:StackedEvalProbeTask", "task.size=64", "data.num_workers=0", "train.parallel=fsdp"]
    out = tmp_path / "fsdp"
    train(load_config(None, [*fsdp, "train.max_steps=3", "train.checkpoint_every=2", f"output_dir={out}"]))
    assert (out / "checkpoints" / "step-2" / ".metadata").is_file()
    last = load_file(str(export_checkpoint(str(out / "checkpoints" / "step-3")) / "model.safetensors"))
    final = load_file(str(out / "model" / "model.safetensors"))
    assert last.keys() == final.keys() and all(torch.equal(last[k], final[k]) for k in final)
    earlier = load_file(str(export_checkpoint(str(out / "checkpoints" / "step-2")) / "model.safetensors"))
    assert any(not torch.equal(earlier[k], final[k]) for k in final)


def test_a_new_best_adds_a_checked_save_and_keeps_a_stop_requests_check():
    from distqa.control import AfterStep

    plain = AfterStep(log=True, evaluate=True, save=False, check_weights=True)
    assert plain.on_new_best() == AfterStep(True, True, save=True, check_weights=True, check_optimizer=True)
    planned = AfterStep(log=True, evaluate=True, save=True, check_weights=True)
    assert planned.on_new_best() == planned  # its optimizer state is checked with the weights already
    stopping = plain.on_stop_request(True).on_new_best()
    assert stopping.stop and stopping.save and stopping.check_optimizer


def test_a_loss_keeps_its_lowest_value_as_best_without_best_mode(tmp_path):
    """train.best_metric=eval_loss alone: the default direction kept the highest loss (max), so
    checkpoints/best and `distqa export` of it gave the worst weights, exit 0."""
    root = tmp_path / "run"
    cfg = load_config(None, [*BASE[:-2], "task.name=test_best_checkpoint:ScriptedLossTask",
                             "train.best_metric=eval_loss", "train.max_steps=12", f"output_dir={root}"])  # fmt: skip
    assert cfg.train.best_mode == "min"
    train(cfg)
    assert os.readlink(root / "checkpoints" / "best") == "step-4"  # loss 0.1; max kept step 12's 0.6
    state = json.loads((root / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    assert state["best"] == {"metric": "eval_loss", "mode": "min", "value": pytest.approx(0.1), "step": 4}


def direction(task, metric, *more):
    return load_config(None, [f"task.name={task}", f"train.best_metric={metric}", *more]).train.best_mode


def test_best_mode_auto_takes_the_direction_the_task_declares_or_refuses(tmp_path):
    assert direction("nq", "eval_micro_f1") == "max"
    assert direction("textcls", "eval_macro_f1", "task.labels=a,b") == "max"
    assert direction("test_best_checkpoint:DeclaredTask", "eval_score") == "min"  # a fork's declaration
    assert direction("test_best_checkpoint:DeclaredTask", "eval_score", "train.best_mode=max") == "max"  # said
    assert direction("test_best_checkpoint:NamesOnlyTask", "eval_loss") == "min"
    # Nothing says which way a score improves: one line at start, never a guess.
    with pytest.raises(ConfigError) as unknown:
        direction("test_best_checkpoint:NamesOnlyTask", "eval_score")
    assert str(unknown.value) == (
        "train.best_metric='eval_score': the task does not say whether a higher or a lower value is better "
        "(its settings' metric_names give no direction): set train.best_mode=max or train.best_mode=min"
    )
    with pytest.raises(ConfigError, match=r"'eval_score': the task does not say whether a higher or a lower"):
        direction("toy_task:ToyClassificationTask", "eval_score")  # no metric_names at all
    # NQ's thresholds are chosen on the validation set: no score to keep a checkpoint by.
    with pytest.raises(ConfigError, match=r"'eval_long_threshold' is no score this task improves .*best_mode=max"):
        direction("nq", "eval_long_threshold")
    assert direction("nq", "eval_long_threshold", "train.best_mode=min") == "min"
    with pytest.raises(ConfigError) as bad:
        direction("test_best_checkpoint:MisdeclaredTask", "eval_score")
    assert str(bad.value) == (
        "MisdeclaredSettings.metric_names gives 'eval_score' the direction 'higher': use 'max' (higher is "
        "better), 'min' (lower is better) or None (not a score)"
    )
    assert load_config(None, []).train.best_mode == "auto"  # no best_metric: nothing to decide


def test_a_resume_after_the_old_default_starts_the_loss_record_afresh(tmp_path, capsys):
    """A checkpoint whose record kept eval_loss by max (the old default) is no record of min: the
    resumed run's best is the lowest loss from then on, not the highest of before."""
    root = tmp_path / "run"
    loss = [*BASE[:-2], "task.name=test_best_checkpoint:ScriptedLossTask", "train.best_metric=eval_loss"]
    train(load_config(None, [*loss, "train.best_mode=max", "train.max_steps=8", f"output_dir={root}"]))
    assert os.readlink(root / "checkpoints" / "best") == "step-2"  # loss 0.5, the highest: what max kept
    capsys.readouterr()
    train(load_config(None, [*loss, "train.max_steps=12", f"output_dir={root}"]))
    assert "changed settings, applied from step 8 on: train.best_mode ('max' -> 'min')" in capsys.readouterr().out
    assert os.readlink(root / "checkpoints" / "best") == "step-10"  # 0.2: the lowest after the resume at 8


def test_a_best_metric_that_is_not_finite_is_said_at_each_evaluation(capsys):
    """A metric NaN at every evaluation ended the run without checkpoints/best, and without a word."""
    from distqa.best import new_best

    assert new_best({"step": 4, "eval_f1": float("nan")}, "eval_f1", "max", None) is None
    assert capsys.readouterr().out == (
        "warning: train.best_metric=eval_f1 is nan at step 4: no candidate for the best checkpoint\n"
    )
    assert new_best({"step": 6, "eval_f1": 0.5}, "eval_f1", "max", None) is not None
    assert capsys.readouterr().out == ""


def _damage(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])


KEEP_TWO = ["train.checkpoint_every=2", "train.keep_checkpoints=2"]


@pytest.mark.safety  # about 3 s: make test-safety, for make test's 5 minutes
def test_a_fall_back_from_a_damaged_newest_checkpoint_finds_the_best_its_record_names(tmp_path, monkeypatch):
    """keep_checkpoints=2: step 12's new best pruned step 4, the best before it, while step 10, still
    kept, recorded step 4 as its best. With step 12 damaged the resume fell back to step 10, whose
    record (0.9 at step 4) named a folder gone: `best` kept naming step 12, and when the redone step
    12 scored less than 0.9 (a setting changed on resume) it stayed there for good, with a record
    of weights that no longer existed; `distqa export --checkpoint best` refused (found by a review)."""
    root = run(tmp_path / "run", "train.max_steps=12", *KEEP_TWO)
    assert os.readlink(root / "best") == "step-12"
    # Step 10 records step 4 as its best: step 4 stays while step 10 does (one checkpoint more).
    assert names(root) == ["best", "step-10", "step-12", "step-4"]
    _damage(root / "step-12")
    monkeypatch.setitem(ScriptedEvalTask.SCORES, 12, 0.85)
    run(tmp_path / "run", "train.max_steps=12", *KEEP_TWO)
    assert os.readlink(root / "best") == "step-4" and resolve_checkpoint(root / "best") == root / "step-4"
    state = json.loads((root / "step-12" / "trainer_state.json").read_text())
    assert state["best"] == {"metric": "eval_score", "mode": "max", "value": 0.9, "step": 4}
    assert names(root) == ["best", "step-10", "step-12", "step-4"]
    monkeypatch.setitem(ScriptedEvalTask.SCORES, 14, 0.6)
    run(tmp_path / "run", "train.max_steps=14", *KEEP_TWO)  # step 12 and 14 kept, both record step 4
    assert names(root) == ["best", "step-12", "step-14", "step-4"]


def test_a_best_record_whose_checkpoint_is_gone_starts_again_and_says_so(tmp_path, monkeypatch, capsys):
    """A record naming a checkpoint that is gone (removed by hand, or pruned by an older distqa):
    its weights cannot be exported, so the record starts again, in one line, and `best` goes until
    the next evaluation names a checkpoint that exists."""
    import shutil

    root = run(tmp_path / "run", "train.max_steps=12", *KEEP_TWO)
    _damage(root / "step-12")
    shutil.rmtree(root / "step-4", ignore_errors=True)
    monkeypatch.setitem(ScriptedEvalTask.SCORES, 12, 0.85)
    capsys.readouterr()
    run(tmp_path / "run", "train.max_steps=12", *KEEP_TWO)
    out = capsys.readouterr().out
    assert (
        "warning: train.best_metric's record (eval_score=0.9 at step 4) names a checkpoint that is gone from "
        f"{root}" in out
    ), out
    assert os.readlink(root / "best") == "step-12" and resolve_checkpoint(root / "best") == root / "step-12"
    state = json.loads((root / "step-12" / "trainer_state.json").read_text())
    assert state["best"] == {"metric": "eval_score", "mode": "max", "value": 0.85, "step": 12}


def test_pointing_best_again_on_resume_keeps_the_checkpoint_resumed_from(tmp_path, monkeypatch):
    """Resumed from step 4 after step 6 (the best) was found damaged, with train.keep_checkpoints
    lowered to 1: pointing `best` back at step 2 (step 4's record) pruned step 4, the checkpoint
    just loaded, while the damaged step 6 was kept; a kill before the next save lost steps 2 to 4."""
    from distqa.checkpoint_manager import CheckpointManager

    for step, score in {2: 0.9, 4: 0.5, 6: 0.95}.items():
        monkeypatch.setitem(ScriptedEvalTask.SCORES, step, score)
    root = run(tmp_path / "run", "train.max_steps=6", "train.checkpoint_every=2", "train.keep_checkpoints=3")
    assert names(root) == ["best", "step-2", "step-4", "step-6"] and os.readlink(root / "best") == "step-6"
    _damage(root / "step-6")
    seen = []
    restore = CheckpointManager.restore

    def look(self, directory):
        step = restore(self, directory)
        seen.append(names(root))
        return step

    monkeypatch.setattr(CheckpointManager, "restore", look)
    run(tmp_path / "run", "train.max_steps=8", "train.checkpoint_every=2", "train.keep_checkpoints=1")
    assert "step-4" in seen[0], seen
    assert os.readlink(root / "best") == "step-6"  # step 6 redone: 0.95 again
