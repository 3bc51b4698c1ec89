"""Writing submission.csv: the exact bytes, the order of rows, validation, and a round trip."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from distqa.durable import umask
from distqa.nq.metric import read_submission
from distqa.nq.submission import format_span, write_submission

REAL_SUBMISSION = Path(__file__).resolve().parent / "fixtures" / "nq" / "submission.csv"


def test_exact_format_and_order(tmp_path):
    path = tmp_path / "submission.csv"
    write_submission(path, {"9": ("1:2", ""), "10": ("", "NO"), "-5": ("3:9", "4:5"), "-40": ("", "YES")})
    # Ids sorted as strings: "-40" < "-5" < "10" < "9"; the _long row before the _short row.
    assert path.read_bytes() == (
        b"example_id,PredictionString\n"
        b"-40_long,\n-40_short,YES\n"
        b"-5_long,3:9\n-5_short,4:5\n"
        b"10_long,\n10_short,NO\n"
        b"9_long,1:2\n9_short,\n"
    )
    assert not list(tmp_path.glob("*.partial"))
    # As readable as an ordinary file (mkstemp's 0600 kept other users out: found by a review).
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask()


def test_two_predictions_into_one_output_each_write_a_whole_file(tmp_path, monkeypatch):
    """Both wrote `submission.csv.partial`: the one renamed in last could hold the other's rows, or
    its rename found the file gone. Each now writes a file of its own; the last rename wins whole."""
    from distqa.nq import submission

    path = tmp_path / "submission.csv"
    first, second = {"1": ("1:2", "")}, {"2": ("", "YES"), "3": ("4:5", "")}
    real = submission.os.replace
    calls = []

    def meanwhile(src, dst):
        calls.append(src)
        if len(calls) == 1:  # the other prediction writes and renames in before this one
            write_submission(path, second)
        real(src, dst)

    monkeypatch.setattr(submission.os, "replace", meanwhile)
    write_submission(path, first)
    assert len(set(calls)) == 2  # two files of their own
    assert read_submission(path) == {"1_long": "1:2", "1_short": ""}
    assert not list(tmp_path.glob("*.partial"))


def test_round_trip_through_read_submission(tmp_path):
    predictions = {"-7853356005143141653": ("6:18", "YES"), "-545833482873225036": ("105:200", ""), "3": ("", "")}
    path = tmp_path / "out" / "submission.csv"
    write_submission(path, predictions)
    rows = read_submission(path)
    assert rows == {f"{i}_{kind}": v for i, pair in predictions.items() for kind, v in zip(("long", "short"), pair)}


def test_real_submission_rewritten_has_the_same_rows(tmp_path):
    rows = read_submission(REAL_SUBMISSION)
    ids = {row_id.rsplit("_", 1)[0] for row_id in rows}
    predictions = {example_id: (rows[f"{example_id}_long"], rows[f"{example_id}_short"]) for example_id in ids}
    assert len(predictions) == 346
    path = tmp_path / "submission.csv"
    write_submission(path, predictions)
    assert read_submission(path) == rows
    written = path.read_text().splitlines()
    original = REAL_SUBMISSION.read_text().splitlines()
    assert written[0] == original[0] and sorted(written[1:]) == sorted(original[1:])
    # The original is ordered by id as a number; ours as a string, like Kaggle's sample_submission.
    ids = [line.split(",")[0].rsplit("_", 1)[0] for line in written[1::2]]
    assert ids == sorted(ids) and written != original


@pytest.mark.parametrize(
    ("long", "short", "message"),
    [
        ("5:5", "", "empty or reversed"),
        ("7:3", "", "empty or reversed"),
        ("1:2:3", "", "not 'start:end'"),
        ("-1:4", "", "not 'start:end'"),
        ("YES", "", "only allowed as a short answer"),
        ("", "yes", "not 'start:end'"),
        ("", " 1:2", "not 'start:end'"),
        ("", 3, "not a string"),
        (None, "", "not a string"),
    ],
)
def test_invalid_values_are_rejected_naming_the_example(tmp_path, long, short, message):
    path = tmp_path / "submission.csv"
    with pytest.raises(ValueError, match=rf"example 123 \((long|short) answer\): .*{message}"):
        write_submission(path, {"1": ("1:2", ""), "123": (long, short)})
    assert not path.exists() and not list(tmp_path.iterdir())  # nothing written, not even a partial file


def test_ids_and_pairs_are_checked(tmp_path):
    with pytest.raises(ValueError, match="example id 123 must be a non-empty string"):
        write_submission(tmp_path / "s.csv", {123: ("", "")})
    with pytest.raises(ValueError, match="example 7: expected a \\(long, short\\) pair"):
        write_submission(tmp_path / "s.csv", {"7": ("1:2",)})


def test_format_span():
    assert format_span(0, 1) == "0:1"
    assert format_span(1952, 2019) == "1952:2019"
    for start, end in [(5, 5), (7, 3), (-1, 2), (True, 2), (1.0, 2)]:
        with pytest.raises(ValueError):
            format_span(start, end)
