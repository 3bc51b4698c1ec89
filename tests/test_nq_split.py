"""`distqa split`: a validation set carved out of an NQ train file, by example id, all or nothing."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conftest import TESTS, help_texts
from distqa.cli import main
from distqa.nq import split
from distqa.nq.reader import BadLine

FIXTURES = TESTS / "fixtures" / "nq"
REAL = [
    *(FIXTURES / "simplified-nq-sample.jsonl").read_bytes().splitlines(keepends=True),
    *(FIXTURES / "train_sample.jsonl").read_bytes().splitlines(keepends=True),
]


def generated(n: int) -> list[bytes]:
    """Small NQ-shaped lines: integer ids (train), string ids (test), the id first or last, spacing."""
    lines = []
    for i in range(n):
        example_id: int | str = -(10**18) + 7919 * i if i % 3 else f"-{i}5312"
        doc = {"document_text": f"<P> doc {i} </P>", "question_text": "q?", "long_answer_candidates": []}
        obj = {"example_id": example_id, **doc} if i % 4 == 0 else {**doc, "example_id": example_id}
        lines.append((json.dumps(obj, indent=None if i % 5 else 0).replace("\n", " ") + "\n").encode())
    return lines


LINES = REAL + generated(40)


def run(tmp_path: Path, lines: list[bytes], *args: str, name: str = "in.jsonl") -> tuple[int, Path]:
    source = tmp_path / name
    source.write_bytes(b"".join(lines))
    out = tmp_path / "out"
    return main(["split", "--input", str(source), "--output", str(out), *args]), out


def ids_of(lines: list[bytes]) -> set[str]:
    return {str(json.loads(line)["example_id"]) for line in lines}


def test_split_is_a_disjoint_partition_with_exactly_n_valid(tmp_path, capsys):
    code, out = run(tmp_path, LINES, "--valid", "7")
    assert code == 0
    train = (out / "train.jsonl").read_bytes().splitlines(keepends=True)
    valid = (out / "valid.jsonl").read_bytes().splitlines(keepends=True)
    assert len(valid) == 7
    assert Counter(train) + Counter(valid) == Counter(LINES)  # the same bytes, each line once
    assert not ids_of(train) & ids_of(valid)
    # The documented rule, computed here from json.loads: the 7 smallest SHA-256 of "0:<id>".
    ranked = sorted(ids_of(LINES), key=lambda i: hashlib.sha256(f"0:{i}".encode()).digest())
    assert ids_of(valid) == set(ranked[:7])
    record = json.loads((out / "split.json").read_text())
    assert record["input"] == str((tmp_path / "in.jsonl").resolve())
    assert record["input_bytes"] == len(b"".join(LINES))
    assert (record["valid"], record["train_examples"], record["valid_examples"]) == (7, len(LINES) - 7, 7)
    assert "SHA-256" in record["rule"]
    assert sorted(p.name for p in out.iterdir()) == ["split.json", "train.jsonl", "valid.jsonl"]  # no staging
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"wrote {out}: {len(LINES) - 7} train and 7 valid examples (") and last.endswith(" MB/s)")


def test_the_selection_depends_on_ids_and_seed_not_on_line_order(tmp_path):
    shuffled = LINES[:]
    random.Random(1).shuffle(shuffled)
    chosen = []
    for i, (lines, seed) in enumerate([(LINES, "0"), (shuffled, "0"), (LINES, "1")]):
        (tmp_path / str(i)).mkdir()
        code, out = run(tmp_path / str(i), lines, "--valid", "9", "--seed", seed)
        assert code == 0
        chosen.append(ids_of((out / "valid.jsonl").read_bytes().splitlines()))
    assert chosen[0] == chosen[1]
    assert chosen[0] != chosen[2]


def test_gzip_input_blank_lines_and_a_missing_last_newline(tmp_path):
    lines = [*LINES[:20], b"\n", b"  \r\n", LINES[20].rstrip(b"\n")]
    source = tmp_path / "in.jsonl.gz"
    source.write_bytes(gzip.compress(b"".join(lines)))
    assert main(["split", "--input", str(source), "--valid", "5", "--output", str(tmp_path / "out")]) == 0
    written = b"".join((tmp_path / "out" / name).read_bytes() for name in ("train.jsonl", "valid.jsonl"))
    assert written.endswith(b"\n")  # the unterminated line gained one, or the next line would join it
    assert Counter(written.splitlines()) == Counter(line.rstrip(b"\r\n") for line in lines if line.strip())


def test_a_damaged_gzip_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    from test_nq_metric import damaged_gzip

    code, out = run(tmp_path, [damaged_gzip(b"".join(LINES))], "--valid", "5", name="in.jsonl.gz")
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"distqa: error: {tmp_path / 'in.jsonl.gz'}: cannot be read as gzip") and "\n" not in err


def test_the_figure_read_is_the_input_s_size_on_disk(tmp_path, capsys):
    """0.5 MB of input says 0.5 MB read (not both passes' 1.0 MB); a .gz input, its compressed size."""
    lines = generated(30)
    pad = 500_000 - len(b"".join(lines))
    lines[-1] = lines[-1].replace(b'"q?"', b'"q?' + b" " * pad + b'"', 1)  # a longer question: still JSON
    assert len(b"".join(lines)) == 500_000
    code, out = run(tmp_path, lines, "--valid", "3")
    assert code == 0
    assert "(0.5 MB read in " in capsys.readouterr().out.strip().splitlines()[-1]
    assert split.split_file(tmp_path / "in.jsonl", out, 3, overwrite=True).bytes_read == 500_000
    packed = tmp_path / "in.jsonl.gz"
    packed.write_bytes(gzip.compress(b"".join(lines)))
    assert split.split_file(packed, tmp_path / "gz", 3).bytes_read == packed.stat().st_size


def test_existing_outputs_need_overwrite_and_a_failed_split_keeps_them(tmp_path, capsys, monkeypatch):
    assert run(tmp_path, LINES, "--valid", "3")[0] == 0
    out = tmp_path / "out"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert run(tmp_path, LINES, "--valid", "4")[0] == 2
    assert capsys.readouterr().err.strip() == (
        f"distqa: error: {out} already holds train.jsonl and valid.jsonl: pass --overwrite to replace them"
    )

    def disk_full(path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(split, "fsync_path", disk_full)
    assert run(tmp_path, LINES, "--valid", "4", "--overwrite")[0] == 2
    assert capsys.readouterr().err.strip().endswith(f"cannot write the split into {out} (No space left on device)")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing lost, no staging left

    monkeypatch.undo()
    assert run(tmp_path, LINES, "--valid", "4", "--overwrite")[0] == 0
    assert len((out / "valid.jsonl").read_bytes().splitlines()) == 4


@pytest.mark.safety  # about 5 s: make test-safety, for make test's 5 minutes
def test_two_splits_into_one_folder_move_their_files_in_one_after_the_other(tmp_path, capsys):
    """Their renames interleaved: one split's train.jsonl beside the other's valid.jsonl, both exit 0
    (27 of 30 validation examples were also in training). Each moves its files in holding the
    folder's lock; one without --overwrite then finds the other's files and refuses."""
    import fcntl
    import os
    import threading

    source, out = tmp_path / "in.jsonl", tmp_path / "out"
    source.write_bytes(b"".join(generated(50)))
    out.mkdir()
    held = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)  # another split is moving its files in
    results: dict[str, object] = {}

    def second(seed: int, overwrite: bool) -> None:
        try:
            results[seed] = split.split_file(source, out, 5, seed=seed, overwrite=overwrite)
        except split.DistqaError as err:
            results[seed] = err

    waiting = threading.Thread(target=second, args=(1, False))
    waiting.start()
    waiting.join(timeout=5)
    assert waiting.is_alive() and f"waiting for another split into {out}" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == []  # nothing moved in
    split.split_file(source, tmp_path / "first", 5, seed=0)
    for name in ("train.jsonl", "valid.jsonl", "split.json"):  # the other split's files, as it moves them in
        (tmp_path / "first" / name).rename(out / name)
    os.close(held)
    waiting.join(timeout=30)
    assert isinstance(results[1], split.DistqaError) and "already holds train.jsonl and valid.jsonl" in str(results[1])
    assert json.loads((out / "split.json").read_text())["seed"] == 0
    second(2, True)  # --overwrite: its own three files, whole
    assert json.loads((out / "split.json").read_text())["seed"] == 2
    train, valid = (
        ids_of((out / name).read_bytes().splitlines(keepends=True)) for name in ("train.jsonl", "valid.jsonl")
    )
    assert len(valid) == 5 and not train & valid and len(train | valid) == 50


def test_a_failure_while_writing_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(split, "fsync_path", lambda path: (_ for _ in ()).throw(OSError(28, "No space left")))
    assert run(tmp_path, LINES, "--valid", "3")[0] == 2
    assert not (tmp_path / "out").exists()


BAD = {
    "all": (LINES[:5], ["--valid", "5"], "--valid 5 leaves no training examples: {src} holds 5; choose fewer"),
    "more": (LINES[:5], ["--valid", "6"], "--valid 6 leaves no training examples: {src} holds 5; choose fewer"),
    "zero": (LINES, ["--valid", "0"], "--valid 0: the number of validation examples must be at least 1"),
    "negative": (LINES, ["--valid", "-3"], "--valid -3: the number of validation examples must be at least 1"),
    "truncated": ([*LINES[:2], LINES[2][:5000] + b"\n", *LINES[3:]], ["--valid", "2"], "{src}, line 3: not valid JSON"),
    "no id": ([*LINES[:3], b'{"question_text": "q"}\n'], ["--valid", "1"], "{src}, line 4: no example_id"),
    "not an object": ([LINES[0], b"[1, 2]\n"], ["--valid", "1"], "{src}, line 2: not a JSON object"),
    "bool id": ([LINES[0], b'{"example_id": true}\n'], ["--valid", "1"], "{src}, line 2: example_id is bool"),
    "duplicate": (
        [*LINES[:6], LINES[1]],
        ["--valid", "2"],
        "{src}, line 7: its example_id appears a second time",
    ),
    # \x0c is whitespace to Python's strip() but not to JSON: the line is not valid JSON.
    "junk after": ([LINES[0], b'{"example_id": 5}\x0c\n'], ["--valid", "1"], "{src}, line 2: not valid JSON"),
    "empty": ([b"\n"], ["--valid", "1"], "{src} holds no examples"),
    # Text before the object: the id read from the line's end would have made it an example.
    "stray text": ([LINES[0], b'GARBAGE {"example_id": 77}\n'], ["--valid", "1"], "{src}, line 2: not valid JSON"),
    "byte-order mark": ([b"\xef\xbb\xbf" + LINES[0], LINES[1]], ["--valid", "1"], "{src}, line 1: not valid JSON"),
    # Two files glued where the first lacked its last newline: the id read from the line's end was
    # the second object's, and the first example was lost ("6 train and 3 valid" of 10).
    "glued": (
        [*LINES[:2], LINES[2].rstrip(b"\n") + LINES[3], *LINES[4:]],
        ["--valid", "2"],
        "{src}, line 3: not valid JSON",
    ),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, case):
    lines, args, expected = BAD[case]
    code, out = run(tmp_path, lines, *args)
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("distqa: error: " + expected.format(src=tmp_path / "in.jsonl")), err
    assert not out.exists()


def test_bad_paths_are_one_line(tmp_path, capsys):
    source = tmp_path / "train.jsonl"
    source.write_bytes(b"".join(LINES))
    cases = [
        (tmp_path / "nope.jsonl", tmp_path / "o", f"--input {tmp_path / 'nope.jsonl'} does not exist or is not a file"),
        (source, source, f"--output {source} is a file, not a folder"),
        # Splitting DIR/train.jsonl into DIR would delete the input it reads.
        (source, tmp_path, f"--input {source} is one of the files the split writes to {tmp_path}"),
    ]
    for src, out, expected in cases:
        assert main(["split", "--input", str(src), "--valid", "2", "--output", str(out), "--overwrite"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"distqa: error: {expected}"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.jsonl"]
    assert source.read_bytes() == b"".join(LINES)


def test_help_imports_no_torch():
    (text,) = help_texts(["split"])
    assert "--valid N" in text and "--overwrite" in text


# ---- the example_id scanner ----


def test_real_lines_take_the_fast_path(monkeypatch):
    """NQ train puts example_id last: no line of the fixtures may need the full json.loads."""
    monkeypatch.setattr(split, "_parse_fully", lambda line: pytest.fail("parsed the whole line"))
    assert [split.example_id_of(line) for line in REAL] == [str(json.loads(line)["example_id"]) for line in REAL]


KEYS = st.sampled_from(
    ["example_id", "a", 'x"example_id', 'x"example_id"', "example_id\\", '"example_id": 1}', "\\"]
) | st.text(max_size=4)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | KEYS
)
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3), max_leaves=6
)
SPACE = st.sampled_from(["", " ", "\t", "\r\n", "  "])


@st.composite
def json_object_lines(draw) -> str:
    """A JSON object with duplicate keys allowed, the key written plainly or with a \\u escape,
    and JSON whitespace anywhere between tokens."""
    ascii_only = draw(st.booleans())  # without it, lone surrogates could not be written as UTF-8
    keys = st.sampled_from(['"example_id"', '"example\\u005fid"']) | KEYS.map(lambda k: json.dumps(k))
    pairs = draw(st.lists(st.tuples(keys, VALUES), max_size=4))
    if draw(st.booleans()):
        position = draw(st.integers(0, len(pairs)))
        pairs.insert(position, ('"example_id"', draw(st.integers() | st.text(max_size=8) | VALUES)))
    s = lambda: draw(SPACE)  # noqa: E731
    dump = lambda v: json.dumps(v, ensure_ascii=ascii_only, allow_nan=False)  # noqa: E731
    body = ",".join(f"{s()}{k}{s()}:{s()}{dump(v)}{s()}" for k, v in pairs)
    line = f"{s()}{{{body}}}{s()}" + draw(st.sampled_from(["", "\n", "\r\n"]))
    assume(ascii_only or not any(0xD800 <= ord(c) <= 0xDFFF for c in line))  # UTF-8 cannot hold them
    return line


@settings(max_examples=150, deadline=None)
@given(json_object_lines())
def test_example_id_of_agrees_with_json_loads(line):
    obj = json.loads(line)
    value = obj.get("example_id", None)
    surrogate = isinstance(value, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in value)  # refused, as by prepare
    if "example_id" in obj and isinstance(value, (str, int)) and not isinstance(value, bool) and not surrogate:
        assert split.example_id_of(line.encode()) == str(value)
    else:
        with pytest.raises(BadLine):
            split.example_id_of(line.encode())


def test_a_staging_folder_a_killed_split_left_is_removed_and_a_live_ones_kept(tmp_path, capsys):
    """A split killed while writing left `.split-staging-*` (up to a copy of the 17 GB input) that
    no later split removed. What a SIGKILL leaves: the folder, its writer's lock gone with it."""
    import os
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    killed, live = out / ".split-staging-killed", out / ".split-staging-live"
    for folder in (killed, live):
        folder.mkdir(parents=True)
        (folder / "train.jsonl").write_bytes(b"x" * 1000)
    holder = subprocess.Popen(  # a split still writing: it holds its staging folder's lock
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", str(live)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        old = time.time() - 3600
        for folder in (killed, live):
            os.utime(folder, (old, old))
        status, _ = run(tmp_path, LINES, "--valid", "5")
        assert status == 0
        assert not killed.exists() and (live / "train.jsonl").is_file()
        assert f"removed {killed}, left by an interrupted split" in capsys.readouterr().out
        assert sorted(p.name for p in out.iterdir()) == [
            ".split-staging-live",
            "split.json",
            "train.jsonl",
            "valid.jsonl",
        ]
    finally:
        holder.kill()
        holder.wait()
