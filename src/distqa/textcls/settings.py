"""The `task.*` keys of `task.name=textcls` (TextClsTask.Config).

A module of its own that imports no torch: the configuration is checked before the trainer (and
torch with it) is imported, so a mistake is reported at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from distqa.config import check_min, setting
from distqa.errors import ConfigError


@dataclass
class TextClsSettings:
    # data.train=dummy (the default) is refused by `distqa train` before the model loads
    # (`config_layers.check_training_data`); `distqa export` sets it, and reads no data.
    no_synthetic_data: ClassVar[bool] = True
    # The eval_* keys the task reports (`textcls.metric`), each with the way it improves:
    # train.best_metric is one, and train.best_mode=auto takes its direction from here.
    metric_names: ClassVar[dict[str, str | None]] = {"eval_accuracy": "max", "eval_macro_f1": "max"}

    labels: str | None = setting(
        None,
        "the class names in order, comma-separated (e.g. 'negative,positive'); "
        "the file's labels may be these names or their indices (names only, where the names are numbers)",
    )
    text_column: str = setting("text", "column (CSV) or key (JSONL) of the text")
    text_pair_column: str | None = setting(None, "column of the second text of a pair (default: single texts)")
    label_column: str = setting("label", "column of the label")
    max_seq_len: int = setting(128, "tokens per input, special tokens included (longer inputs are cut)")

    def __post_init__(self) -> None:
        check_min("task.max_seq_len", self.max_seq_len, 4)
        # task.labels stays optional here so that `--help` and the defaults load; the task requires it.
        names = self.label_names()
        if self.labels is not None and len(names) < 2:
            raise ConfigError(f"task.labels={self.labels!r} must name at least 2 classes, comma-separated")
        if len(set(names)) != len(names):
            raise ConfigError(f"task.labels={self.labels!r} names a class twice")
        if any(not name for name in names):
            raise ConfigError(f"task.labels={self.labels!r} has an empty class name")

    def label_names(self) -> list[str]:
        """task.labels as a list, in order (empty when unset)."""
        return [] if self.labels is None else [name.strip() for name in str(self.labels).split(",")]
