"""Reading a classification file (CSV or JSON lines) into examples: (text, pair or None, label index).

Both formats are read row by row with the standard library, so a row's number in an error is the
one an editor shows, and nothing is cached or converted on disk. Texts stay strings until the
collate tokenizes a batch, which keeps the dataset small and the padding per batch.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from torch.utils.data import Dataset

from distqa.errors import DistqaError

FORMATS = {".csv": "csv", ".jsonl": "json", ".json": "json"}


class Example(NamedTuple):
    text: str
    pair: str | None
    label: int


def _not_utf8(path: Path, key: str) -> DistqaError:
    """Where the first byte that is not UTF-8 is: the text reader decodes in blocks, so its own
    error's position is within a block, not the file. Read again as bytes to find it."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        where = f" (line {line}, byte offset {err.start}: 0x{data[err.start]:02x})"
    else:  # the file changed since: name no place
        where = ""
    return DistqaError(
        f"{key}={str(path)!r} is not UTF-8 text{where}: save it as UTF-8, e.g. "
        "`iconv -f cp1252 -t utf-8 IN > OUT` with the encoding it was written in"
    )


def _rows(path: Path, key: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) for each data row of a CSV or JSON-lines file."""
    try:
        yield from _decoded_rows(path, key)
    except UnicodeDecodeError:
        raise _not_utf8(path, key) from None


def _decoded_rows(path: Path, key: str) -> Iterator[tuple[int, dict[str, Any]]]:
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise DistqaError(f"{key}={str(path)!r}: textcls reads .csv or .jsonl (JSON lines) files, not {path.suffix!r}")
    if not path.is_file():
        raise DistqaError(f"{key}={str(path)!r} is not a file")
    # newline="" as the csv module asks: a quoted field may hold a line break. utf-8-sig: a file saved
    # by a spreadsheet starts with a byte-order mark, which would otherwise rename the first column.
    csv_file = kind == "csv"
    with path.open(encoding="utf-8-sig", newline="" if csv_file else None) as f:
        if kind == "csv":
            yield from _csv_rows(f, f"{key}={str(path)!r}")
            return
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue  # a trailing blank line is common and means nothing
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DistqaError(f"{key}={str(path)!r} line {number} is not JSON ({err.msg})") from err
            if not isinstance(row, dict):
                raise DistqaError(f"{key}={str(path)!r} line {number} is not a JSON object")
            yield number, row


def _csv_rows(f: Any, where: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) of each CSV row; a damaged row is an error naming its line, not an
    example: an unclosed quote (which swallowed the rows after it into one text) and a row with
    more fields than the header (an unquoted comma, whose text was cut there) passed silently."""
    csv.field_size_limit(1 << 30)  # a long document is a text, not the module's 128 KB error
    reader = csv.DictReader(f, strict=True)
    ended = 1  # the line the last whole row (the header first) ended on: csv's own count stops at an error
    try:
        header = reader.fieldnames or []
        if repeated := sorted({name for name in header if header.count(name) > 1}):
            raise DistqaError(f"{where}: the header names column(s) {', '.join(map(repr, repeated))} twice")
        for row in reader:
            if None in row:  # DictReader's place for the fields past the header's
                raise DistqaError(
                    f"{where} row ending on line {reader.line_num}: {len(header) + len(row[None])} fields, the header "
                    f"has {len(header)}: put a text that holds a comma in double quotes"
                )
            # The header is line 1; a row's number is where it ends (quoted fields may span lines).
            ended = reader.line_num
            yield ended, row
    except csv.Error as err:  # an unclosed quote: "unexpected end of data"
        raise DistqaError(f"{where} row starting on line {ended + 1}: not valid CSV ({err})") from None


def _label_index(value: Any, labels: list[str], names_only: bool) -> int | None:
    """The class of a file's label: a name of task.labels, else an index into it; but where the
    class names are numbers themselves (`names_only`), only a name (labels named 1..5 and a file's
    0..4: 0 as an index and 1 as a name were both the class '1', and every class moved, silently)."""
    text = str(value).strip()
    if text in labels:  # names win, so labels named "1,0" mean what they say
        return labels.index(text)
    if isinstance(value, bool) or names_only:
        return None  # JSON true/false is not an index; with numeric names an index is ambiguous
    # Plain ASCII digits only: int() also reads "+1", "-0", "1_0" (10) and full-width digits.
    if not _INDEX.fullmatch(text):
        return None
    index = int(text)
    return index if index < len(labels) else None


_INDEX = re.compile(r"0|[1-9][0-9]*")


def _is_number(text: str) -> bool:
    """Whether a class name reads as a number (1, 0.5, 1e3): a file's label could then be meant as
    that name or as an index (names 0.0,0.5,1.0 and a label 1, a JSON writer's 1.0, took class 0.5)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_examples(path: str | Path, key: str, settings: Any) -> list[Example]:
    """Every row of `path` (the value of config key `key`) as an Example; one clear error per bad
    input. `settings` is the task's TextClsSettings."""
    path = Path(path)
    labels = settings.label_names()
    names_only = any(_is_number(name) for name in labels)
    columns = [settings.text_column, settings.label_column]
    if settings.text_pair_column is not None:
        columns.insert(1, settings.text_pair_column)
    examples: list[Example] = []
    for number, row in _rows(path, key):
        where = f"{key}={str(path)!r} {'row ending on line' if path.suffix.lower() == '.csv' else 'line'} {number}"
        for column in columns:
            if column in row and row[column] is None:  # csv: a row with fewer fields than the header
                raise DistqaError(f"{where}: no value in column {column!r}")
            if column not in row:
                found = ", ".join(str(c) for c in row if c is not None) or "none"
                setting_key = {
                    settings.text_column: "task.text_column",
                    settings.label_column: "task.label_column",
                }.get(column, "task.text_pair_column")
                raise DistqaError(f"{where}: no column {column!r} ({setting_key}); its columns: {found}")
        texts = [row[settings.text_column]]
        if settings.text_pair_column is not None:
            texts.append(row[settings.text_pair_column])
        if not all(isinstance(t, str) for t in texts):
            raise DistqaError(f"{where}: the text columns must hold strings")
        if not all(t.strip() for t in texts):
            raise DistqaError(f"{where}: a text column is empty")
        label = _label_index(row[settings.label_column], labels, names_only)
        if label is None:
            given, names = row[settings.label_column], ", ".join(labels)
            if names_only:
                raise DistqaError(
                    f"{where}: label {given!r} is not one of task.labels ({names}): with class names that "
                    "are numbers, a file gives the names, not indices"
                )
            raise DistqaError(
                f"{where}: label {given!r} is neither one of task.labels ({names}) nor an index 0..{len(labels) - 1}"
            )
        examples.append(Example(texts[0], texts[1] if len(texts) > 1 else None, label))
    if not examples:
        raise DistqaError(f"{key}={str(path)!r} has no rows")
    return examples


class ExampleDataset(Dataset):
    """The examples of one file; item i is example i (a plain tuple, tokenized by the collate)."""

    def __init__(self, examples: list[Example]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Example:
        return self.examples[index]
