"""Natural Questions' side of evaluation, and the forward pass `distqa predict` shares with it.

The trainer runs evaluation (`distqa.evaluation`): each rank's share of the validation windows
goes through `window_best_spans`, which shrinks each window to its best span (`WindowBest`, a few
numbers) before the gather; rank 0 groups them by example id, predicts, chooses the pair of long
and short thresholds that maximises the competition's micro F1 (one F1 over long and short rows
together: `best_pair`), and reports it (`score_predictions`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from distqa.data_identity import digest_of
from distqa.errors import DistqaError
from distqa.evaluation import eval_mode, to_device
from distqa.nq.data import pad_collate
from distqa.nq.postprocess import (
    WindowBest,
    apply_thresholds,
    best_spans,
    f1,
    kind_f1,
    predict_example,
)
from distqa.nq.reader import NQReader

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
EVAL_COLUMNS = ["example_id", *MODEL_INPUTS, "token_map"]


def window_best_spans(model: nn.Module, batch: dict[str, Any], max_answer_len: int) -> list[WindowBest]:
    """The best span of every window of a batch (its tensors on the model's device), of at most
    `max_answer_len` sub-words (task.max_answer_len: no default here, so that predict cannot give
    other spans than the evaluation that chose its thresholds)."""
    logits = model(**{k: batch[k] for k in MODEL_INPUTS})
    return best_spans(
        logits["start_logits"].float().cpu(),
        logits["end_logits"].float().cpu(),
        logits["answer_type_logits"].float().cpu(),
        batch["token_map"].cpu(),
        batch["example_id"],
        max_answer_len=max_answer_len,
    )


def window_bests(
    model: nn.Module,
    folder: Path,
    *,
    device: torch.device,
    batch_size: int,
    pad_id: int,
    max_len: int,
    max_answer_len: int,
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
            out.extend(window_best_spans(model, to_device(batch, device), max_answer_len))
    return out


class GoldIndex:
    """What rank 0 needs of the validation examples: candidates and gold answers, not the text."""

    def __init__(self, path: str | Path, *, skip_bad_lines: bool = False) -> None:
        from distqa.nq.metric import BadGold, gold_answers  # the competition's gold rules, in one place

        self.examples: dict[str, Any] = {}
        self.gold: dict[str, tuple[set[str], set[str]]] = {}
        reader = NQReader(path, skip_bad_lines=skip_bad_lines, keyed_by_id=True)
        for example in reader:
            try:
                self.gold[example.example_id] = gold_answers(
                    {"annotations": example.annotations, "example_id": example.example_id}
                )
            except BadGold as err:  # a test-format line, say: never skipped, nothing could score it
                raise DistqaError(
                    f"{path}: example {example.example_id}: {err}; validation needs the gold answers of every example"
                ) from None
            example.tokens = []  # candidates are all postprocessing needs; the text is large
            self.examples[example.example_id] = example

    def digest(self) -> str:
        """The gold answers and candidates of every example, in example-id order (the file's order
        does not change a score): part of the validation set's identity (`NQTask.data_fingerprint`)."""
        return digest_of(
            [[key, sorted(self.gold[key][0]), sorted(self.gold[key][1]), self.examples[key].candidates]
             for key in sorted(self.gold)]
        )  # fmt: skip


Rows = list[tuple[float, str, set[str]]]  # (score, prediction, gold) of one kind, one per example


def _cut_between(score: float, below: float | None) -> float:
    """A threshold that keeps `score` and drops `below` (None: nothing below): halfway, robust to
    tiny numeric differences on reuse, unless no float lies strictly between."""
    if below is None:
        below = score - 1.0 if score - 1.0 < score else math.nextafter(score, -math.inf)
    halfway = score / 2 + below / 2  # not (score + below) / 2, which overflows for huge scores
    return halfway if below < halfway < score else below


def kind_cuts(rows: Rows) -> tuple[list[float], list[tuple[int, int, int]]]:
    """Every distinct way to threshold one kind of row: (thresholds, (TP, FP, FN) at each), from
    +inf ("never answer": nothing kept) down to keeping every prediction. A row is kept when its
    score > threshold (`kind_f1`); lowering the cut past a row with a prediction turns it from
    "empty" (FN when it has gold) into TP or FP. Ties move together. One sort, one sweep."""
    # NaN and -inf exceed no threshold; +inf exceeds every finite one.
    scored = sorted((r for r in rows if r[1] and r[0] > -math.inf), key=lambda r: -r[0])
    tp, fp, fn = 0, 0, sum(1 for _, _, gold in rows if gold)
    cuts, counts = [math.inf], [(tp, fp, fn)]
    i = 0
    while i < len(scored):
        score = scored[i][0]
        while i < len(scored) and scored[i][0] == score:
            _, pred, gold = scored[i]
            fn -= 1 if gold else 0
            tp, fp = (tp + 1, fp) if pred in gold else (tp, fp + 1)
            i += 1
        cuts.append(_cut_between(score, scored[i][0] if i < len(scored) else None))
        counts.append((tp, fp, fn))
    return cuts, counts


def _best_cut(counts: list[tuple[int, int, int]], num: int, den: int) -> int:
    """The cut maximising 2TP - (num/den)(2TP + FP + FN), in integers (exact); the first, i.e. the
    highest threshold (fewest answers), of equals."""
    values = [den * 2 * tp - num * (2 * tp + fp + fn) for tp, fp, fn in counts]
    return values.index(max(values))


def best_pair(long_rows: Rows, short_rows: Rows) -> dict[str, float]:
    """The long and short thresholds that maximise micro F1 = 2TP / (2TP + FP + FN), TP, FP and FN
    summed over both kinds: the competition's one F1, which the best threshold of each kind on its
    own does not maximise (a kind's extra answers can lower its own F1 and raise the pooled one).

    Dinkelbach's method, exact over the finite set of pairs: for a ratio lam, maximising
    2TP - lam(2TP + FP + FN) splits into one choice per kind (each a sweep over its cuts). Starting
    at lam = 0, the chosen pair's F1 becomes the next lam; it rises strictly until no pair beats lam,
    and then the chosen pair is optimal (finitely many steps, a handful in practice). Of equally good
    pairs, each kind takes its highest threshold, "never" (+inf) included."""
    cuts = [kind_cuts(long_rows), kind_cuts(short_rows)]
    num, den = 0, 1  # lam = num / den, kept as integers: the comparisons are exact
    while True:
        chosen = [_best_cut(counts, num, den) for _, counts in cuts]
        tp, fp, fn = (sum(c[1][i][k] for c, i in zip(cuts, chosen, strict=True)) for k in range(3))
        # Not above lam: no pair is (lam is the optimum), and this pair reaches it. (Every pair's
        # denominator is at least the number of gold rows: > 0 once any TP is possible.)
        if 2 * tp * den <= num * (2 * tp + fp + fn):
            return {kind: c[0][i] for kind, c, i in zip(("long", "short"), cuts, chosen, strict=True)}
        num, den = 2 * tp, 2 * tp + fp + fn


def score_predictions(
    grouped: dict[str, list[WindowBest]], gold: GoldIndex, thresholds: dict[str, float] | None = None
) -> tuple[dict[str, float], dict[str, float]]:
    """(metrics, thresholds): chooses the thresholds on these examples (`best_pair`) unless given."""
    preds = {eid: predict_example(grouped.get(eid, []), ex) for eid, ex in gold.examples.items()}
    long_rows = [(p.score, p.long, gold.gold[eid][0]) for eid, p in preds.items()]
    short_rows = [(p.score, p.short, gold.gold[eid][1]) for eid, p in preds.items()]
    if thresholds is None:
        thresholds = best_pair(long_rows, short_rows)
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
