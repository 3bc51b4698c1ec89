"""Streaming reader for Natural Questions JSONL, in the three shapes the competition uses.

- train (`simplified-nq-train.jsonl`, 17 GB): one annotation per example;
- dev: the same fields with five annotations per example;
- test (`simplified-nq-test.jsonl`): no annotations, and `example_id` may be a string.

The file is read line by line (never whole), and a byte range of it can be read on its own, which
is how `distqa prepare` splits one file over several processes without a pre-pass. A malformed line
is an error naming the file and the line; with `skip_bad_lines` it is counted instead, and the
count is reported by the caller. Nothing is dropped silently.

Where examples are keyed by their id (validation, prediction: `keyed_by_id=True`), an id must also
be usable as a submission row id, and appear once: a repeated id would pool the windows of two
documents under one answer, and `distqa score`/`split` refuse such files too. Training examples
(`training=True`) must appear once as well (a repeated one is trained on twice as often: two files
concatenated), and must carry annotations: a line of the test set has none, and every one of its
windows would teach "no answer".
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distqa.errors import DistqaError


@dataclass
class NQExample:
    example_id: str  # always a string: test ids are strings, train ids are integers
    question: str
    tokens: list[str]  # the document's whitespace tokens; HTML tags (<P>, <Table>) included
    candidates: list[dict[str, Any]]  # long-answer candidates: start_token, end_token, top_level
    annotations: list[dict[str, Any]] = field(default_factory=list)  # empty for the test set
    annotated: bool = True  # False: the line has no annotation (the test set's lines have no key)


class BadLine(ValueError):
    """A line that is not a valid Natural Questions example (the message says why)."""


def _span(obj: Any, what: str, n_tokens: int) -> tuple[int, int]:
    if not isinstance(obj, dict):
        raise BadLine(f"{what} is not an object")
    start, end = obj.get("start_token"), obj.get("end_token")
    # JSON true/false arrive as Python bools, which are ints too: [true, 2) is no span.
    if any(not isinstance(v, int) or isinstance(v, bool) for v in (start, end)):
        raise BadLine(f"{what} has no integer start_token/end_token")
    if (start, end) != (-1, -1) and not 0 <= start < end <= n_tokens:
        raise BadLine(f"{what} [{start}, {end}) is outside the document's {n_tokens} tokens")
    return start, end


def checked_example_id(value: object) -> str:
    """str(example_id), or a BadLine: NQ train ids are integers, test ids strings; anything else
    (null, true, 1.5) would become an id like "None" that two lines could share."""
    # bool is an int too, but `true` is no id.
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        kind = "null" if value is None else type(value).__name__
        raise BadLine(f"example_id is {kind}, not a string or an integer")
    if isinstance(value, str) and any("\ud800" <= c <= "\udfff" for c in value):
        # JSON's "\ud800": no submission row can name it (the file is UTF-8), and hashing it failed.
        raise BadLine("example_id holds an unpaired surrogate (an invalid \\uD8xx escape)")
    return str(value)


def submission_id_problem(example_id: str) -> str | None:
    """Why `example_id` cannot name a submission row (`<id>_long`), or None if it can."""
    if not example_id:
        return "example_id is empty"
    if any(c in example_id for c in ",\r\n"):
        return f"example_id {example_id!r} holds a comma or a line break, which a submission row id cannot"
    return None


# How many skipped line numbers a message names (and `distqa prepare`'s record keeps).
LINES_SHOWN = 10


def shown_lines(numbers: list[int], total: int | None = None) -> str:
    """'3, 7, 12 ...': the first LINES_SHOWN of `numbers`, and ' ...' when there are more (of
    `total`, when only some of the numbers are known)."""
    shown = numbers[:LINES_SHOWN]
    more = " ..." if (len(numbers) if total is None else total) > len(shown) else ""
    return ", ".join(str(line) for line in shown) + more


def load_object(line: str) -> dict[str, Any]:
    """One JSONL line to a JSON object, or a BadLine that says what is wrong with it."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as err:
        # The column within the line: a cut-off line's error lands past its newline, where json's
        # colno counts from 1 again; past the last character is said as one after it.
        column = min(err.pos, len(line.rstrip("\r\n"))) + 1
        raise BadLine(f"not valid JSON ({err.msg} at column {column})") from None
    except (RecursionError, ValueError) as err:  # nesting too deep, an integer of thousands of digits
        raise BadLine(f"not usable JSON ({type(err).__name__}: {str(err).splitlines()[0][:120]})") from None
    if not isinstance(raw, dict):
        raise BadLine("not a JSON object")
    return raw


def absent_annotation_keys(ann: dict[str, Any], i: int) -> str | None:
    """What annotation `i` lacks of its three keys, or None. Each must be there even when it holds
    no answer: a key a conversion script renamed read as "no answer" (the reader's training
    targets and evaluation's gold alike, and `distqa score`'s)."""
    absent = [key for key in ("long_answer", "short_answers", "yes_no_answer") if key not in ann]
    return f"annotations[{i}] has no {', '.join(absent)}" if absent else None


def parse_example(line: str) -> NQExample:
    """One JSONL line to an NQExample, checking every field the pipeline relies on."""
    raw = load_object(line)
    # long_answer_candidates too: without the key (renamed by a conversion script) every example
    # had no candidates, so no long answer, and predict and evaluation answered almost nothing, exit 0.
    missing = [k for k in ("example_id", "question_text", "long_answer_candidates") if k not in raw]
    if "document_text" in raw:
        text = raw["document_text"]
        if not isinstance(text, str):
            raise BadLine("document_text is not a string")
        tokens = text.split(" ")  # exactly the split that NQ's token indices refer to
    elif "document_tokens" in raw:  # the original (non-simplified) NQ format
        listed = raw["document_tokens"]
        if not isinstance(listed, list) or not all(isinstance(t, dict) for t in listed):
            raise BadLine("document_tokens is not a list of objects")
        tokens = [t.get("token") for t in listed]
        if not all(isinstance(t, str) for t in tokens):
            raise BadLine("document_tokens[].token is not always a string")
    else:
        missing.append("document_text")
    if missing:
        raise BadLine(f"missing field(s) {', '.join(missing)}")
    if not isinstance(raw["question_text"], str):
        raise BadLine("question_text is not a string")
    for name, text in (("question_text", raw["question_text"]), ("document", " ".join(tokens))):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # JSON's "\ud800": a lone surrogate, which no tokenizer accepts
            raise BadLine(f"{name} holds an unpaired surrogate (an invalid \\uD8xx escape)") from None
    n = len(tokens)
    candidates = raw["long_answer_candidates"]
    if not isinstance(candidates, list):
        raise BadLine("long_answer_candidates is not a list")
    for i, cand in enumerate(candidates):
        _span(cand, f"long_answer_candidates[{i}]", n)
        # Postprocessing prefers top-level candidates: the string "false" would count as true.
        if not isinstance(cand.get("top_level", True), bool):
            raise BadLine(
                f"long_answer_candidates[{i}].top_level is {json.dumps(cand['top_level'])}, not true or false"
            )
    # Only a list is one: `{}`, false or "" read as an empty list, and every window of such a line
    # was "no answer" in training, exit 0. An empty list is no annotation, as a missing key.
    given = raw.get("annotations")
    if given is not None and not isinstance(given, list):
        raise BadLine(f"annotations is {json.dumps(given)[:40]}, not a list")
    annotations = given or []
    for i, ann in enumerate(annotations):
        if not isinstance(ann, dict):
            raise BadLine(f"annotations[{i}] is not an object")
        if absent := absent_annotation_keys(ann, i):
            raise BadLine(absent)
        _span(ann["long_answer"], f"annotations[{i}].long_answer", n)
        shorts = ann["short_answers"]
        if not isinstance(shorts, list):  # a string would be read as a list of characters
            raise BadLine(f"annotations[{i}].short_answers is not a list")
        for j, short in enumerate(shorts):
            _span(short, f"annotations[{i}].short_answers[{j}]", n)
        if ann["yes_no_answer"] not in ("YES", "NO", "NONE"):
            raise BadLine(f"annotations[{i}].yes_no_answer is {ann['yes_no_answer']!r}")
    return NQExample(
        checked_example_id(raw["example_id"]),
        raw["question_text"],
        tokens,
        candidates,
        annotations,
        annotated=bool(annotations),
    )


GZIP_MAGIC = b"\x1f\x8b"
UTF8_BOM = b"\xef\xbb\xbf"


def refuse_unreadable_start(path: Path) -> None:
    """One line for a file whose first bytes no line of it can get past: a gzip file (read line by
    line, every line would be a bad one, and skipping them leaves nothing) or a UTF-8 byte-order
    mark (JSON text must not start with one; skipping line 1 would drop a real example)."""
    try:
        with path.open("rb") as f:
            head = f.read(len(UTF8_BOM))
    except OSError as err:
        raise DistqaError(f"{path}: cannot be read ({err.strerror or err})") from None
    if head.startswith(GZIP_MAGIC):
        raise DistqaError(
            f"{path} is gzip-compressed: this command reads plain JSON lines (it splits the file by byte "
            f"ranges), so unpack it first (gunzip -k {path})"
        )
    if head == UTF8_BOM:
        raise DistqaError(
            f"{path} starts with a UTF-8 byte-order mark, which JSON lines must not: remove it "
            f"(sed -i '1s/^\\xEF\\xBB\\xBF//' {path}) and run again"
        )


def line_number_at(path: Path, offset: int) -> int:
    """1-based number of the line starting at byte `offset` (computed only when reporting)."""
    count, done = 0, 0
    with path.open("rb") as f:
        while done < offset:
            chunk = f.read(min(1 << 24, offset - done))
            if not chunk:
                break
            count += chunk.count(b"\n")
            done += len(chunk)
    return count + 1


def byte_ranges(path: Path, parts: int) -> list[tuple[int, int]]:
    """Split the file into `parts` byte ranges; each line belongs to the range holding its first byte."""
    size = path.stat().st_size
    parts = max(1, min(parts, size))  # no more ranges than bytes (nor a list of `parts` bounds for nothing)
    bounds = [size * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


class NQReader:
    """Iterate the examples of one JSONL file, or of one byte range of it.

    `bad_lines` holds (line number, reason) for each skipped line once iteration is over.
    `keyed_by_id`: an id that cannot name a submission row is a bad line, and a repeated id is an
    error (never skipped: which of the two documents is meant cannot be known). `training`: a
    repeated id is an error too, and so is a line without annotations (never skipped: a file of
    such lines is the test set, which has no answers to train on); `ids` then holds every id read.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        skip_bad_lines: bool = False,
        byte_range: tuple[int, int] | None = None,
        keyed_by_id: bool = False,
        training: bool = False,
    ) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise DistqaError(f"{self.path} does not exist or is not a file")
        refuse_unreadable_start(self.path)
        self.skip_bad_lines = skip_bad_lines
        self.byte_range = byte_range or (0, self.path.stat().st_size)
        self.keyed_by_id, self.training = keyed_by_id, training
        self.bad_lines: list[tuple[int, str]] = []
        self._first_offset: dict[str, int] = {}  # keyed_by_id or training: where each id was first seen

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        """(byte offset, raw line) for every line that starts inside the byte range."""
        start, end = self.byte_range
        with self.path.open("rb") as f:
            if start > 0:
                # Begin at the first line that starts at or after `start`.
                f.seek(start - 1)
                if f.read(1) != b"\n":
                    f.readline()
            while (offset := f.tell()) < end:
                line = f.readline()
                if not line:
                    return
                yield offset, line

    def __iter__(self) -> Iterator[NQExample]:
        for offset, raw in self._lines():
            if not raw.strip():
                continue  # blank lines (a trailing newline, say) are not examples
            try:
                example = parse_example(raw.decode("utf-8"))
                if self.keyed_by_id and (problem := submission_id_problem(example.example_id)):
                    raise BadLine(problem)
            except (BadLine, UnicodeDecodeError, KeyError, TypeError) as err:
                line_no = line_number_at(self.path, offset)
                reason = str(err) if isinstance(err, BadLine) else f"{type(err).__name__}: {err}"
                if not self.skip_bad_lines:
                    raise DistqaError(
                        f"{self.path}, line {line_no}: {reason} (set task.skip_bad_lines=true to skip such lines)"
                    ) from None
                self.bad_lines.append((line_no, reason))
                continue
            if self.training and not example.annotated:
                raise DistqaError(
                    f"{self.path}, line {line_number_at(self.path, offset)}: example {example.example_id} has no "
                    "annotations, as the lines of the test set (simplified-nq-test.jsonl) have none: training needs "
                    "the answers; train on simplified-nq-train.jsonl, or the train.jsonl that `distqa split` makes"
                )
            if self.keyed_by_id or self.training:
                self._check_first(example.example_id, offset)
            yield example

    @property
    def ids(self) -> list[str]:
        """The ids read so far (`keyed_by_id` or `training` only), in the order first seen."""
        return list(self._first_offset)

    def _check_first(self, example_id: str, offset: int) -> None:
        first = self._first_offset.setdefault(example_id, offset)
        if first != offset:
            raise DistqaError(
                f"{self.path}, line {line_number_at(self.path, offset)}: example_id {example_id} appears a second "
                f"time (first on line {line_number_at(self.path, first)}): each example must appear once, "
                "remove or rename one of them"
            )
