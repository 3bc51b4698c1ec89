"""`distqa predict` runs a model with the task settings it was trained with: the export carries them
(model/distqa_task.json), so leaving out `task.max_seq_len=...` cannot give a plausible, wrong
submission; a key given on the command line that differs is used, with one warning line naming
both values, and one from a --config file is refused."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass

import pytest

from conftest import TESTS
from distqa import config_layers
from distqa.cli import main
from distqa.config import setting
from distqa.errors import DistqaError
from distqa.registry import load_config
from distqa.task import SETTINGS_FILE, given_task_keys, with_trained_settings, write_task_settings

SAMPLE = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"
TRAINED = ["task.max_seq_len=128", "task.doc_stride=64"]


def strict_json(text: str) -> dict:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in a file that must be strict JSON")

    return json.loads(text, parse_constant=refuse)


def warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if "warning" in line]


def test_saved_settings_round_trip(tmp_path, capsys):
    from distqa.nq.task import NQTask

    trained = load_config(
        None, ["model.name=tiny", *TRAINED, "task.max_query_len=32", "task.keep_unknown=0.25", "task.max_answer_len=12"]
    )
    path = NQTask(trained).save_settings(tmp_path)
    assert path == tmp_path / SETTINGS_FILE
    saved = strict_json(path.read_text())["task"]
    assert saved["name"] == "nq" and saved["max_seq_len"] == 128 and saved["doc_stride"] == 64

    capsys.readouterr()
    fresh = with_trained_settings(load_config(None, ["task.skip_bad_lines=true"]), tmp_path)
    assert type(fresh.task) is type(trained.task)
    # Every setting that shapes the model's inputs comes back; the run's own choices stay the command line's.
    for key in ("name", "max_seq_len", "doc_stride", "max_query_len", "keep_unknown", "max_answer_len", "dummy_size"):
        assert getattr(fresh.task, key) == getattr(trained.task, key), key
    assert fresh.task.skip_bad_lines is True
    out, err = capsys.readouterr()
    assert err == "" and out.count("\n") == 1, out
    taken = "task.max_seq_len=128, task.doc_stride=64, task.max_query_len=32, task.keep_unknown=0.25"
    assert out.endswith(f"{taken}, task.max_answer_len=12\n"), out


@dataclass
class ForkSettings:
    temperature: float = setting(1.0, "a float a fork allows to be infinite", finite=False)
    floor: float = setting(0.0, "a float that must be finite")
    weights: list[float] = setting([1.0], "a list of floats that must be finite")
    scales: dict[str, float] = setting({"a": 1.0}, "a mapping of floats that may be infinite", finite=False)


def fork_config(*overrides: str):
    return config_layers.load_config(None, ["task.name=fork:Task", *overrides], settings_of=lambda name: ForkSettings)


def test_infinite_settings_are_saved_as_strict_json_and_read_back(tmp_path):
    write_task_settings(fork_config("task.temperature=-inf").task, tmp_path)
    text = (tmp_path / SETTINGS_FILE).read_text()
    assert strict_json(text)["task"] == {
        "name": "fork:Task", "temperature": "-inf", "floor": 0.0, "weights": [1.0], "scales": {"a": 1.0}
    }  # fmt: skip
    assert with_trained_settings(fork_config(), tmp_path).task.temperature == -math.inf
    write_task_settings({"name": "fork:Task", "scales": {"a": "inf"}}, tmp_path)
    assert with_trained_settings(fork_config(), tmp_path).task.scales == {"a": math.inf}
    # nan, or inf where the setting must be finite (an item of a list or mapping too): a tampered
    # file, refused in one line.
    cases = [({"temperature": "nan"}, "temperature"), ({"floor": "inf"}, "floor"),
             ({"weights": [1.0, "nan"]}, r"weights\[1\]"), ({"weights": ["inf"]}, r"weights\[0\]"),
             ({"scales": {"a": "nan"}}, r"scales\.a")]  # fmt: skip
    for saved, key in cases:
        write_task_settings({"name": "fork:Task", **saved}, tmp_path)
        with pytest.raises(DistqaError, match=f"{SETTINGS_FILE}: task.{key}=.* is not a finite number"):
            with_trained_settings(fork_config(), tmp_path)


def test_a_given_key_that_differs_is_used_with_one_warning_line(tmp_path, capsys):
    write_task_settings(load_config(None, TRAINED).task, tmp_path)
    capsys.readouterr()
    cfg = with_trained_settings(load_config(None, ["task.max_seq_len=64"]), tmp_path, {"max_seq_len"})
    assert cfg.task.max_seq_len == 64 and cfg.task.doc_stride == 64
    (line,) = warnings(capsys.readouterr().err)
    assert "task.max_seq_len=64 was given" in line and "trained with task.max_seq_len=128" in line, line
    # The trained value given again: nothing to warn about.
    with_trained_settings(load_config(None, TRAINED), tmp_path, {"max_seq_len", "doc_stride"})
    assert warnings(capsys.readouterr().err) == []


def test_an_export_without_settings_keeps_the_defaults_and_says_so(tmp_path, capsys):
    capsys.readouterr()
    cfg = with_trained_settings(load_config(None, ["task.doc_stride=64"]), tmp_path, {"doc_stride"})
    assert cfg.task.max_seq_len == 512 and cfg.task.doc_stride == 64
    (line,) = capsys.readouterr().err.splitlines()
    assert f"no {SETTINGS_FILE}" in line and "task.max_seq_len=512" in line and "task.doc_stride=64" in line, line


def test_given_keys_come_from_the_overrides_and_the_config_file(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("task:\n  max_query_len: 32\ndata:\n  train: dummy\n")
    overrides = ["task.max_seq_len=128", "task.doc_stride=64", "task=nq", "train.lr=1e-4"]
    given = given_task_keys(str(config), overrides)
    line = "the command line"
    assert given == {"max_seq_len": line, "doc_stride": line, "name": line, "max_query_len": str(config)}
    # A key in both: the command line's value is the one used.
    assert given_task_keys(str(config), ["task.max_query_len=16"])["max_query_len"] == line
    assert given_task_keys(None, []) == {}


def test_a_file_s_value_other_than_the_trained_one_is_refused_naming_the_file(tmp_path, capsys):
    """The training run's --config file without that run's command-line overrides builds other
    windows than training's: refused; the same value typed on the command line is a choice."""
    write_task_settings(load_config(None, TRAINED).task, tmp_path)
    config = tmp_path / "train.yaml"
    with pytest.raises(DistqaError) as caught:
        with_trained_settings(load_config(None, ["task.doc_stride=32"]), tmp_path, {"doc_stride": str(config)})
    message = str(caught.value)
    assert f"task.doc_stride=32 in {config} is not the task.doc_stride=64 the model in {tmp_path}" in message, message
    assert "give task.doc_stride=32 on the command line" in message and "\n" not in message
    # A fork's own command, its task named by its config file, on another task's model: refused
    # (it was one warning, and a head with random weights predicted, exit 0).
    with pytest.raises(DistqaError, match=rf"task.name=fork:Task in {config} is not the task.name=nq the model"):
        with_trained_settings(fork_config(), tmp_path, {"name": str(config)})
    # The trained value in the file: taken without a word.
    capsys.readouterr()
    with_trained_settings(load_config(None, ["task.doc_stride=64"]), tmp_path, {"doc_stride": str(config)})
    assert warnings(capsys.readouterr().err) == []


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{", "cannot be read"),
        ('{"format": 1, "task": {"max_seq_len": Infinity}}', "Infinity is not JSON"),
        ('{"format": 1, "task": {"max_seq_len": 3}}', "task.max_seq_len=3 must be >= 8"),
        ('{"format": 1, "task": {"max_seq_len": "long"}}', "task.max_seq_len"),
        ('{"format": 1, "task": {"name": "textcls"}}', "give task.name=textcls"),
        ('{"format": 9, "task": {}}', "format 9"),
        ('{"format": 1, "task": {"name": 5}}', "its task name 5 is not a name"),  # (tracebacks: a review)
        ('{"format": 1, "task": {"name": ["nq"]}}', "its task name ['nq'] is not a name"),
        ("[" * 100_000 + "]" * 100_000, "cannot be read (maximum recursion depth"),
    ],
    ids=range(9),
)
def test_a_damaged_or_foreign_settings_file_is_one_line(tmp_path, content, expected):
    (tmp_path / SETTINGS_FILE).write_text(content)
    with pytest.raises(DistqaError) as caught:
        with_trained_settings(load_config(None, []), tmp_path)
    message = str(caught.value)
    assert expected in message and str(tmp_path / SETTINGS_FILE) in message and "\n" not in message, message


def test_a_setting_the_file_lacks_is_said_with_the_value_used(tmp_path, capsys):
    """An export of a distqa with fewer settings (or a file edited, which its export's record
    refuses): the default was used without a word (a review)."""
    (tmp_path / SETTINGS_FILE).write_text('{"format": 1, "task": {"name": "nq", "max_seq_len": 128, "doc_stride": 64}}')
    capsys.readouterr()
    cfg = with_trained_settings(load_config(None, ["task.max_query_len=32"]), tmp_path, {"max_query_len"})
    assert cfg.task.max_seq_len == 128
    said = warnings(capsys.readouterr().err)
    assert len(said) == 1 and said[0].startswith(
        f"distqa: warning: {tmp_path / SETTINGS_FILE} does not hold task.keep_unknown"
    ), said
    assert "task.max_query_len" not in said[0] and f"task.keep_unknown={cfg.task.keep_unknown}" in said[0]


@pytest.mark.safety
def test_predict_without_the_trained_settings_writes_the_same_submission(tmp_path, minilm_dir, capsys):
    """MiniLM trained at task.max_seq_len=128 task.doc_stride=64 (the defaults are 512 and 128);
    its model/ folder copied elsewhere predicts the same without those keys as with them."""
    from distqa.trainer import train

    out, cache = tmp_path / "run", tmp_path / "cache"
    common = [f"task.cache_dir={cache}"]
    source = tmp_path / "two.jsonl"  # two documents of the sample keep the four forward passes short
    source.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:2]))
    train(
        load_config(
            None,
            [f"model.name={minilm_dir}", f"data.train={source}", *TRAINED, *common, "data.num_workers=0"]
            + ["train.batch_size=2", "train.max_steps=3", "train.lr=1e-4", f"output_dir={out}"],
        )
    )
    assert strict_json((out / "model" / SETTINGS_FILE).read_text())["task"]["max_seq_len"] == 128
    elsewhere = tmp_path / "copied" / "model"
    shutil.copytree(out / "model", elsewhere)

    def predict(checkpoint, name, *overrides):
        capsys.readouterr()
        argv = ["predict", "--input", str(source), "--checkpoint", str(checkpoint), "--output", str(tmp_path / name)]
        assert main([*argv, *common, *overrides]) == 0
        return (tmp_path / name).read_bytes(), capsys.readouterr()

    given, given_out = predict(out, "given.csv", *TRAINED)
    plain, plain_out = predict(elsewhere, "plain.csv")
    assert plain == given
    assert warnings(given_out.err) == [] and warnings(plain_out.err) == []
    assert "task.max_seq_len=128, task.doc_stride=64\n" in plain_out.out, plain_out.out

    _, other = predict(elsewhere, "other.csv", "task.max_seq_len=64")
    (line,) = [line for line in warnings(other.err) if "task.max_seq_len" in line]
    assert "task.max_seq_len=64 was given" in line and "task.max_seq_len=128" in line, other.err
    assert len(warnings(other.err)) == 1, other.err
