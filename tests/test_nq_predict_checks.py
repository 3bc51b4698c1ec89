"""`distqa predict` refuses what would give a meaningless submission, and says which thresholds it
applies: a model exported without a tokenizer (the quick start's), or a tokenizer of another size."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
import types

import pytest

from conftest import ROOT, SMALL, TESTS, subprocess_env
from distqa.cli import main
from distqa.models import load_tokenizer
from distqa.nq.data import resolve_features
from distqa.registry import load_config
from distqa.trainer import train

SAMPLE = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The model `make train` makes: tiny, trained on the DummyDataset, exported without a tokenizer."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    train(load_config(None, [*SMALL, "train.max_steps=2", "train.batch_size=2", f"output_dir={out}"]))
    return out


def predict(tmp_path, checkpoint, *overrides: str, source=SAMPLE) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "distqa", "predict", "--input", str(source), "--checkpoint", str(checkpoint)]
    cmd += ["--output", str(tmp_path / "sub.csv"), "task.max_seq_len=128", f"task.cache_dir={tmp_path / 'cache'}"]
    return subprocess.run(
        [*cmd, *overrides], env=subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def predict_here(tmp_path, capsys, checkpoint, *overrides: str, source=SAMPLE) -> tuple[int, str, str]:
    """`distqa predict` through the command line's entry point, in this process: the exit status,
    stdout and stderr. (The subprocess `predict` is for what only a real process shows: its output
    streams as another program reads them.)"""
    argv = ["predict", "--input", str(source), "--checkpoint", str(checkpoint), "--output", str(tmp_path / "sub.csv")]
    capsys.readouterr()
    status = main([*argv, "task.max_seq_len=128", f"task.cache_dir={tmp_path / 'cache'}", *overrides])
    out, err = capsys.readouterr()
    return status, out, err


def test_a_model_without_tokenizer_files_is_refused_and_no_file_written(tmp_path, tiny_run, capsys):
    """nq-predict-no-tokenizer"""
    status, _, err = predict_here(tmp_path, capsys, tiny_run)
    assert status != 0
    last = err.strip().splitlines()[-1]
    assert "has no tokenizer files" in last and "model.tokenizer" in last, last
    assert not (tmp_path / "sub.csv").exists()


def test_a_config_file_s_window_length_other_than_training_s_is_refused(tmp_path, tiny_run, capsys):
    """The training run's YAML given to predict without that run's `task.max_seq_len=64` override
    would build 128-token windows: refused before the model loads, naming the file and both values."""
    config = tmp_path / "train.yaml"
    config.write_text("task:\n  max_seq_len: 128\n")
    argv = ["predict", "--config", str(config), "--input", str(SAMPLE), "--checkpoint", str(tiny_run)]
    argv += ["--output", str(tmp_path / "sub.csv"), f"task.cache_dir={tmp_path / 'cache'}"]
    capsys.readouterr()
    assert main(argv) != 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"task.max_seq_len=128 in {config} is not the task.max_seq_len=64 the model" in last, last
    assert not (tmp_path / "sub.csv").exists() and not (tmp_path / "cache").exists()
    # The same value on the command line is a deliberate choice: used with a warning, and the run
    # goes on to the next check (this export has no tokenizer).
    assert main([*argv, "task.max_seq_len=128"]) != 0
    err = capsys.readouterr().err
    assert "task.max_seq_len=128 was given but" in err and "has no tokenizer files" in err.strip().splitlines()[-1]


def test_a_tokenizer_of_another_size_is_refused(tmp_path, tiny_run, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    small = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1, "[CLS]": 2, "[SEP]": 3, "the": 4}, unk_token="[UNK]"))
    small.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "small-tokenizer"
    PreTrainedTokenizerFast(
        tokenizer_object=small, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
    ).save_pretrained(str(folder))
    status, _, err = predict_here(tmp_path, capsys, tiny_run, f"model.tokenizer={folder}")
    assert status != 0
    last = err.strip().splitlines()[-1]
    assert "has 5 entries but the model's vocabulary has 30522" in last, last
    assert not (tmp_path / "sub.csv").exists()


@pytest.mark.launch  # about 13 s: make test-launch, for make test's 5 minutes
def test_the_right_tokenizer_predicts_and_says_no_thresholds_were_saved(tmp_path, tiny_run, minilm_dir):
    # The features validation during training prepares from this file (training's keep_unknown and
    # seed, which evaluation features do not depend on): predict must reuse them, not prepare again.
    cache = tmp_path / "cache"
    valid = [f"model.tokenizer={minilm_dir}", "task.max_seq_len=128", f"task.cache_dir={cache}"]
    cfg = load_config(None, [*valid, "task.keep_unknown=0.3", "seed=7"])
    folder = resolve_features(cfg, str(SAMPLE), load_tokenizer(cfg.model), training=False)
    assert [p.name for p in cache.iterdir()] == [folder.name]

    proc = predict(tmp_path, tiny_run, f"model.tokenizer={minilm_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no distqa_thresholds.json" in proc.stdout and "best long and short answer" in proc.stdout
    # `make train`'s model was trained at task.max_seq_len=64 (SMALL); 128 is given: used, said once.
    said = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert said == [
        f"distqa: warning: task.max_seq_len=128 was given but the model in {tiny_run / 'model'} was trained "
        "with task.max_seq_len=64: using 128 (leave task.max_seq_len out to use the trained value)"
    ], proc.stderr[-2000:]
    assert (tmp_path / "sub.csv").read_text().startswith("example_id,PredictionString")
    assert [p.name for p in cache.iterdir()] == [folder.name] and "prepared" not in proc.stdout
    # Not a terminal: no progress bars of transformers or datasets (a redraw is a carriage return).
    assert "\r" not in proc.stderr and "Loading weights" not in proc.stderr, proc.stderr[-2000:]


def test_a_test_file_without_annotations_predicts(tmp_path, tiny_run, minilm_dir, capsys):
    """The Kaggle test file, the one a submission is for, has no annotations and string ids."""
    test_line = json.dumps(json.loads((TESTS / "fixtures" / "nq" / "ds-test-head1.json").read_text()))
    source = tmp_path / "simplified-nq-test.jsonl"
    source.write_text(test_line + "\n")
    status, _, err = predict_here(tmp_path, capsys, tiny_run, f"model.tokenizer={minilm_dir}", source=source)
    assert status == 0, err[-2000:]
    example_id = json.loads(test_line)["example_id"]
    rows = (tmp_path / "sub.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in rows] == ["example_id", f"{example_id}_long", f"{example_id}_short"]


def copied_model(tmp_path, tiny_run):
    folder = tmp_path / "model"
    shutil.copytree(tiny_run / "model", folder)
    return folder


def test_a_model_without_the_trained_heads_is_refused(tmp_path, minilm_dir, capsys):
    """A pretrained encoder (no span head, no answer-type head) would answer with random heads."""
    status, _, err = predict_here(tmp_path, capsys, minilm_dir, "task.doc_stride=64")
    last = err.strip().splitlines()[-1]
    assert status != 0 and last.startswith(f"distqa: error: {minilm_dir} is not a model trained for Natural"), last
    assert "its checkpoint lacks qa_outputs.bias, qa_outputs.weight, answer_type_head.weight" in last
    assert not (tmp_path / "sub.csv").exists()


@pytest.mark.parametrize(
    "trained, given, said",
    [
        (
            "textcls",
            (),
            "the model in {model} was trained with task.name=textcls, but distqa predict serves "
            "Natural Questions (task.name=nq) alone: task textcls brings no predict command",
        ),
        (
            "toy_task:PredictTask",
            (),
            "the model in {model} was trained with task.name=toy_task:PredictTask, but "
            "distqa predict serves Natural Questions (task.name=nq) alone: use its own command: distqa toy-predict "
            "task.name=toy_task:PredictTask",
        ),
        ("nq", ("task.name=textcls",), "task.name=textcls, but distqa predict serves Natural Questions"),
    ],
)
def test_a_model_of_another_task_is_refused_up_front(tmp_path, tiny_run, capsys, trained, given, said):
    model = copied_model(tmp_path, tiny_run)
    record = json.loads((model / "distqa_task.json").read_text())
    record["task"]["name"] = trained
    (model / "distqa_task.json").write_text(json.dumps(record))
    capsys.readouterr()
    status = main(
        ["predict", "--input", str(SAMPLE), "--checkpoint", str(model), "--output", str(tmp_path / "sub.csv"), *given]
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert status != 0 and len(lines) == 1 and lines[0].startswith(f"distqa: error: {said.format(model=model)}"), lines
    assert "give task.name" not in lines[0] and not (tmp_path / "sub.csv").exists()


def test_a_damaged_model_file_is_one_line_naming_it(tmp_path, tiny_run, minilm_dir, capsys):
    model = copied_model(tmp_path, tiny_run)
    weights = model / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:1000])  # its size and hash in distqa_source.json no longer match
    status, _, err = predict_here(tmp_path, capsys, model, f"model.tokenizer={minilm_dir}")
    assert status != 0 and err.strip().splitlines() == [
        f"distqa: error: the model in {model} is damaged (model.safetensors has 1000 bytes, distqa_source.json "
        f"says {len(whole)}): export it again (distqa export)"
    ], err
    # An export of an older distqa records no hashes: the load itself says it, naming the file.
    source = json.loads((model / "distqa_source.json").read_text())
    del source["files"]
    (model / "distqa_source.json").write_text(json.dumps(source))
    weights.write_bytes(whole[:20] + bytes([whole[20] ^ 0x55]) + whole[21:])  # a byte of the header
    status, _, err = predict_here(tmp_path, capsys, model, f"model.tokenizer={minilm_dir}")
    last = err.strip().splitlines()[-1]
    assert status != 0 and last.startswith(f"distqa: error: {weights} is damaged (Error while deserializing"), err
    assert last.endswith("export the model again (distqa export)") and "Traceback" not in err
    assert not (tmp_path / "sub.csv").exists()


def test_an_output_that_cannot_be_written_is_one_line_before_or_after_the_work(
    tmp_path, tiny_run, minilm_dir, capsys, monkeypatch
):
    from distqa.nq import submission

    # Where no file can be made (root passes os.access everywhere): refused before the model loads.
    argv = ["predict", "--input", str(SAMPLE), "--checkpoint", str(tiny_run), "--output", "/proc/distqa/sub.csv"]
    assert main([*argv, "task.max_seq_len=128", f"task.cache_dir={tmp_path / 'cache'}"]) != 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("distqa: error: --output /proc/distqa/sub.csv cannot be written"), last

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    # The disk fills up while the submission is written, after all the work.
    monkeypatch.setattr(submission, "csv", types.SimpleNamespace(writer=full_disk))
    status, _, err = predict_here(tmp_path, capsys, tiny_run, f"model.tokenizer={minilm_dir}")
    assert status != 0 and err.strip().splitlines()[-1] == (
        f"distqa: error: cannot write the submission {tmp_path / 'sub.csv'} (No space left on device): free space "
        f"in {tmp_path}, or choose another --output"
    ), err[-2000:]
    assert list(tmp_path.glob("sub.csv*")) == []


def test_a_missing_input_is_one_line_before_the_model_loads(tmp_path, tiny_run, capsys):
    missing = tmp_path / "no-such.jsonl"
    status, out, err = predict_here(tmp_path, capsys, tiny_run, source=missing)
    assert status != 0 and err.strip().splitlines() == [
        f"distqa: error: --input {missing} does not exist or is not a file"
    ]
    assert "thresholds" not in out and not (tmp_path / "sub.csv").exists()  # nothing loaded, nothing said of it


def test_a_training_checkpoint_is_named_with_the_export_that_makes_a_model_of_it(tmp_path, tiny_run, capsys):
    checkpoint = tiny_run / "checkpoints" / "step-2"
    status, _, err = predict_here(tmp_path, capsys, checkpoint)
    assert status != 0 and err.strip().splitlines() == [
        f"distqa: error: --checkpoint {checkpoint} is a training checkpoint, not an exported model: export it "
        f"first (distqa export --checkpoint {checkpoint}) and give the folder it writes"
    ]
