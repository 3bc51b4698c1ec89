"""The Natural Questions task, as the generic trainer sees it (see `distqa.task.Task`)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from distqa.config import Config
from distqa.dist import print0
from distqa.errors import DistqaError
from distqa.models import RANDOM_MODELS, check_model_fits, load_tokenizer
from distqa.nq.data import (
    TRAIN_COLUMNS,
    FeatureDataset,
    check_feature_ids,
    pad_collate,
    resolve_features,
    train_data_fingerprint,
    warn_overlap,
)
from distqa.nq.dummy import DummyDataset
from distqa.nq.evaluate import EVAL_COLUMNS, GoldIndex, score_predictions, window_best_spans
from distqa.nq.features import TOKEN_TYPES
from distqa.nq.model import BertJointQA, bert_joint_loss
from distqa.nq.postprocess import WindowBest, group_by_example
from distqa.nq.settings import NQSettings
from distqa.nq.thresholds import THRESHOLDS_FILE, from_json_values, thresholds_json, to_json_values
from distqa.task import Batch, Task


class NQTask(Task):
    Config = NQSettings  # the task.* keys (max_seq_len, doc_stride, ...): distqa.nq.settings
    core_settings = ("model.name", "data.train")

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        # None for a random model ('tiny'): the DummyDataset needs no tokenizer.
        self.tokenizer = load_tokenizer(cfg.model)
        if cfg.data.valid is not None and cfg.data.valid == "dummy":
            raise DistqaError("data.valid=dummy: validation needs Natural Questions data (a JSONL file)")
        if cfg.data.valid is not None and Path(cfg.data.valid).is_dir():
            # Scoring needs the gold answers, which only the JSONL file holds (features have none).
            raise DistqaError(
                f"data.valid={cfg.data.valid} is a folder: validation reads its gold answers from the Natural "
                "Questions JSONL file, so name the file (its features are cached on first use; `distqa prepare "
                "--mode eval --input FILE` without --output prepares them ahead)"
            )
        self._valid_folder: Path | None = None
        self._gold: GoldIndex | None = None  # rank 0 only, read at start (build_train_dataset)
        self._gold_digest: str | None = None  # each node's first process: part of the validation identity
        self.thresholds: dict[str, float] | None = None
        # The step whose weights the thresholds were chosen on (None: a checkpoint of an older distqa).
        self.thresholds_step: int | None = None
        # The train.precision of the scores they were chosen on: predict computes its scores in it too.
        self.thresholds_precision: str | None = None
        # The step of the weights `save_model` exports, set by the exporter (the trainer at the end
        # of a run, `distqa export`): thresholds of another step are not written with them.
        self.weights_step: int | None = None

    def build_model(self) -> nn.Module:
        model = BertJointQA.build(self.cfg.model)
        settings = self.cfg.task
        check_model_fits(
            model, self.cfg.model, max_seq_len=settings.max_seq_len, tokenizer=self.tokenizer, token_types=TOKEN_TYPES
        )
        self._vocab_size = model.config.vocab_size
        return model

    def build_train_dataset(self) -> Dataset:
        data, own = self.cfg.data, self.cfg.task
        # Before the dummy branch: validation on real data is also wanted (and must not be
        # dropped silently) when training on the DummyDataset.
        if data.valid is not None:  # prepared here too: this runs on one process per node first
            self._valid_folder = resolve_features(self.cfg, data.valid, self.tokenizer, training=False)
            # The gold, read now by one process per node: a file without answers (a test file) or
            # a stale feature cache stops every node in one line before the first step, not at the
            # first evaluation, hours in. Rank 0 keeps it for scoring.
            if os.environ.get("LOCAL_RANK", "0") == "0":
                gold = self._read_gold()
                self._gold = gold if os.environ.get("RANK", "0") == "0" else None
                self._gold_digest = gold.digest()  # this process hashes the node's validation set
        if data.train == "dummy":
            if self.cfg.model.name not in RANDOM_MODELS:  # fine-tuning real weights on noise: say so once
                print0(
                    f"warning: the pretrained model {self.cfg.model.name} trains on the DummyDataset "
                    "(data.train=dummy), synthetic data: set data.train to Natural Questions data for a real run"
                )
            return DummyDataset(
                own.dummy_size,
                own.max_seq_len,
                vocab_size=self._vocab_size,
                seed=self.cfg.seed,
                **self._special_ids(),
            )
        folder = resolve_features(self.cfg, data.train, self.tokenizer, training=True)
        if self._gold is not None:
            warn_overlap(folder, self._gold.examples.keys(), train=data.train, valid=str(data.valid))
        return FeatureDataset(folder, TRAIN_COLUMNS)

    def data_fingerprint(self, dataset: Dataset) -> str:
        """Prepared features by their Arrow content, the DummyDataset by its settings: both cover
        every example, at a fraction of hashing item by item (distqa.nq.data). The validation set's
        also covers what scores it beside its windows, the gold answers and long-answer candidates
        of data.valid: a file whose answers alone changed kept the identity, and with it the best
        record measured on the old answers (a step scoring 0.0 exported as the best)."""
        features = train_data_fingerprint(dataset)
        if not isinstance(dataset, FeatureDataset) or dataset.columns != EVAL_COLUMNS or self._valid_folder is None:
            return features
        if self._gold_digest is None:  # read in build_train_dataset; a process that did not, now
            self._gold_digest = self._read_gold().digest()
        # "+": a record of the windows alone (a checkpoint from before the gold counted) compares by them.
        return f"{features}+{self._gold_digest[:16]}"

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
        return self.collate_fn()(items)

    collate_fn_own = True  # collate_fn does not call collate (`distqa.task.check_collate_used`)

    def collate_fn(self) -> functools.partial[Batch]:
        # Two numbers for the loader's workers to unpickle, not the task with its tokenizer.
        pad_id = self._special_ids().get("pad_id", 0)
        return functools.partial(pad_collate, pad_id=pad_id, max_len=self.cfg.task.max_seq_len)

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
        return window_best_spans(model, batch, self.cfg.task.max_answer_len)

    def compute_metrics(self, outputs: list[WindowBest], step: int) -> dict[str, float]:
        """Competition F1 on data.valid; also chooses the thresholds saved with these (step's) weights."""
        if self._gold is None:  # rank 0 read it at start (build_train_dataset); a task used without that reads it now
            self._gold = self._read_gold()
        metrics, self.thresholds = score_predictions(group_by_example(outputs), self._gold)
        self.thresholds_step, self.thresholds_precision = step, self.cfg.train.precision
        return metrics

    def _read_gold(self) -> GoldIndex:
        gold = GoldIndex(self.cfg.data.valid, skip_bad_lines=self.cfg.task.skip_bad_lines)
        # The features' cache is keyed on the file's path, size and modification time, the gold is
        # read from the file itself: an edit that kept both would score old windows against new
        # answers (an example without windows scores as unanswered, silently).
        if self._valid_folder is not None:
            check_feature_ids(self._valid_folder, gold.examples.keys(), self.cfg.data.valid)
        return gold

    def state_dict(self) -> dict[str, Any]:
        """The thresholds of the latest evaluation, with its step, travel in each checkpoint: a resumed
        run, or `distqa export` of an earlier (the best) checkpoint, has them, and exports them with
        the weights of that step only. JSON: +inf ("never answer") as null, as in the thresholds file."""
        if self.thresholds is None:
            return {}
        return {"thresholds": to_json_values(self.thresholds, self.thresholds_step, self.thresholds_precision)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("thresholds")
        if saved is None:  # nothing evaluated before that checkpoint
            return
        try:
            self.thresholds, self.thresholds_step, self.thresholds_precision = from_json_values(saved)
        except ValueError as err:
            raise DistqaError(
                f"the checkpoint's task state holds thresholds distqa cannot read ({err}): resume from, "
                "or export, another checkpoint"
            ) from None

    def _thresholds_to_write(self) -> dict[str, float] | None:
        """The thresholds if they belong to the weights being exported; else None, and one line why."""
        chosen, weights = self.thresholds_step, self.weights_step
        if self.thresholds is None or weights is None or chosen == weights:
            return self.thresholds  # (weights None: an exporter that does not say its step)
        if chosen is None:  # a checkpoint of an older distqa: write them, as it did, but say so
            print0(
                f"warning: {THRESHOLDS_FILE} holds the thresholds of the latest evaluation up to step {weights} "
                "(a checkpoint of an older distqa records no step): they fit these weights only if step "
                f"{weights} was evaluated"
            )
            return self.thresholds
        # Another step's thresholds give a plausible, wrong submission (a "never" one an empty one).
        print0(
            f"warning: the thresholds were chosen at step {chosen}, these weights are step {weights}: "
            f"{THRESHOLDS_FILE} is not written, so `distqa predict` gives every example its best answer; "
            "for thresholds of their own, export an evaluated checkpoint (checkpoints/best) or train on with data.valid"
        )
        return None

    def save_model(self, model: nn.Module, directory: Path) -> None:
        assert isinstance(model, BertJointQA)
        model.save_pretrained(directory)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(directory))
        thresholds = self._thresholds_to_write()
        if thresholds is not None:  # chosen on data.valid with these weights; `distqa predict` applies them
            text = thresholds_json(thresholds, self.thresholds_step, self.thresholds_precision)
            (directory / THRESHOLDS_FILE).write_text(text)
