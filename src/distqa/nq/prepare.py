"""`distqa prepare`: Natural Questions JSONL to a cached, memory-mappable `datasets` dataset.

The input is cut into byte ranges, one per process (`--num-proc`); each process streams its range,
builds features with its own word cache and writes Arrow through `datasets.Dataset.from_generator`.
The result is saved with `save_to_disk` under a fingerprint of (input file, tokenizer, settings):
running `prepare` again with the same three reuses it, and `distqa train` reads the same cache.
How the folder is staged, committed and written by one process at a time: `distqa.nq.feature_folder`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import datasets
from transformers import AutoTokenizer

from distqa.durable import write_atomically
from distqa.errors import DistqaError
from distqa.models import load_error
from distqa.nq import feature_stamp
from distqa.nq.feature_folder import (
    BAD_LINES_KEPT,
    FINGERPRINT_FILE,
    PrepareResult,
    claim,
    commit,
    one_writer,
    open_staging,
    read_stamp,
    recorded_result,
    summary,
)
from distqa.nq.feature_stamp import (
    CONTENT_KEY,
    INPUT_FILE,
    content_digest,
    fingerprint,
    input_record,
    load_features,
    same_input,
)
from distqa.nq.features import FeatureBuilder, FeatureSettings, require_cls_and_sep
from distqa.nq.reader import NQReader, byte_ranges, refuse_unreadable_start
from distqa.parent_watch import children_die_with_me, inherited_objects_frozen
from distqa.rank0 import reason

FEATURES = datasets.Features(
    {
        "example_id": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "token_type_ids": datasets.Sequence(datasets.Value("int8")),
        "attention_mask": datasets.Sequence(datasets.Value("int8")),
        "start_positions": datasets.Value("int32"),
        "end_positions": datasets.Value("int32"),
        "answer_type": datasets.Value("int8"),
        "token_map": datasets.Sequence(datasets.Value("int32")),
    }
)


def _generate(shards: list[dict[str, Any]]) -> Any:
    """Runs in each worker process: stream its byte ranges, yield features, record its counts.

    A user-facing error (a malformed line) is written to the shard's stats file instead of being
    raised: across the process pool `datasets` would wrap it and lose the message.
    """
    for shard in shards:
        tokenizer = AutoTokenizer.from_pretrained(shard["tokenizer"])
        builder = FeatureBuilder(tokenizer, FeatureSettings(**shard["settings"]))
        reader = NQReader(
            shard["path"],
            skip_bad_lines=shard["skip_bad_lines"],
            byte_range=tuple(shard["range"]),
            # Evaluation features are grouped by example id (validation, predict): ids must be unique.
            keyed_by_id=not shard["settings"]["training"],
            training=shard["settings"]["training"],
        )
        stats: dict[str, Any] = {"docs": 0, "features": 0, "started": time.time()}  # after start-up
        try:
            for example in reader:
                stats["docs"] += 1
                for feature in builder(example):
                    stats["features"] += 1
                    yield feature
        except (DistqaError, ValueError) as err:  # a bad line; settings that leave no room for text
            stats["error"] = str(err)
        stats.update(bad_lines=reader.bad_lines, finished=time.time())
        if reader.training:  # compared across shards (`_refuse_repeated_ids`): most examples leave no window
            stats["ids"] = reader.ids
        Path(shard["stats"]).write_text(json.dumps(stats))
        if "error" in stats:
            return


def _fast_tokenizer(name: str) -> Any:
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:  # the hub unreachable, or a name neither cached nor a folder
        raise load_error("tokenizer", name, err, "model.tokenizer") from None
    if not getattr(tokenizer, "is_fast", False):
        raise DistqaError(f"tokenizer {name!r} has no fast (Rust) version, which prepare needs")
    require_cls_and_sep(tokenizer)  # here, not in the workers: theirs read as a crash
    return tokenizer


def _shard_stats(shards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The counts each worker wrote (those that got as far as writing them)."""
    return [json.loads(Path(s["stats"]).read_text()) for s in shards if Path(s["stats"]).is_file()]


def _generate_all(source: Path, shards: list[dict[str, Any]], num_proc: int, staging: Path) -> datasets.Dataset:
    """Every shard's features in one dataset, built by up to `num_proc` processes."""
    try:
        with children_die_with_me(), inherited_objects_frozen():
            dataset = datasets.Dataset.from_generator(
                _generate,
                features=FEATURES,
                gen_kwargs={"shards": shards},  # a list: datasets gives each process its share
                num_proc=min(len(shards), num_proc) if num_proc > 1 else None,
                cache_dir=str(staging / "cache"),
            )
    except Exception as err:
        # A worker's own error explains more than the wrapper `datasets` raises around it.
        stats = _shard_stats(shards)
        errors = [s["error"] for s in stats if "error" in s]
        if errors:
            raise DistqaError(errors[0]) from None
        if len(stats) < len(shards):  # a worker that wrote no counts died (a crash, or out of memory)
            raise DistqaError(
                f"a process preparing {source} ended before finishing "
                f"({reason(err)}): killed (out of memory?) "
                "or crashed; nothing was kept: run again"
            ) from err
        if sum(s["features"] for s in stats) == 0:
            raise DistqaError(_no_features(source, stats, training=shards[0]["settings"]["training"])) from None
        raise
    stats = _shard_stats(shards)
    errors = [s["error"] for s in stats if "error" in s]
    if errors:
        raise DistqaError(errors[0])
    if len(shards) > 1:
        docs = sum(s["docs"] for s in stats)
        training = shards[0]["settings"]["training"]
        distinct = len(set().union(*(s["ids"] for s in stats))) if training else len(dataset.unique("example_id"))
        _refuse_repeated_ids(source, distinct, docs)
    return dataset


def _no_features(source: Path, stats: list[dict[str, Any]], *, training: bool) -> str:
    """Why `source` gave no features: no examples at all, or (training) every window dropped."""
    docs, skipped = sum(s["docs"] for s in stats), sum(len(s["bad_lines"]) for s in stats)
    if docs == 0:
        why = f"all {skipped} of its lines were skipped as bad (task.skip_bad_lines)" if skipped else "it is blank"
        return f"{source} holds no examples: {why}"
    if training:
        return (
            f"{source} produced no features from its {docs} example(s): every window was dropped "
            "(task.keep_unknown keeps that fraction of the windows without an answer)"
        )
    return f"{source} produced no features from its {docs} example(s)"


def _refuse_repeated_ids(source: Path, distinct: int, docs: int) -> None:
    """Each shard refused an id repeated inside it; one repeated across shards shows as fewer
    `distinct` ids than documents: those of an evaluation feature set (a window of every document),
    those each training shard read. Only then is the file read again, to name the two lines."""
    if distinct == docs:
        return
    for _ in NQReader(source, skip_bad_lines=True, keyed_by_id=True):
        pass  # raises at the second line of the first repeated id
    raise DistqaError(f"{source}: an example_id appears on more than one line: each example must appear once")


def prepare_features(
    input_path: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    tokenizer_name: str,
    settings: FeatureSettings,
    num_proc: int = 1,
    skip_bad_lines: bool = False,
) -> PrepareResult:
    """Build (or reuse) the features of `input_path` in `output_dir`."""
    source, target = Path(input_path), Path(output_dir)
    # Before the output folder is claimed (created): a file that yields nothing leaves no folder.
    _refuse_unusable_input(source)
    fp = fingerprint(source, _fast_tokenizer(tokenizer_name), settings)
    stamp = target / FINGERPRINT_FILE
    recorded = read_stamp(stamp)
    if _reusable(recorded, fp, target, skip_bad_lines, source, may_hash=False) is not None:
        return recorded_result(target, recorded)  # type: ignore[arg-type]
    # One writer at a time (two runs sharing a cache, nodes on shared storage, `prepare` beside a
    # training run): each would otherwise delete the other's staging folder mid-write. A waiter
    # then finds the folder the other one wrote, and reuses it if it is what it needs.
    claim(target)
    with one_writer(target):
        recorded = read_stamp(stamp)
        judged = _reusable(recorded, fp, target, skip_bad_lines, source, may_hash=True)
        if judged is not None:
            kept = recorded[INPUT_FILE]  # type: ignore[index]
            if kept.get("ctime_ns") != judged:  # the same bytes under a new change time: the next use is quick
                recorded[INPUT_FILE] = {**kept, "ctime_ns": judged}  # type: ignore[index]
                with contextlib.suppress(OSError):  # a cache this process may not write: hashed each time
                    write_atomically(stamp, json.dumps(recorded, indent=2).encode())
            return recorded_result(target, recorded)  # type: ignore[arg-type]
        return _prepare_into(source, target, fp, settings, tokenizer_name, num_proc, skip_bad_lines)


def _reusable(
    recorded: dict[str, Any] | None,
    fp: dict[str, Any],
    target: Path,
    skip_bad_lines: bool,
    source: Path,
    *,
    may_hash: bool,
) -> int | None:
    """The input's change time the reuse was judged at when a stamped folder holds what this call
    would make, else None: the same fingerprint and input bytes (`same_input`; not reusable where
    they would need hashing and `may_hash` is false), whole, and no skipped line unless this call
    skips them too (task.skip_bad_lines is not in the key: a strict run reusing an entry made by a
    skipping one trained on without the lines, where its own build stops at the first; it builds,
    and stops there, leaving the entry as it was)."""
    if recorded is None or recorded.get("fingerprint") != fp:
        return None
    if recorded.get("bad_lines") and not skip_bad_lines:
        return None
    same, judged = same_input(recorded, source, may_hash=may_hash)
    return judged if same and _whole(target) else None


def _whole(target: Path) -> bool:
    """Whether the features of a stamped folder load, all of them, with the content they were
    written with: a damaged one is made again. Under torchrun the node's local rank 0 reads the
    content (it resolves the cache first, `local_main_first`); the node's other ranks then find the
    same files and check their count only."""
    try:
        load_features(target, verify=local_main())
    except DistqaError:
        return False
    return True


def local_main() -> bool:
    """Whether this process is its node's first (LOCAL_RANK 0, or not under torchrun)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _refuse_unusable_input(source: Path) -> None:
    """One line for an input no shard could read an example from, said by this process: raised in
    a worker, `datasets` would wrap it, and the file would be called blank."""
    if not source.is_file():
        raise DistqaError(f"{source} does not exist or is not a file")
    refuse_unreadable_start(source)  # gzip, a byte-order mark: as NQReader says it
    with source.open("rb") as f:
        # Stops at the first byte of a real file; reads to the end only a file of whitespace.
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return
    raise DistqaError(f"{source} holds no examples: it is blank")


def _prepare_into(
    source: Path,
    target: Path,
    fp: dict[str, Any],
    settings: FeatureSettings,
    tokenizer_name: str,
    num_proc: int,
    skip_bad_lines: bool,
) -> PrepareResult:
    """Build the features of `source` in a staging folder and commit them to `target` (held locked)."""
    stamp = target / FINGERPRINT_FILE
    # Before the input is read: a write while it is prepared leaves another change time, so the
    # next use hashes it again and finds other bytes than these features were made from.
    read_before = input_record(source)
    staging = open_staging(target)
    committing = False
    try:
        shards = [
            {
                "path": str(source),
                "range": r,
                "tokenizer": tokenizer_name,
                "settings": dataclasses.asdict(settings),
                "skip_bad_lines": skip_bad_lines,
                "stats": str(staging / f"stats-{i}.json"),
            }
            for i, r in enumerate(byte_ranges(source, max(1, num_proc)))
        ]
        dataset = _generate_all(source, shards, num_proc, staging)
        if feature_stamp.change_time_ns(source.stat()) != read_before["ctime_ns"]:
            # Written to while read: the features hold a mix, and the digest is of the bytes before.
            raise DistqaError(f"{source} changed while its features were being prepared: nothing was kept: run again")
        result = summary(target, _shard_stats(shards))
        record = {
            "fingerprint": fp,
            INPUT_FILE: read_before,
            "docs": result.docs,
            "features": result.features,
            "bad_lines": result.skipped,
            "bad_line_samples": result.bad_lines[:BAD_LINES_KEPT],
        }
        try:
            dataset.save_to_disk(str(staging / "dataset"))
            # What was written, read back from the files themselves: what a reuse compares.
            record[CONTENT_KEY] = content_digest(datasets.load_from_disk(str(staging / "dataset")))
            committing = True
            commit(target, staging / "dataset", json.dumps(record, indent=2))
        except OSError as err:  # a full disk, a folder made read-only meanwhile
            raise DistqaError(f"cannot write features to {target}: {err.strerror or err}") from None
        return result
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if committing and not stamp.is_file():
            # Stopped half-way through the swap: keep the (now empty) marker, so that the next
            # run knows this stamp-less folder is a partial one of ours and rebuilds it.
            staging.mkdir(exist_ok=True)
