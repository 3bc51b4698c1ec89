"""Toy tasks about the data: validation data read from data.valid, and augmentation drawn in
`__getitem__` (tests/test_valid_identity.py, tests/test_item_seeds.py)."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from distqa.errors import DistqaError
from distqa.task import Batch
from toy_task import FEATURES, BlobsDataset, IndexedBlobs, ToyClassificationTask


class ValidFileTask(ToyClassificationTask):
    """Validation data read from data.valid, a JSON object {"seed", "size", "score"}: IndexedBlobs of
    that seed and size, whose metric eval_score is the file's "score". With "skew": true, rank 1
    sees one item more, as a node whose data.valid holds another file at the same path would; with
    "absent": true, rank 1 has none, as a node given data.valid= (empty) would."""

    def build_eval_dataset(self) -> Dataset | None:
        spec = json.loads(Path(self.cfg.data.valid).read_text())
        self.score = float(spec["score"])
        if spec.get("absent") and int(os.environ.get("RANK", "0")) == 1:
            return None
        extra = 1 if spec.get("skew") and int(os.environ.get("RANK", "0")) == 1 else 0
        return IndexedBlobs(spec["size"] + extra, seed=spec["seed"])

    def eval_step(self, model: nn.Module, batch: Batch) -> list:
        return [int(i) for i in batch["index"]]

    def compute_metrics(self, outputs: list, step: int) -> dict[str, float]:
        refusal = json.loads(Path(self.cfg.data.valid).read_text()).get("refuse")
        if refusal:  # what a task's scoring refuses on rank 0 (a stale cache, a bad gold line)
            raise DistqaError(refusal)
        return {"eval_score": self.score, "eval_items": float(len(outputs))}


class NoisyBlobs(BlobsDataset):
    """Augmentation as a fork writes it: noise drawn from the global RNGs in `__getitem__`."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(index)
        noise = torch.randn(FEATURES) + float(np.random.normal()) + random.random()
        return {**item, "features": item["features"] + noise}


class AugmentedTask(ToyClassificationTask):
    def build_train_dataset(self) -> Dataset:
        return NoisyBlobs(self.cfg.task.size, self.cfg.seed)


def masking_collate(items: list) -> dict:
    """Masking in the collate, as an MLM collator does it: each feature kept with probability 0.8."""
    batch = default_collate(items)
    return {**batch, "features": batch["features"] * torch.bernoulli(torch.full_like(batch["features"], 0.8))}


class MaskedCollateTask(ToyClassificationTask):
    def collate_fn(self):
        return masking_collate


class PerProcessOrderTask(ToyClassificationTask):
    """Training rows deduplicated the way a fork may write it, `list(set(rows))`: ordered by each
    process's string hash seed, so every process builds another order of the same rows."""

    def build_train_dataset(self) -> Dataset:
        rows = sorted({f"row-{i}" for i in range(self.cfg.task.size)}, key=lambda r: hash((r, os.getpid())))
        blobs = BlobsDataset(self.cfg.task.size, self.cfg.seed)
        return [blobs[int(row.removeprefix("row-"))] for row in rows]


class JitteredBlobs(BlobsDataset):
    """Items jittered from a generator the dataset keeps (seeded alike in every process)."""

    def __init__(self, size: int, seed: int) -> None:
        super().__init__(size, seed)
        self.rng = np.random.default_rng(seed)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(index)
        return {**item, "features": item["features"] + float(self.rng.normal(scale=0.01))}


class SharedGeneratorTask(ToyClassificationTask):
    """Training and validation as two parts of one jittered dataset: reading either moves both."""

    def _whole(self) -> JitteredBlobs:
        if not hasattr(self, "whole"):
            self.whole = JitteredBlobs(self.cfg.task.size + 16, self.cfg.seed)
        return self.whole

    def build_train_dataset(self) -> Dataset:
        return torch.utils.data.Subset(self._whole(), range(self.cfg.task.size))

    def build_eval_dataset(self) -> Dataset:
        return torch.utils.data.Subset(self._whole(), range(self.cfg.task.size, self.cfg.task.size + 16))

    def eval_step(self, model: nn.Module, batch: Batch) -> list:
        return model(batch["features"]).argmax(dim=-1).tolist()

    def compute_metrics(self, outputs: list, step: int) -> dict[str, float]:
        return {"eval_items": float(len(outputs))}


class ShrinkingBlobs(BlobsDataset):
    """A third of its examples once all have been read: a filter a fork applies during training."""

    def __init__(self, size: int, seed: int) -> None:
        super().__init__(size, seed)
        self.read: set[int] = set()

    def __len__(self) -> int:
        return self.size // 3 if len(self.read) >= self.size else self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.read.add(int(index))  # counted in this process: run with data.num_workers=0
        return super().__getitem__(index)


class ShrinkingTask(ToyClassificationTask):
    def build_train_dataset(self) -> Dataset:
        return ShrinkingBlobs(self.cfg.task.size, seed=self.cfg.seed)

    def data_fingerprint(self, dataset: Dataset) -> str:
        return "fixed"  # reads no item: the first epoch is the first to read them all


class MaskedEvalTask(MaskedCollateTask):
    """Masking in the collate in evaluation too, scored by the loss of each validation example."""

    def build_eval_dataset(self) -> Dataset:
        return BlobsDataset(30, seed=11)  # 8 batches of 4, the last of 2

    def eval_step(self, model: nn.Module, batch) -> list:
        return nn.functional.cross_entropy(model(batch["features"]), batch["label"], reduction="none").tolist()

    def compute_metrics(self, outputs: list, step: int) -> dict[str, float]:
        return {"eval_loss": sum(outputs) / len(outputs)}


# Set by ScaledTask.build_train_dataset in the training process: a worker started from the fork
# server imports this module afresh and reads 1.0 (the pattern a review found training other data).
SCALE = 1.0


class ScaledBlobs(BlobsDataset):
    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(index)
        return {**item, "features": item["features"] * SCALE}


class ScaledTask(ToyClassificationTask):
    """Its data scaled by a module-level value it sets at run time, not on the dataset."""

    def build_train_dataset(self) -> Dataset:
        global SCALE
        SCALE = 10.0
        return ScaledBlobs(self.cfg.task.size, self.cfg.seed)


class StallingBlobs(BlobsDataset):
    """Its items stall in a loader worker from the 5th on (a stale network mount); read in the
    training process they do not (the data agreement's samples)."""

    served = 0

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if torch.utils.data.get_worker_info() is not None:
            StallingBlobs.served += 1
            if StallingBlobs.served > 4:
                time.sleep(120)  # (past the test's timeout: the loader ends it at shutdown)
        return super().__getitem__(index)


class StallingTask(ToyClassificationTask):
    def build_train_dataset(self) -> Dataset:
        return StallingBlobs(self.cfg.task.size, self.cfg.seed)


def scaled_collate(items: list[dict]) -> dict:
    """A collate that reads the module-level SCALE: a worker of the fork server reads 1.0."""
    batch = default_collate(items)
    return {**batch, "features": batch["features"] * SCALE}


class SummingBlobs(BlobsDataset):
    """Each item carries a sum over 1M floats: its last bits depend on the thread count (a worker
    reads on one thread), as a per-image standardisation's mean does."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(index)
        big = torch.from_numpy(np.random.default_rng(index).standard_normal(1 << 20, dtype=np.float32))
        return {**item, "features": item["features"] + big.sum() * 1e-3}
