"""The Natural Questions task, as the generic trainer sees it (see `distqa.task.Task`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import AutoTokenizer

from distqa.config import Config
from distqa.errors import DistqaError
from distqa.models import RANDOM_MODELS, load_error
from distqa.nq.commands import add_commands as add_nq_commands
from distqa.nq.data import TRAIN_COLUMNS, FeatureDataset, pad_collate, resolve_features, train_data_fingerprint
from distqa.nq.dummy import DummyDataset
from distqa.nq.evaluate import EVAL_COLUMNS, GoldIndex, score_predictions, window_best_spans
from distqa.nq.model import BertJointQA, bert_joint_loss
from distqa.nq.postprocess import WindowBest, group_by_example
from distqa.nq.settings import NQSettings
from distqa.task import Batch, Task


def load_tokenizer(cfg: Config) -> Any | None:
    """The tokenizer `model.tokenizer` (default: `model.name`) names; none for a bare random model.

    'tiny' and 'bert-base-random' have bert-base-uncased's vocabulary size but no tokenizer of
    their own: dummy data needs none, and loading bert-base-uncased's would need a download.
    """
    name = cfg.model.tokenizer or cfg.model.name
    if name in RANDOM_MODELS:
        return None
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise load_error("tokenizer", name, err, "model.tokenizer") from err


THRESHOLDS_FILE = "distqa_thresholds.json"


class NQTask(Task):
    Config = NQSettings  # the task.* keys (max_seq_len, doc_stride, ...): distqa.nq.settings

    @classmethod
    def add_commands(cls, commands: Any, add_settings: Any) -> None:
        add_nq_commands(commands, add_settings)  # prepare, predict, score, download

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.tokenizer = load_tokenizer(cfg)
        if cfg.data.valid is not None and cfg.data.valid == "dummy":
            raise DistqaError("data.valid=dummy: validation needs Natural Questions data (a JSONL file)")
        self._valid_folder: Path | None = None
        self._gold: GoldIndex | None = None  # rank 0 only, loaded at the first evaluation
        self.thresholds: dict[str, float] | None = None

    def build_model(self) -> nn.Module:
        model = BertJointQA.build(self.cfg.model)
        max_positions = getattr(model.config, "max_position_embeddings", None)
        if max_positions is not None and self.cfg.task.max_seq_len > max_positions:
            raise DistqaError(
                f"task.max_seq_len={self.cfg.task.max_seq_len} exceeds the {max_positions} positions "
                f"model {self.cfg.model.name!r} was built for"
            )
        if self.tokenizer is not None and len(self.tokenizer) > model.config.vocab_size:
            raise DistqaError(
                f"tokenizer {self.cfg.model.tokenizer or self.cfg.model.name!r} has {len(self.tokenizer)} tokens, "
                f"more than model {self.cfg.model.name!r}'s vocabulary of {model.config.vocab_size}"
            )
        self._vocab_size = model.config.vocab_size
        return model

    def build_train_dataset(self) -> Dataset:
        data, own = self.cfg.data, self.cfg.task
        # Before the dummy branch: validation on real data is also wanted (and must not be
        # dropped silently) when training on the DummyDataset.
        if data.valid is not None:  # prepared here too: this runs on one process per node first
            self._valid_folder = resolve_features(self.cfg, data.valid, self.tokenizer, training=False)
        if data.train == "dummy":
            return DummyDataset(
                own.dummy_size,
                own.max_seq_len,
                vocab_size=self._vocab_size,
                seed=self.cfg.seed,
                **self._special_ids(),
            )
        folder = resolve_features(self.cfg, data.train, self.tokenizer, training=True)
        return FeatureDataset(folder, TRAIN_COLUMNS)

    def data_fingerprint(self, dataset: Dataset) -> str:
        """Prepared features by their Arrow content, the DummyDataset by its settings: both cover
        every example, at a fraction of hashing item by item (distqa.nq.data)."""
        return train_data_fingerprint(dataset)

    def _special_ids(self) -> dict[str, int]:
        """The tokenizer's own [CLS]/[SEP]/[PAD] ids (DummyDataset's defaults are BERT's)."""
        if self.tokenizer is None:
            return {}
        special = {
            "cls_id": self.tokenizer.cls_token_id,
            "sep_id": self.tokenizer.sep_token_id,
            "pad_id": self.tokenizer.pad_token_id,
        }
        return {k: v for k, v in special.items() if v is not None}

    def collate(self, items: list[Any]) -> Batch:
        pad_id = self._special_ids().get("pad_id", 0)
        return pad_collate(items, pad_id=pad_id, max_len=self.cfg.task.max_seq_len)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        outputs = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            token_type_ids=batch["token_type_ids"],
        )
        return bert_joint_loss(outputs, dict(batch))

    def build_eval_dataset(self) -> Dataset | None:
        # Prepared in build_train_dataset, which runs on one process per node first.
        return None if self._valid_folder is None else FeatureDataset(self._valid_folder, EVAL_COLUMNS)

    def eval_step(self, model: nn.Module, batch: Batch) -> list[WindowBest]:
        """Each window shrinks to its best span (a few numbers) before the gather."""
        return window_best_spans(model, batch)

    def compute_metrics(self, outputs: list[WindowBest], step: int) -> dict[str, float]:
        """Competition F1 on data.valid; also chooses the thresholds saved with the model."""
        if self._gold is None:
            self._gold = GoldIndex(self.cfg.data.valid, skip_bad_lines=self.cfg.task.skip_bad_lines)
        metrics, self.thresholds = score_predictions(group_by_example(outputs), self._gold)
        return metrics

    def save_model(self, model: nn.Module, directory: Path) -> None:
        assert isinstance(model, BertJointQA)
        model.save_pretrained(directory)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(directory))
        if self.thresholds is not None:  # chosen on data.valid; `distqa predict` applies them
            (directory / THRESHOLDS_FILE).write_text(json.dumps(self.thresholds, indent=2) + "\n")
