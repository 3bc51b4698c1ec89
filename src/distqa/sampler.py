"""Data order that depends on (seed, epoch) alone, never on the number of processes.

PyTorch's DistributedSampler deals indices round-robin, so the examples that meet in one optimizer
step change with the world size, and a run on 8 GPUs cannot be compared with one on 1. Here the
epoch's permutation is cut into *global* batches of `batch_size * grad_accum * world_size`
examples; optimizer step k always sees global batch k, and each rank takes a contiguous slice of
it, split into `grad_accum` micro-batches. 1 process x batch 8 and 2 processes x batch 4 therefore
average the gradient over exactly the same 8 examples at every step.

The sampler can start in the middle of an epoch (`start_step`), which is how a resumed run picks up
at the exact position in the data without replaying the loader. `training_batches` are the
trainer's batches through a DataLoader over it; `seed_everything` and `derive_seed` seed weights, dropout and workers.
"""

from __future__ import annotations

import contextlib
import pickle
import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler

from distqa.dist import DistInfo, default_num_workers
from distqa.errors import ConfigError, DistqaError
from distqa.loader_server import Patient, loader_context, loader_timeout
from distqa.parent_watch import inherited_objects_frozen
from distqa.worker_signals import loader_worker_init, sigterm_held

if TYPE_CHECKING:  # for hints only
    from distqa.config import Config


def steps_per_epoch(num_examples: int, batch_size: int, grad_accum: int, world_size: int) -> int:
    """Optimizer steps in one epoch; the incomplete last global batch is dropped."""
    global_batch = batch_size * grad_accum * world_size
    steps = num_examples // global_batch
    if steps == 0:
        raise ConfigError(
            f"the training set has {num_examples} examples, fewer than one global batch "
            f"(train.batch_size={batch_size} x train.grad_accum={grad_accum} x {world_size} processes "
            f"= {global_batch}): lower train.batch_size or use more data"
        )
    return steps


def epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    # SeedSequence mixes (seed, epoch) properly: seeds 1/epoch 2 and seeds 2/epoch 1 differ.
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches (lists of dataset indices) for one epoch."""

    def __init__(
        self,
        num_examples: int,
        *,
        batch_size: int,
        grad_accum: int,
        rank: int,
        world_size: int,
        seed: int,
        epoch: int,
        start_step: int = 0,
    ) -> None:
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = epoch
        self.steps = steps_per_epoch(num_examples, batch_size, grad_accum, world_size)
        if not 0 <= start_step <= self.steps:
            raise ValueError(f"start_step={start_step} outside the epoch's {self.steps} steps")
        self.start_step = start_step

    def __len__(self) -> int:
        return (self.steps - self.start_step) * self.grad_accum

    def __iter__(self) -> Iterator[list[int]]:
        order = epoch_permutation(self.num_examples, self.seed, self.epoch)
        per_rank = self.batch_size * self.grad_accum
        global_batch = per_rank * self.world_size
        for step in range(self.start_step, self.steps):
            begin = step * global_batch + self.rank * per_rank
            mine = order[begin : begin + per_rank]
            for micro in range(self.grad_accum):
                yield mine[micro * self.batch_size : (micro + 1) * self.batch_size].tolist()


# Names the loader's stream in `derive_seed`, apart from the per-rank seeds (seed, rank[, step]).
LOADER_STREAM = 0x6C6F6164  # "load"


def derive_seed(*parts: int) -> int:
    """One 32-bit seed from several numbers, without the collisions of `seed + rank`."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


ITEM_STREAM = 0x6974656D  # "item"
COLLATE_STREAM = 0x636F6C6C  # "coll"
EVAL_STREAM = 0x6576616C  # "eval": evaluation's items and batches (`evaluation.evaluate_dataset`)
_MASK64 = (1 << 64) - 1


def item_seed(base: int, index: int) -> int:
    """A 32-bit seed for item `index` from an epoch's `base`: splitmix64's finalizer over
    base + (index + 1) * golden ratio, a microsecond where `derive_seed` takes tens."""
    z = (base + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & 0xFFFFFFFF


class ItemSeeded(Dataset):
    """`dataset` as the DataLoader's workers read it: torch's, numpy's and `random`'s generators
    seeded before each item from (seed, epoch, index).

    A task whose `__getitem__` draws random numbers (augmentation, masking) would otherwise draw
    from its worker's stream, whose position depends on which items that worker made before: other
    after a resume (the epoch's loader starts at a later step, its workers afresh) and with another
    `data.num_workers`, so neither would give the uninterrupted run's result.

    `in_process` (data.num_workers=0: items made in the training process): the same seeds, with
    the process's own streams set aside around each item and put back after it, so its dropout
    stream does not move and 0 workers draw what N workers draw (data.num_workers is a setting a
    resume may change without a word)."""

    def __init__(self, dataset: Dataset, base: int, *, in_process: bool = False) -> None:
        self.dataset, self.base, self.in_process = dataset, base, in_process

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def seeded(self, index: int) -> contextlib.AbstractContextManager[None]:
        return seeded_streams(item_seed(self.base, index), keep=self.in_process)

    def __getitem__(self, index: int) -> Any:
        with self.seeded(index):
            return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> Any:
        """A batch's items, marked with its first index for `SeededCollate`."""
        return SeededBatch([self[i] for i in indices], indices[0])


class BatchSeeded(ItemSeeded):
    """ItemSeeded for a dataset that reads a batch at once (`__getitems__`, as `datasets.Dataset`):
    seeded per batch, from its first index (the sampler makes the same batches on a resume)."""

    def __getitems__(self, indices: list[int]) -> Any:
        with self.seeded(indices[0]):
            items = self.dataset.__getitems__(indices)  # type: ignore[attr-defined]
        return SeededBatch(items, indices[0]) if isinstance(items, list) else items


@contextlib.contextmanager
def seeded_streams(seed: int, *, keep: bool) -> Iterator[None]:
    """torch's CPU generator, numpy's global one and `random` seeded with `seed`; `keep`: the
    process's own states set aside and put back afterwards (a training process's dropout stream)."""
    kept = (torch.get_rng_state(), random.getstate(), np.random.get_state()) if keep else None
    torch.default_generator.manual_seed(seed)  # the CPU generator: items are never made on a GPU
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        if kept is not None:
            torch.set_rng_state(kept[0])
            random.setstate(kept[1])
            np.random.set_state(kept[2])


class SeededBatch(list):
    """A batch's items on their way to the collate, with the batch's first index (`first`)."""

    def __init__(self, items: list[Any], first: int) -> None:
        super().__init__(items)
        self.first = first


class SeededCollate:
    """The task's collate, its random draws (masking, as an MLM collator makes) seeded per batch
    from (seed, epoch, the batch's first index). Otherwise a worker's collate drew from the stream
    its last item left, and with data.num_workers=0 from the training process's own (moving its
    dropout stream): a resume that changed data.num_workers, which changes nothing computed, gave
    other weights without a word. `in_process`: as ItemSeeded's."""

    def __init__(self, collate: Callable[[list[Any]], Any], base: int, *, in_process: bool = False) -> None:
        self.collate, self.base, self.in_process = collate, base, in_process

    def __call__(self, items: list[Any]) -> Any:
        if not isinstance(items, SeededBatch):
            return self.collate(items)
        with seeded_streams(item_seed(self.base, items.first), keep=self.in_process):
            return self.collate(list(items))


def training_batches(
    dataset: Dataset,
    collate: Callable[[list[Any]], Any],
    cfg: Config,
    info: DistInfo,
    epoch: int,
    start_step: int,
    length: int | None = None,
) -> Iterator[Any]:
    """This rank's batches of one epoch, from optimizer step `start_step` on, its DataLoader workers
    started. `length`: the set's length when the run planned its steps; a set that shrank since (a
    fork's filter applied during training) ended in a StopIteration traceback, one that grew was
    read in part without a word."""
    if length is not None and len(dataset) != length:  # type: ignore[arg-type]
        raise DistqaError(
            f"the training set's length changed during the run: {length} examples at start, "
            f"{len(dataset)} at epoch {epoch}: a run reads one set from start to end (its steps, data "  # type: ignore[arg-type]
            "order and checkpoints count on it); make the dataset's length fixed"
        )
    sampler = GlobalBatchSampler(
        len(dataset),  # type: ignore[arg-type]
        batch_size=cfg.train.batch_size,
        grad_accum=cfg.train.grad_accum,
        rank=info.rank,
        world_size=info.world_size,
        seed=cfg.seed,
        epoch=epoch,
        start_step=start_step,
    )
    # The loader draws its workers' base seed from this generator, not from the global RNG:
    # otherwise creating a loader after a resume would shift the dropout stream.
    generator = torch.Generator().manual_seed(derive_seed(cfg.seed, epoch, LOADER_STREAM))
    workers = loader_workers(cfg)
    # SIGTERM is held while the workers start (`worker_signals`); a SIGTERM for this process
    # meanwhile is delivered when the block ends. (The caller's previous epoch's workers end after
    # this returns, outside the hold.)
    wrapper = BatchSeeded if hasattr(dataset, "__getitems__") else ItemSeeded
    items = wrapper(dataset, derive_seed(cfg.seed, epoch, ITEM_STREAM), in_process=workers == 0)
    seeded_collate = SeededCollate(collate, derive_seed(cfg.seed, epoch, COLLATE_STREAM), in_process=workers == 0)
    with sigterm_held():
        context = training_loader_context(dataset, collate, cfg, info)
        loader = DataLoader(
            items,
            batch_sampler=sampler,
            collate_fn=seeded_collate,
            num_workers=workers,
            pin_memory=info.device.type == "cuda",
            generator=generator,
            worker_init_fn=loader_worker_init,
            # Across processes, workers start from a fork server out of this process's group (`loader_server`).
            multiprocessing_context=context,
            # A worker stuck in an item (a stale mount) otherwise held the rank for good, and its peers
            # until the process group's timeout, with a gloo traceback: `as_worker_loss` says it.
            timeout=loader_timeout(workers, cfg.data.timeout_s),
        )
        # Workers forked from this process (one process: plain fork) must not finalize what they
        # inherit, such as an earlier epoch's iterator, whose finalizer shuts down its workers.
        forked = context is not None and context.get_start_method() == "fork"
        try:
            with inherited_objects_frozen() if forked else contextlib.nullcontext():
                return Patient(iter(loader), cfg.data.timeout_s) if workers else iter(loader)
        except (pickle.PicklingError, AttributeError, TypeError) as err:
            sent = (("the training dataset", dataset), ("the task's collate_fn", collate))
            named = None if context is None or forked else unpicklable(*sent)
            if named is None:
                raise
            raise named from err


def loader_workers(cfg: Config) -> int:
    return default_num_workers() if cfg.data.num_workers is None else cfg.data.num_workers


def training_loader_context(dataset: Dataset, collate: Callable[[list[Any]], Any], cfg: Config, info: DistInfo) -> Any:
    """The training loader's multiprocessing context (`loader_server.loader_context`); call with
    SIGTERM held. Across processes (a process group's threads) its workers start from a fork server."""
    distributed = info.world_size > 1 or dist.is_initialized()
    return loader_context(loader_workers(cfg), uses=(dataset, collate), distributed=distributed)


def check_picklable(collate: Callable[[list[Any]], Any], cfg: Config, info: DistInfo) -> None:
    """One process starts its loader's workers with plain fork, which pickles nothing: a collate_fn
    that cannot be pickled (a lambda, a closure: a fork's usual slip) trained there, and stopped only
    under torchrun, whose workers receive it pickled from a fork server (a fork's 1-process try
    passed, its launch failed: a review). Checked once at the start of such a run. Not the dataset:
    plain pickle copies a dataset's tensors (the fork server's pickler shares them) and refuses what
    only a process start may pickle (a forkserver `Value`), so it would refuse what a launch runs."""
    if info.world_size == 1 and not dist.is_initialized() and loader_workers(cfg):
        if named := unpicklable(("the task's collate_fn", collate)):
            raise named


class _Discard:
    """A pickle's destination that keeps nothing: what is checked is never held whole in memory."""

    def write(self, data: bytes) -> int:
        return len(data)


def unpicklable(*named: tuple[str, object]) -> ConfigError | None:
    """Why a loader's workers could not start, in one line: which of the (what, thing) pairs does
    not pickle (they receive the dataset and the task's `collate_fn` pickled); None when all do."""
    for what, thing in named:
        try:
            pickle.Pickler(_Discard()).dump(thing)
        except Exception as failed:  # noqa: BLE001 (whatever pickling raises is the answer)
            return ConfigError(
                f"{what} ({type(thing).__qualname__}) cannot be pickled into the DataLoader workers "
                f"({type(failed).__name__}: {failed}): make it picklable (module-level classes and "
                "functions, no open files or locks), or set data.num_workers=0"
            )
    return None
