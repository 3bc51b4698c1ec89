"""Natural Questions' own settings, the `task.*` keys of `task.name=nq` (NQTask.Config).

A module of its own that imports no torch: the configuration is checked before the trainer (and
torch with it) is imported, so a mistake is reported at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from distqa.config import check_min, setting
from distqa.errors import ConfigError


@dataclass
class NQSettings:
    # These keys were `data.*` before they became the task's own (before any release): an old name
    # is refused like any unknown key, and the error gives the new one.
    renamed_keys: ClassVar[dict[str, str]] = {
        f"data.{key}": f"task.{key}"
        for key in (
            "max_seq_len",
            "doc_stride",
            "max_query_len",
            "keep_unknown",
            "skip_bad_lines",
            "cache_dir",
            "dummy_size",
        )
    }
    # What to do when data.valid names no file (`config_layers.check_data_paths`): the usual cause
    # is a config naming a split not yet made.
    missing_data_hints: ClassVar[dict[str, str]] = {
        "data.valid": "set data.valid= (empty) to train without validation, or set examples aside "
        "with `distqa split --input data/simplified-nq-train.jsonl --valid 2000 --output data/split`"
    }

    # The eval_* keys the task reports (`nq.evaluate.score_predictions`), each with the way it
    # improves: train.best_metric is one, and train.best_mode=auto takes its direction from here
    # (the thresholds are no scores: chosen on the validation set, neither higher nor lower is better).
    metric_names: ClassVar[dict[str, str | None]] = {
        "eval_micro_f1": "max",
        "eval_long_f1": "max",
        "eval_short_f1": "max",
        "eval_long_threshold": None,
        "eval_short_threshold": None,
    }

    max_seq_len: int = setting(512, "tokens per input sequence, special tokens included")
    doc_stride: int = setting(128, "document tokens between the starts of two windows (at most a window's length)")
    max_query_len: int = setting(64, "question tokens kept (the rest is cut)")
    keep_unknown: float = setting(0.02, "fraction of training windows without the answer that are kept")
    # Saved with the model (no resume rule): `distqa predict` then gives the spans evaluation gave,
    # on which the thresholds were chosen.
    max_answer_len: int = setting(
        30,
        "longest short answer evaluation and `distqa predict` give, in sub-words (a longer gold answer is never given)",
    )
    skip_bad_lines: bool = setting(
        False, "skip (and count) malformed JSONL lines instead of stopping", resume="applied"
    )
    cache_dir: str | None = setting(
        None, "where prepared features are cached (default: HF_HOME/distqa/features)", resume="silent"
    )
    dummy_size: int = setting(4096, "number of examples in the DummyDataset (data.train=dummy)")

    def ensure_dummy_examples(self, count: int) -> None:
        """With data.train=dummy, let the DummyDataset hold at least `count` examples (`distqa bench`
        keeps its measured steps inside one epoch this way, whichever task it runs)."""
        self.dummy_size = max(self.dummy_size, count)

    def __post_init__(self) -> None:
        check_min("task.max_seq_len", self.max_seq_len, 8)
        check_min("task.dummy_size", self.dummy_size, 1)
        check_min("task.doc_stride", self.doc_stride, 1)
        check_min("task.max_query_len", self.max_query_len, 1)
        check_min("task.max_answer_len", self.max_answer_len, 1)
        if not 0.0 <= self.keep_unknown <= 1.0:
            raise ConfigError(f"task.keep_unknown={self.keep_unknown} must be in [0, 1]")
