"""Cost of the training-data fingerprint (`distqa.data_identity`) on prepared Natural Questions features.

Makes (once) a features folder of `--rows` rows by repeating the rows of a small folder that
`distqa prepare` wrote, then times what every rank runs at start,
`FeatureDataset(folder, TRAIN_COLUMNS).fingerprint()` (under torchrun, one process per node):

  warm   the Arrow files already in the page cache (a restart on the same node)
  cold   the files evicted from the page cache first (posix_fadvise DONTNEED): read from disk
  each on 1 thread and on every CPU of the process (the default), in the same run;
  verify the node's first process's check of a prepared folder at start: every column against
         the digest its stamp records (`load_features(verify=True)`), warm
  item by item  the generic path (`data_identity.fingerprint`) over `--item-rows` rows, per row,
         for comparison: what the same data costs without the Arrow path

With `--procs N`, N processes fingerprint at once (as every rank would, were it not one per node). Usage:
  python scripts/bench_fingerprint.py --source PREPARED_FOLDER --output /tmp/fp-full --rows 726518
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import time
from pathlib import Path

import datasets
import pyarrow as pa
from torch.utils.data import Subset

from distqa.data_identity import arrow_fingerprint, fingerprint, usable_cpus
from distqa.nq.data import TRAIN_COLUMNS, FeatureDataset
from distqa.nq.feature_stamp import content_digest, load_features
from distqa.nq.prepare import FINGERPRINT_FILE

BLOCK = 1000  # rows per Arrow record batch, as `prepare` writes them


def make_folder(source: Path, output: Path, rows: int) -> None:
    """`rows` rows cycling through the source's, in record batches of BLOCK rows, plus its stamp."""
    if (output / FINGERPRINT_FILE).is_file() and len(datasets.load_from_disk(str(output))) == rows:
        return
    shutil.rmtree(output, ignore_errors=True)
    table = datasets.load_from_disk(str(source)).data.table
    block = pa.concat_tables([table] * (BLOCK // table.num_rows + 1)).slice(0, BLOCK).combine_chunks()
    full = pa.concat_tables([block] * (rows // BLOCK + 1)).slice(0, rows)  # references, not copies
    datasets.Dataset(datasets.table.InMemoryTable(full)).save_to_disk(str(output))
    # The source's stamp, with this folder's count and content digest, as `prepare` would write them.
    stamp = json.loads((source / FINGERPRINT_FILE).read_text())
    stamp.update(features=rows, content=content_digest(datasets.load_from_disk(str(output))))
    (output / FINGERPRINT_FILE).write_text(json.dumps(stamp))


def arrow_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.arrow"))


def evict(folder: Path) -> None:
    """Drop the folder's Arrow files from the page cache (written back first, so it can)."""
    for path in arrow_files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed_fingerprint(folder: str, threads: int | None) -> tuple[float, str]:
    dataset = FeatureDataset(Path(folder), TRAIN_COLUMNS)  # memory-maps: reads nothing yet
    started = time.perf_counter()
    digest = dataset.fingerprint() if threads is None else arrow_fingerprint(dataset.data, threads)
    return time.perf_counter() - started, digest


def run(folder: Path, procs: int, cold: bool, threads: int | None) -> float:
    """Seconds until the last of `procs` processes has its fingerprint (they all agree: checked)."""
    if cold:
        evict(folder)
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        results = pool.starmap(timed_fingerprint, [(str(folder), threads)] * procs)
    assert len({digest for _, digest in results}) == 1
    return max(seconds for seconds, _ in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, required=True, help="a folder `distqa prepare` wrote")
    parser.add_argument("--output", type=Path, required=True, help="where the large folder is made (reused)")
    parser.add_argument("--rows", type=int, default=726_518)
    parser.add_argument("--procs", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--item-rows", type=int, default=5000)
    args = parser.parse_args()

    make_folder(args.source, args.output, args.rows)
    dataset = FeatureDataset(args.output, TRAIN_COLUMNS)
    train_bytes = sum(dataset.data.data.table.column(c).nbytes for c in TRAIN_COLUMNS)
    run(args.output, args.procs, cold=False, threads=None)  # once, so that "warm" is warm
    times: dict[str, list[float]] = {}
    for _ in range(args.repeat):  # interleaved, so that the machine's load reaches every figure alike
        for threads in (1, None):
            for cold in (False, True):
                key = f"{'cold' if cold else 'warm'}_s_{'1_thread' if threads else f'{usable_cpus()}_threads'}"
                times.setdefault(key, []).append(run(args.output, args.procs, cold, threads))
    # What the node's first process adds at start: every column read against the stamp's digest.
    for _ in range(args.repeat):
        started = time.perf_counter()
        load_features(args.output, verify=True)
        times.setdefault("verify_every_column_warm_s", []).append(time.perf_counter() - started)
    started = time.perf_counter()
    fingerprint(Subset(dataset, range(args.item_rows)))
    item_us = (time.perf_counter() - started) / args.item_rows * 1e6
    print(
        json.dumps(
            {
                "rows": len(dataset),
                "train_columns_gb": round(train_bytes / 1e9, 3),
                "files_gb": round(sum(p.stat().st_size for p in arrow_files(args.output)) / 1e9, 3),
                "procs": args.procs,
                **{key: round(statistics.median(v), 3) for key, v in times.items()},
                "all_s": {key: [round(x, 3) for x in v] for key, v in times.items()},
                "item_by_item_us_per_row": round(item_us, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
