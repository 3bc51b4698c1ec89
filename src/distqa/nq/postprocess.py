"""From per-window logits to one long and one short answer per example, and the thresholds.

Per window: the top-k start and end positions inside the document part give candidate spans of at
most `max_answer_len` sub-words, scored `start + end - (start[CLS] + end[CLS])` (how much better
than "no answer in this window"). Per example: the best span over its windows that lies inside a
long-answer candidate (NQ's short answers always do; one outside all of them could only be wrong),
or whose window answers YES or NO.
The long answer is the top-level candidate that contains it; the short answer is the span itself,
YES/NO when the answer-type head of that window says so, or none when it says "long answer only".
A prediction is only written when its score clears a threshold, one for long and one for short
answers, chosen together on the validation set to maximise the competition's micro F1 over both
(`distqa.nq.evaluate.best_pair`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from distqa.nq.features import LONG, NO, YES
from distqa.nq.reader import NQExample


@dataclass
class WindowBest:
    """The best span of one window, in NQ token indices (end exclusive), as a rank sends it."""

    example_id: str
    score: float
    start_token: int
    end_token: int
    answer_type: int


def best_spans(
    start_logits: torch.Tensor,
    end_logits: torch.Tensor,
    type_logits: torch.Tensor,
    token_maps: torch.Tensor,
    example_ids: list[str],
    *,
    max_answer_len: int,
    top_k: int = 20,
) -> list[WindowBest]:
    """Best span of each window of a batch (tensors of shape (batch, seq); token_map -1 = not document).

    Every pair of the top-k starts and ends at once, as a (batch, k, k) tensor: pair by pair in
    Python this took 35 ms a batch on the CPU, longer than the model's forward pass of a small
    model, for every batch of every evaluation. The same arithmetic in the same float32 order, and
    the first best pair in start-major order on a tie, as `_best_pair` (kept for rows whose best is
    not a finite number, whose comparisons it decides as it always did)."""
    out = []
    doc = token_maps >= 0
    masked_start = start_logits.float().masked_fill(~doc, -math.inf)
    masked_end = end_logits.float().masked_fill(~doc, -math.inf)
    k = min(top_k, start_logits.shape[1])
    starts, ends = masked_start.topk(k, dim=1).indices, masked_end.topk(k, dim=1).indices
    null = start_logits[:, 0].float() + end_logits[:, 0].float()
    pair_starts, pair_ends = starts[:, :, None], ends[:, None, :]
    scores = masked_start.gather(1, starts)[:, :, None] + masked_end.gather(1, ends)[:, None, :] - null[:, None, None]
    valid = doc.gather(1, starts)[:, :, None] & doc.gather(1, ends)[:, None, :]
    valid &= (pair_ends >= pair_starts) & (pair_ends - pair_starts + 1 <= max_answer_len)
    best_scores, firsts = scores.masked_fill(~valid, -math.inf).flatten(1).max(dim=1)  # the first of equal maxima
    best_starts, best_ends = starts.gather(1, firsts[:, None] // k), ends.gather(1, firsts[:, None] % k)
    per_row = zip(
        example_ids,
        valid.flatten(1).any(dim=1).tolist(),
        best_scores.tolist(),
        best_starts[:, 0].tolist(),
        best_ends[:, 0].tolist(),
        type_logits.argmax(dim=1).tolist(),
    )
    for row, (example_id, any_pair, score, s, e, answer_type) in enumerate(per_row):
        if not any_pair:
            continue  # a window without document tokens (an empty document)
        if not math.isfinite(score):
            score, s, e = _best_pair(
                masked_start[row], masked_end[row], null[row], doc[row], starts[row], ends[row], max_answer_len
            )
        tmap = token_maps[row]
        out.append(WindowBest(example_id, score, int(tmap[s]), int(tmap[e]) + 1, answer_type))
    return out


def _best_pair(
    start: torch.Tensor,
    end: torch.Tensor,
    null: torch.Tensor,
    doc: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    max_answer_len: int,
) -> tuple[float, int, int]:
    """One window's best (score, start, end), pair by pair: the first valid pair, then any that
    scores higher (so a NaN or -inf score is kept only while nothing beats it)."""
    best: tuple[float, int, int] | None = None
    for s in starts.tolist():
        for e in ends.tolist():
            if doc[s] and doc[e] and s <= e < s + max_answer_len:
                score = float(start[s] + end[e] - null)
                if best is None or score > best[0]:
                    best = (score, s, e)
    assert best is not None, "called only for a window with a valid pair"
    return best


@dataclass
class ExamplePrediction:
    long: str  # "start:end" or ""
    short: str  # "start:end", "YES", "NO" or ""
    score: float


def _containing(window: WindowBest, example: NQExample) -> list[dict[str, Any]]:
    return [
        c for c in example.candidates if c["start_token"] <= window.start_token and window.end_token <= c["end_token"]
    ]


def predict_example(windows: list[WindowBest], example: NQExample) -> ExamplePrediction:
    """Before thresholds: the best window that could be right, its long-answer candidate, and
    YES/NO. NQ's short answers always lie inside one of the candidates, so a span outside all of
    them (across two paragraphs, say) could only be a false positive: such a window is passed over
    unless its answer is YES or NO, which names no span."""
    ranked = sorted(windows, key=lambda w: w.score, reverse=True)
    best = next((w for w in ranked if w.answer_type in (YES, NO) or _containing(w, example)), None)
    if best is None:
        return ExamplePrediction("", "", -math.inf)
    long = ""
    if containing := _containing(best, example):
        # Prefer top-level candidates, as NQ's long answers are; then the narrowest.
        chosen = min(containing, key=lambda c: (not c.get("top_level", True), c["end_token"] - c["start_token"]))
        long = f"{chosen['start_token']}:{chosen['end_token']}"
    if best.answer_type == YES:
        short = "YES"
    elif best.answer_type == NO:
        short = "NO"
    elif best.answer_type == LONG:
        # The type head says: a long answer without a short one. Its span (the paragraph's first
        # sub-words, cut at max_answer_len) is no short answer: written, it could only be a false
        # positive, kept by the same threshold that keeps YES/NO and short answers of equal score.
        short = ""
    else:
        short = f"{best.start_token}:{best.end_token}"
    return ExamplePrediction(long, short, best.score)


def f1(tp: int, fp: int, fn: int) -> float:
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def kind_f1(rows: list[tuple[float, str, set[str]]], threshold: float) -> tuple[int, int, int]:
    """TP, FP, FN of one kind of row at a given threshold (the competition's counting)."""
    tp = fp = fn = 0
    for score, pred, gold in rows:
        if pred and score > threshold:
            tp, fp = (tp + 1, fp) if pred in gold else (tp, fp + 1)
        elif gold:
            fn += 1
    return tp, fp, fn


def apply_thresholds(pred: ExamplePrediction, thresholds: dict[str, float]) -> tuple[str, str]:
    long = pred.long if pred.score > thresholds.get("long", -math.inf) else ""
    short = pred.short if pred.score > thresholds.get("short", -math.inf) else ""
    return long, short


def group_by_example(windows: list[Any]) -> dict[str, list[WindowBest]]:
    grouped: dict[str, list[WindowBest]] = {}
    for w in windows:
        grouped.setdefault(w.example_id, []).append(w)
    return grouped
