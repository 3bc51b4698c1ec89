"""The competition metric: gold answers (one and five annotators), reading files, and every kind of row."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from distqa.errors import DistqaError
from distqa.nq.metric import BadGold, gold_answers, main_score, read_gold, read_submission, score

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nq"
TRAIN_SAMPLE = FIXTURES / "simplified-nq-sample.jsonl"
SUBMISSION = FIXTURES / "submission.csv"
NULL = {"start_token": -1, "end_token": -1, "candidate_index": -1}


def annotation(long: tuple[int, int] | None = None, shorts: tuple = (), yes_no: str = "NONE") -> dict:
    long_answer = {"start_token": long[0], "end_token": long[1], "candidate_index": 0} if long else dict(NULL)
    return {
        "annotation_id": 1,
        "long_answer": long_answer,
        "short_answers": [{"start_token": s, "end_token": e} for s, e in shorts],
        "yes_no_answer": yes_no,
    }


def example(*annotations: dict, example_id: int = 1) -> dict:
    return {"example_id": example_id, "question_text": "q", "document_text": "d", "annotations": list(annotations)}


def test_single_annotation_is_the_gold_answer():
    assert gold_answers(example(annotation((10, 20), [(12, 14), (15, 16)]))) == ({"10:20"}, {"12:14", "15:16"})
    assert gold_answers(example(annotation((10, 20), yes_no="YES"))) == ({"10:20"}, {"YES"})
    assert gold_answers(example(annotation())) == (set(), set())


@pytest.mark.parametrize("key", ["long_answer", "short_answers", "yes_no_answer"])
def test_a_gold_annotation_without_one_of_its_keys_is_bad_gold_not_no_answer(key):
    """A renamed `short_answers` or `yes_no_answer` read as "none": a blank prediction then scored as
    a correct blank, and a right answer as a false positive."""
    ann = annotation((10, 20), [(12, 14)], yes_no="NONE")
    del ann[key]
    with pytest.raises(BadGold, match=f"^annotations\\[0\\] has no {key}$"):
        gold_answers(example(ann))


def test_two_of_five_rule():
    one_vote = example(annotation((10, 20), [(12, 14)]), *[annotation() for _ in range(4)])
    assert gold_answers(one_vote) == (set(), set())

    # Two annotators with DIFFERENT answers: both answers are gold; null annotators add nothing.
    two_votes = example(
        annotation((10, 20), [(12, 14)]), annotation((30, 40), [(31, 33)]), annotation(), annotation(), annotation()
    )
    assert gold_answers(two_votes) == ({"10:20", "30:40"}, {"12:14", "31:33"})

    # A YES counts as a short-answer vote, like a span (nq_eval's gold_has_short_answer).
    span_and_yes = example(annotation((10, 20), [(12, 14)]), annotation((10, 20), yes_no="YES"), *[annotation()] * 3)
    assert gold_answers(span_and_yes) == ({"10:20"}, {"12:14", "YES"})

    # Long and short are voted on separately: two long votes but one short vote.
    long_only = example(annotation((10, 20), [(12, 14)]), annotation((10, 20)), *[annotation()] * 3)
    assert gold_answers(long_only) == ({"10:20"}, set())


def test_read_gold_on_real_train_lines():
    gold = read_gold(TRAIN_SAMPLE)
    assert len(gold) == 10
    assert gold["5655493461695504401"] == ({"1952:2019"}, {"1960:1969"})
    assert gold["-2500044561429484630"] == ({"82:169"}, {"83:85"})  # negative ids stay strings as written
    assert gold["4435104480114867852"] == ({"319:438"}, set())  # long answer only
    assert gold["5489863933082811018"] == (set(), set())  # no answer
    assert sum(bool(long) for long, _ in gold.values()) == 6
    assert sum(bool(short) for _, short in gold.values()) == 4


def test_read_gold_reads_gzip(tmp_path):
    packed = tmp_path / "sample.jsonl.gz"
    packed.write_bytes(gzip.compress(TRAIN_SAMPLE.read_bytes()))
    assert read_gold(packed) == read_gold(TRAIN_SAMPLE)


def damaged_gzip(data: bytes) -> bytes:
    """A gzip file whose compressed data is corrupt, not truncated: zlib.error, which neither
    EOFError nor gzip.BadGzipFile catches. Its first deflate block (after the 10-byte header)
    gets the reserved block type 11, so the error comes at once, on every zlib."""
    packed = bytearray(gzip.compress(data, mtime=0))
    packed[10] |= 0b110
    return bytes(packed)


def test_a_damaged_gzip_is_one_line(tmp_path):
    packed = tmp_path / "sample.jsonl.gz"
    packed.write_bytes(damaged_gzip(TRAIN_SAMPLE.read_bytes()))
    with pytest.raises(DistqaError, match=rf"{re.escape(str(packed))}: cannot be read as UTF-8 JSON lines"):
        read_gold(packed)


def test_malformed_line_names_file_and_line(tmp_path):
    lines = TRAIN_SAMPLE.read_text(encoding="utf-8").splitlines(keepends=True)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(lines[:2]) + '{"example_id": 7, "annotations": [\n' + "".join(lines[2:4]))
    with pytest.raises(DistqaError, match=rf"{re.escape(str(broken))}, line 3: not valid JSON"):
        read_gold(broken)

    # The real Kaggle TEST example has no annotations: no gold answers to score against.
    test_example = json.loads((FIXTURES / "ds-test-head1.json").read_text(encoding="utf-8"))
    test_file = tmp_path / "test.jsonl"
    test_file.write_text(lines[0] + json.dumps(test_example) + "\n")
    with pytest.raises(DistqaError, match=rf"{re.escape(str(test_file))}, line 2: no annotations"):
        read_gold(test_file)

    repeated = tmp_path / "repeated.jsonl"
    repeated.write_text(lines[0] + lines[1] + lines[0])
    with pytest.raises(
        DistqaError, match=rf"{re.escape(str(repeated))}, line 3: example_id 5655493461695504401 appears a second"
    ):
        read_gold(repeated)


def test_unusable_gold_lines_are_one_line_naming_file_and_line(tmp_path):
    """What `distqa prepare` refuses, `distqa score` refuses too: deep nesting and a huge integer
    were tracebacks; a negative span other than (-1, -1) read as "no answer", so an empty
    prediction scored as correct."""
    line = json.loads(TRAIN_SAMPLE.read_text(encoding="utf-8").splitlines()[0])
    short = line["annotations"][0]["short_answers"]
    assert short, "the fixture's first example has a short answer"
    damaged = {**line, "annotations": [{**line["annotations"][0], "short_answers": [{**short[0], "start_token": -5}]}]}
    for text, message in [
        ("[" * 100_000 + "]" * 100_000, r"not usable JSON \(RecursionError"),
        ('{"example_id": ' + "9" * 5000 + "}", r"not usable JSON \(ValueError"),
        (json.dumps(damaged), r"annotations\[0\]\.short_answers\[0\] \[-5, \d+\) has a negative token index"),
        (json.dumps({**line, "example_id": "a\ud800"}), "example_id holds an unpaired surrogate"),
    ]:
        gold = tmp_path / "gold.jsonl"
        gold.write_text(text + "\n", encoding="utf-8")
        with pytest.raises(DistqaError, match=rf"{re.escape(str(gold))}, line 1: {message}"):
            read_gold(gold)


def test_gold_lines_end_at_newlines_only(tmp_path):
    """A raw carriage return is JSON whitespace: prepare's reader reads such a line whole, and so
    must the scorer (universal newlines split it into two unreadable lines). CRLF still reads."""
    lines = TRAIN_SAMPLE.read_text(encoding="utf-8").splitlines()[:2]
    gold = tmp_path / "gold.jsonl"
    gold.write_bytes((lines[0].replace(', "', ',\r"', 1) + "\r\n" + lines[1] + "\n").encode())
    assert len(read_gold(gold)) == 2


def test_read_real_submission():
    rows = read_submission(SUBMISSION)
    assert len(rows) == 692
    assert rows["-9198586108074363474_long"] == "1854:2771"
    assert rows["-9198586108074363474_short"] == "2573:2576"
    assert rows["-9076824655968712429_short"] == ""
    assert sum(1 for v in rows.values() if v) == 229
    assert [k for k, v in rows.items() if v == "NO"] and all(k.endswith("_short") for k, v in rows.items() if v == "NO")


@pytest.mark.parametrize(
    ("content", "line", "message"),
    [
        ("id,PredictionString\n1_long,\n", 1, "header"),
        ("example_id,PredictionString\n1_long,\n1_answer,\n", 3, "does not end in _long or _short"),
        ("example_id,PredictionString\n1_long,5:3\n", 2, "expected start:end"),
        ("example_id,PredictionString\n1_long,1:2:3\n", 2, "expected start:end"),
        ("example_id,PredictionString\n1_long,YES\n", 2, "short answer only"),
        ("example_id,PredictionString\n1_long,\n1_short,\n1_long,2:3\n", 4, "appears a second time"),
        ("example_id,PredictionString\n1_long,2:3,x\n", 2, "3 fields"),
        # int() of more than 4300 digits raises ValueError: it was a traceback
        ("example_id,PredictionString\n1_long,1:" + "9" * 5000 + "\n", 2, "expected start:end"),
    ],
)
def test_bad_submission_names_file_and_line(tmp_path, content, line, message):
    path = tmp_path / "submission.csv"
    path.write_text(content)
    with pytest.raises(DistqaError, match=rf"{re.escape(str(path))}, line {line}: .*{message}"):
        read_submission(path)


def test_every_kind_of_row():
    gold = {
        "1": ({"10:20"}, {"12:14"}),  # long TP; short wrong span: FP only, not also FN
        "2": ({"30:40", "50:60"}, {"YES"}),  # long matches the 2nd gold: TP; YES: TP
        "3": (set(), set()),  # long predicted without gold: FP; short empty without gold: TN
        "4": ({"70:80"}, {"NO"}),  # long empty: FN; short YES against NO: FP
        "5": ({"90:99"}, set()),  # long empty: FN; short empty, no gold: TN
    }
    pred = {
        "1_long": "10:20",
        "1_short": "12:15",
        "2_long": "50:60",
        "2_short": "YES",
        "3_long": "5:6",
        "3_short": "",
        "4_long": "",
        "4_short": "YES",
        "5_long": "",
        "5_short": "",
    }
    result = score(gold, pred)
    assert (result["long_tp"], result["long_fp"], result["long_fn"], result["long_tn"]) == (2, 1, 2, 0)
    assert (result["short_tp"], result["short_fp"], result["short_fn"], result["short_tn"]) == (1, 2, 0, 2)
    assert (result["tp"], result["fp"], result["fn"], result["tn"]) == (3, 3, 2, 2)
    assert result["micro_f1"] == pytest.approx(2 * 3 / (2 * 3 + 3 + 2))
    assert result["long_f1"] == pytest.approx(4 / 7)
    assert result["short_f1"] == pytest.approx(2 / 4)
    assert result["precision"] == pytest.approx(3 / 6) and result["recall"] == pytest.approx(3 / 5)
    assert result["missing_rows"] == 0


def test_perfect_and_empty_submissions_on_real_gold():
    gold = read_gold(TRAIN_SAMPLE)
    n_gold = sum(bool(long) + bool(short) for long, short in gold.values())
    perfect = {
        f"{i}_{kind}": min(answers, default="")
        for i, pair in gold.items()
        for kind, answers in zip(("long", "short"), pair)
    }
    result = score(gold, perfect)
    assert result["micro_f1"] == 1.0 and (result["tp"], result["fp"], result["fn"]) == (n_gold, 0, 0) and n_gold == 10

    empty = {row_id: "" for row_id in perfect}
    result = score(gold, empty)
    assert result["micro_f1"] == 0.0 and (result["tp"], result["fp"], result["fn"]) == (0, 0, n_gold)


def test_missing_examples_are_empty_predictions_and_unknown_ids_fail():
    gold = read_gold(TRAIN_SAMPLE)
    pred = {"5655493461695504401_long": "1952:2019", "5655493461695504401_short": "1960:1969"}
    result = score(gold, pred)
    assert (result["tp"], result["fn"], result["missing_examples"], result["missing_rows"]) == (2, 8, 9, 18)

    # The real submission was made for the public test set, not these train examples.
    with pytest.raises(DistqaError, match="row -9198586108074363474_long names example -9198586108074363474"):
        score(gold, read_submission(SUBMISSION))


def test_main_score_prints_exactly_one_json_object_on_stdout(tmp_path, capsys):
    path = tmp_path / "submission.csv"
    path.write_text("example_id,PredictionString\n5655493461695504401_long,1952:2019\n5655493461695504401_short,\n")
    assert main_score(TRAIN_SAMPLE, path) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)  # the whole of stdout: `distqa score ... > score.json` is valid JSON
    assert "micro F1" in captured.err  # the human summary
    assert {"micro_f1", "long_f1", "short_f1", "tp", "fp", "fn"} <= result.keys()
    assert (result["tp"], result["fp"], result["fn"], result["missing_examples"]) == (1, 0, 9, 9)
    assert "lacks 18 rows (9 whole examples)" in captured.err


@pytest.mark.parametrize("bad_row", [2, 7, 300])
def test_a_byte_that_is_not_utf_8_names_its_own_line(tmp_path, bad_row):
    """The decoder reads ahead a block at a time: the reader's count named line 0, or one far
    before the byte (a review)."""
    rows = [f"{i}_long,{i}:{i + 5}".encode() for i in range(400)]
    rows[bad_row - 2] = rows[bad_row - 2].replace(b",", b",\xff", 1)  # file line bad_row (after the header)
    path = tmp_path / "submission.csv"
    path.write_bytes(b"\r\n".join([b"example_id,PredictionString", *rows]) + b"\r\n")
    said = rf"{re.escape(str(path))}, line {bad_row}: not a readable CSV file \('utf-8'"
    with pytest.raises(DistqaError, match=said):
        read_submission(path)
