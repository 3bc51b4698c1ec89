"""What `distqa export` and `distqa predict` read besides the weights is checked too: a tokenizer
folder changed since training, an exported distqa_task.json, config.json or tokenizer file edited
or lost, a distqa_source.json that no longer reads, a thresholds file that is a folder or names a
key twice. Each gave a submission of other inputs with exit 0 (or a traceback). One process, the
tiny model on the 10 fixture examples: seconds."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import SMALL, TESTS, subprocess_env
from distqa.cli import main
from distqa.errors import DistqaError
from distqa.export import export_checkpoint
from distqa.registry import load_config
from distqa.trainer import train

SAMPLE = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# Refusals of damaged model files, most of them on one NQ training run (13 s): make test-safety
# (about 40 s in all), for make test's 5 minutes.
pytestmark = pytest.mark.safety


@pytest.fixture(scope="module")
def nq_run(tmp_path_factory, minilm_dir):
    """4 steps of the tiny model with a copy of MiniLM's tokenizer, evaluated at the end: a model/
    with tokenizer files and thresholds, and checkpoints step-2 and step-4."""
    root = tmp_path_factory.mktemp("files")
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_dir / name, tokenizer / name)
    out = root / "run"
    args = [*SMALL, f"model.tokenizer={tokenizer}", "task.max_seq_len=128", f"task.cache_dir={root / 'cache'}"]
    args += [f"data.train={SAMPLE}", f"data.valid={SAMPLE}", "task.keep_unknown=0.3", "train.batch_size=4"]
    train(load_config(None, [*args, "train.max_steps=4", "train.checkpoint_every=2", f"output_dir={out}"]))
    return out


def predict(tmp_path, capsys, model, *extra: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    argv = ["predict", "--input", str(SAMPLE), "--checkpoint", str(model), "--output", str(tmp_path / "sub.csv")]
    status = main([*argv, f"task.cache_dir={tmp_path / 'cache'}", *extra])
    return status, capsys.readouterr().err.strip().splitlines()


def copied(tmp_path, nq_run):
    shutil.copytree(nq_run / "model", tmp_path / "model")
    return tmp_path / "model"


def test_export_refuses_a_tokenizer_changed_since_the_checkpoint_was_trained(nq_run, tmp_path):
    """A tokenizer folder replaced after training (here: lower-casing off, as a cased one): export
    packaged it beside the weights, and 'Who Wrote' became [UNK] [UNK] in every prediction."""
    step = nq_run / "checkpoints" / "step-2"
    assert (export_checkpoint(str(step), str(tmp_path / "before")) / "tokenizer.json").is_file()
    tokenizer = nq_run.parent / "tokenizer"
    names = ("tokenizer.json", "tokenizer_config.json")
    whole = {name: (tokenizer / name).read_text() for name in names}
    try:
        definition, settings = (json.loads(whole[name]) for name in names)
        definition["normalizer"]["lowercase"], settings["do_lower_case"] = False, False
        (tokenizer / "tokenizer.json").write_text(json.dumps(definition))
        (tokenizer / "tokenizer_config.json").write_text(json.dumps(settings))
        with pytest.raises(DistqaError, match="trained with another tokenizer than model.tokenizer=") as caught:
            export_checkpoint(str(step), str(tmp_path / "after"))
        assert "put back the files it was trained with" in str(caught.value)
        assert not (tmp_path / "after").exists()
    finally:
        for name in names:
            (tokenizer / name).write_text(whole[name])


@pytest.mark.parametrize(
    "name, change",
    [
        ("distqa_task.json", lambda path: path.write_text('{"format": 1, "task": {"name": "nq"}}')),
        (
            "config.json",
            lambda path: path.write_text(path.read_text().replace('"hidden_act": "gelu"', '"hidden_act": "relu"')),
        ),  # fmt: skip
        (
            "tokenizer.json",
            lambda path: path.write_text(path.read_text().replace('"lowercase": true', '"lowercase": false')),
        ),  # fmt: skip
        ("distqa_task.json", lambda path: path.unlink()),
        ("tokenizer_config.json", lambda path: path.unlink()),
    ],
    ids=["task-settings-lost-keys", "config-edited", "tokenizer-edited", "task-settings-gone", "tokenizer-config-gone"],
)
def test_predict_refuses_a_model_file_changed_since_the_export(nq_run, tmp_path, capsys, name, change):
    """distqa_task.json without its keys predicted with 512-token windows instead of the trained
    128 (7 of 20 rows changed); the export's distqa_source.json held every file's hash."""
    model = copied(tmp_path, nq_run)
    before = (model / name).read_bytes()
    change(model / name)
    assert not (model / name).exists() or (model / name).read_bytes() != before  # the edit took
    status, lines = predict(tmp_path, capsys, model)
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"distqa: error: the model in {model} is damaged ({name} "), lines
    assert not (tmp_path / "sub.csv").exists()


@pytest.mark.parametrize("damage", [b"", b"[]", b"\xff\xfe", b'{"files": '])
def test_a_distqa_source_that_no_longer_reads_is_damage_not_a_pass(nq_run, tmp_path, capsys, damage):
    """Unreadable, it vouched for nothing: the weights' hash and the thresholds' step went unchecked."""
    model = copied(tmp_path, nq_run)
    (model / "distqa_source.json").write_bytes(damage)
    status, lines = predict(tmp_path, capsys, model)
    said = f"the model in {model} is damaged (distqa_source.json is damaged): export it again (distqa export)"
    assert status == 2 and lines == [f"distqa: error: {said}"]


def test_the_thresholds_may_be_removed_or_tuned_but_not_be_a_folder_or_name_a_key_twice(nq_run, tmp_path, capsys):
    model = copied(tmp_path, nq_run)
    thresholds = model / "distqa_thresholds.json"
    chosen = json.loads(thresholds.read_text())
    # Tuned by hand: a number of the user's, read strictly; the export's hash does not hold it back.
    thresholds.write_text(json.dumps({**chosen, "long": 0.25}))
    status, lines = predict(tmp_path, capsys, model)
    assert status == 0, lines
    thresholds.write_text(json.dumps(chosen)[:-1] + ', "long": 9.5}')  # {"long": ..., "long": 9.5}
    status, lines = predict(tmp_path, capsys, model)
    assert status == 2 and "(the key 'long' is given twice)" in lines[-1], lines
    thresholds.unlink()
    thresholds.mkdir()  # was taken for no file: every example got its best answer
    status, lines = predict(tmp_path, capsys, model)
    assert status == 2 and lines[-1].startswith(f"distqa: error: {thresholds} is not a thresholds file"), lines
    thresholds.rmdir()  # removed: every example gets its best answer, as documented
    status, lines = predict(tmp_path, capsys, model)
    assert status == 0, lines


@pytest.mark.parametrize(
    "content, said",
    [(b"[]", "holds an array, where a config is a JSON object"), (b"\xff\x00{", "is not JSON")],
    ids=["a-list", "bytes"],
)
def test_a_config_json_that_is_no_object_is_one_line_naming_it(nq_run, tmp_path, capsys, content, said):
    """A model folder of no export (no distqa_source.json): transformers' TypeError was a traceback,
    then a line that blamed the tokenizer (which reads config.json first, for its class)."""
    model = copied(tmp_path, nq_run)
    (model / "distqa_source.json").unlink()
    (model / "config.json").write_bytes(content)
    status, lines = predict(tmp_path, capsys, model)
    assert status == 2 and lines[-1].startswith(f"distqa: error: cannot load tokenizer from the folder {model}")
    assert f"its config.json {said}; set model.tokenizer to a folder that holds a whole model" in lines[-1]


def test_a_model_replaced_while_predict_reads_it_is_refused(nq_run, tmp_path, capsys, monkeypatch):
    """An export that renamed a new folder into place after predict had loaded the weights: predict
    read the new export's thresholds beside the old weights, whose steps both came from the new
    folder's files, and wrote a submission with exit 0."""
    from distqa.nq.model import BertJointQA

    model = export_checkpoint(str(nq_run / "checkpoints" / "step-2"), str(tmp_path / "m"))
    real = BertJointQA.from_pretrained.__func__

    def load_then_replaced(cls, folder, *args, **kwargs):
        loaded = real(cls, folder, *args, **kwargs)
        export_checkpoint(str(nq_run / "checkpoints" / "step-4"), str(model))  # meanwhile, another export
        return loaded

    monkeypatch.setattr(BertJointQA, "from_pretrained", classmethod(load_then_replaced))
    status, lines = predict(tmp_path, capsys, model)
    assert status == 2 and lines[-1] == (
        f"distqa: error: the model in {model} was replaced while predict read it (an export wrote it meanwhile): "
        "run predict again"
    ), lines
    assert not (tmp_path / "sub.csv").exists()


def test_a_damaged_config_json_in_the_hugging_face_cache_is_named_not_said_to_be_missing(tmp_path, minilm_dir):
    """A hub id whose cached config.json is no object: the line said to download it (found by a
    review), which a download would not fix (the cache keeps its files by content). A fresh
    interpreter: the hub library reads HF_HOME when it is imported."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = tmp_path / "hf" / "hub" / "models--acme--tinybert"
    snapshot = entry / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_dir / name, snapshot / name)
    (snapshot / "config.json").write_text("[]")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"), "HF_HUB_OFFLINE": "1"}
    code = (
        "import sys; from distqa.config import ModelConfig; from distqa.models import load_tokenizer\n"
        "try:\n    load_tokenizer(ModelConfig(name='acme/tinybert'))\n"
        "except Exception as err:\n    print(err)\n"
    )
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(**env))
    assert said.stdout.strip() == (
        "cannot load tokenizer 'acme/tinybert': its config.json in the Hugging Face cache "
        f"({snapshot / 'config.json'}) holds an array, where a config is a JSON object; delete {entry} and "
        "download it again, or set model.name to a local folder"  # (the key that named it: model.tokenizer unset)
    ), said.stdout + said.stderr
    # A config.json of the wrong types there: not "download it once" nor "set HF_HOME to a cache
    # that holds it", which it does (a review).
    config = json.loads((minilm_dir / "config.json").read_text())
    (snapshot / "config.json").write_text(json.dumps({**config, "layer_norm_eps": "small"}))
    said = subprocess.run(
        [sys.executable, "-c", code.replace("load_tokenizer", "hf_config")], capture_output=True, text=True,
        env=subprocess_env(**env),
    )  # fmt: skip
    assert said.stdout.strip().startswith("cannot load model 'acme/tinybert' from the Hugging Face cache ("), said
    assert said.stdout.strip().endswith(
        f"its files there do not load as a model; delete {entry} and download it again, or set model.name to a "
        "local folder"
    ), said.stdout
