"""`distqa split`: carve a validation set out of Kaggle's `simplified-nq-train.jsonl`.

Kaggle ships only the train file (17 GB, one annotation per example) and the unannotated test
file, so there is nothing to validate on until some train examples are set aside. The split is

- deterministic by example id: valid holds the N examples whose SHA-256 of "<seed>:<example_id>"
  is smallest. That depends only on the ids, N and the seed, not on line order or on the machine,
  and a larger N keeps every example a smaller N chose. A hash threshold ("digest < 2^256·N/M")
  would need no order statistics but gives about N, not exactly N;
- two streaming passes: the first reads every id (checking that each line has one, and that no id
  repeats) and keeps the N smallest digests, the second copies each line's bytes, unchanged, to
  train.jsonl or valid.jsonl. Memory grows with the number of examples (one digest each, about
  30 MB for the 307,373 of NQ train), never with the file's size;
- cheap per line: a real NQ line is 50-100 KB and `json.loads` of it runs at ~160 MB/s, the same
  order as reading the file. `example_id_of` reads the id from the line's last bytes instead (NQ
  train puts `example_id` last), and falls back to `json.loads` whenever it cannot prove the key
  is the top-level one. It does not check the rest of the line: `distqa prepare` does that;
- all or nothing: the files are written into a hidden staging folder inside DIR, made durable,
  and moved into DIR only when complete. Old train.jsonl/valid.jsonl (with --overwrite) are
  removed before the new ones arrive, so DIR never pairs an old file with a new one; split.json,
  moved in last, marks a complete split.
"""

from __future__ import annotations

import gzip
import hashlib
import heapq
import json
import os
import re
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from distqa.durable import abandoned, fsync_path, held_exclusively, lock_while_writing
from distqa.errors import DistqaError
from distqa.nq.reader import BadLine, checked_example_id, load_object

OUTPUTS = ("train.jsonl", "valid.jsonl", "split.json")
_KEY = b'"example_id"'
_JSON_WS = " \t\n\r"  # JSON's whitespace; str.strip() alone would also accept "\x0b" and friends
_JSON_WS_BYTES = _JSON_WS.encode()
_DECODER = json.JSONDecoder()
_GLUED = re.compile(rb"\}[ \t\n\r]*\{")  # one object's end, then another's start


def _parse_fully(line: bytes) -> str:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadLine(f"not UTF-8 ({err.reason} at byte {err.start})") from None
    obj = load_object(text)
    if "example_id" not in obj:
        raise BadLine("no example_id")
    return checked_example_id(obj["example_id"])


def example_id_of(line: bytes) -> str:
    """str(example_id) of one JSONL line holding a JSON object: what `json.loads(line)["example_id"]`
    gives, read from the end of the line when it is there, by a full parse otherwise.

    Why reading the tail is right for valid JSON: in raw JSON text every quote inside a string is
    escaped, so a match of `"example_id"` whose first quote has no backslash before it is a string
    token of its own, and a `:` after it makes it a key. If its value is then followed only by `}`
    and the line's end, that `}` closes the object holding the key and nothing follows it: that
    object is the line's top-level object. It is the last occurrence in the text, which is also the
    one `json.loads` keeps when a key repeats. Unless the line holds two objects: two files glued
    where the first lacked its last newline, `{...}{..."example_id": 5}`, whose first object the tail
    never sees. A `}` then `{` anywhere sends the line to `json.loads`, which refuses it ("Extra
    data"); in the text of a document (LaTeX's `}{`) it only costs that line a full parse. Anything
    else (another key order, escapes in the key, nesting) is left to `json.loads` as well.
    """
    at = line.rfind(_KEY)
    # Only a line that opens an object: anything else before it (a byte-order mark, stray text)
    # is no JSON, and the full parse says so.
    if (
        at > 0
        and line[at - 1] != ord("\\")
        and line.lstrip(_JSON_WS_BYTES).startswith(b"{")
        and not _GLUED.search(line)
    ):
        rest = line[at + len(_KEY) :].lstrip(_JSON_WS_BYTES)
        if rest.startswith(b":"):
            try:
                tail = rest[1:].decode("utf-8").lstrip(_JSON_WS)
                value, end = _DECODER.raw_decode(tail)
            except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError: the full parse says why
                pass
            else:
                if tail[end:].strip(_JSON_WS) == "}":
                    return checked_example_id(value)
    return _parse_fully(line)


def selection_key(example_id: str, seed: int) -> bytes:
    """The digest that ranks an example for valid (smallest first)."""
    # surrogatepass: a JSON "\ud800" in an id still has bytes to hash, the same on every machine.
    return hashlib.sha256(f"{seed}:{example_id}".encode("utf-8", "surrogatepass")).digest()


def _open_binary(path: Path) -> IO[bytes]:
    # The NQ dev set ships gzipped; a .gz input is read through gzip and written out plain.
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return path.open("rb", buffering=1 << 20)


def _examples(path: Path, seed: int) -> Iterator[tuple[int, bytes, bytes]]:
    """(line number, raw line, selection key) of every non-blank line; a line without a usable
    example_id is an error naming the file and the line."""
    try:
        with _open_binary(path) as f:
            for line_no, line in enumerate(f, start=1):
                if line.isspace():  # a blank line (a trailing newline, say) is no example, as in the reader
                    continue
                try:
                    key = selection_key(example_id_of(line), seed)
                except BadLine as err:
                    raise DistqaError(f"{path}, line {line_no}: {err}") from None
                yield line_no, line, key
    except (gzip.BadGzipFile, zlib.error) as err:  # not gzip; damaged compressed data
        raise DistqaError(f"{path}: cannot be read as gzip ({err})") from None
    except EOFError:
        raise DistqaError(f"{path}: the gzip stream ends early (a truncated download?)") from None
    except OSError as err:  # only reading errors: the consumer's writes do not pass through here
        raise DistqaError(f"{path}: cannot be read ({err.strerror or err})") from None


@dataclass
class SplitResult:
    output: Path
    train: int
    valid: int
    # The input's size on disk (compressed for a .gz), what `ls -l` shows: the split reads it twice
    # (two passes), and a figure of both passes read as twice the file's size.
    bytes_read: int
    seconds: float


def _check_paths(source: Path, output: Path, overwrite: bool) -> None:
    if not source.is_file():
        raise DistqaError(f"--input {source} does not exist or is not a file")
    if output.exists() and not output.is_dir():
        raise DistqaError(f"--output {output} is a file, not a folder")
    existing = [name for name in OUTPUTS[:2] if (output / name).exists()]
    if existing and not overwrite:
        raise DistqaError(f"{output} already holds {' and '.join(existing)}: pass --overwrite to replace them")
    if any(source.resolve() == (output / name).resolve() for name in OUTPUTS):
        raise DistqaError(f"--input {source} is one of the files the split writes to {output}: choose another --output")


def _choose(source: Path, valid: int, seed: int) -> tuple[set[bytes], int]:
    """Pass 1: the keys of the examples for valid, and the number of examples."""
    seen: set[bytes] = set()
    for line_no, _, key in _examples(source, seed):
        if key in seen:
            raise DistqaError(f"{source}, line {line_no}: its example_id appears a second time")
        seen.add(key)
    if not seen:
        raise DistqaError(f"{source} holds no examples")
    if valid >= len(seen):
        raise DistqaError(f"--valid {valid} leaves no training examples: {source} holds {len(seen):,}; choose fewer")
    return set(heapq.nsmallest(valid, seen)), len(seen)


def _write(source: Path, staging: Path, chosen: set[bytes], seed: int) -> tuple[int, int]:
    """Pass 2: copy each line into staging's train.jsonl or valid.jsonl; (train, valid)."""
    counts = [0, 0]
    paths = [staging / "train.jsonl", staging / "valid.jsonl"]
    with paths[0].open("wb", buffering=1 << 20) as train, paths[1].open("wb", buffering=1 << 20) as held_out:
        for _, line, key in _examples(source, seed):
            out = key in chosen
            (held_out if out else train).write(line if line.endswith(b"\n") else line + b"\n")
            counts[out] += 1
    for path in paths:
        fsync_path(path)
    return counts[0], counts[1]


def _move_into_place(staging: Path, output: Path) -> None:
    # Old files go first, so a crash in between leaves some of the new files, never a mix.
    for name in reversed(OUTPUTS):
        (output / name).unlink(missing_ok=True)
    fsync_path(output)
    for name in OUTPUTS:
        (staging / name).rename(output / name)
    fsync_path(output)


def _remove_abandoned_staging(output: Path) -> None:
    """The staging folders of splits into `output` that were killed (up to a copy of the input each)."""
    for path in output.glob(".split-staging-*"):
        if path.is_dir() and abandoned(path):
            shutil.rmtree(path, ignore_errors=True)
            print(f"removed {path}, left by an interrupted split", flush=True)


def split_file(
    source: str | Path, output: str | Path, valid: int, *, seed: int = 0, overwrite: bool = False
) -> SplitResult:
    """Write output/train.jsonl, output/valid.jsonl and output/split.json (see the module's doc)."""
    source, output = Path(source), Path(output)
    if valid < 1:
        raise DistqaError(f"--valid {valid}: the number of validation examples must be at least 1")
    _check_paths(source, output, overwrite)
    size = source.stat().st_size
    started = time.perf_counter()
    chosen, examples = _choose(source, valid, seed)

    created = not output.exists()
    staging: Path | None = None
    held: int | None = None
    try:
        output.mkdir(parents=True, exist_ok=True)
        _remove_abandoned_staging(output)
        staging = Path(tempfile.mkdtemp(prefix=".split-staging-", dir=output))
        # Locked while written (closed with the process): a later split removes what a killed one left.
        held = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        lock_while_writing(held)
        train, held_out = _write(source, staging, chosen, seed)
        if (train + held_out, held_out) != (examples, valid):
            raise DistqaError(f"{source} changed while it was being split: run the split again")
        record = {
            "input": str(source.resolve()),
            "input_bytes": size,
            "valid": valid,
            "seed": seed,
            "train_examples": train,
            "valid_examples": held_out,
            "rule": f'valid holds the {valid} examples with the smallest SHA-256 of "{seed}:<example_id>"',
        }
        (staging / "split.json").write_text(json.dumps(record, indent=2) + "\n")
        fsync_path(staging / "split.json")
        # Two splits into one folder at once: each moves its files in holding the folder's lock, or
        # one's train.jsonl went beside the other's valid.jsonl (27 of 30 validation examples also
        # in training). The later one, without --overwrite, then finds the first one's files.
        with held_exclusively(output, lambda: print(f"waiting for another split into {output}", flush=True)):
            if not overwrite:
                _check_paths(source, output, overwrite)
            _move_into_place(staging, output)
    except OSError as err:
        raise DistqaError(f"cannot write the split into {output} ({err.strerror or err})") from None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if held is not None:
            os.close(held)
        if created and output.is_dir() and not any(output.iterdir()):
            output.rmdir()
    return SplitResult(output, train, held_out, size, time.perf_counter() - started)
