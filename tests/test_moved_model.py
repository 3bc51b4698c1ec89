"""A run whose pretrained model folder (`model.name=DIR`) is at another place now: the run copied to
another machine, a volume mounted elsewhere. Every weight comes from the checkpoint, so `distqa
export model.name=NEW` and a resume with `model.name=NEW` go on, as long as the checkpoint's
records of the config and tokenizer vouch for the new folder; other files are refused."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file

from conftest import SMALL, TESTS, load_weights, max_abs_diff
from distqa.cli import main
from distqa.errors import ConfigError
from distqa.moved_model import check_vouched, warn_of_folder_dropout
from distqa.registry import load_config
from distqa.resume import check_model_settings
from distqa.trainer import train

SAMPLE = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"


def run_args(model, out, steps: int) -> list[str]:
    return [
        *SMALL,
        f"model.name={model}",
        "task.max_seq_len=128",
        f"data.train={SAMPLE}",
        "task.keep_unknown=0.3",
        "train.batch_size=4",
        "train.checkpoint_every=2",
        f"train.max_steps={steps}",
        f"task.cache_dir={out.parent / 'cache'}",
        f"output_dir={out}",
    ]


@pytest.fixture(scope="module")
def moved(tmp_path_factory, minilm_dir):
    """A 2-step run of a pretrained model from a folder that was then moved: (run, new folder)."""
    root = tmp_path_factory.mktemp("moved")
    old, new = root / "minilm", root / "minilm-moved"
    shutil.copytree(minilm_dir, old)
    run = root / "run"
    train(load_config(None, run_args(old, run, 2)))
    old.rename(new)
    return run, new


@pytest.mark.safety  # with the module's 2-step run, about 30 s: make test-safety, for make test's 5 minutes
def test_an_export_names_the_moved_folder_and_writes_the_same_model(moved, tmp_path, capsys):
    run, new = moved
    step2 = str(run / "checkpoints" / "step-2")
    capsys.readouterr()
    assert main(["export", "--checkpoint", step2, "--output", str(tmp_path / "a")]) != 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"from the folder {new.parent / 'minilm'}: there is no such folder" in last and "network" not in last, last
    assert main(["export", "--checkpoint", step2, "--output", str(tmp_path / "b"), f"model.name={new}"]) == 0
    # The end of the run exported step 2 from the old folder: the same tensors.
    assert max_abs_diff(load_file(tmp_path / "b" / "model.safetensors"), load_weights(run)) == 0


def edited_copy(source, target, edit) -> str:
    shutil.copytree(source, target)
    edit(target)
    return str(target)


def swap_two_words(folder) -> None:
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["the"], vocab["of"] = vocab["of"], vocab["the"]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))


def pads_on_the_left(folder) -> None:
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "padding_side": "left"}))


def other_activation(folder) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu_new"}))


@pytest.mark.safety  # about 15 s: make test-safety
def test_an_export_refuses_other_files_and_other_settings(moved, tmp_path, capsys):
    run, new = moved
    export = ["export", "--checkpoint", str(run / "checkpoints" / "step-2"), "--output", str(tmp_path / "out")]
    cases = [
        (f"model.name={edited_copy(new, tmp_path / 'words', swap_two_words)}", "another tokenizer than"),
        (f"model.name={edited_copy(new, tmp_path / 'left', pads_on_the_left)}", "another tokenizer than"),
        (f"model.name={edited_copy(new, tmp_path / 'act', other_activation)}", "another model config than"),
        (f"model.name={tmp_path / 'nowhere'}", f"model.name={tmp_path / 'nowhere'}: there is no such folder"),
        ("train.lr=1", "distqa export takes model.name=DIR and model.tokenizer=DIR alone (given: train.lr=1)"),
    ]
    for given, said in cases:
        capsys.readouterr()
        assert main([*export, given]) != 0, given
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert said in last, last
        assert not (tmp_path / "out").exists()


@pytest.mark.safety  # about 25 s: make test-safety
def test_a_resume_from_the_moved_folder_ends_with_the_uninterrupted_run_s_weights(moved, tmp_path, capsys):
    run, new = moved
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    straight = tmp_path / "straight"
    train(load_config(None, run_args(new, straight, 4)))
    capsys.readouterr()
    train(load_config(None, run_args(new, resumed, 4)))
    out = capsys.readouterr().out
    assert "with the model's files at another place: model.name" in out and "resumed from" in out, out
    assert max_abs_diff(load_weights(resumed), load_weights(straight)) == 0
    # Another tokenizer at the new place: refused once the model is built, nothing trained.
    words = edited_copy(new, tmp_path / "words", swap_two_words)
    with pytest.raises(ConfigError, match="was trained with another tokenizer than this run builds"):
        train(load_config(None, run_args(words, resumed, 6)))


def test_the_records_must_hold_the_same_entries_on_both_sides(tmp_path):
    """The value comparison skips an entry one side lacks: a tokenizer hashed at training and none
    now (or the other way round) is refused here, as are records an earlier distqa never kept."""
    state = {"task_identity": {"tokenizer": "ab" * 32}, "model_settings": {"hidden_size": 8}}
    check_vouched(tmp_path, state, {"tokenizer": "cd" * 32}, {"hidden_size": 8}, ["model.name"], "fix it")
    with pytest.raises(
        ConfigError, match="trained with a tokenizer, and this run builds no tokenizer from model.name: fix it"
    ):
        check_vouched(tmp_path, state, {}, {"hidden_size": 8}, ["model.name"], "fix it")
    with pytest.raises(ConfigError, match="keeps no record of its model's config and tokenizer"):
        check_vouched(tmp_path, {"task_identity": {}}, {}, {"hidden_size": 8}, ["model.name"], "fix it")


def test_the_folder_s_own_dropout_changed_is_said_as_applied_and_model_dropout_given_is_not(capsys, tmp_path):
    """With model.dropout unset then and now the rates are the folder's: a copy with others trained
    on with them, unsaid (a review). Given then or now, model.dropout's own change is the one said."""
    state = {
        "step": 2,
        "config": {"model": {"dropout": None}},
        "model_settings": {"hidden_size": 8, "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1},
    }
    now = {"hidden_size": 8, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.1}
    warn_of_folder_dropout(tmp_path, state, now, None)
    assert capsys.readouterr().out.strip() == (
        f"warning: resuming {tmp_path} with other dropout rates in model.name's config, applied from step 2 on: "
        "hidden_dropout_prob: 0.1 then, 0.0 now (model.dropout=RATE sets one rate for all)"
    )
    warn_of_folder_dropout(tmp_path, state, now, 0.0)
    warn_of_folder_dropout(tmp_path, {**state, "config": {"model": {"dropout": 0.1}}}, now, None)
    warn_of_folder_dropout(tmp_path, state, dict(state["model_settings"]), None)
    warn_of_folder_dropout(tmp_path, {**state, "model_settings": {"hidden_size": 8}}, now, None)  # an older record
    assert capsys.readouterr().out == ""
    # Nor is it a refusal: the model's config check leaves the rates to this line.
    check_model_settings(tmp_path, state["model_settings"], now, "than this run builds")
