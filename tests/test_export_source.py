"""A finished run counts as exported only when model/ holds its final checkpoint's weights
(`checkpoint_verify.SOURCE_FILE`): a model/ left by an earlier, shorter run (its export failed,
or the process was killed before it) is written again, never reported as the finished run's."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file

from conftest import SMALL
from distqa.checkpoint_verify import SOURCE_FILE
from distqa.registry import load_config
from distqa.trainer import train

TOY = [arg for arg in SMALL if not arg.startswith("task.")]
TOY += ["task.name=toy_task:ToyClassificationTask", "train.checkpoint_every=2"]


@pytest.mark.safety  # about 4 s: make test-safety, for make test's 5 minutes
def test_a_stale_model_folder_is_written_again_not_taken_for_the_finished_run(tmp_path, capsys):
    out = tmp_path / "run"
    train(load_config(None, [*TOY, f"output_dir={out}", "train.max_steps=4"]))
    source = json.loads((out / "model" / SOURCE_FILE).read_text())
    assert (source["checkpoint"], source["step"]) == ("step-4", 4) and len(source["manifest_sha256"]) == 64
    shutil.copytree(out / "model", tmp_path / "model-4")
    train(load_config(None, [*TOY, f"output_dir={out}", "train.max_steps=6"]))
    # As if the step-6 export had never happened: model/ still holds step 4's weights.
    shutil.rmtree(out / "model")
    shutil.copytree(tmp_path / "model-4", out / "model")
    capsys.readouterr()

    train(load_config(None, [*TOY, f"output_dir={out}", "train.max_steps=6"]))
    said = capsys.readouterr().out
    assert f"{out / 'model'} does not record that it holds the weights of {out / 'checkpoints' / 'step-6'}" in said
    assert "already finished" not in said
    final = load_file(str(out / "checkpoints" / "step-6" / "model.safetensors"))
    exported = load_file(str(out / "model" / "model.safetensors"))
    assert final.keys() == exported.keys() and all((final[k] == exported[k]).all() for k in final)
    assert json.loads((out / "model" / SOURCE_FILE).read_text())["step"] == 6

    # Now it is the final one: a rerun has nothing to do.
    train(load_config(None, [*TOY, f"output_dir={out}", "train.max_steps=6"]))
    assert "already finished at step 6: nothing to train, nothing written" in capsys.readouterr().out


@pytest.mark.safety  # about 5 s: make test-safety, for make test's 5 minutes
def test_a_rerun_that_only_exports_draws_a_plot_missing_or_older_than_the_metrics(tmp_path, capsys):
    """A kill between the final checkpoint and the plot left metrics.png missing (or an earlier,
    shorter run's) and the rerun, which only exports, left it so with exit 0."""
    out = tmp_path / "run"
    train(load_config(None, [*TOY, f"output_dir={out}", "train.max_steps=4"]))
    png, metrics = out / "metrics.png", out / "metrics.jsonl"
    shutil.rmtree(out / "model")
    png.unlink()
    capsys.readouterr()
    train(load_config(None, [*TOY, f"output_dir={out}", "train.max_steps=4"]))
    assert png.is_file() and "plotted in" in capsys.readouterr().out

    earlier = metrics.stat().st_mtime_ns - 10**9  # the plot of an earlier, shorter line of the run
    os.utime(png, ns=(earlier, earlier))
    shutil.rmtree(out / "model")
    train(load_config(None, [*TOY, f"output_dir={out}", "train.max_steps=4"]))
    assert png.stat().st_mtime_ns >= metrics.stat().st_mtime_ns

    drawn = png.stat().st_mtime_ns  # up to date: an export-only rerun leaves it alone
    shutil.rmtree(out / "model")
    train(load_config(None, [*TOY, f"output_dir={out}", "train.max_steps=4"]))
    assert png.stat().st_mtime_ns == drawn


def test_an_export_without_a_source_or_with_a_damaged_one_is_not_the_final_one(tmp_path):
    from distqa.checkpoint_verify import exported_from

    out = tmp_path / "run"
    train(load_config(None, [*TOY, f"output_dir={out}", "train.max_steps=2"]))
    model, final = out / "model", out / "checkpoints" / "step-2"
    assert exported_from(model, final)
    for damaged in (b"", b"\xff\xfe", b"[]", b'{"step": 2}', b"null"):
        (model / SOURCE_FILE).write_bytes(damaged)
        assert not exported_from(model, final), damaged
    (model / SOURCE_FILE).unlink()
    assert not exported_from(model, final)


def test_a_source_record_of_the_wrong_shape_is_damage_not_a_pass(tmp_path):
    """A record that parsed to a mapping without a `files` mapping vouched for nothing, and every
    check of the export's files passed: flipped weights predicted, exit 0 (a review)."""
    from distqa.checkpoint_verify import export_damage

    out = tmp_path / "run"
    train(load_config(None, [*TOY, f"output_dir={out}", "train.max_steps=2"]))
    model = out / "model"
    whole = (model / SOURCE_FILE).read_text()
    assert export_damage(model) is None
    for shape in (
        "{}",
        '{"files": []}',
        '{"files": null}',
        '{"files": "x"}',
        '{"files": {}}',
        '{"step": 2}',
        '{"checkpoint": "step-2", "files": []}',
    ):
        (model / SOURCE_FILE).write_text(shape)
        assert export_damage(model) == f"{SOURCE_FILE} records no files", shape
    (model / SOURCE_FILE).write_text(whole)
    assert export_damage(model) is None
    older = {key: value for key, value in json.loads(whole).items() if key != "files"}  # names no files yet
    (model / SOURCE_FILE).write_text(json.dumps(older))
    assert export_damage(model) is None
    (model / SOURCE_FILE).unlink()
    assert export_damage(model) is None  # an export of an older distqa: predict says it is unchecked


def test_an_export_replaces_only_an_earlier_export_never_a_run_or_a_file(tmp_path, capsys):
    from distqa.errors import DistqaError
    from distqa.export import export_checkpoint

    out = tmp_path / "run"
    train(load_config(None, [*TOY, f"output_dir={out}", "train.max_steps=2"]))
    step = out / "checkpoints" / "step-2"
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    for target, said in (
        (out, "is a folder that is not a model export (it holds"),
        (a_file, "is a file, not a folder"),
    ):
        with pytest.raises(DistqaError) as refused:
            export_checkpoint(str(step), str(target))
        assert str(refused.value).startswith(f"--output {target} {said}")
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before and a_file.read_text() == "mine\n"
    # An earlier export (its source file says so), an older one (its settings file) and an empty
    # folder are replaced; the new export records its checkpoint.
    export_checkpoint(str(step), str(out / "model"))
    assert json.loads((out / "model" / SOURCE_FILE).read_text())["checkpoint"] == "step-2"
    (out / "model" / SOURCE_FILE).unlink()
    export_checkpoint(str(step), str(out / "model"))
    (tmp_path / "empty").mkdir()
    export_checkpoint(str(step), str(tmp_path / "empty"))
    assert (tmp_path / "empty" / SOURCE_FILE).is_file()


@pytest.mark.safety  # about 4 s: make test-safety, for make test's 5 minutes
def test_a_damaged_model_folder_is_written_again_not_taken_for_the_finished_run(tmp_path, capsys):
    out = tmp_path / "run"
    settings = [*TOY, f"output_dir={out}", "train.max_steps=2"]
    train(load_config(None, settings))
    weights = out / "model" / "model.safetensors"
    whole = weights.read_bytes()
    recorded = json.loads((out / "model" / SOURCE_FILE).read_text())["files"]
    assert recorded["model.safetensors"]["bytes"] == len(whole) and SOURCE_FILE not in recorded
    for damage in (whole[: len(whole) // 2], whole[:-1] + bytes([whole[-1] ^ 1])):  # truncated; a byte flipped
        weights.write_bytes(damage)
        capsys.readouterr()
        train(load_config(None, settings))
        out_text, err_text = capsys.readouterr()
        assert "already finished" not in out_text
        said = [line for line in err_text.splitlines() if "warning" in line]
        assert len(said) == 1 and said[0].startswith(f"distqa: warning: {out / 'model'} is damaged (model.safetensors ")
        assert said[0].endswith("): writing it again"), said
        assert weights.read_bytes() == whole
    assert not list(tmp_path.glob("run/model.replaced-*"))  # damaged weights are written again, not kept
    # An export of an older distqa records no files: taken as it is, as before.
    source = json.loads((out / "model" / SOURCE_FILE).read_text())
    del source["files"]
    (out / "model" / SOURCE_FILE).write_text(json.dumps(source))
    weights.write_bytes(whole[:100])
    train(load_config(None, settings))
    assert "already finished at step 2" in capsys.readouterr().out


def test_a_model_folder_the_user_added_to_or_edited_is_kept_aside_when_written_again(tmp_path, capsys):
    """A rerun found model/ "damaged" (an edited file), wrote it again and removed the old folder
    whole: the user's notes and submission in it went too, exit 0 (found by a review)."""
    out = tmp_path / "run"
    settings = [*TOY, f"output_dir={out}", "train.max_steps=2"]
    train(load_config(None, settings))
    (out / "model" / "notes.txt").write_text("mine\n")
    written = (out / "model" / "toy.json").read_text()
    (out / "model" / "toy.json").write_text(written.replace("}", ', "mine": 1}'))
    capsys.readouterr()
    train(load_config(None, settings))
    said = capsys.readouterr().out
    kept = list(tmp_path.glob("run/model.replaced-*"))
    assert len(kept) == 1 and (kept[0] / "notes.txt").read_text() == "mine\n"
    assert '"mine": 1' in (kept[0] / "toy.json").read_text()
    assert (out / "model" / "toy.json").read_text() == written and not (out / "model" / "notes.txt").exists()
    assert f"held files it did not write (notes.txt); files edited since (toy.json): kept as {kept[0]}" in said
    # A kill between the export's two renames left the previous folder as .old-model: the next
    # export removed it, the user's files in it too (found by a review). Kept aside now.
    import shutil

    shutil.copytree(out / "model", out / ".old-model")
    (out / ".old-model" / "notes.txt").write_text("left\n")
    (out / "model" / "model.safetensors").write_bytes(b"damaged")
    train(load_config(None, settings))
    left = [p for p in tmp_path.glob("run/model.replaced-*") if (p / "notes.txt").is_file() and p not in kept]
    assert len(left) == 1 and (left[0] / "notes.txt").read_text() == "left\n" and not (out / ".old-model").exists()


def test_an_export_never_replaces_a_model_folder_of_the_users_nor_writes_in_checkpoints(tmp_path, monkeypatch):
    from distqa.errors import DistqaError
    from distqa.export import export_checkpoint

    out = tmp_path / "run"
    train(load_config(None, [*TOY, f"output_dir={out}", "train.max_steps=2"]))
    step = out / "checkpoints" / "step-2"
    hf = tmp_path / "bert"  # a Hugging Face model folder: the weights and config an export also writes, and more
    hf.mkdir()
    for name in ("config.json", "model.safetensors", "vocab.txt"):
        (hf / name).write_text(name)
    (out / "checkpoints" / "best").symlink_to("step-2")
    for target, said in (
        (hf, "is a folder that is not a model export (it holds config.json, model.safetensors, vocab.txt)"),
        (out / "checkpoints" / "best", f"is inside the run's checkpoints folder {out / 'checkpoints'}"),
        (step / "model", f"is inside the run's checkpoints folder {out / 'checkpoints'}"),
    ):
        with pytest.raises(DistqaError) as refused:
            export_checkpoint(str(step), str(target))
        assert str(refused.value).startswith(f"--output {target} {said}"), refused.value
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors", "vocab.txt"]
    assert os.readlink(out / "checkpoints" / "best") == "step-2" and not (step / "model").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["best", "step-2"]
    # A link is replaced by the export, what it named left alone, and no `.old-` link is left behind.
    export_checkpoint(str(step), str(tmp_path / "earlier"))
    (tmp_path / "link").symlink_to(tmp_path / "earlier")
    export_checkpoint(str(step), str(tmp_path / "link"))
    assert (tmp_path / "link").is_dir() and not (tmp_path / "link").is_symlink()
    assert (tmp_path / "earlier" / SOURCE_FILE).is_file() and not (tmp_path / ".old-link").exists()
    assert not (tmp_path / ".old-link").is_symlink()
    # `--output .`: the folder it names, here an empty one.
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    export_checkpoint(str(step), ".")
    assert (tmp_path / "here" / SOURCE_FILE).is_file()


@pytest.mark.parametrize("when", ["load_model", "source_of"])
def test_a_checkpoint_pruned_during_the_export_is_one_line_naming_it(tmp_path, monkeypatch, when):
    """A live run with train.keep_checkpoints=1 removes the step being exported: one line, no traceback."""
    from distqa import export
    from distqa.errors import DistqaError

    out = tmp_path / "run"
    train(load_config(None, [*TOY, f"output_dir={out}", "train.max_steps=2"]))
    step = out / "checkpoints" / "step-2"
    real = getattr(export, when)

    def pruned_first(*args, **kwargs):
        shutil.rmtree(step)
        return real(*args, **kwargs)

    monkeypatch.setattr(export, when, pruned_first)
    with pytest.raises(DistqaError) as refused:
        export.export_checkpoint(str(step), str(tmp_path / "model"))
    assert str(refused.value) == (
        f"checkpoint {step} disappeared during the export (a live run pruned it, train.keep_checkpoints, or set "
        "its run aside, train.resume=never): export checkpoints/best, or export after the run"
    )
    assert not (tmp_path / "model").exists()


@pytest.mark.safety  # about 6 s: make test-safety, for make test's 5 minutes
@pytest.mark.parametrize("then", ["set-aside", "written-again"])
def test_a_checkpoint_gone_or_replaced_once_the_export_is_written_is_not_renamed_in(tmp_path, monkeypatch, then):
    """`distqa export` (default target OUT/model-step-N) went on while `train.resume=never` set its
    run aside and a new run took OUT: the old run's weights landed in the new run's folder, under a
    name the new run's own step-N also has. The checkpoint is compared last, before the rename."""
    from distqa import export
    from distqa.errors import DistqaError

    out, other = tmp_path / "run", tmp_path / "other"
    train(load_config(None, [*TOY, f"output_dir={out}", "train.max_steps=2"]))
    train(load_config(None, [*TOY, f"output_dir={other}", "train.max_steps=2", "seed=5"]))
    step = out / "checkpoints" / "step-2"
    real = export.export_atomically

    def meanwhile(save, target, *args, **kwargs):
        def save_then_taken_over(folder):
            save(folder)
            shutil.move(out / "checkpoints", tmp_path / "earlier")  # set aside, as resume=never does
            if then == "written-again":  # and the new run's own step-2 (its export would wait for this one)
                shutil.copytree(other / "checkpoints", out / "checkpoints")

        return real(save_then_taken_over, target, *args, **kwargs)

    monkeypatch.setattr(export, "export_atomically", meanwhile)
    with pytest.raises(DistqaError) as refused:
        export.export_checkpoint(str(step))
    said = {
        "set-aside": f"checkpoint {step} disappeared during the export",
        "written-again": f"checkpoint {step} was written again during the export (another run writes there)",
    }[then]
    assert str(refused.value).startswith(said), refused.value
    assert not (out / "model-step-2").exists() and not list(out.glob(".tmp-*"))


def test_a_run_kept_in_a_projects_folder_named_checkpoints_exports_to_its_default(tmp_path):
    """A project's own config.yaml beside its folder `checkpoints/` (output_dir=checkpoints/run1) made
    every export of that run refused as 'inside the run's checkpoints folder', its default too."""
    from distqa.export import export_checkpoint

    (tmp_path / "config.yaml").write_text("train:\n  lr: 0.001\n")
    out = tmp_path / "checkpoints" / "run1"
    train(load_config(None, [*TOY, f"output_dir={out}", "train.max_steps=2"]))
    export_checkpoint(str(out / "checkpoints" / "step-2"), None)
    assert (out / "model-step-2" / SOURCE_FILE).is_file()


def test_a_file_removed_from_the_export_on_purpose_is_no_damage_but_the_weights_are(tmp_path, capsys):
    """nq.md: remove distqa_thresholds.json to give every example its best answer. A rerun of the
    finished run must not call that damage and write the file back; missing weights it must."""
    out = tmp_path / "run"
    settings = [*TOY, f"output_dir={out}", "train.max_steps=2"]
    train(load_config(None, settings))
    recorded = json.loads((out / "model" / SOURCE_FILE).read_text())["files"]
    optional = sorted(name for name in recorded if name != "config.json" and not name.endswith(".safetensors"))
    assert optional  # the toy task's settings file at least
    (out / "model" / optional[0]).unlink()
    capsys.readouterr()
    train(load_config(None, settings))
    assert "already finished at step 2" in capsys.readouterr().out
    assert not (out / "model" / optional[0]).exists()
    (out / "model" / "model.safetensors").unlink()
    train(load_config(None, settings))
    assert "model.safetensors is missing): writing it again" in capsys.readouterr().err
    assert (out / "model" / "model.safetensors").is_file()
