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
from distqa.task import Batch
from toy_task import CLASSES, FEATURES, EvalProbeTask, ToyClassificationTask, ToyClassifier, ToySettings


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
    metric_kind: str = setting("numbers", "numbers | text | nested")


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
