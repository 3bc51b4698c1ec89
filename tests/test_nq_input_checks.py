"""What `distqa predict`, validation and `distqa score` refuse in their input, in one line and before
the expensive work: a repeated or unusable example id, an --output that cannot be written or is the
input, features cached from an earlier version of the file; and what they say about lines skipped
with task.skip_bad_lines, on every run that uses those features, not only the one that prepared them."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest

from conftest import SMALL, TESTS
from distqa.cli import main
from distqa.errors import DistqaError
from distqa.models import load_tokenizer
from distqa.nq.data import resolve_features
from distqa.nq.feature_folder import PrepareResult
from distqa.nq.features import FeatureSettings
from distqa.nq.metric import read_gold, read_submission, score
from distqa.nq.prepare import prepare_features
from distqa.nq.reader import BadLine, NQReader, parse_example
from distqa.registry import load_config

SAMPLE = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"
LINES = SAMPLE.read_text().splitlines()
EVAL = FeatureSettings(max_seq_len=64, doc_stride=32, max_query_len=16, training=False)


def write(path, lines: list[str]):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def short(line: str, n_tokens: int = 200) -> str:
    """A real line cut to its first tokens, in the test file's shape (no annotations): a few
    windows each, so that a prediction takes a second, not ten."""
    obj = json.loads(line)
    obj["document_text"] = " ".join(obj["document_text"].split(" ")[:n_tokens])
    obj["long_answer_candidates"] = [c for c in obj["long_answer_candidates"] if c["end_token"] <= n_tokens]
    del obj["annotations"]
    return json.dumps(obj)


SHORT = [short(line) for line in LINES[:3]]


def with_id(line: str, example_id: object) -> str:
    obj = json.loads(line)
    obj["example_id"] = example_id
    return json.dumps(obj)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny model (task.max_seq_len=64) exported as `distqa train` exports one: weights, config and
    task settings. Untrained: these tests are about what happens before and around its forward pass."""
    from distqa.nq.task import NQTask

    folder = tmp_path_factory.mktemp("tiny") / "model"
    task = NQTask(load_config(None, SMALL))
    task.save_model(task.build_model(), folder)
    task.save_settings(folder)
    return folder


def predict_here(tmp_path, capsys, run, minilm_dir, source, *overrides: str, output=None) -> tuple[int, str, str]:
    output = tmp_path / "sub.csv" if output is None else output
    argv = ["predict", "--input", str(source), "--checkpoint", str(run), "--output", str(output)]
    capsys.readouterr()
    status = main([*argv, f"model.tokenizer={minilm_dir}", f"task.cache_dir={tmp_path / 'cache'}", *overrides])
    out, err = capsys.readouterr()
    return status, out, err


# ---------------------------------------------------------------------------------------------
# Example ids: unique, and usable as a submission row id


@pytest.mark.parametrize("value", [None, True, 1.5, [1], {"id": 1}])
def test_an_example_id_that_is_not_a_string_or_an_integer_is_a_bad_line(tmp_path, value):
    """null once became the id "None", which a second null line then shared."""
    with pytest.raises(BadLine, match="example_id is .*, not a string or an integer"):
        parse_example(with_id(LINES[0], value))
    reader = NQReader(write(tmp_path / "in.jsonl", [LINES[0], with_id(LINES[1], value)]), skip_bad_lines=True)
    assert len(list(reader)) == 1 and [n for n, _ in reader.bad_lines] == [2]
    with pytest.raises(DistqaError, match="example_id"):
        read_gold(tmp_path / "in.jsonl")


def test_a_keyed_reader_refuses_a_repeated_id_even_when_skipping_bad_lines(tmp_path):
    path = write(tmp_path / "in.jsonl", [LINES[0], LINES[1], "{broken", LINES[0]])
    assert len(list(NQReader(path, skip_bad_lines=True))) == 3  # training pools windows: no ids needed
    with pytest.raises(DistqaError) as caught:
        list(NQReader(path, skip_bad_lines=True, keyed_by_id=True))
    example_id = json.loads(LINES[0])["example_id"]
    message = str(caught.value)
    assert message.startswith(f"{path}, line 4: example_id {example_id} appears a second time (first on line 1)")
    assert "\n" not in message


@pytest.mark.parametrize("value", ["a,b", "a\nb", "a\rb", ""])
def test_an_id_that_cannot_name_a_submission_row_is_a_bad_line_where_ids_are_keys(tmp_path, value):
    path = write(tmp_path / "in.jsonl", [LINES[0], with_id(LINES[1], value)])
    assert len(list(NQReader(path))) == 2
    with pytest.raises(DistqaError, match=r"line 2: example_id .*task.skip_bad_lines=true"):
        list(NQReader(path, keyed_by_id=True))
    reader = NQReader(path, skip_bad_lines=True, keyed_by_id=True)
    assert len(list(reader)) == 1 and [n for n, _ in reader.bad_lines] == [2]


@pytest.mark.parametrize("num_proc", [1, 2])
def test_validation_features_refuse_a_repeated_id_in_one_shard_or_across_two(tmp_path, minilm_dir, num_proc):
    """Evaluation features (validation, predict) are grouped by id: a repeated id would pool two
    documents' windows. With two processes the repeats lie in different byte ranges."""
    path = write(tmp_path / "valid.jsonl", [SHORT[0], SHORT[1], SHORT[2], SHORT[0]])
    with pytest.raises(DistqaError, match=r"line 4: example_id .* appears a second time \(first on line 1\)"):
        prepare_features(path, tmp_path / "f", tokenizer_name=str(minilm_dir), settings=EVAL, num_proc=num_proc)
    assert not (tmp_path / "f" / "distqa_fingerprint.json").exists()


TRAIN = FeatureSettings(max_seq_len=64, doc_stride=32, max_query_len=16, keep_unknown=1.0)
# SHORT's lines as training lines: annotated, with no answer (their answers lie past the cut).
NO_ANSWER = {"start_token": -1, "end_token": -1, "candidate_index": -1}
# Annotated as NQ's lines without an answer are: one annotation whose spans are all -1.
ANNOTATED = [
    json.dumps({**json.loads(line), "annotations": [{"yes_no_answer": "NONE", "long_answer": NO_ANSWER,
                                                     "short_answers": [], "annotation_id": 1}]})
    for line in SHORT
]  # fmt: skip


@pytest.mark.parametrize("num_proc", [1, 2])
def test_training_features_refuse_a_repeated_id_in_one_shard_or_across_two(tmp_path, minilm_dir, num_proc):
    """Two files concatenated (or one twice): the repeated examples were trained on twice as often,
    'wrote 36 features of 20 documents', exit 0. Most training examples leave no window, so the
    ids each shard read are compared, not the features'."""
    path = write(tmp_path / "train.jsonl", [*ANNOTATED, ANNOTATED[0]])
    with pytest.raises(DistqaError, match=r"line 4: example_id .* appears a second time \(first on line 1\)"):
        prepare_features(path, tmp_path / "f", tokenizer_name=str(minilm_dir), settings=TRAIN, num_proc=num_proc)
    assert not (tmp_path / "f" / "distqa_fingerprint.json").exists()
    once = write(tmp_path / "once.jsonl", ANNOTATED)
    done = prepare_features(once, tmp_path / "g", tokenizer_name=str(minilm_dir), settings=TRAIN, num_proc=num_proc)
    assert done.docs == 3


@pytest.mark.safety  # about 4 s: make test-safety, for make test's 5 minutes
@pytest.mark.parametrize("num_proc", [1, 2])
def test_training_on_lines_without_annotations_is_refused_even_when_skipping_bad_lines(tmp_path, minilm_dir, num_proc):
    """The test set as data.train: every window's target was 'no answer' (answer_type 0 for all),
    and the run exported a model taught to answer nothing, exit 0."""
    path = write(tmp_path / "test.jsonl", SHORT)  # no "annotations", as every line of the test set
    example_id = json.loads(SHORT[0])["example_id"]
    for skip in (False, True):
        with pytest.raises(DistqaError) as caught:
            prepare_features(path, tmp_path / "f", tokenizer_name=str(minilm_dir), settings=TRAIN,
                             num_proc=num_proc, skip_bad_lines=skip)  # fmt: skip
        assert str(caught.value) == (
            f"{path}, line 1: example {example_id} has no annotations, as the lines of the test set "
            "(simplified-nq-test.jsonl) have none: training needs the answers; train on simplified-nq-train.jsonl, "
            "or the train.jsonl that `distqa split` makes"
        )
    # Evaluation features of the same lines are fine: predict reads the test set.
    evaluated = prepare_features(path, tmp_path / "e", tokenizer_name=str(minilm_dir), settings=EVAL)
    assert evaluated.docs == 3
    # Annotations that say "no answer" make an example to train on; one line without them is refused.
    assert prepare_features(write(tmp_path / "a.jsonl", ANNOTATED), tmp_path / "a", tokenizer_name=str(minilm_dir),
                            settings=TRAIN).docs == 3  # fmt: skip
    mixed = write(tmp_path / "mixed.jsonl", [*ANNOTATED[:2], SHORT[2]])
    with pytest.raises(DistqaError, match=r"mixed.jsonl, line 3: example .* has no annotations"):
        prepare_features(mixed, tmp_path / "m", tokenizer_name=str(minilm_dir), settings=TRAIN)


@pytest.mark.parametrize("value", [[], {}, False, 0, ""])
def test_annotations_that_are_empty_or_no_list_are_no_training_answers(tmp_path, minilm_dir, value):
    """A conversion script's `"annotations": []` (or {}, false, 0, "") read as the list of no
    annotation, yet as annotated: every window trained as 'no answer', exit 0 (found by a review)."""
    line = json.dumps({**json.loads(ANNOTATED[0]), "annotations": value})
    path = write(tmp_path / "train.jsonl", [ANNOTATED[1], line])
    said = "has no annotations" if value == [] else rf"annotations is {re.escape(json.dumps(value))}, not a list"
    with pytest.raises(DistqaError, match=rf"train.jsonl, line 2: .*{said}"):
        prepare_features(path, tmp_path / "f", tokenizer_name=str(minilm_dir), settings=TRAIN)


def test_distqa_train_on_the_test_set_is_one_line(tmp_path, capsys, minilm_dir):
    path = write(tmp_path / "test.jsonl", SHORT)  # no "annotations", as every line of the test set
    args = ["train", f"data.train={path}", f"model.name={minilm_dir}", "task.max_seq_len=64", "task.doc_stride=32",
            "task.max_query_len=16", "train.max_steps=1", f"output_dir={tmp_path / 'run'}",
            f"task.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    assert main(args) == 2  # a data error
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"distqa: error: {path}, line 1: example ")
    assert "has no annotations" in err and not (tmp_path / "run" / "model").exists()


def test_predict_refuses_a_repeated_or_unusable_id_before_preparing_anything(tmp_path, capsys, tiny_run, minilm_dir):
    for lines, said in [
        ([SHORT[0], SHORT[1], SHORT[0]], "line 3: example_id"),
        ([SHORT[0], with_id(SHORT[1], None)], "line 2: example_id is null"),
        ([SHORT[0], with_id(SHORT[1], "a,b")], "line 2: example_id 'a,b' holds a comma"),
    ]:
        status, _, err = predict_here(tmp_path, capsys, tiny_run, minilm_dir, write(tmp_path / "in.jsonl", lines))
        last = err.strip().splitlines()[-1]
        assert status != 0 and said in last, err[-2000:]
        assert not (tmp_path / "cache").exists() and not (tmp_path / "sub.csv").exists()


# ---------------------------------------------------------------------------------------------
# Skipped lines are said by every run that uses the features


def test_a_run_reusing_features_says_which_lines_were_skipped(tmp_path, minilm_dir, capsys):
    path = write(tmp_path / "in.jsonl", [SHORT[0], "{broken", SHORT[1], "[]"])
    settings = [f"model.tokenizer={minilm_dir}", "task.max_seq_len=64", f"task.cache_dir={tmp_path}/c"]
    cfg = load_config(None, [*settings, "task.skip_bad_lines=true"])
    tokenizer = load_tokenizer(cfg.model)
    for run in ("prepares", "reuses"):
        capsys.readouterr()
        folder = resolve_features(cfg, str(path), tokenizer, training=False)
        out = capsys.readouterr().out
        assert "skipped 2 bad line(s): line 2, 4 (first: not valid JSON" in out, (run, out)
    assert out.startswith(f"reused the features of {path} at {folder}; "), out
    # The same from `distqa prepare --output` on the folder, and on a reuse of it.
    assert "skipped 2 bad line(s)" in resolve_and_capture(folder, cfg, tokenizer, capsys)


def test_features_made_skipping_bad_lines_are_not_used_by_a_strict_run(tmp_path, minilm_dir, capsys):
    """task.skip_bad_lines is not in the cache key: a strict run (the default) reused an entry a
    skipping run had made and trained on without the lines, where its own build stops at the first."""
    path = write(tmp_path / "in.jsonl", [SHORT[0], "{broken", SHORT[1]])
    settings = [f"model.tokenizer={minilm_dir}", "task.max_seq_len=64", f"task.cache_dir={tmp_path}/c"]
    skipping = load_config(None, [*settings, "task.skip_bad_lines=true"])
    tokenizer = load_tokenizer(skipping.model)
    folder = resolve_features(skipping, str(path), tokenizer, training=False)
    made = (folder / "distqa_fingerprint.json").read_bytes()
    strict = load_config(None, settings)
    with pytest.raises(DistqaError, match=r"in.jsonl, line 2: not valid JSON"):
        resolve_features(strict, str(path), tokenizer, training=False)
    assert (folder / "distqa_fingerprint.json").read_bytes() == made  # the entry is left as it was
    assert resolve_features(skipping, str(path), tokenizer, training=False) == folder  # and reused
    with pytest.raises(DistqaError, match=r"lack the lines their input's preparation skipped \(skipped 1 bad"):
        resolve_features(strict, str(folder), tokenizer, training=False)  # the folder named as data
    capsys.readouterr()


def resolve_and_capture(folder, cfg, tokenizer, capsys) -> str:
    capsys.readouterr()
    resolve_features(cfg, str(folder), tokenizer, training=False)  # a prepared folder named directly
    return capsys.readouterr().out


def test_a_folder_stamped_before_lines_were_recorded_says_how_to_see_them(tmp_path):
    note = PrepareResult(tmp_path, reused=True, skipped=3).skipped_note("x.jsonl")
    assert note.startswith("skipped 3 bad line(s) of x.jsonl (which ones was not recorded: delete"), note
    assert str(tmp_path) in note
    assert PrepareResult(tmp_path, reused=True).skipped_note() == ""


def test_more_skipped_lines_than_are_named_end_in_dots(tmp_path):
    """Ten line numbers are named; more (all known when prepared now, or only counted when reused
    from the record) end in " ...", and exactly ten end without."""
    bad = [(line, "why") for line in range(1, 13)]
    named = "line 1, 2, 3, 4, 5, 6, 7, 8, 9, 10"
    assert f"{named} ... (first: why)" in PrepareResult(tmp_path, False, bad_lines=bad, skipped=12).skipped_note()
    assert f"{named} ... (first: why)" in PrepareResult(tmp_path, True, bad_lines=bad[:10], skipped=12).skipped_note()
    assert f"{named} (first: why)" in PrepareResult(tmp_path, True, bad_lines=bad[:10], skipped=10).skipped_note()


def test_predict_with_skipped_lines_says_in_its_last_line_that_they_have_no_rows(
    tmp_path, capsys, tiny_run, minilm_dir
):
    source = write(tmp_path / "in.jsonl", [SHORT[0], "{broken", SHORT[1]])
    for _ in range(2):  # the second run reuses the cached features
        status, out, err = predict_here(tmp_path, capsys, tiny_run, minilm_dir, source, "task.skip_bad_lines=true")
        assert status == 0, err[-2000:]
        lines = out.strip().splitlines()
        assert lines[-1].endswith("no rows for the 1 bad line(s) skipped (task.skip_bad_lines): line 2"), out
        assert "skipped 1 bad line(s): line 2" in lines[-2], out


# ---------------------------------------------------------------------------------------------
# Stale features, and the output path


def frozen_change_time(monkeypatch) -> None:
    """A file system that keeps no change time: the cache key then sees path, size and mtime only,
    and an edit in place with its mtime restored finds the old entry; the ids behind it catch that."""
    from distqa.nq import feature_stamp

    monkeypatch.setattr(feature_stamp, "change_time_ns", lambda stat: 0)


def test_predict_refuses_features_cached_from_an_earlier_version_of_the_file(
    tmp_path, capsys, tiny_run, minilm_dir, monkeypatch
):
    """The cache was keyed on path, size and mtime: an id edited in place, mtime restored, once gave
    an empty answer for the renamed example and a submission with exit 0."""
    frozen_change_time(monkeypatch)
    source = write(tmp_path / "in.jsonl", SHORT[:2])
    assert predict_here(tmp_path, capsys, tiny_run, minilm_dir, source)[0] == 0
    old_id = str(json.loads(LINES[0])["example_id"])
    new_id = old_id[:-1] + ("0" if old_id[-1] != "0" else "1")  # same length: same file size
    stat = source.stat()
    source.write_text(source.read_text().replace(old_id, new_id))
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert source.stat().st_size == stat.st_size
    status, _, err = predict_here(tmp_path, capsys, tiny_run, minilm_dir, source, output=tmp_path / "again.csv")
    last = err.strip().splitlines()[-1]
    assert status != 0 and "the cache is stale" in last and f"first: {new_id}" in last and "delete" in last, err
    assert not (tmp_path / "again.csv").exists()


def annotated(line: str) -> str:
    """A SHORT line with a gold long answer inside the 200 tokens kept: its first candidate."""
    obj = json.loads(line)
    first = obj["long_answer_candidates"][0]
    long = {"start_token": first["start_token"], "end_token": first["end_token"], "candidate_index": 0}
    obj["annotations"] = [{"yes_no_answer": "NONE", "long_answer": long, "short_answers": [], "annotation_id": 1}]
    return json.dumps(obj)


def test_validation_refuses_features_cached_from_an_earlier_version_of_its_file(tmp_path, minilm_dir, monkeypatch):
    """The same stale cache under `data.valid`: the gold is read from the file, the windows from
    the cache, and a renamed example scored as unanswered (a lower eval_micro_f1, exit 0). The
    refusal comes at start, when the data is built, not at the first evaluation hours later."""
    from distqa.nq.task import NQTask

    frozen_change_time(monkeypatch)

    source = write(tmp_path / "valid.jsonl", [annotated(line) for line in SHORT[:2]])
    args = [*SMALL, f"model.tokenizer={minilm_dir}", f"task.cache_dir={tmp_path / 'cache'}", f"data.valid={source}"]

    def scored() -> dict[str, float]:
        task = NQTask(load_config(None, args))
        task.build_model()
        task.build_train_dataset()  # prepares (or finds) the validation features
        return task.compute_metrics([], step=0)

    assert "eval_micro_f1" in scored()
    old_id = str(json.loads(LINES[0])["example_id"])
    new_id = old_id[:-1] + ("0" if old_id[-1] != "0" else "1")
    stat = source.stat()
    source.write_text(source.read_text().replace(old_id, new_id))
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    task = NQTask(load_config(None, args))
    task.build_model()
    with pytest.raises(DistqaError, match=f"first: {new_id}\\).*the cache is stale"):
        task.build_train_dataset()


def test_validation_data_without_gold_answers_is_refused_at_start_in_one_line(tmp_path, minilm_dir):
    """A test-format file (no annotations) as data.valid trained until the first evaluation, then
    ended in a traceback (metric.BadGold); `task.skip_bad_lines` did not help."""
    from distqa.nq.task import NQTask

    source = write(tmp_path / "valid.jsonl", [annotated(SHORT[0]), SHORT[1]])  # line 2: no annotations
    args = [*SMALL, f"model.tokenizer={minilm_dir}", f"task.cache_dir={tmp_path / 'cache'}", f"data.valid={source}"]
    for skip in ("false", "true"):
        task = NQTask(load_config(None, [*args, f"task.skip_bad_lines={skip}"]))
        task.build_model()
        with pytest.raises(DistqaError) as caught:
            task.build_train_dataset()
        example_id = json.loads(SHORT[1])["example_id"]
        assert str(caught.value).startswith(f"{source}: example {example_id}: no annotations"), caught.value
        assert "validation needs the gold answers" in str(caught.value)


def test_a_prepared_folder_as_validation_data_is_refused_naming_the_file_it_needs(tmp_path):
    """Gold answers are only in the JSONL file: a folder failed at the first evaluation with
    "does not exist or is not a file" (and a --mode train folder would have dropped windows)."""
    from distqa.nq.task import NQTask

    folder = tmp_path / "features"
    folder.mkdir()
    with pytest.raises(DistqaError, match=f"data.valid={folder} is a folder: validation reads its gold answers"):
        NQTask(load_config(None, [*SMALL, f"data.valid={folder}"]))


def test_an_output_that_cannot_be_written_or_is_the_input_is_refused_first(tmp_path, capsys):
    """Each was a traceback after all the prediction work, or (the input itself) an overwritten input
    and exit 0. The checkpoint here does not exist: the output is checked before anything else."""
    source = write(tmp_path / "in.jsonl", LINES[:1])
    (tmp_path / "folder").mkdir()
    for output, said in [
        (tmp_path / "folder", "is a folder: name the file to write"),
        (source / "sub.csv", f"{source} is a file, not a folder"),
        (source, "is the --input file"),
    ]:
        capsys.readouterr()
        argv = ["predict", "--input", str(source), "--checkpoint", str(tmp_path / "none"), "--output", str(output)]
        assert main(argv) != 0
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert said in last and "--output" in last, last
    assert source.read_text() == LINES[0] + "\n"


# ---------------------------------------------------------------------------------------------
# `distqa score`: spans compared as integers, ASCII digits only


def test_a_span_with_leading_zeros_is_compared_as_integers(tmp_path):
    gold = read_gold(write(tmp_path / "gold.jsonl", LINES[:1]))
    ((example_id, (gold_long, gold_short)),) = gold.items()
    start, end = sorted(gold_short)[0].split(":")
    sub = tmp_path / "sub.csv"
    sub.write_text(f"example_id,PredictionString\n{example_id}_long,\n{example_id}_short,0{start}:00{end}\n")
    assert read_submission(sub)[f"{example_id}_short"] == f"{start}:{end}"
    result = score(gold, read_submission(sub))
    assert (result["short_tp"], result["short_fp"]) == (1, 0)


def test_a_span_in_other_digits_is_refused(tmp_path):
    sub = tmp_path / "sub.csv"
    sub.write_text("example_id,PredictionString\n1_long,١٩٥٢:٢٠١٩\n1_short,\n")
    with pytest.raises(DistqaError, match="line 2: 1_long has '١٩٥٢:٢٠١٩', expected start:end"):
        read_submission(sub)


# ---------------------------------------------------------------------------------------------
# Files no line of which can be read, and lines of the wrong shape


def test_a_gzip_file_or_a_byte_order_mark_is_one_line_that_does_not_suggest_skipping(tmp_path):
    """A .gz input was 'line 1: UnicodeDecodeError ... (set task.skip_bad_lines=true ...)', and
    skipping then left nothing; a BOM's advice to skip line 1 dropped a real example."""
    import gzip

    packed = tmp_path / "in.jsonl.gz"
    packed.write_bytes(gzip.compress(SAMPLE.read_bytes()))
    marked = tmp_path / "bom.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + SAMPLE.read_bytes())
    for path, expected in ((packed, "is gzip-compressed"), (marked, "starts with a UTF-8 byte-order mark")):
        for skip in (False, True):
            with pytest.raises(DistqaError) as caught:
                NQReader(path, skip_bad_lines=skip)
            message = str(caught.value)
            assert message.startswith(f"{path} {expected}") and "skip_bad_lines" not in message, message


@pytest.mark.parametrize(
    "change,reason",
    [
        (
            {
                "annotations": [
                    {"long_answer": {"start_token": -1, "end_token": -1}, "short_answers": "x", "yes_no_answer": "NONE"}
                ]
            },
            "annotations[0].short_answers is not a list",
        ),
        ({"document_tokens": [{"token": "a"}, "b"], "document_text": None}, "document_tokens is not a list of objects"),
        ({"document_tokens": "a b", "document_text": None}, "document_tokens is not a list of objects"),
    ],
)
def test_a_field_of_the_wrong_shape_is_named(change, reason):
    obj = json.loads(SHORT[0])
    obj.update(change)
    if obj.get("document_text", "") is None:
        del obj["document_text"]
        obj["long_answer_candidates"] = []
    with pytest.raises(BadLine) as caught:
        parse_example(json.dumps(obj))
    assert str(caught.value) == reason


@pytest.mark.parametrize("key", ["long_answer_candidates", "annotations.long_answer", "annotations.short_answers",
                                 "annotations.yes_no_answer"])  # fmt: skip
def test_a_missing_key_is_a_bad_line_not_no_answer(tmp_path, key):
    """Without long_answer_candidates (a conversion script renamed it) every example had no
    candidates: predict gave 0 long answers for 10 real examples, and evaluation scored 0 and chose
    the threshold "never", exit 0. A missing annotation key read as "no answer" the same way."""
    obj = json.loads(LINES[0])  # a training line: one annotation
    if key.startswith("annotations."):
        del obj["annotations"][0][key.partition(".")[2]]
        reason = f"annotations[0] has no {key.partition('.')[2]}"
    else:
        del obj[key]
        reason = f"missing field(s) {key}"
    with pytest.raises(BadLine) as caught:
        parse_example(json.dumps(obj))
    assert str(caught.value) == reason
    path = write(tmp_path / "in.jsonl", [json.dumps(obj)])
    with pytest.raises(DistqaError, match=re.escape(f"line 1: {reason}")):
        list(NQReader(path))


@pytest.mark.parametrize("training", [False, True])
def test_an_input_without_examples_says_so_and_blames_no_setting(tmp_path, minilm_dir, training):
    """'produced no features (... task.keep_unknown ...)' for a blank file, where keep_unknown
    plays no part (and none at all in evaluation features)."""
    blank = write(tmp_path / "blank.jsonl", ["", "  "])
    settings = FeatureSettings(max_seq_len=64, doc_stride=32, max_query_len=16, training=training)
    with pytest.raises(DistqaError) as caught:
        prepare_features(blank, tmp_path / "out", tokenizer_name=str(minilm_dir), settings=settings)
    assert str(caught.value) == f"{blank} holds no examples: it is blank"
    bad = write(tmp_path / "bad.jsonl", ["{broken", "[1]"])
    with pytest.raises(DistqaError) as caught:
        prepare_features(bad, tmp_path / "out2", tokenizer_name=str(minilm_dir), settings=settings, skip_bad_lines=True)
    assert str(caught.value) == f"{bad} holds no examples: all 2 of its lines were skipped as bad (task.skip_bad_lines)"


@pytest.mark.parametrize("training", [True, False])
def test_features_made_by_a_reader_that_checked_less_are_not_reused(tmp_path, minilm_dir, monkeypatch, training):
    """A cache built before the reader refused lines without short_answers (read as "none": 468
    windows, every one "no answer") was found by the same key and trained on, exit 0: a reused cache
    never reads its input again. Its key now holds the reader's checks (INPUT_CHECKS)."""
    import distqa.nq.feature_stamp as stamp
    import distqa.nq.reader as reader_module

    renamed = []
    for line in LINES[:3]:
        obj = json.loads(line)
        for ann in obj["annotations"]:
            ann["short_answer"] = ann.pop("short_answers")
        renamed.append(json.dumps(obj))
    path = write(tmp_path / "renamed.jsonl", renamed)
    cfg = load_config(None, [f"model.tokenizer={minilm_dir}", "task.max_seq_len=64", f"task.cache_dir={tmp_path}/c"])
    tokenizer = load_tokenizer(cfg.model)
    strict = reader_module.parse_example

    def lenient(line: str):  # the reader before: a missing key read as "none"
        obj = json.loads(line)
        for ann in obj.get("annotations") or []:
            ann.setdefault("short_answers", [])
        return strict(json.dumps(obj))

    with monkeypatch.context() as old:
        old.setattr(reader_module, "parse_example", lenient)
        old.setattr(stamp, "INPUT_CHECKS", 0)
        built = resolve_features(cfg, str(path), tokenizer, training=training)
    assert built.is_dir()  # the old distqa's cache of the damaged file
    with pytest.raises(DistqaError, match=r"line 1: annotations\[0\] has no short_answers"):
        resolve_features(cfg, str(path), tokenizer, training=training)
    # A folder `distqa prepare` made with it, named directly, says why it is not used.
    with pytest.raises(DistqaError, match="prepared by an older distqa, whose reader took lines this one refuses"):
        resolve_features(cfg, str(built), tokenizer, training=training)


def test_training_features_of_empty_annotations_made_before_they_were_refused_are_not_reused(
    tmp_path, minilm_dir, monkeypatch
):
    """The reader of INPUT_CHECKS 1 took `"annotations": []` as annotated (every window "no
    answer"); its cache, found by the same key, trained on with exit 0 (found by a review)."""
    import distqa.nq.feature_stamp as stamp
    import distqa.nq.reader as reader_module

    path = write(tmp_path / "empty.jsonl", [json.dumps({**json.loads(line), "annotations": []}) for line in SHORT])
    cfg = load_config(None, [f"model.tokenizer={minilm_dir}", "task.max_seq_len=64", f"task.cache_dir={tmp_path}/c"])
    tokenizer = load_tokenizer(cfg.model)
    strict = reader_module.parse_example

    def lenient(line: str):  # that reader: an empty list counted as annotated
        return dataclasses.replace(strict(line), annotated=True)

    with monkeypatch.context() as old:
        old.setattr(reader_module, "parse_example", lenient)
        old.setattr(stamp, "INPUT_CHECKS", 1)
        assert resolve_features(cfg, str(path), tokenizer, training=True).is_dir()
    with pytest.raises(DistqaError, match=r"line 1: example .* has no annotations"):
        resolve_features(cfg, str(path), tokenizer, training=True)
