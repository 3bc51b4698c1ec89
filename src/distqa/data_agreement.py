"""Whether every rank sees the same data, before any step: the identities `distqa.data_identity`
computes, compared across ranks in one line each (a rank with fewer batches would leave the others
waiting forever; validation shares from different files would be scored as one set), and a sample
of items every process reads itself (a task may build its data in another order per process).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from distqa.data_identity import FINGERPRINT_FORMAT, feed
from distqa.dist import DistInfo, all_gather_objects
from distqa.errors import DistqaError
from distqa.loader_server import Patient, as_worker_loss, loader_timeout
from distqa.rank0 import reason
from distqa.sampler import item_seed, loader_workers, seeded_streams, training_loader_context
from distqa.worker_signals import loader_worker_init, sigterm_held

SAMPLED_ITEMS = 16
SAMPLE_STREAM = 0x73616D70  # "samp"


def _sampled_items(dataset: Dataset) -> list[Any]:
    """A few items at evenly spaced indices, each read with seeded random streams (the process's
    own are put back), on one thread, as a loader worker reads (PyTorch sets one there): a
    reduction over many elements sums in another order on more threads, and the bytes differ, so
    processes on other thread counts (another node's OMP_NUM_THREADS, a worker) would disagree."""
    length = len(dataset)  # type: ignore[arg-type]
    indices = sorted({int(i) for i in np.linspace(0, length - 1, num=min(length, SAMPLED_ITEMS))}) if length else []
    items = []
    with _one_thread():
        for index in indices:
            with seeded_streams(item_seed(SAMPLE_STREAM, index), keep=True):
                items.append(dataset[index])
    return items


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def sample_digest(dataset: Dataset) -> str:
    """A hash of `_sampled_items`, every process's own: one process per node hashes the whole set
    (`agreed_identity`), and its other processes build their own, which a task may build in
    another order (`list(set(rows))` is ordered by each process's string hash seed): each trained
    and scored other items, 4 of 15 twice and 4 never, exit 0."""
    h = hashlib.sha256(b"sample")
    for item in _sampled_items(dataset):
        feed(h, item, exact=False)
    return h.hexdigest()[:16]


def loader_digest(dataset: Dataset, collate: Any) -> str:
    """`_sampled_items`, then the task's collate over them as one batch: what a loader worker
    makes of them (the collate on one thread too)."""
    h, items = hashlib.sha256(b"loader"), _sampled_items(dataset)
    for item in items:
        feed(h, item, exact=False)
    try:  # (a collate that cannot batch these items fails the same way on both sides)
        with _one_thread(), seeded_streams(item_seed(SAMPLE_STREAM, len(dataset)), keep=True):  # type: ignore[arg-type]
            feed(h, collate(items), exact=False)
    except Exception as err:  # noqa: BLE001
        feed(h, type(err).__name__)
    return h.hexdigest()[:16]


class _ReadInWorker(Dataset):
    """One item: `loader_digest` of the dataset and collate, read where this is unpickled (a worker)."""

    def __init__(self, dataset: Dataset, collate: Any) -> None:
        self.dataset, self.collate = dataset, collate

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> str:
        return loader_digest(self.dataset, self.collate)


_WHY = (
    "they start from a fork server that imports the task's module afresh, so a module-level value set at run time "
    "(in build_train_dataset, say) and read by the dataset or collate_fn is not theirs: keep such state on the "
    "dataset object or in the collate_fn (both reach the workers pickled), or set data.num_workers=0"
)


def workers_differ(dataset: Dataset, loader: tuple[Any, Any], info: DistInfo) -> str | None:
    """Why the training loader's workers would make other batches than this process, or None. Only
    workers started from the fork server can: a module-level value the task sets at run time is
    not theirs, and they trained on other data than the run recorded, exit 0. The worker receives
    the dataset pickled before this process reads its own sample (a dataset's own generator is in
    the same state on both sides). `loader`: (the task's collate_fn, the Config). Never raises: a
    rank that stopped alone here would leave its peers waiting in the all-gather."""
    collate, cfg = loader
    if not loader_workers(cfg):
        return None
    try:
        with sigterm_held():
            context = training_loader_context(dataset, collate, cfg, info)
            if context is None or context.get_start_method() != "forkserver":
                return None  # forked from this process: its own copies
            probe = DataLoader(
                _ReadInWorker(dataset, collate),
                batch_size=None,
                num_workers=1,
                timeout=loader_timeout(1, cfg.data.timeout_s),  # a worker stuck in an item: one line, not a hang
                multiprocessing_context=context,
                worker_init_fn=loader_worker_init,
            )
            batches = Patient(iter(probe), cfg.data.timeout_s)  # its copy pickled now, before this process reads
    except (pickle.PicklingError, AttributeError, TypeError):
        return None  # what does not pickle: the training loader names it
    except Exception as err:
        return f"rank {info.rank}: cannot start a DataLoader worker ({reason(err)})"
    try:
        mine = loader_digest(dataset, collate)
    except Exception as err:
        return f"rank {info.rank} cannot read an item of data.train: {reason(err)}"
    try:
        theirs = next(batches)
    except Exception as err:  # read here, not there
        if (lost := as_worker_loss(err)) is not None:  # stalled past data.timeout_s, or killed
            return f"rank {info.rank}: {lost}"
        read = f"a DataLoader worker cannot read the training items its process reads ({reason(err)})"
        return f"rank {info.rank}: {read}: {_WHY}"
    if theirs == mine:
        return None
    return (
        f"rank {info.rank}: its DataLoader workers make other batches than the process itself (sample "
        f"{theirs}, not {mine}): {_WHY}"
    )


def agreed_samples(
    info: DistInfo, named: list[tuple[str, Dataset | None, str | None]], loader: tuple[Any, Any] | None = None
) -> None:
    """Every process's `sample_digest` of each (key, dataset, path) it built, compared across all
    ranks before any process reads a set whole (a dataset drawing from a generator of its own has
    then drawn alike everywhere); given `loader`, that the training loader's workers read the first
    set's items as the process does (`workers_differ`); and that every rank has each set or none has: data.valid may
    differ per node (PER_NODE), and one node's set beside another's none left the first node's
    all-gather paired with the other's next collective ('DDP expects same model'), or waiting for
    ever. Samples are compared at one length: other lengths are `agreed_identity`'s to name."""
    if not info.is_distributed:
        return
    mine: list[Any] = []
    problem = None
    for key, dataset, _ in named:
        try:
            # A stream is not sampled: agreed_identity names what the trainer needs instead.
            readable = not isinstance(dataset, IterableDataset) and hasattr(dataset, "__len__")
            mine.append(None if dataset is None else (len(dataset), sample_digest(dataset)) if readable else ())  # type: ignore[arg-type]
        except Exception as err:  # an item that cannot be read: said on every rank, none waits
            problem = f"rank {info.rank} cannot read an item of {key}: {reason(err)}"
            break
        if loader is not None and key == named[0][0] and mine[-1]:
            problem = workers_differ(dataset, loader, info)  # type: ignore[arg-type]
    views: list[Any] = all_gather_objects((mine, problem), info)  # type: ignore[assignment]
    if failed := next((p for _, p in views if p), None):
        raise DistqaError(failed)
    for i, (key, _, path) in enumerate(named):
        seen = [view[0][i] for view in views]
        without = [rank for rank, entry in enumerate(seen) if entry is None]
        if without and len(without) < len(seen):
            with_set = [rank for rank, entry in enumerate(seen) if entry is not None]
            raise DistqaError(
                f"the ranks do not see the same {_what(key)} data: a {_what(key)} set on {_ranks(with_set)}, none "
                f"on {_ranks(without)} ({key}={path!r} on this node): give every node the same {key}"
            )
        if without or () in seen or len({entry[0] for entry in seen}) > 1 or len(set(seen)) == 1:
            continue
        by_sample: dict[str, list[int]] = {}
        for rank, (_, value) in enumerate(seen):
            by_sample.setdefault(value, []).append(rank)
        described = "; ".join(f"{_ranks(ranks)}: {value}" for value, ranks in by_sample.items())
        raise DistqaError(
            f"the ranks' {_what(key)} datasets hold other items at the same indices ({described}): the task "
            f"builds {key}={path!r} in another order or content in each process (a set(), an unseeded shuffle, "
            "a per-rank shard): build it the same way in every process; the trainer shards it"
        )


def agreed_identity(
    fingerprint_of: Callable[[Dataset], str], dataset: Dataset, info: DistInfo, path: str, key: str = "data.train"
) -> dict[str, Any]:
    """This dataset's identity, checked to be the same on every rank (one line on every rank if
    not, before any step: a rank with fewer batches would leave the others waiting forever, and
    validation shares from different files would be scored as one set). `key` names the setting
    (data.train, data.valid) whose data it is, at `path` on this node.

    Under torchrun one process per node (local rank 0) computes the fingerprint and the node's
    other ranks take its result: they read the same files, so hashing them once per node costs the
    node one read instead of one per GPU, and a node whose copy differs still shows it. Without
    torchrun's node rank (`GROUP_RANK`) every rank hashes its own view.
    """
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        # (Every rank builds the same kind of dataset: each says so before the first collective.)
        hook = "build_train_dataset" if key == "data.train" else "build_eval_dataset"
        raise DistqaError(
            f"the task's {hook}() returned a {type(dataset).__name__}, not a map-style dataset (with __len__ and "
            "__getitem__): the trainer shards, orders and resumes it by index; wrap a stream in a list or a "
            "datasets.Dataset"
        )
    node = os.environ.get("GROUP_RANK")
    hashes = node is None or info.local_rank == 0
    digest, problem = None, None
    if hashes:
        try:
            digest = fingerprint_of(dataset)
        except (OSError, ValueError, RuntimeError) as err:  # a file unreadable halfway: said on every rank
            why = str(err).splitlines()[0] if str(err) else type(err).__name__
            problem = f"rank {info.rank} cannot hash {key}={path!r}: {why}"
    mine = {"node": node, "examples": len(dataset), "fingerprint": digest, "problem": problem}  # type: ignore[arg-type]
    views: list[dict[str, Any]] = all_gather_objects(mine, info)  # type: ignore[assignment]
    failed = next((view.get("problem") for view in views if view.get("problem")), None)
    if failed:
        raise DistqaError(failed)
    what = _what(key)
    # Filled in from the gathered views alone, so every rank reaches the same verdict (a rank
    # that stopped alone would leave the others waiting).
    by_node = {view["node"]: view["fingerprint"] for view in views if view["fingerprint"] is not None}
    seen = [(view["examples"], view["fingerprint"] or by_node.get(view["node"])) for view in views]
    if len(set(seen)) > 1:
        groups: dict[tuple[int, str | None], list[int]] = {}
        for rank, identity in enumerate(seen):
            groups.setdefault(identity, []).append(rank)
        # Ranks that all took their node's fingerprint show their own length beside another's hash: said so.
        taken = " (its node's, hashed by local rank 0)"
        described = "; ".join(
            f"{_ranks(ranks)}: {examples} examples, fingerprint {digest}"
            + (taken if all(views[rank]["fingerprint"] is None for rank in ranks) else "")
            for (examples, digest), ranks in groups.items()
        )
        raise DistqaError(
            f"the ranks do not see the same {what} data ({described}): {key}={path!r} "
            "must be the same data on every node"
        )
    examples, digest = seen[info.rank]
    return {"examples": examples, "fingerprint": digest, "format": FINGERPRINT_FORMAT, key.removeprefix("data."): path}


def same_identity(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether an identity a checkpoint recorded (`agreed_identity`'s) is this data's: the same
    length and fingerprint, wherever the file now lies. A task may extend its fingerprint after a
    "+" (NQ's validation set: its gold answers beside its windows); a record without the extension,
    from before it, compares by the part before the "+"."""
    if saved.get("examples") != now["examples"]:
        return False
    old, new = str(saved.get("fingerprint")), str(now["fingerprint"])
    return old == new or ("+" not in old and new.split("+", 1)[0] == old)


def _what(key: str) -> str:
    return "training" if key == "data.train" else "validation" if key == "data.valid" else key


def _ranks(ranks: list[int]) -> str:
    """`rank 3` or `ranks 0-7`, `ranks 0,2,5`: short even for many GPUs."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ",".join(map(str, ranks))


def agreed_valid_identity(task: Any, info: DistInfo, valid: str | None) -> dict[str, Any] | None:
    """`agreed_identity` of the task's validation set (`data.valid`, or the task's own), or None
    without one: its shares are scored as one set, so every node's must be the same."""
    dataset = task.eval_dataset()  # (whether every rank has one, `agreed_samples` made sure)
    if dataset is None:
        return None
    return agreed_identity(task.data_fingerprint, dataset, info, valid or "(none: the task's own set)", "data.valid")
