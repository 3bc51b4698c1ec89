"""Toy tasks that break the seam (`distqa.task.Task`) the way a fork's first version does: a loss
that is no scalar with a gradient, metrics that are no numbers, a collate that returns no mapping,
a model part used only for some batches. Each must end in one line naming what to change."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from distqa.config import setting
from distqa.nq.task import NQTask
from distqa.task import Batch
from toy_task import CLASSES, FEATURES, EvalProbeTask, IndexedBlobs, ToyClassificationTask, ToyClassifier, ToySettings


@dataclass
class LossSettings(ToySettings):
    loss_kind: str = setting("vector", "vector | float | detached | nan_first | tuple_batch")


class BrokenLossTask(ToyClassificationTask):
    Config = LossSettings

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        per_example = F.cross_entropy(model(batch["features"]), batch["label"], reduction="none")
        kind = self.cfg.task.loss_kind
        if kind == "vector":
            return per_example  # reduction="none" left in
        if kind == "float":
            return per_example.mean().item()  # type: ignore[return-value]
        if kind == "detached":
            return per_example.mean().detach()
        if kind == "nan_first":
            return per_example.mean() * float("nan")  # from the first step: the data's or the task's
        return per_example.mean()

    def collate(self, items: list) -> Batch:
        batch = super().collate(items)
        return tuple(batch.values()) if self.cfg.task.loss_kind == "tuple_batch" else batch  # type: ignore[return-value]


@dataclass
class MetricSettings(ToySettings):
    # (resume="applied": a resume with the metric code fixed stands for the fork's fixed code)
    metric_kind: str = setting("numbers", "numbers | text | nested | train_key | step_key | raises", resume="applied")


class MetricKindTask(EvalProbeTask):
    """Metrics as forks write them: a 0-d tensor ((pred == gold).float().mean()), a NumPy number,
    an int; or, broken, a text or a nested dict."""

    Config = MetricSettings

    def compute_metrics(self, outputs: list, step: int) -> dict:
        kind = self.cfg.task.metric_kind
        if kind == "text":
            return {"eval_verdict": "good"}
        if kind == "nested":
            return {"eval_per_class": {"a": 0.5}}
        if kind in ("train_key", "step_key"):  # names the training figures' own: they were overwritten
            return {"eval_count": len(outputs), "loss" if kind == "train_key" else "step": 123}
        if kind == "raises":
            return {"eval_rate": len(outputs) / 0}  # a bug in the fork's metric code
        return {"eval_tensor": torch.tensor(0.5), "eval_numpy": np.float32(0.25), "eval_count": len(outputs)}


class SometimesUnusedHead(nn.Module):
    """A second head used only for batches whose first label is 0: the set of parameters with a
    gradient changes from step to step."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.aux = ToyClassifier(), nn.Linear(FEATURES, CLASSES)

    def forward(self, features: torch.Tensor, use_aux: bool) -> torch.Tensor:
        out = self.body(features)
        return out + self.aux(features) if use_aux else out


class SometimesUnusedTask(ToyClassificationTask):
    def build_model(self) -> nn.Module:
        return SometimesUnusedHead()

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(model(batch["features"], bool(batch["label"][0] == 0)), batch["label"])


@dataclass
class EvalStepSettings(ToySettings):
    eval_kind: str = setting("list", "list | dict | scalar | short | meta | meta_in_dicts | raises_on_rank_1")


class EvalStepKindTask(EvalProbeTask):
    """eval_step results as forks write them: a dict of tensors (Hugging Face style), a 0-d
    tensor, one item fewer than the batch (NQ skips empty windows: allowed), tensors off the CPU
    (a meta tensor stands in for a GPU's), or an error on one rank only."""

    Config = EvalStepSettings

    def eval_step(self, model: nn.Module, batch: Batch) -> list:
        kind = self.cfg.task.eval_kind
        if kind == "dict":
            return {"pred": model(batch["features"]).argmax(-1), "labels": batch["label"]}  # type: ignore[return-value]
        if kind == "scalar":
            return model(batch["features"]).sum()  # type: ignore[return-value]
        if kind == "short":
            return super().eval_step(model, batch)[:-1]
        if kind == "meta":
            return [torch.empty(2, device="meta") for _ in batch["index"]]
        if kind == "meta_in_dicts":  # Hugging Face style: a dict of tensors per example
            return [{"logits": torch.empty(2, device="meta")} for _ in batch["index"]]
        if kind == "raises_on_rank_1" and torch.distributed.get_rank() == 1:
            raise KeyError("label_ids")
        return super().eval_step(model, batch)


def padded(items: list) -> Batch:
    """A collate default_collate cannot do: items of different lengths, padded to the longest."""
    width = max(len(item["features"]) for item in items)
    return {
        "features": torch.stack([F.pad(item["features"], (0, width - len(item["features"]))) for item in items]),
        "label": torch.stack([item["label"] for item in items]),
        "index": torch.stack([item["index"] for item in items]),
    }


class RaggedBlobs(torch.utils.data.Dataset):
    """IndexedBlobs whose odd items lack their last feature (padded back by `padded`)."""

    def __init__(self, size: int, seed: int) -> None:
        self.blobs = IndexedBlobs(size, seed)

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, index: int) -> dict:
        item = self.blobs[index]
        return {**item, "features": item["features"][: FEATURES - index % 2]}


class CollateFnOnlyTask(EvalProbeTask):
    """Overrides collate_fn() alone, as docs/fork.md suggests: evaluation must batch with it too."""

    def build_train_dataset(self):
        return RaggedBlobs(self.cfg.task.size, self.cfg.seed)

    def build_eval_dataset(self):
        return RaggedBlobs(11, 7)

    def collate_fn(self):
        return padded


class StreamTask(ToyClassificationTask):
    """A training set that is a stream (no __len__, no indexing)."""

    def build_train_dataset(self):
        blobs = super().build_train_dataset()

        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return (blobs[i] for i in range(len(blobs)))

        return Stream()


class ElsewhereSaveTask(ToyClassificationTask):
    """A save_model that forgot its directory: the weights go to the working directory."""

    def save_model(self, model: nn.Module, directory) -> None:
        torch.save(model.state_dict(), "model.pt")


class NQCollateTask(NQTask):
    """A fork of NQ that overrides `collate` alone: NQ's collate_fn never calls it."""

    def collate(self, items):
        raise AssertionError("never called by NQ's collate_fn")


class NQCollateUsedTask(NQCollateTask):
    """The same, with collate_fn returning it: what the refusal asks for."""

    def collate_fn(self):
        return self.collate


class MaskingMixin:
    """A collate in a mixin placed before NQTask: as unused as a subclass's."""

    def collate(self, items):
        raise AssertionError("never called by NQ's collate_fn")


class MixinCollateTask(MaskingMixin, NQTask):
    pass


class StaticCollateTask(NQTask):
    """A static collate that collate_fn returns: used, and small to pickle."""

    @staticmethod
    def collate(items):
        return items

    def collate_fn(self):
        return self.collate


def nested_with_ids(items: list[dict]) -> dict:
    """A batch as some forks shape it: the model's inputs in a mapping of their own, ids as strings."""
    return {
        "inputs": {"features": torch.stack([item["features"] for item in items])},
        "label": torch.stack([item["label"] for item in items]),
        "ids": [f"example-{i}" for i in range(len(items))],
    }


class NestedBatchTask(ToyClassificationTask):
    """Its batches nest and hold strings: every loop (the trainer's, the bench's baseline) counts
    and moves them as such."""

    def collate_fn(self):
        return nested_with_ids

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(model(batch["inputs"]["features"]), batch["label"])


class TupleModelTask(ToyClassificationTask):
    """build_model returns (model,): a trailing comma."""

    def build_model(self):
        return (super().build_model(),)


class TensorStateTask(ToyClassificationTask):
    """state_dict holds a tensor, which JSON cannot."""

    def state_dict(self):
        return {"threshold": torch.tensor(0.5)}


class LambdaCollateTask(ToyClassificationTask):
    """collate_fn returns a lambda: it cannot be pickled into a fork server's workers."""

    def collate_fn(self):
        return lambda items: self.collate(items)


class EmptyValidTask(EvalProbeTask):
    """A validation file with no rows."""

    def build_eval_dataset(self):
        return IndexedBlobs(0, seed=7)
