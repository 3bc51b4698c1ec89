"""`distqa prepare`: Natural Questions JSONL to a cached, memory-mappable `datasets` dataset.

The input is cut into byte ranges, one per process (`--num-proc`); each process streams its range,
builds features with its own word cache and writes Arrow through `datasets.Dataset.from_generator`.
The result is saved with `save_to_disk` under a fingerprint of (input file, tokenizer, settings):
running `prepare` again with the same three reuses it, and `distqa train` reads the same cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import datasets
from transformers import AutoTokenizer

from distqa.errors import DistqaError
from distqa.nq.features import FeatureBuilder, FeatureSettings
from distqa.nq.reader import NQReader, byte_ranges

# Bump when the feature layout or the targets change: old caches must not be reused.
FEATURES_VERSION = 2
FINGERPRINT_FILE = "distqa_fingerprint.json"

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


def fingerprint(input_path: Path, tokenizer: Any, settings: FeatureSettings) -> dict[str, Any]:
    """What the features depend on. The tokenizer enters by content, not name: a local folder
    edited in place must not reuse features made with its old vocabulary."""
    stat = input_path.stat()
    vocab = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]
    return {
        "version": FEATURES_VERSION,
        "input": str(input_path.resolve()),
        "input_size": stat.st_size,
        "input_mtime_ns": stat.st_mtime_ns,
        "tokenizer": vocab,
        "settings": dataclasses.asdict(settings),
    }


def fingerprint_key(fp: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:20]


def _generate(shards: list[dict[str, Any]]) -> Any:
    """Runs in each worker process: stream its byte ranges, yield features, record its counts.

    A user-facing error (a malformed line) is written to the shard's stats file instead of being
    raised: across the process pool `datasets` would wrap it and lose the message.
    """
    for shard in shards:
        tokenizer = AutoTokenizer.from_pretrained(shard["tokenizer"])
        builder = FeatureBuilder(tokenizer, FeatureSettings(**shard["settings"]))
        reader = NQReader(shard["path"], skip_bad_lines=shard["skip_bad_lines"], byte_range=tuple(shard["range"]))
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
        Path(shard["stats"]).write_text(json.dumps(stats))
        if "error" in stats:
            return


@dataclasses.dataclass
class PrepareResult:
    path: Path
    reused: bool
    docs: int = 0
    features: int = 0
    bad_lines: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def docs_per_s(self) -> float:
        return self.docs / self.seconds if self.seconds else 0.0


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
    if not source.is_file():
        raise DistqaError(f"{source} does not exist or is not a file")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
    if not getattr(tokenizer, "is_fast", False):
        raise DistqaError(f"tokenizer {tokenizer_name!r} has no fast (Rust) version, which prepare needs")
    fp = fingerprint(source, tokenizer, settings)
    stamp = target / FINGERPRINT_FILE
    if stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == fp:
        return PrepareResult(target, reused=True)
    if target.exists() and any(target.iterdir()) and not stamp.is_file():
        raise DistqaError(f"{target} exists and is not a distqa features folder: choose another --output")

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".prepare-", dir=target.parent))
    try:
        ranges = byte_ranges(source, max(1, num_proc))
        shards = [
            {
                "path": str(source),
                "range": r,
                "tokenizer": tokenizer_name,
                "settings": dataclasses.asdict(settings),
                "skip_bad_lines": skip_bad_lines,
                "stats": str(work / f"stats-{i}.json"),
            }
            for i, r in enumerate(ranges)
        ]

        def shard_stats() -> list[dict[str, Any]]:
            return [json.loads(Path(s["stats"]).read_text()) for s in shards if Path(s["stats"]).is_file()]

        try:
            dataset = datasets.Dataset.from_generator(
                _generate,
                features=FEATURES,
                gen_kwargs={"shards": shards},  # a list: datasets gives each process its share
                num_proc=min(len(shards), num_proc) if num_proc > 1 else None,
                cache_dir=str(work / "cache"),
            )
        except Exception:
            # A worker's own error explains more than the wrapper `datasets` raises around it.
            errors = [s["error"] for s in shard_stats() if "error" in s]
            if errors:
                raise DistqaError(errors[0]) from None
            if sum(s["features"] for s in shard_stats()) == 0:
                raise DistqaError(
                    f"{source} produced no features (no examples, or every window dropped: "
                    "data.keep_unknown keeps that fraction of windows without an answer)"
                ) from None
            raise
        stats = shard_stats()
        errors = [s["error"] for s in stats if "error" in s]
        if errors:
            raise DistqaError(errors[0])
        staged = work / "dataset"
        dataset.save_to_disk(str(staged))
        result = PrepareResult(
            target,
            reused=False,
            docs=sum(s["docs"] for s in stats),
            features=sum(s["features"] for s in stats),
            bad_lines=sorted(b for s in stats for b in s["bad_lines"]),
            seconds=max(s["finished"] for s in stats) - min(s["started"] for s in stats),
        )
        (staged / FINGERPRINT_FILE).write_text(
            json.dumps(
                {
                    "fingerprint": fp,
                    "docs": result.docs,
                    "features": result.features,
                    "bad_lines": len(result.bad_lines),
                },
                indent=2,
            )
        )
        # Swap in whole: a reader never sees a half-written folder under the final name.
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def load_features(path: str | os.PathLike) -> datasets.Dataset:
    """Memory-map a prepared folder (nothing is read into RAM until used)."""
    folder = Path(path)
    if not (folder / FINGERPRINT_FILE).is_file():
        raise DistqaError(f"{folder} is not a folder written by `distqa prepare`")
    return datasets.load_from_disk(str(folder))
