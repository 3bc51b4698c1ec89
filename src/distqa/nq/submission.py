"""Writing predictions in the Kaggle "TensorFlow 2.0 Question Answering" submission format.

    example_id,PredictionString
    -1011141123527297803_long,1214:1373
    -1011141123527297803_short,1294:1297
    -1028916936938579349_long,
    -1028916936938579349_short,NO

Two rows per example, `_long` then `_short`; a value is a token span "start:end" (end exclusive,
indices into the whitespace-split `document_text`), "YES"/"NO" (short answers only) or empty for
"no answer". Examples are ordered by their id as a string, the order of Kaggle's
`sample_submission.csv`; the grader matches rows by id, but the same order makes two submissions
comparable with `diff`.

Every value is checked before anything is written, so a bug upstream (a reversed span, a YES on
a long row, a stray float) fails here, naming the example, instead of silently scoring zero.
"""

from __future__ import annotations

import csv
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

from distqa.durable import file_in_the_way, umask
from distqa.errors import DistqaError
from distqa.rank0 import fix_for

HEADER = ("example_id", "PredictionString")
_SPAN = re.compile(r"([0-9]+):([0-9]+)")  # ASCII digits: `\d` would also take "١٩٦٠"


def format_span(start: int, end: int) -> str:
    """The PredictionString "start:end" of the token span [start, end); end is exclusive."""
    # bool is an int subclass: True:False would otherwise pass as "1:0" before the order check.
    if type(start) is not int or type(end) is not int:
        raise ValueError(f"a span needs integer token indices, got {start!r}:{end!r}")
    if not 0 <= start < end:
        raise ValueError(f"span [{start}, {end}) is empty or negative: need 0 <= start < end")
    return f"{start}:{end}"


def _check_value(example_id: str, kind: str, value: object) -> str:
    """Return `value` if it is a valid PredictionString for a `kind` row, else raise ValueError."""
    where = f"example {example_id} ({kind} answer)"
    if not isinstance(value, str):
        raise ValueError(f"{where}: {value!r} is not a string; use format_span(start, end), 'YES', 'NO' or ''")
    if value in ("YES", "NO"):
        if kind == "long":
            raise ValueError(f"{where}: {value} is only allowed as a short answer")
        return value
    if value == "":
        return value
    match = _SPAN.fullmatch(value)
    if match is None:
        raise ValueError(f"{where}: {value!r} is not 'start:end', 'YES', 'NO' or ''")
    if int(match[1]) >= int(match[2]):
        raise ValueError(f"{where}: span {value} is empty or reversed (need start < end)")
    return value


def submission_rows(predictions: Mapping[str, tuple[str, str]]) -> list[tuple[str, str]]:
    """The (row id, PredictionString) rows of a submission, validated and in Kaggle's order."""
    rows: list[tuple[str, str]] = []
    for example_id in predictions:
        # Ids must already be strings: an int 123 and a str "123" would both become row 123_long.
        if not isinstance(example_id, str) or not example_id or any(c in example_id for c in ",\r\n"):
            raise ValueError(f"example id {example_id!r} must be a non-empty string without commas or newlines")
    for example_id in sorted(predictions):
        answers = predictions[example_id]
        if not isinstance(answers, tuple | list) or len(answers) != 2:
            raise ValueError(f"example {example_id}: expected a (long, short) pair, got {answers!r}")
        long_value, short_value = answers
        rows.append((f"{example_id}_long", _check_value(example_id, "long", long_value)))
        rows.append((f"{example_id}_short", _check_value(example_id, "short", short_value)))
    return rows


def check_output_path(output: str | os.PathLike, *, input_path: str | os.PathLike) -> None:
    """Refuse an --output that `write_submission` could not write, or that would overwrite the
    input, before any prediction work (each was a traceback at the very end, or a lost input)."""
    path = Path(output)
    if path.is_dir():
        raise DistqaError(
            f"--output {path} is a folder: name the file to write, e.g. --output {path / 'submission.csv'}"
        )
    blocker = file_in_the_way(path.parent)
    if blocker is not None:
        raise DistqaError(f"--output {path}: {blocker} is a file, not a folder: choose another --output")
    if path.exists() and Path(input_path).exists() and os.path.samefile(path, input_path):
        raise DistqaError(
            f"--output {path} is the --input file: the submission would overwrite it: choose another --output"
        )
    folder = next(p for p in (path.parent, *path.parent.parents) if p.exists())
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DistqaError(f"--output {path} cannot be written: {folder} is not writable: choose another --output")
    # Its folder created and a file made there now, not after the model's work: a read-only mount
    # that os.access does not see, or a folder that cannot be created, fails here.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _partial(path).unlink()
    except OSError as err:
        raise DistqaError(
            f"--output {path} cannot be written ({err.strerror or err}): choose another --output"
        ) from err


def _partial(path: Path) -> Path:
    """A new file of its own beside `path`, where a submission is written before it is renamed to
    `path`: two predictions given one --output each write their own (one name for both interleaved
    their rows, and the one renamed last held some of the other's)."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp's 0600 kept other users out (a review saw it)
    finally:
        os.close(fd)
    return Path(name)


def write_submission(path: str | os.PathLike, predictions: Mapping[str, tuple[str, str]]) -> None:
    """Write `submission.csv` for predictions {example_id: (long_string, short_string)}.

    All values are validated first (ValueError naming the example), then the file is written to a
    temporary name beside `path` and renamed, so an interrupted run never leaves half a submission
    where Kaggle would pick it up.
    """
    rows = submission_rows(predictions)
    path = Path(path)
    partial: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = _partial(path)
        # lineterminator "\n": what pandas writes on Linux and what sample_submission.csv uses.
        with partial.open("w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(HEADER)
            writer.writerows(rows)
        os.replace(partial, path)
    except OSError as err:  # a full disk: after all the prediction work, one line, and `path` as it was
        raise DistqaError(
            f"cannot write the submission {path} ({err.strerror or err}): {fix_for(err, str(path.parent))}, or "
            "choose another --output"
        ) from err
    finally:
        if partial is not None:
            partial.unlink(missing_ok=True)
