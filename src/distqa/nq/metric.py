"""The Kaggle "TensorFlow 2.0 Question Answering" metric: micro F1 over every `_long` and `_short` row.

A submission has two rows per example, `<id>_long` and `<id>_short`, whose PredictionString is a
token span "start:end" (end exclusive), "YES"/"NO" (short rows only) or empty. The competition's
evaluation page defines, pooled over all rows of both kinds:

- TP: a non-empty prediction that equals one of the gold answers of that row;
- FP: a non-empty prediction that equals none of them, including where no gold answer exists;
- FN: an empty prediction where a gold answer exists.

A non-empty WRONG prediction where gold exists is therefore one FP and not also a FN: the page
lists "the predicted indices do NOT match" under FP only, and the public re-implementations
(Kaggle notebook "possible-evaluation-metric", mle-bench's grader) score it the same way. This
differs from Natural Questions' own nq_eval.py, which also counts it as a miss on the recall side.
An empty prediction where no gold exists (a true negative) counts nowhere.

A span is compared as two integers, as those graders parse it (`int(start), int(end)`): "01952:2019"
is the span 1952:2019. Its digits must be ASCII: Python's `int` would also read "١٩٦٠" (Arabic-
Indic digits) as 1960, but no submission writer produces them and Kaggle's own parser is not
known to, so such a value is refused rather than scored one way or the other.

    micro F1 = 2 TP / (2 TP + FP + FN)        (0.0 when the denominator is 0)

`distqa score --gold GOLD.jsonl --pred submission.csv` runs `main_score`; its last stdout line is one JSON object.
"""

from __future__ import annotations

import csv
import gzip
import json
import re
import sys
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from distqa.errors import DistqaError
from distqa.nq.reader import BadLine, absent_annotation_keys, checked_example_id, load_object

Gold = dict[str, tuple[set[str], set[str]]]  # example id -> (gold long strings, gold short strings)

HEADER = ["example_id", "PredictionString"]
ROW_KINDS = ("long", "short")
# A prediction value as Kaggle accepts it; YES/NO are allowed on `_short` rows only (checked apart).
# At most 9 digits a token index: a document has far fewer tokens, and int() of thousands of digits raises.
_VALUE = re.compile(r"([0-9]{1,9}):([0-9]{1,9})|YES|NO|")
# Annotators that must give a non-null answer before an example with several annotations "has" one.
MIN_VOTES = 2


class BadGold(ValueError):
    """An example whose annotations cannot be read (the message says which field)."""


def _span_string(obj: Any, what: str) -> str | None:
    """The "start:end" string of an annotation span, or None for the null span (-1, -1)."""
    if not isinstance(obj, dict):
        raise BadGold(f"{what} is not an object")
    start, end = obj.get("start_token"), obj.get("end_token")
    if type(start) is not int or type(end) is not int:
        raise BadGold(f"{what} has no integer start_token/end_token")
    if (start, end) == (-1, -1):
        return None
    if start < 0:
        # Only (-1, -1) is NQ's null span: [-213, 215) is a damaged one, which read as "no answer"
        # made an empty prediction count as correct (prepare's reader refuses the same line).
        raise BadGold(f"{what} [{start}, {end}) has a negative token index, and is not the null span (-1, -1)")
    if start >= end:
        raise BadGold(f"{what} is the empty span [{start}, {end})")
    return f"{start}:{end}"


def gold_answers(example: dict) -> tuple[set[str], set[str]]:
    """(gold long strings, gold short strings) of one parsed example, as Kaggle PredictionStrings.

    Long: "start:end" of each non-null long answer. Short: "start:end" of each short span, plus
    "YES"/"NO" where `yes_no_answer` says so. An annotation with several short spans contributes
    each span on its own, because a Kaggle row holds a single span.

    Several annotators (NQ dev has five): the evaluation metrics of Kwiatkowski et al. 2019,
    "Natural Questions: a Benchmark for Question Answering Research" (TACL), count an example as
    having a long (short) answer only when at least 2 of the 5 annotators gave a non-null one;
    NQ's nq_eval.py implements that vote (`gold_has_long_answer`, `gold_has_short_answer`) and then
    accepts a prediction that matches ANY non-null annotator. We do the same for any
    example with two or more annotations: fewer than `MIN_VOTES` non-null votes gives an empty set,
    otherwise every non-null annotator's answers count. An annotator votes "short" when it gave a
    short span or a YES/NO. With one annotation (train) its non-null answer is the gold answer.
    """
    annotations = example.get("annotations")
    if not isinstance(annotations, list) or not annotations:
        raise BadGold("no annotations (a test file has none: score against train or dev data)")
    per_annotator: list[tuple[set[str], set[str]]] = []
    for i, ann in enumerate(annotations):
        if not isinstance(ann, dict):
            raise BadGold(f"annotations[{i}] is not an object")
        if absent := absent_annotation_keys(ann, i):
            raise BadGold(absent)
        long = _span_string(ann["long_answer"], f"annotations[{i}].long_answer")
        shorts = ann["short_answers"]
        if not isinstance(shorts, list):
            raise BadGold(f"annotations[{i}].short_answers is not a list")
        short = {s for j, sa in enumerate(shorts) if (s := _span_string(sa, f"annotations[{i}].short_answers[{j}]"))}
        yes_no = ann["yes_no_answer"]
        if yes_no not in ("YES", "NO", "NONE"):
            raise BadGold(f"annotations[{i}].yes_no_answer is {yes_no!r}")
        if yes_no != "NONE":
            short.add(yes_no)
        per_annotator.append(({long} if long else set(), short))

    needed = MIN_VOTES if len(per_annotator) >= 2 else 1
    gold_long: set[str] = set()
    gold_short: set[str] = set()
    if sum(1 for long, _ in per_annotator if long) >= needed:
        gold_long = set().union(*(long for long, _ in per_annotator))
    if sum(1 for _, short in per_annotator if short) >= needed:
        gold_short = set().union(*(short for _, short in per_annotator))
    return gold_long, gold_short


def _open_text(path: Path) -> IO[str]:
    # The NQ dev set ships gzipped; read it without unpacking 1 GB first. Lines end at "\n" only, as
    # the reader's (distqa.nq.reader) do: a raw "\r" is JSON whitespace, which universal newlines
    # took for a line's end, splitting a line that prepare reads whole.
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="\n")
    return path.open("r", encoding="utf-8", newline="\n")


def _jsonl(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) of every non-blank line, one at a time (train is 17 GB)."""
    if not path.is_file():
        raise DistqaError(f"{path} does not exist or is not a file")
    with _open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                yield line_no, line


def read_gold(path: str | Path) -> Gold:
    """Gold answers of every example of a train/dev JSONL file, keyed by str(example_id).

    The file is streamed line by line; only the answer strings are kept. A malformed line or a
    repeated example id is a DistqaError naming the file and the line.
    """
    path = Path(path)
    gold: Gold = {}
    try:
        for line_no, line in _jsonl(path):
            try:
                example = load_object(line)  # also a nesting too deep, an integer of thousands of digits
                if "example_id" not in example:
                    raise BadGold("not a JSON object with an example_id")
                example_id = checked_example_id(example["example_id"])  # null would be the id "None"
                if example_id in gold:
                    raise BadGold(f"example_id {example_id} appears a second time")
                gold[example_id] = gold_answers(example)
            except (BadGold, BadLine) as err:
                raise DistqaError(f"{path}, line {line_no}: {err}") from None
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile, zlib.error) as err:  # zlib: damaged compressed data
        raise DistqaError(f"{path}: cannot be read as UTF-8 JSON lines ({err})") from None
    except OSError as err:  # unreadable (its permissions), or a read that failed
        raise DistqaError(f"{path} cannot be read ({err.strerror or err})") from None
    if not gold:
        raise DistqaError(f"{path} holds no examples")
    return gold


def read_submission(path: str | Path) -> dict[str, str]:
    """Row id ("123_long") -> PredictionString of a Kaggle submission.csv, empty for no answer.

    Checks the header `example_id,PredictionString`, two fields a row, ids ending in `_long` or
    `_short` and appearing once, and values "start:end" (start < end), "YES"/"NO" (short rows
    only) or empty; "nan" (what a careless pandas export writes) also reads as empty. Anything
    else is a DistqaError naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise DistqaError(f"{path} does not exist or is not a file")
    rows: dict[str, str] = {}
    try:
        # utf-8-sig: a spreadsheet may have saved the file with a byte-order mark.
        f = path.open("r", encoding="utf-8-sig", newline="")
    except OSError as err:  # unreadable (its permissions)
        raise DistqaError(f"{path} cannot be read ({err.strerror or err})") from None
    with f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            if header != HEADER:
                raise DistqaError(f"{path}, line 1: header is {header!r}, expected {','.join(HEADER)}")
            for fields in reader:
                where = f"{path}, line {reader.line_num}"
                if not fields:
                    continue
                if len(fields) != 2:
                    raise DistqaError(f"{where}: {len(fields)} fields, expected 2 (row id, PredictionString)")
                row_id, value = fields[0].strip(), fields[1].strip()
                kind = row_id.rpartition("_")[2]
                if kind not in ROW_KINDS or not row_id.rpartition("_")[0]:
                    raise DistqaError(f"{where}: row id {row_id!r} does not end in _long or _short")
                if row_id in rows:
                    raise DistqaError(f"{where}: row id {row_id} appears a second time")
                if value.lower() == "nan":
                    value = ""
                match = _VALUE.fullmatch(value)
                if match is None or (match[1] is not None and int(match[1]) >= int(match[2])):
                    expected = "start:end (start < end), YES, NO or empty"
                    raise DistqaError(f"{where}: {row_id} has {value!r}, expected {expected}")
                if value in ("YES", "NO") and kind == "long":
                    raise DistqaError(f"{where}: {row_id} is {value}, but YES/NO is a short answer only")
                # Compared as integers, as the graders do: "01952:2019" is the span 1952:2019.
                rows[row_id] = f"{int(match[1])}:{int(match[2])}" if match[1] is not None else value
        except (csv.Error, UnicodeDecodeError) as err:
            line = _undecodable_line(path) if isinstance(err, UnicodeDecodeError) else reader.line_num
            raise DistqaError(f"{path}, line {line}: not a readable CSV file ({err})") from None
    return rows


def _undecodable_line(path: Path) -> int:
    """The first line of `path` that is not UTF-8. The decoder reads ahead a block at a time, and
    the reader's line count then named a line before the byte, line 0 once (a review)."""
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return 0  # (not reached: the text decoder failed on these bytes)


def _f1(tp: int, fp: int, fn: int) -> float:
    denominator = 2 * tp + fp + fn
    return 2 * tp / denominator if denominator else 0.0


def score(gold: Mapping[str, tuple[set[str], set[str]]], pred: Mapping[str, str]) -> dict[str, Any]:
    """Micro F1 of a submission (`read_submission`) against gold answers (`read_gold`).

    Returns micro_f1, precision, recall, tp, fp, fn, tn pooled over both row kinds; long_f1 and
    short_f1 with their own counts; the number of gold examples, and how many examples and rows
    of the gold set the submission lacks (each missing row scores as an empty prediction, as if
    the notebook had written nothing). A row for an example that is not in the gold set is a
    DistqaError naming the first such id: the predictions were made for another file.
    """
    for row_id in pred:
        example_id = row_id.rpartition("_")[0]
        if example_id not in gold:
            raise DistqaError(
                f"submission row {row_id} names example {example_id}, which is not among the {len(gold)} gold "
                "examples: score the predictions against the file they were made for"
            )
    counts = {kind: {"tp": 0, "fp": 0, "fn": 0, "tn": 0} for kind in ROW_KINDS}
    missing_rows = missing_examples = 0
    for example_id, answers in gold.items():
        absent = 0
        for kind, gold_set in zip(ROW_KINDS, answers):
            row_id = f"{example_id}_{kind}"
            if row_id not in pred:
                absent += 1
            prediction = pred.get(row_id, "")
            if prediction:
                counts[kind]["tp" if prediction in gold_set else "fp"] += 1
            else:
                counts[kind]["fn" if gold_set else "tn"] += 1
        missing_rows += absent
        missing_examples += absent == len(ROW_KINDS)

    total = {key: counts["long"][key] + counts["short"][key] for key in ("tp", "fp", "fn", "tn")}
    tp, fp, fn = total["tp"], total["fp"], total["fn"]
    result: dict[str, Any] = {
        "micro_f1": _f1(tp, fp, fn),
        "precision": tp / (tp + fp) if tp + fp else 0.0,
        "recall": tp / (tp + fn) if tp + fn else 0.0,
        **total,
    }
    for kind in ROW_KINDS:
        c = counts[kind]
        result[f"{kind}_f1"] = _f1(c["tp"], c["fp"], c["fn"])
        result.update({f"{kind}_{key}": value for key, value in c.items()})
    result.update(examples=len(gold), missing_examples=missing_examples, missing_rows=missing_rows)
    return result


def main_score(gold_path: str | Path, pred_path: str | Path) -> int:
    """Score a submission file against a gold JSONL file. stdout holds exactly one JSON object (so
    `distqa score ... > score.json` is valid JSON); the human summary goes to stderr."""
    gold = read_gold(gold_path)
    pred = read_submission(pred_path)
    result = score(gold, pred)
    if result["missing_rows"]:
        print(
            f"warning: {pred_path} lacks {result['missing_rows']} rows ({result['missing_examples']} whole examples) "
            f"of the {len(gold)} gold examples; they count as empty predictions",
            file=sys.stderr,
        )
    print(
        f"{len(gold)} examples: micro F1 {result['micro_f1']:.4f} "
        f"(long {result['long_f1']:.4f}, short {result['short_f1']:.4f}; "
        f"TP {result['tp']}, FP {result['fp']}, FN {result['fn']})",
        file=sys.stderr,
    )
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0
