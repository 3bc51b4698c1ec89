"""Text and text-pair classification, as the generic trainer sees it (see `distqa.task.Task`).

    torchrun --standalone --nproc-per-node 2 -m distqa train task.name=textcls \
        task.labels=negative,positive data.train=train.csv data.valid=valid.csv model.name=bert-base-uncased

Any Hugging Face encoder with a sequence-classification head works; the export in
output_dir/model loads with `AutoModelForSequenceClassification` and `AutoTokenizer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from transformers import AutoModelForSequenceClassification

from distqa.config import Config
from distqa.dist import print0
from distqa.errors import DistqaError
from distqa.models import build_hf_model, check_model_fits, hf_config, load_tokenizer
from distqa.task import Batch, Task
from distqa.textcls.data import Example, ExampleDataset, read_examples
from distqa.textcls.metric import accuracy_and_macro_f1
from distqa.textcls.settings import TextClsSettings


def no_dummy(key: str) -> DistqaError:
    return DistqaError(f"{key}=dummy: textcls has no synthetic data; give a .csv or .jsonl file")


class TextClsTask(Task):
    Config = TextClsSettings  # task.labels, task.text_column, ...: distqa.textcls.settings
    core_settings = ("model.name", "data.train")

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        # Every input mistake before the tokenizer and model load, so it is reported at once.
        self.labels = cfg.task.label_names()
        if not self.labels:
            raise DistqaError("task.name=textcls needs task.labels, the class names in order (e.g. negative,positive)")
        if cfg.data.valid == "dummy":
            raise no_dummy("data.valid")
        self.tokenizer = load_tokenizer(cfg.model, required=True)  # text needs one: a random model must name it

    def build_model(self) -> nn.Module:
        config = hf_config(self.cfg.model)
        check_head_classes(config, self.labels, self.cfg.model.name)
        config.num_labels = len(self.labels)
        # Saved in the export's config.json, so a pipeline shows class names, not LABEL_0.
        config.id2label, config.label2id = dict(enumerate(self.labels)), {name: i for i, name in enumerate(self.labels)}
        model = build_hf_model(AutoModelForSequenceClassification, self.cfg.model, config)
        check_model_fits(model, self.cfg.model, max_seq_len=self.cfg.task.max_seq_len, tokenizer=self.tokenizer)
        return model

    def build_train_dataset(self) -> Dataset:
        # Here, not at start: `distqa export` builds the task with data.train=dummy (it reads no data).
        if self.cfg.data.train == "dummy":
            raise no_dummy("data.train")
        return ExampleDataset(read_examples(self.cfg.data.train, "data.train", self.cfg.task))

    def build_eval_dataset(self) -> Dataset | None:
        if self.cfg.data.valid is None:
            return None
        return ExampleDataset(read_examples(self.cfg.data.valid, "data.valid", self.cfg.task))

    def collate(self, items: list[Example]) -> Batch:
        return self.collate_fn()(items)

    collate_fn_own = True  # collate_fn does not call collate (`distqa.task.check_collate_used`)

    def collate_fn(self) -> TokenizeBatch:
        # The tokenizer and one number for the loader's workers to unpickle, not the whole task.
        return TokenizeBatch(self.tokenizer, self.cfg.task.max_seq_len)

    def _logits(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return model(**inputs).logits

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        # The loss here, not the model's: cross-entropy in fp32 whatever the autocast.
        return F.cross_entropy(self._logits(model, batch).float(), batch["labels"])

    def eval_step(self, model: nn.Module, batch: Batch) -> list[tuple[int, int]]:
        predictions = self._logits(model, batch).argmax(dim=-1)
        return list(zip(predictions.tolist(), batch["labels"].tolist(), strict=True))

    def compute_metrics(self, outputs: list[tuple[int, int]], step: int) -> dict[str, float]:
        predictions, gold = zip(*outputs, strict=True)
        return accuracy_and_macro_f1(list(predictions), list(gold), len(self.labels))

    def save_model(self, model: nn.Module, directory: Path) -> None:
        model.save_pretrained(directory)
        # The export's tokenizer cuts where evaluation did (task.max_seq_len), not at the model's
        # 512: a pipeline(truncation=True) of the export otherwise scored other inputs than the run.
        kept, self.tokenizer.model_max_length = self.tokenizer.model_max_length, self.cfg.task.max_seq_len
        try:
            self.tokenizer.save_pretrained(str(directory))
        finally:
            self.tokenizer.model_max_length = kept


@dataclass(frozen=True)
class TokenizeBatch:
    """Tokenize a batch, padded to its longest input (not to max_seq_len: short texts stay cheap)."""

    tokenizer: Any
    max_len: int

    def __call__(self, items: list[Example]) -> Batch:
        texts = [item.text for item in items]
        pairs = None if items[0].pair is None else [item.pair for item in items]
        batch = dict(
            self.tokenizer(
                texts,
                pairs,
                padding="longest",
                truncation=True,  # a pair is cut from its longer text first
                max_length=self.max_len,
                return_tensors="pt",
            )
        )
        batch["labels"] = torch.tensor([item.label for item in items])
        return batch


def check_head_classes(config: Any, labels: list[str], name: str) -> None:
    """A model.name whose classification head was trained already (a distqa export, a fine-tuned
    hub model: its architectures say ...ForSequenceClassification) keeps its head's weights index by
    index: task.labels in another order renamed each class as another (accuracy 0.32 where the
    weights scored 1.0, exit 0), and another count failed in a traceback. Both are refused in one
    line; where the order cannot be checked (LABEL_0, ... or other names) one line says so."""
    if not any(
        str(arch).endswith("ForSequenceClassification") for arch in getattr(config, "architectures", None) or ()
    ):
        return  # an encoder without a trained head: transformers makes a new one
    trained = getattr(config, "id2label", None) or {}
    names = [str(value) for _, value in sorted((int(key), value) for key, value in trained.items())]
    if len(names) != len(labels):
        raise DistqaError(
            f"model.name={name!r} has a classification head for {len(names)} classes ({', '.join(names)}) and "
            f"task.labels gives {len(labels)}: start from its encoder without that head, or give its classes"
        )
    folded, wanted = ([n.strip().casefold() for n in given] for given in (names, labels))
    if folded == wanted:
        return
    if sorted(folded) == sorted(wanted):
        raise DistqaError(
            f"model.name={name!r} was trained for the classes {', '.join(names)} in that order, and task.labels "
            f"gives them as {', '.join(labels)}: its head would answer each with another's weights; give "
            "task.labels in the model's order"
        )
    print0(
        f"warning: model.name={name!r} has a trained head for the classes {', '.join(names)}: its weights are "
        f"kept for {', '.join(labels)}, in that order (check that it is the model's)"
    )
