"""The built-in text classification task (task.name=textcls): reading, errors, metrics, training."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_train, subprocess_env
from distqa.errors import ConfigError, DistqaError
from distqa.export import export_checkpoint
from distqa.registry import load_config, load_task
from distqa.textcls.data import Example, read_examples
from distqa.textcls.metric import accuracy_and_macro_f1

LABELS = "negative,positive"
GOOD = ["excellent", "wonderful", "superb", "delightful"]
BAD = ["terrible", "awful", "dreadful", "horrible"]
FILLER = "the film about a city at night had long scenes and a quiet ending with music".split()


def write_csv(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def settings(**keys: str):
    """The task's settings as load_config builds them."""
    items = ["task.name=textcls", f"task.labels={LABELS}", *(f"task.{k}={v}" for k, v in keys.items())]
    return load_config(None, items).task


def keyword_rows(n: int, seed: int) -> list[tuple[str, int]]:
    """Sentences of filler words; one keyword decides the label (1: a GOOD word, 0: a BAD one)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.randrange(2)
        words = rng.sample(FILLER, 6)
        words.insert(rng.randrange(7), rng.choice(GOOD if label else BAD))
        rows.append((" ".join(words), label))
    return rows


# --- reading ---------------------------------------------------------------------------------------


def test_reads_csv_with_names_and_indices_and_quoted_fields(tmp_path):
    path = write_csv(tmp_path / "a.csv", ["id,text,label", '1,"good, really",positive', "2,bad,0", '3,"two\nlines",1'])
    assert read_examples(path, "data.train", settings()) == [
        Example("good, really", None, 1),
        Example("bad", None, 0),
        Example("two\nlines", None, 1),
    ]


def test_reads_jsonl_pairs_with_own_column_names(tmp_path):
    path = tmp_path / "a.jsonl"
    rows = [{"q": "is it?", "a": "yes", "y": 1}, {"q": "is it not?", "a": "no", "y": "negative"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")  # a trailing blank line is fine
    own = settings(text_column="q", text_pair_column="a", label_column="y")
    assert read_examples(path, "data.valid", own) == [Example("is it?", "yes", 1), Example("is it not?", "no", 0)]


def test_a_spreadsheet_csv_with_a_byte_order_mark_keeps_its_first_column(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes("text,label\r\ncafé,positive\r\n".encode("utf-8-sig"))
    assert read_examples(path, "data.train", settings()) == [Example("café", None, 1)]


def test_class_names_win_over_indices(tmp_path):
    path = write_csv(tmp_path / "a.csv", ["text,label", "x,1", "y,0"])
    own = load_config(None, ["task.name=textcls", "task.labels=1,0"]).task
    assert [e.label for e in read_examples(path, "data.train", own)] == [0, 1]


@pytest.mark.parametrize(
    ("name", "content", "keys", "message"),
    [
        (
            "a.csv",
            "sentence,label\nhi,0\n",
            {},
            r"data.train='.*a.csv' row ending on line 2: no column 'text' \(task.text_column\); "
            r"its columns: sentence, label",
        ),
        (
            "a.jsonl",
            '{"text": "hi", "label": 0}\n{"text": "hi", "answer": "x", "label": 0}\n',
            {"text_pair_column": "pair"},
            r"'.*a.jsonl' line 1: no column 'pair' \(task.text_pair_column\); its columns: text, label",
        ),
        (
            "a.csv",
            "text,label\nhi,positive\nho,neutral\n",
            {},
            r"a.csv' row ending on line 3: label 'neutral' is neither",
        ),
        ("a.jsonl", '{"text": "hi", "label": 2}\n', {}, r"line 1: label 2 is neither one of task.labels \(negative, "),
        ("a.jsonl", '{"text": "hi", "label": true}\n', {}, r"label True is neither"),
        ("a.csv", "text,label\nhi\n", {}, r"row ending on line 2: no value in column 'label'"),
        ("a.jsonl", '{"text": 3, "label": 0}\n', {}, r"line 1: the text columns must hold strings"),
        ("a.jsonl", '{"text": "hi", "label": 0}\n{"text"\n', {}, r"line 2 is not JSON"),
        ("a.jsonl", '["hi", 0]\n', {}, r"line 1 is not a JSON object"),
        ("a.csv", "", {}, r"a.csv' has no rows"),
        ("a.csv", "text,label\n", {}, r"a.csv' has no rows"),
        ("a.jsonl", "\n", {}, r"a.jsonl' has no rows"),
        ("a.txt", "hi\n", {}, r"textcls reads .csv or .jsonl \(JSON lines\) files, not '.txt'"),
        # Damaged rows that once became wrong examples with exit 0: an unquoted comma cut the text
        # and dropped a field; an unclosed quote made the rows after it one text; a repeated column
        # kept its last value.
        ("a.csv", "text,label\nso bad, 0,1\n", {}, r"row ending on line 2: 3 fields, the header has 2: put a text"),
        (
            "a.csv",
            'text,label\n"awful,negative\nbad one,negative\n',
            {},
            r"row starting on line 2: not valid CSV",
        ),
        ("a.csv", "text,label,text\nhi,0,ho\n", {}, r"a.csv': the header names column\(s\) 'text' twice"),
        ("a.csv", "text,label\n ,0\n", {}, r"row ending on line 2: a text column is empty"),
        # Class names that are numbers: 0 was read as index 0, the class "1", as was the name "1".
        ("a.csv", "text,label\nhi,1\nho,0\n", {"labels": "1,2,3"}, r"line 3: label '0' is not one of task.labels"),
        # Decimal class names (scores): a JSON writer's 1.0 written as 1 was index 1, the class 0.5.
        ("a.jsonl", '{"text": "hi", "label": 1}\n', {"labels": "0.0,0.5,1.0"}, r"label 1 is not one of task.labels"),
        # An index is plain ASCII digits: int() also read these (1_0 as 10, full-width 1 as 1).
        *[
            ("a.csv", f"text,label\nhi,{x}\n", {}, rf"label {re.escape(repr(x))} is neither")
            for x in ("+1", "-0", "1_0", "\uff11")
        ],
    ],
)
def test_each_bad_file_is_one_clear_line(tmp_path, name, content, keys, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DistqaError, match=message) as err:
        read_examples(path, "data.train", settings(**keys))
    assert "\n" not in str(err.value)


def test_labels_as_names_or_plain_indices(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "a", "label": "1.0"}\n{"text": "b", "label": 0.5}\n{"text": "c", "label": "0.0"}\n')
    assert [e.label for e in read_examples(path, "data.train", settings(labels="0.0,0.5,1.0"))] == [2, 1, 0]
    path.write_text('{"text": "a", "label": 1}\n{"text": "b", "label": "0"}\n{"text": "c", "label": " positive "}\n')
    assert [e.label for e in read_examples(path, "data.train", settings())] == [1, 0, 1]


def test_bad_settings_are_one_line():
    for labels, message in [("spam", "at least 2 classes"), ("a,b,a", "names a class twice"), ("a,,b", "empty class")]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, ["task.name=textcls", f"task.labels={labels}"])
    with pytest.raises(ConfigError, match="task.max_seq_len=2 must be >= 4"):
        load_config(None, ["task.name=textcls", "task.max_seq_len=2"])


def task_errors(tmp_path: Path, minilm_dir: Path, *items: str) -> str:
    from distqa.textcls.task import TextClsTask

    train = write_csv(tmp_path / "t.csv", ["text,label", "hi,0"])
    base = ["task.name=textcls", f"data.train={train}", f"model.name={minilm_dir}", f"task.labels={LABELS}"]
    with pytest.raises(DistqaError) as err:
        TextClsTask(load_config(None, [*base, *items]))
    assert "\n" not in str(err.value)
    return str(err.value)


def test_task_refuses_dummy_data_missing_labels_and_a_random_model_without_tokenizer(tmp_path, minilm_dir):
    from distqa.textcls.task import TextClsTask

    base = ["task.name=textcls", f"model.name={minilm_dir}", f"task.labels={LABELS}", "data.train=dummy"]
    with pytest.raises(DistqaError, match="^data.train=dummy: textcls has no synthetic data; give a .csv"):
        TextClsTask(load_config(None, base)).build_train_dataset()  # (at start: export builds it with dummy)
    assert "data.valid=dummy" in task_errors(tmp_path, minilm_dir, "data.valid=dummy")
    assert "needs task.labels" in task_errors(tmp_path, minilm_dir, "task.labels=null")
    assert "model.name='tiny' has no tokenizer: set model.tokenizer" in task_errors(
        tmp_path, minilm_dir, "model.name=tiny"
    )
    assert "cannot load tokenizer" in task_errors(tmp_path, minilm_dir, f"model.tokenizer={tmp_path}")


def test_cli_prints_one_line(tmp_path):
    cmd = [sys.executable, "-m", "distqa", "train", "task.name=textcls", f"task.labels={LABELS}"]
    proc = subprocess.run(
        [*cmd, f"output_dir={tmp_path / 'out'}"], env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert (
        proc.stderr.strip()
        == "distqa: error: data.train=dummy: task.name=textcls has no synthetic data; give a file of its training data"
    )


# --- metrics and batching --------------------------------------------------------------------------


def test_accuracy_and_macro_f1():
    # class 0: P=2/3 R=1 F1=0.8; class 1: P=1 R=1/2 F1=2/3; class 2 neither predicted nor present: left out
    metrics = accuracy_and_macro_f1([0, 0, 0, 1], [0, 0, 1, 1], num_labels=3)
    assert metrics["eval_accuracy"] == pytest.approx(0.75)
    assert metrics["eval_macro_f1"] == pytest.approx((0.8 + 2 / 3) / 2)
    from distqa.textcls.settings import TextClsSettings

    assert tuple(metrics) == tuple(TextClsSettings.metric_names)  # what train.best_metric is checked against
    # a class only predicted (never present) counts, with F1 0
    assert accuracy_and_macro_f1([2, 0], [0, 0], num_labels=3)["eval_macro_f1"] == pytest.approx((2 / 3 + 0) / 2)


def test_collate_pads_to_the_longest_in_the_batch_and_cuts_at_max_seq_len(tmp_path, minilm_dir):
    from distqa.textcls.task import TextClsTask

    train = write_csv(tmp_path / "t.csv", ["text,label", "hi,0"])
    base = ["task.name=textcls", f"data.train={train}", "model.name=tiny", f"model.tokenizer={minilm_dir}"]
    task = TextClsTask(load_config(None, [*base, f"task.labels={LABELS}", "task.max_seq_len=16"]))
    batch = task.collate([Example("a b c", None, 1), Example("a", None, 0)])
    assert batch["input_ids"].shape == (2, 5)  # [CLS] a b c [SEP]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    assert batch["labels"].tolist() == [1, 0]
    pair = task.collate([Example("a " * 40, "b", 1)])
    assert pair["input_ids"].shape == (1, 16) and pair["token_type_ids"][0, -2:].tolist() == [1, 1]


# --- training ---------------------------------------------------------------------------------------


def write_keyword_csv(path: Path, n: int, seed: int) -> Path:
    names = LABELS.split(",")
    return write_csv(path, ["text,label", *(f"{text},{names[label]}" for text, label in keyword_rows(n, seed))])


def exported_predictions(
    folder: Path, trained_with: Path, texts: list[str], pairs: list[str] | None = None
) -> torch.Tensor:
    """Class predictions of the export, loaded as anyone would (no distqa), with no missing keys and
    the tokenizer it was trained with (`trained_with`)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, info = AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.id2label == {0: "negative", 1: "positive"}
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # Without tokenizer files transformers builds an empty-vocabulary tokenizer, silently: compare ids.
    original = AutoTokenizer.from_pretrained(trained_with)
    assert tokenizer(texts, pairs)["input_ids"] == original(texts, pairs)["input_ids"]
    with torch.no_grad():
        logits = model.eval()(**tokenizer(texts, pairs, padding=True, return_tensors="pt")).logits
    assert torch.isfinite(logits).all()
    return logits.argmax(-1)


def test_trains_evaluates_and_exports_in_process(tmp_path, minilm_dir):
    """The whole seam on a tiny random BERT, one process: both metrics logged, the export loads."""
    from distqa.trainer import train

    out = tmp_path / "run"
    args = ["task.name=textcls", f"task.labels={LABELS}", "model.name=tiny", f"model.tokenizer={minilm_dir}"]
    args += [f"data.train={write_keyword_csv(tmp_path / 't.csv', 32, 0)}"]
    args += [f"data.valid={write_keyword_csv(tmp_path / 'v.csv', 10, 1)}", "data.num_workers=0"]
    train(load_config(None, [*args, "train.batch_size=8", "train.max_steps=2", f"output_dir={out}"]))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if "eval_accuracy" in r][-1]
    assert 0.0 <= final["eval_accuracy"] <= 1.0 and 0.0 <= final["eval_macro_f1"] <= 1.0
    rows = keyword_rows(10, 1)
    predicted = exported_predictions(out / "model", minilm_dir, [text for text, _ in rows])
    accuracy = (predicted == torch.tensor([label for _, label in rows])).float().mean().item()
    # The export's tokenizer cuts where evaluation cut (a pipeline of it cut at MiniLM's 512).
    from transformers import AutoTokenizer

    max_seq_len = load_config(None, args).task.max_seq_len
    assert AutoTokenizer.from_pretrained(out / "model").model_max_length == max_seq_len < 512
    assert accuracy == pytest.approx(final["eval_accuracy"])
    # `distqa export` of its checkpoint (it builds the task with data.train=dummy, which textcls
    # refused at start: no textcls checkpoint could be exported).
    exported = export_checkpoint(str(out / "checkpoints" / "step-2"), str(tmp_path / "exported"))
    assert torch.equal(exported_predictions(exported, minilm_dir, [text for text, _ in rows]), predicted)

    # Trained further from its export: its head answers for LABELS' classes in LABELS' order. In
    # another order each class took another's weights (accuracy 0.32 where they scored 1.0), exit 0.
    def head_from_export(labels: str) -> object:
        cfg = load_config(None, ["task.name=textcls", f"task.labels={labels}", f"model.name={exported}"])
        return load_task(cfg).build_model()

    names = LABELS.split(",")
    assert head_from_export(LABELS).config.id2label == dict(enumerate(names))
    with pytest.raises(DistqaError, match=r"was trained for the classes .* in that order, and task.labels gives"):
        head_from_export(",".join(reversed(names)))
    with pytest.raises(DistqaError, match=rf"has a classification head for {len(names)} classes .* and task.labels"):
        head_from_export(",".join([*names, "extra"]))
    with pytest.raises(DistqaError, match=r"in that order, and task.labels gives"):  # case and spaces aside
        head_from_export(",".join(name.upper() for name in reversed(names)))


def test_a_trained_head_s_order_is_checked_only_where_there_is_one(tmp_path, capsys):
    """An encoder config that names classes but holds no trained head (no ...ForSequenceClassification
    in its architectures) gets a new head: nothing to check. A trained head whose classes are
    LABEL_0, ... cannot be checked: said in one line."""
    from types import SimpleNamespace

    from distqa.textcls.task import check_head_classes

    encoder = SimpleNamespace(architectures=["BertModel"], id2label={0: "O", 1: "B-PER", 2: "I-PER"})
    check_head_classes(encoder, ["neg", "pos"], "enc")
    head = SimpleNamespace(architectures=["BertForSequenceClassification"], id2label={"0": "LABEL_0", "1": "LABEL_1"})
    capsys.readouterr()
    check_head_classes(head, ["pos", "neg"], "cls")
    assert (
        "has a trained head for the classes LABEL_0, LABEL_1: its weights are kept for pos, neg"
        in capsys.readouterr().out
    )
    with pytest.raises(DistqaError, match=r"has a classification head for 2 classes \(LABEL_0, LABEL_1\) and task"):
        check_head_classes(head, ["a", "b", "c"], "cls")  # a traceback before, with default names too


# 96 rows, 3 epochs of 3 steps at 2e-4: the in-process run measured 1.0 validation accuracy (96 rows at
# 2 epochs: 0.83; 64 rows at 3: 0.88), in half the time of 200 rows at 1e-4.
TRAIN_ROWS = 96
TRAIN_ARGS = [
    "task.name=textcls",
    f"task.labels={LABELS}",
    "data.num_workers=0",
    "train.batch_size=16",
    "train.epochs=3",
    "train.lr=2e-4",
    "train.warmup_ratio=0.1",
    "train.log_every=2",
]


@pytest.mark.slow
@pytest.mark.launch  # not in `make test` (its budget): make test-launch
def test_minilm_learns_a_keyword_from_csv_under_torchrun(tmp_path, minilm_dir):
    out = tmp_path / "csv"
    train = write_keyword_csv(tmp_path / "train.csv", TRAIN_ROWS, 0)
    valid = write_keyword_csv(tmp_path / "valid.csv", 60, 1)
    proc = run_train(
        [*TRAIN_ARGS, f"model.name={minilm_dir}", f"data.train={train}", f"data.valid={valid}", f"output_dir={out}"],
        nproc=2,
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # The output of a launch into a log (not a terminal): a plain line per logged record instead of a
    # progress bar, and transformers' report of the new classifier head once (rank 0), uncoloured.
    printed = proc.stdout + proc.stderr
    steps = [line.split("/")[0] for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert steps == [f"step {r['step']}" for r in records] and len(records) >= 5
    assert proc.stderr.count("LOAD REPORT") == 1 and "classifier.weight" in proc.stderr
    assert "\r" not in printed and "\x1b" not in printed
    final = [r for r in records if "eval_accuracy" in r][-1]
    assert final["eval_accuracy"] >= 0.85 and final["eval_macro_f1"] >= 0.85, final  # chance is 0.5
    rows = keyword_rows(60, 1)
    predicted = exported_predictions(out / "model", minilm_dir, [text for text, _ in rows])
    accuracy = (predicted == torch.tensor([label for _, label in rows])).float().mean().item()
    # Padding differs from the evaluation's batches: allow one example to fall the other way.
    assert abs(accuracy - final["eval_accuracy"]) <= 1 / 60 + 1e-9


def write_pair_jsonl(path: Path, n: int, seed: int) -> tuple[Path, list[tuple[str, str, int]]]:
    """The label lives in the second text only (the first is filler): the pair column must be read."""
    rng = random.Random(seed + 100)
    rows = [(" ".join(rng.sample(FILLER, 5)), text, label) for text, label in keyword_rows(n, seed)]
    path.write_text("".join(json.dumps({"premise": a, "review": b, "y": y}) + "\n" for a, b, y in rows))
    return path, rows


# (13 s) in make test-launch, beyond make test's 5 minutes at 1179 tests
@pytest.mark.launch
def test_minilm_learns_from_the_pair_column_of_jsonl(tmp_path, minilm_dir):
    """In this process: the torchrun path is the CSV test's; this one is about the pair column."""
    from distqa.trainer import train as run_in_process

    out = tmp_path / "pairs"
    train, _ = write_pair_jsonl(tmp_path / "train.jsonl", TRAIN_ROWS, 0)
    valid, rows = write_pair_jsonl(tmp_path / "valid.jsonl", 60, 1)
    columns = ["task.text_column=premise", "task.text_pair_column=review", "task.label_column=y"]
    # The global batch of the 2-process CSV run (train.batch_size is per rank: 2 x 16).
    args = [*TRAIN_ARGS, *columns, f"model.name={minilm_dir}", f"data.train={train}", f"data.valid={valid}"]
    run_in_process(load_config(None, [*args, "train.batch_size=32", f"output_dir={out}"]))
    final = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_accuracy" in r][-1]
    assert final["eval_accuracy"] >= 0.85 and final["eval_macro_f1"] >= 0.85, final
    predicted = exported_predictions(out / "model", minilm_dir, [a for a, _, _ in rows], [b for _, b, _ in rows])
    accuracy = (predicted == torch.tensor([y for _, _, y in rows])).float().mean().item()
    assert abs(accuracy - final["eval_accuracy"]) <= 1 / 60 + 1e-9


def test_a_long_text_a_byte_order_mark_in_json_lines_and_numeric_class_names_by_name(tmp_path):
    """A text over the csv module's 128 KB field limit was a traceback; a JSONL file with a
    byte-order mark was refused while a CSV with one was read."""
    long = "word " * 40_000
    path = write_csv(tmp_path / "a.csv", ["text,label", f"{long},positive", "short,negative"])
    assert [(len(e.text), e.label) for e in read_examples(path, "data.train", settings())] == [(len(long), 1), (5, 0)]
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"text": "hi", "label": "positive"}\n')
    assert read_examples(path, "data.train", settings())[0].label == 1
    path = write_csv(tmp_path / "stars.csv", ["text,label", "bad,1", "good,3"])
    assert [e.label for e in read_examples(path, "data.train", settings(labels="1,2,3"))] == [0, 2]
