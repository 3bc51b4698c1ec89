"""What a prepared feature folder records of how it was made (its stamp), and reading it back whole.

`fingerprint` keys the cache (the input file, the tokenizer's contents, the settings); `made_otherwise`
compares a folder `distqa prepare` wrote with what a run would make, so that a run never trains on
features of another tokenizer, length or mode while its config.yaml says otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

from distqa.data_identity import arrow_fingerprint
from distqa.durable import file_digest
from distqa.errors import DistqaError
from distqa.nq.feature_folder import FINGERPRINT_FILE, read_stamp
from distqa.nq.features import FeatureSettings, spells_after_space
from distqa.rank0 import reason

# Bump when the feature layout or the targets change: old caches must not be reused.
FEATURES_VERSION = 2
# Bump when the reader refuses lines it used to read: features made from such lines must not be
# reused, since a reused cache never reads its input again. 1: lines without
# long_answer_candidates, or annotations without long_answer, short_answers or yes_no_answer (read
# as "none": every target "no answer"), training lines without annotations, repeated ids. 2:
# training lines whose annotations are an empty list, or no list ({}, false, "").
INPUT_CHECKS = 2
CONTENT_KEY = "content"  # the stamp's digest of every value the folder holds (`content_digest`)


def fingerprint(input_path: Path, tokenizer: Any, settings: FeatureSettings) -> dict[str, Any]:
    """What the features depend on. The tokenizer enters by content, not name: a local folder
    edited in place must not reuse features made with its old vocabulary. Evaluation features keep
    every window, so the subsampling settings (keep_unknown, seed) are left out of theirs: `predict`
    then reuses the folder that validation during training prepared from the same file."""
    stat = input_path.stat()
    made = made_with(tokenizer, settings)
    return {
        "version": made["version"],
        "input": str(input_path.resolve()),
        "input_size": stat.st_size,
        "input_mtime_ns": stat.st_mtime_ns,
        "tokenizer": made["tokenizer"],
        "settings": made["settings"],
    }


def change_time_ns(stat: os.stat_result) -> int:
    """The input's change time (a function: a test stands in a file system that keeps none)."""
    return stat.st_ctime_ns


# The key above holds the input's path, size and modification time, which an edit in place can
# keep (`touch -r` restores the mtime): a corrected label then reused the old features, exit 0. So
# the stamp also records the input's change time, which any write sets and nothing can set back,
# and a digest of its bytes. The same change time: the same file, at no cost. Another (an edit,
# or only a chmod, a chown, a hard link, a Kubernetes fsGroup re-chown at each pod start): the
# file is hashed (a read of it: 5.7 GB/s from the page cache here, docs/benchmarks.md, else the
# disk's read rate) and reused only if its bytes are the ones prepared; the stamp then takes the
# change time read before that hash.
INPUT_FILE = "input_file"


def input_record(path: Path) -> dict[str, Any]:
    """What the stamp keeps of the input: its change time, then a digest of its bytes (in that
    order: a write during the hash leaves another change time, and the next use hashes again)."""
    changed = change_time_ns(path.stat())
    return {"ctime_ns": changed, "digest": input_digest(path)}


def input_digest(path: Path) -> str:
    import xxhash  # a dependency of `datasets`: it hashes faster than a disk reads

    return file_digest(path, xxhash.xxh3_128())


def same_input(stamp: dict[str, Any], path: Path, *, may_hash: bool) -> tuple[bool | None, int]:
    """Whether `path` holds the bytes the stamp's features were prepared from: True, False, or None
    when its change time moved and `may_hash` is false (the caller hashes it under the writer's lock,
    where it may also write the stamp's new change time); and the change time read before any
    hashing, the one a refreshed stamp may keep: an edit during the hash leaves another, so the next
    use hashes again (the time read after it once blessed such an edit for good)."""
    changed = change_time_ns(path.stat())
    kept = stamp.get(INPUT_FILE)
    if not isinstance(kept, dict):  # stamped by an older distqa: prepared again
        return False, changed
    if kept.get("ctime_ns") == changed:
        return True, changed
    return (kept.get("digest") == input_digest(path) if may_hash else None), changed


def made_with(tokenizer: Any, settings: FeatureSettings) -> dict[str, Any]:
    """The part of `fingerprint` that is not the input file: how its features were made."""
    used = dataclasses.asdict(settings)
    used["input_checks"] = INPUT_CHECKS
    if not settings.training:
        del used["keep_unknown"], used["seed"]
        used["ids_checked"] = True  # repeated/unusable ids refused: folders made before are made again
    if spells_after_space(tokenizer.backend_tokenizer):
        # Words encoded after a space (byte-level BPE): features an older distqa made of such a
        # tokenizer spelt each word alone, and must not be reused. Other tokenizers' keys are as before.
        used["words"] = "after a space"
    vocab = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]
    return {"version": FEATURES_VERSION, "tokenizer": vocab, "settings": used}


# The settings of a prepared folder's stamp, by the key that gives each. Not the seed: it picks
# which unknown windows task.keep_unknown keeps, an equally fair sample whatever it is, and a run's
# seed (its initialisation and data order) may differ from the one its features were prepared with.
SETTING_KEYS = {
    "max_seq_len": "task.max_seq_len",
    "doc_stride": "task.doc_stride",
    "max_query_len": "task.max_query_len",
    "keep_unknown": "task.keep_unknown",
}


def stamp_of(folder: Path) -> dict[str, Any]:
    """The stamp of a folder `distqa prepare` wrote. One it cannot read was taken for one of other
    settings ("give the settings they were prepared with"), or of an older distqa (a review)."""
    stamp = read_stamp(folder / FINGERPRINT_FILE)
    if stamp is None:
        raise DistqaError(
            f"the features at {folder} are damaged: their stamp {FINGERPRINT_FILE} cannot be read as the "
            f"record `distqa prepare` writes: delete {folder} and prepare the features again"
        )
    return stamp


def made_otherwise(folder: Path, tokenizer: Any, settings: FeatureSettings) -> list[str]:
    """How the features in a folder `distqa prepare` wrote differ from those a run would make from
    the same input (none: the run may use them as they are)."""
    recorded = stamp_of(folder).get("fingerprint")
    if not isinstance(recorded, dict):
        return ["its stamp records no settings"]
    wanted, differ = made_with(tokenizer, settings), []
    if recorded.get("version") != wanted["version"]:
        differ.append(f"feature layout {recorded.get('version')}, where this distqa reads {FEATURES_VERSION}")
    if recorded.get("tokenizer") != wanted["tokenizer"]:
        differ.append("another tokenizer (its vocabulary is not model.tokenizer's, or model.name's)")
    there = dict(recorded["settings"]) if isinstance(recorded.get("settings"), dict) else {}
    here = dict(wanted["settings"])
    there.pop("seed", None), here.pop("seed", None)
    if there.get("training") != here["training"]:
        mode = "train" if there.get("training") else "eval"
        return [
            *differ,
            f"prepared with --mode {mode}, used here for {'training' if here['training'] else 'evaluation'}",
        ]
    differ += [f"{key}={there.get(name)!r} there, {here[name]!r} here" for name, key in SETTING_KEYS.items()
               if name in here and there.get(name) != here[name]]  # fmt: skip
    if not differ and there.get("input_checks", 0) < INPUT_CHECKS:
        differ.append(
            "prepared by an older distqa, whose reader took lines this one refuses (e.g. a line without "
            "long_answer_candidates as one without candidates)"
        )
    elif not differ and there != here:
        differ.append("prepared by an older distqa")
    return differ


def fingerprint_key(fp: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:20]


def content_digest(dataset: datasets.Dataset) -> str:
    """Every value of every column, in order (`arrow_fingerprint`): what `distqa prepare` records
    of the features it wrote, and what a check of them reads again."""
    return arrow_fingerprint(dataset)


def load_features(path: str | os.PathLike, *, verify: bool = False) -> datasets.Dataset:
    """Memory-map a prepared folder (nothing is read into RAM until used), whole: a file cut short
    (an interrupted copy) is one line, not a traceback, nor fewer features without a word.

    `verify`: also read every value and compare it with the digest the stamp recorded (0.4 to 0.7 s
    for the full training set's 3.7 GB, docs/benchmarks.md). Arrow keeps no checksum of its
    data: a file zeroed in part (a copy into preallocated space that stopped) loaded with its row
    count intact, and a run trained on empty attention masks. Done once per node per start."""
    folder = Path(path)
    if not (folder / FINGERPRINT_FILE).is_file():
        raise DistqaError(f"{folder} is not a folder written by `distqa prepare`")
    fix = f"delete {folder} and prepare the features again"
    try:
        dataset = datasets.load_from_disk(str(folder))
    # FileNotFoundError, a truncated Arrow file; JSON of another shape in state.json or dataset_info.json
    except (OSError, ValueError, pa.ArrowException, KeyError, TypeError, IndexError, AttributeError) as err:
        raise DistqaError(f"the features at {folder} are damaged ({reason(err)}): {fix}") from None
    stamp = stamp_of(folder)
    counted = stamp.get("features")
    if isinstance(counted, int) and not isinstance(counted, bool) and len(dataset) != counted:
        raise DistqaError(
            f"the features at {folder} are damaged: {len(dataset)} where its stamp counts {counted}: {fix}"
        )
    if verify:
        recorded = stamp.get(CONTENT_KEY)
        if not isinstance(recorded, str):
            raise DistqaError(
                f"the features at {folder} cannot be checked: its stamp records no digest of their content "
                f"(prepared by an older distqa): {fix}"
            )
        try:
            found = content_digest(dataset)
        except (OSError, pa.ArrowException) as err:  # a file that shrank after it was mapped
            raise DistqaError(f"the features at {folder} are damaged ({reason(err)}): {fix}") from None
        if found != recorded:
            raise DistqaError(
                f"the features at {folder} are damaged: their content is not what `distqa prepare` wrote "
                f"(digest {found}, its stamp records {recorded}): {fix}"
            )
    return dataset
