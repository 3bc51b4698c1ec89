"""The smallest task: a classifier on synthetic Gaussian blobs, trained by the unchanged trainer.

It exists to prove the seam (`distqa.task.Task`): nothing of Natural Questions, BERT or text is
involved. Run it like any task:

    PYTHONPATH=tests torchrun --nproc-per-node 2 -m distqa train task=toy_task:ToyClassificationTask
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import Dataset

from distqa.config import setting
from distqa.task import Batch, Task

FEATURES, CLASSES = 16, 4


class BlobsDataset(Dataset):
    """Example i: a point near one of CLASSES fixed centres; a pure function of (seed, i)."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed
        self.centres = np.random.default_rng([seed, 2**31]).normal(0.0, 2.0, size=(CLASSES, FEATURES))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.seed, index])
        label = int(rng.integers(CLASSES))
        point = self.centres[label] + rng.normal(0.0, 1.0, size=FEATURES)
        return {"features": torch.tensor(point, dtype=torch.float32), "label": torch.tensor(label)}


class ToyClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)


@dataclass
class ToySettings:
    size: int = setting(4096, "examples in the synthetic blobs dataset")


class ToyClassificationTask(Task):
    Config = ToySettings  # task.size

    def build_model(self) -> nn.Module:
        return ToyClassifier()

    def build_train_dataset(self) -> Dataset:
        return BlobsDataset(self.cfg.task.size, self.cfg.seed)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(model(batch["features"]), batch["label"])

    def save_model(self, model: nn.Module, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(model.state_dict(), str(directory / "model.safetensors"))
        (directory / "toy.json").write_text(json.dumps({"features": FEATURES, "classes": CLASSES}))


class DivergentTask(ToyClassificationTask):
    """A broken task on purpose: it nudges a frozen weight by the rank number, outside DDP's
    gradient averaging, so replicas drift apart. `train.check_replicas` must catch it."""

    def build_model(self) -> nn.Module:
        model = ToyClassifier()
        model.offset = nn.Parameter(torch.zeros(1), requires_grad=False)
        return model

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inner = model.module if hasattr(model, "module") else model
        with torch.no_grad():
            inner.offset.add_(float(os.environ.get("RANK", "0")))
        return super().loss(model, batch)


class BypassTask(ToyClassificationTask):
    """A fork's common mistake: the loss calls the module inside DDP (as with a model kept from
    build_model), so no gradient is all-reduced and each rank trains alone on its share."""

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inner = model.module if hasattr(model, "module") else model
        return F.cross_entropy(inner(batch["features"]), batch["label"])


class UnfreezeTask(ToyClassificationTask):
    """Gradual unfreezing: the first layer starts frozen and its requires_grad is set at the third
    step, after the optimizer and DDP were built without it."""

    def build_model(self) -> nn.Module:
        model = ToyClassifier()
        model.net[0].requires_grad_(False)
        self.losses = 0
        return model

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        self.losses += 1
        if self.losses == 3:
            (model.module if hasattr(model, "module") else model).net[0].requires_grad_(True)
        return super().loss(model, batch)


class NormClassifier(nn.Module):
    """ToyClassifier with BatchNorm: buffers (running statistics) that each rank's forward updates."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, CLASSES))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)


class NormTask(ToyClassificationTask):
    """A BatchNorm model whose evaluation reports its validation loss, summed over the examples."""

    def build_model(self) -> nn.Module:
        return NormClassifier()

    def build_eval_dataset(self) -> Dataset:
        return BlobsDataset(64, seed=11)

    def eval_step(self, model: nn.Module, batch: Batch) -> list:
        return F.cross_entropy(model(batch["features"]), batch["label"], reduction="none").tolist()

    def compute_metrics(self, outputs: list, step: int) -> dict[str, float]:
        return {"eval_loss": sum(outputs) / len(outputs)}


class RankSkewedTask(ToyClassificationTask):
    """A broken set-up on purpose: rank 1 sees a shorter dataset, as a node whose data.train holds
    another file at the same path would. The trainer must stop at start, not hang at epoch end."""

    def build_train_dataset(self) -> Dataset:
        short = int(os.environ.get("RANK", "0")) == 1
        return BlobsDataset(self.cfg.task.size - (8 if short else 0), self.cfg.seed)


class CountingTask(ToyClassificationTask):
    """Keeps a task state across resumes (how many micro-batches it has seen), and feeds `loss`
    a non-tensor batch value (string ids), which must reach it untouched."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.seen = 0

    def collate(self, items):
        batch = dict(super().collate(items))
        batch["ids"] = [f"example-{i}" for i in range(len(items))]
        return batch

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        assert batch["ids"][0] == "example-0"
        self.seen += 1
        return super().loss(model, batch)

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]

    def save_model(self, model: nn.Module, directory: Path) -> None:
        super().save_model(model, directory)
        (directory / "seen.json").write_text(json.dumps(self.seen))


class UnusedHeadTask(ToyClassificationTask):
    """A model with a head the loss never uses: DDP needs train.find_unused_parameters."""

    def build_model(self) -> nn.Module:
        model = ToyClassifier()
        model.unused = nn.Linear(FEATURES, 2)
        return model


class IndexedBlobs(BlobsDataset):
    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(index), "index": torch.tensor(index)}


class EvalProbeTask(ToyClassificationTask):
    """Reports how the trainer ran its evaluation: which items arrived (in order), in which mode,
    with or without gradients, and at which step. 11 items: the ranks' shares differ in length."""

    def build_eval_dataset(self) -> Dataset:
        return IndexedBlobs(11, seed=7)

    def eval_step(self, model: nn.Module, batch: Batch) -> list:
        logits = model(batch["features"])
        flags = (model.training, torch.is_grad_enabled(), logits.requires_grad)
        return [(int(i), *flags) for i in batch["index"]]

    def compute_metrics(self, outputs: list, step: int) -> dict[str, float]:
        return {
            "eval_items_in_order": float([o[0] for o in outputs] == list(range(11))),
            "eval_any_training_mode": float(any(o[1] for o in outputs)),
            "eval_any_grad": float(any(o[2] or o[3] for o in outputs)),
            "eval_step_seen": float(step),
        }


class StackedClassifier(nn.Module):
    """ToyClassifier's shape with its hidden layers as a stack of blocks (an `nn.ModuleList`), the
    units that train.parallel=fsdp shards one by one and gathers at each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(n, 32), nn.ReLU()) for n in (FEATURES, 32))
        self.head = nn.Linear(32, CLASSES)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            features = block(features)
        return self.head(features)


class StackedEvalProbeTask(EvalProbeTask):
    def build_model(self) -> nn.Module:
        return StackedClassifier()


class PrecisionProbeTask(ToyClassificationTask):
    """Records, at each forward of its first block's Linear, the dtype of the weight it computes
    with and whether autocast is on, and the dtype of the logits the loss gets; save_model writes
    what it saw to precision.json."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.seen: set[tuple[str, bool]] = set()

    def build_model(self) -> nn.Module:
        model = StackedClassifier()

        def record(module: nn.Module, args: tuple) -> None:
            if torch.is_grad_enabled():  # training forwards only
                self.seen.add((str(module.weight.dtype), torch.is_autocast_enabled("cpu")))

        model.blocks[0][0].register_forward_pre_hook(record)
        return model

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        logits = model(batch["features"])
        self.seen.add(("logits", str(logits.dtype)))
        return F.cross_entropy(logits.float(), batch["label"])

    def save_model(self, model: nn.Module, directory: Path) -> None:
        super().save_model(model, directory)
        (directory / "precision.json").write_text(json.dumps(sorted(self.seen)))


class TrainerProbeTask(EvalProbeTask):
    """EvalProbeTask with an unused head (so it needs train.find_unused_parameters) that also counts
    DDP's gradient all-reduces: its own comm hook, registered before the first backward, counts the
    buckets it reduces. save_model writes, per micro-batch, how many had been reduced before it."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.allreduces = 0
        self.before_micro_batch: list[int] = []

    def build_model(self) -> nn.Module:
        model = ToyClassifier()
        model.unused = nn.Linear(FEATURES, 2)
        return model

    def _count(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.allreduces += 1
        return allreduce_hook(state, bucket)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        if isinstance(model, nn.parallel.DistributedDataParallel) and not self.before_micro_batch:
            model.register_comm_hook(None, self._count)
        self.before_micro_batch.append(self.allreduces)
        return super().loss(model, batch)

    def save_model(self, model: nn.Module, directory: Path) -> None:
        super().save_model(model, directory)
        (directory / "allreduces.json").write_text(json.dumps(self.before_micro_batch + [self.allreduces]))


def _count(args) -> int:
    from distqa.registry import load_config

    cfg = load_config(args.config, args.overrides)  # the task's own settings, as for train
    print(f"{len(BlobsDataset(cfg.task.size, cfg.seed))} examples")
    return 0


def _counting_command(name: str, help_text: str) -> classmethod:
    """A `Task.add_commands` adding one command `name` that counts the synthetic examples."""

    def add_commands(cls, commands, add_settings) -> None:
        parser = commands.add_parser(name, help=help_text)
        add_settings(parser)
        parser.set_defaults(run=_count)

    return classmethod(add_commands)


class CommandTask(ToyClassificationTask):
    """Brings a command of its own: `distqa toy-count task.name=toy_task:CommandTask`."""

    add_commands = _counting_command("toy-count", "count the synthetic examples")


class PredictTask(ToyClassificationTask):
    """Brings a predict command of its own, which `distqa predict` names for its models."""

    add_commands = _counting_command("toy-predict", "predict with a toy model")


class SleepyTask(ToyClassificationTask):
    """Known phase times for `distqa bench`: collating a batch takes COLLATE_MS more and the loss
    LOSS_MS more, so the step breakdown must show at least those in "data" and "forward_backward"."""

    COLLATE_MS, LOSS_MS = 30, 20

    def collate(self, items):
        time.sleep(self.COLLATE_MS / 1000)
        return super().collate(items)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        time.sleep(self.LOSS_MS / 1000)
        return super().loss(model, batch)

    # A validation set of its own (not data.valid): `distqa bench` must not evaluate it, or the
    # evaluation's time would count as the last step's. Evaluating stops the run here.
    def build_eval_dataset(self) -> Dataset:
        return IndexedBlobs(11, seed=7)

    def eval_step(self, model: nn.Module, batch: Batch) -> list:
        raise RuntimeError("SleepyTask was evaluated: a speed run must not evaluate")


class StepCounterTask(ToyClassificationTask):
    """Counts `loss` calls: with train.grad_accum=1 and no evaluation, call N is optimizer step N."""

    BAD_STEP = 3

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.calls = 0

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        self.calls += 1
        return super().loss(model, batch)


class OverflowTask(StepCounterTask):
    """On step BAD_STEP the loss keeps its value but gets a gradient of 1e35 per weight: times
    fp16's GradScaler scale (2**16) that is past float32's range, inf, as a real fp16 overflow is,
    while the logged loss stays finite (so the run's non-finite-loss check does not stop it first)."""

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        loss = super().loss(model, batch)
        if self.calls == self.BAD_STEP:
            inner = model.module if hasattr(model, "module") else model
            spike = inner.net[0].weight.float().sum() * 1e35  # finite: the weights sum to far below 3e3
            loss = loss + (spike - spike.detach())  # value 0, gradient 1e35 per weight
        return loss


class NonFiniteLossTask(StepCounterTask):
    """The loss is inf from step BAD_STEP on, as a diverged run's becomes."""

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        loss = super().loss(model, batch)
        return loss * float("inf") if self.calls >= self.BAD_STEP else loss


class ShardOverflowTask(StepCounterTask):
    """StackedClassifier whose head, on step BAD_STEP, gets a gradient of 1e35 in its last row only:
    an fp16 overflow in the rows FSDP gives to rank 1 (dim 0 is split in rank order), while rank 0's
    shards stay finite. The output's value is unchanged (the added term is 0)."""

    def build_model(self) -> nn.Module:
        model = StackedClassifier()

        def spike(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            if self.calls != self.BAD_STEP or not torch.is_grad_enabled():
                return output
            with torch.autocast(args[0].device.type, enabled=False):  # 1e35 must not meet fp16
                last = F.linear(args[0].detach().float(), module.weight.float(), module.bias.float())[:, -1] * 1e35
            return output + (last - last.detach()).unsqueeze(1).to(output.dtype)

        model.head.register_forward_hook(spike)
        return model


class SyncProbeTask(ToyClassificationTask):
    """StackedClassifier; before each micro-batch records whether any (sharded) parameter already
    holds a gradient. FSDP sets them only when it reduce-scatters, so with train.grad_accum=2 the
    second micro-batch of a step must find none: no communication before the step's last backward."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.reduced_before: list[bool] = []

    def build_model(self) -> nn.Module:
        return StackedClassifier()

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        self.reduced_before.append(any(p.grad is not None for p in model.parameters()))
        return super().loss(model, batch)

    def save_model(self, model: nn.Module, directory: Path) -> None:
        super().save_model(model, directory)
        (directory / "reduced_before.json").write_text(json.dumps(self.reduced_before))
