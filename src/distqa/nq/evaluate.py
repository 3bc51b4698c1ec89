"""Natural Questions' side of evaluation, and the forward pass `distqa predict` shares with it.

The trainer runs evaluation (`distqa.evaluation`): each rank's share of the validation windows
goes through `window_best_spans`, which shrinks each window to its best span (`WindowBest`, a few
numbers) before the gather; rank 0 groups them by example id, predicts, chooses the long and short
thresholds that maximise F1, and reports the competition metric (`score_predictions`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from distqa.evaluation import eval_mode, to_device
from distqa.nq.data import pad_collate
from distqa.nq.postprocess import (
    WindowBest,
    apply_thresholds,
    best_spans,
    best_threshold,
    f1,
    kind_f1,
    predict_example,
)
from distqa.nq.reader import NQReader

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
EVAL_COLUMNS = ["example_id", *MODEL_INPUTS, "token_map"]


def window_best_spans(model: nn.Module, batch: dict[str, Any]) -> list[WindowBest]:
    """The best span of every window of a batch (its tensors on the model's device)."""
    logits = model(**{k: batch[k] for k in MODEL_INPUTS})
    return best_spans(
        logits["start_logits"].float().cpu(),
        logits["end_logits"].float().cpu(),
        logits["answer_type_logits"].float().cpu(),
        batch["token_map"].cpu(),
        batch["example_id"],
    )


def window_bests(
    model: nn.Module,
    folder: Path,
    *,
    device: torch.device,
    batch_size: int,
    pad_id: int,
    max_len: int,
    autocast_dtype: torch.dtype | None = None,
) -> list[WindowBest]:
    """Best span of every window of a prepared folder, in one process (`distqa predict`)."""
    from distqa.nq.prepare import load_features  # not at the top: see distqa.nq.data.resolve_features

    data = load_features(folder).select_columns(EVAL_COLUMNS)
    loader = DataLoader(data, batch_size=batch_size, collate_fn=lambda items: pad_collate(items, pad_id, max_len))
    out: list[WindowBest] = []
    # The trainer's evaluation mode (eval, no gradients, autocast), so predictions match its own.
    with eval_mode(model, device.type, autocast_dtype):
        for batch in loader:
            out.extend(window_best_spans(model, to_device(batch, device)))
    return out


class GoldIndex:
    """What rank 0 needs of the validation examples: candidates and gold answers, not the text."""

    def __init__(self, path: str | Path, *, skip_bad_lines: bool = False) -> None:
        from distqa.nq.metric import gold_answers  # the competition's gold rules, in one place

        self.examples: dict[str, Any] = {}
        self.gold: dict[str, tuple[set[str], set[str]]] = {}
        reader = NQReader(path, skip_bad_lines=skip_bad_lines)
        for example in reader:
            self.gold[example.example_id] = gold_answers(
                {"annotations": example.annotations, "example_id": example.example_id}
            )
            example.tokens = []  # candidates are all postprocessing needs; the text is large
            self.examples[example.example_id] = example


def score_predictions(
    grouped: dict[str, list[WindowBest]], gold: GoldIndex, thresholds: dict[str, float] | None = None
) -> tuple[dict[str, float], dict[str, float]]:
    """(metrics, thresholds): chooses the thresholds on these examples unless given."""
    preds = {eid: predict_example(grouped.get(eid, []), ex) for eid, ex in gold.examples.items()}
    long_rows = [(p.score, p.long, gold.gold[eid][0]) for eid, p in preds.items()]
    short_rows = [(p.score, p.short, gold.gold[eid][1]) for eid, p in preds.items()]
    if thresholds is None:
        thresholds = {"long": best_threshold(long_rows)[0], "short": best_threshold(short_rows)[0]}
    lt, lf, ln = kind_f1(long_rows, thresholds["long"])
    st, sf, sn = kind_f1(short_rows, thresholds["short"])
    metrics = {
        "eval_micro_f1": f1(lt + st, lf + sf, ln + sn),
        "eval_long_f1": f1(lt, lf, ln),
        "eval_short_f1": f1(st, sf, sn),
        "eval_long_threshold": thresholds["long"],
        "eval_short_threshold": thresholds["short"],
    }
    return metrics, thresholds


def final_answers(grouped: dict[str, list[WindowBest]], examples: dict[str, Any], thresholds: dict[str, float]):
    """example id -> (long, short) strings, thresholds applied (what a submission holds)."""
    return {
        eid: apply_thresholds(predict_example(grouped.get(eid, []), ex), thresholds) for eid, ex in examples.items()
    }
