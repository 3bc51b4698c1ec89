"""Accuracy and macro F1 of class predictions."""

from __future__ import annotations


def accuracy_and_macro_f1(predictions: list[int], gold: list[int], num_labels: int) -> dict[str, float]:
    """`eval_accuracy` and `eval_macro_f1`: the mean F1 over the classes that occur among the gold
    labels or the predictions. A class that does neither has no F1 (0/0) and is left out, as
    scikit-learn does by default: a validation set without a rare class is not penalised for it.
    A class that occurs on one side only has F1 0."""
    if len(predictions) != len(gold) or not gold:
        raise ValueError(f"need as many predictions as labels, and some ({len(predictions)} vs {len(gold)})")
    f1s = []
    for c in range(num_labels):
        tp = sum(p == c and g == c for p, g in zip(predictions, gold, strict=True))
        predicted, present = predictions.count(c), gold.count(c)
        if predicted or present:
            f1s.append(2 * tp / (predicted + present))  # 2PR/(P+R) with P=tp/predicted, R=tp/present
    correct = sum(p == g for p, g in zip(predictions, gold, strict=True))
    return {"eval_accuracy": correct / len(gold), "eval_macro_f1": sum(f1s) / len(f1s)}
