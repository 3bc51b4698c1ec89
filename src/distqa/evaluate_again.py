"""The evaluation a resume owes: the step whose evaluation raised, run again before training goes on.

When the task's evaluation raises (a bug in a fork's metric code, a stale validation cache, memory
run out in the evaluation's larger batches), the trainer saves the step's checkpoint without it and
stops (`Trainer._after_step`); the checkpoint records `evaluation_pending`. Before, the resume went
on from the next step, and that step's figures were never measured: its metrics line had no eval_*
figures, train.best_metric never saw it, and at the last step the export carried the thresholds
(or whatever else a task keeps from its evaluation) of an earlier step's weights, which
`distqa predict` then refused. The weights, and every random stream, are the checkpoint's (an
evaluation moves none, `run_evaluation`), so running the evaluation now measures what it would have.

What follows is what an evaluation in the loop leads to: the step's metrics line gets the eval_*
figures (the line is written again, so each step still has one), the best record is compared, and
the step's checkpoint is saved again, with the task's new state and no evaluation pending.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distqa.best import best_after_evaluation
from distqa.dist import print0
from distqa.errors import EvaluationFailed
from distqa.evaluation import run_evaluation
from distqa.metrics import MetricsWriter, read_metrics

if TYPE_CHECKING:
    from distqa.trainer import Trainer


def logged_line(trainer: Trainer, step: int) -> dict[str, Any]:
    """Rank 0: the training figures metrics.jsonl holds for `step` (the failed evaluation's line),
    or just the step where the line is gone."""
    path = trainer.out / "metrics.jsonl"
    lines = read_metrics(path)[0] if trainer.info.is_main and path.is_file() else []
    found = [record for _, record in lines if record["step"] == step]
    record = found[-1] if found else {"step": step, "epoch": round(step / trainer.epoch_steps, 4)}
    return {key: value for key, value in record.items() if not key.startswith("eval_")}


def evaluate_again(trainer: Trainer, step: int) -> None:
    """Every rank, right after the restore of a checkpoint with an evaluation pending."""
    state, info = trainer.state, trainer.info
    assert state is not None
    print0(f"evaluation at step {step}: it failed before checkpoint step-{step} was written; running it now")
    try:
        model, dtype = trainer.raw_model, trainer.autocast_dtype
        figures = run_evaluation(trainer.task, model, info, step=step, autocast_dtype=dtype)
    except EvaluationFailed as err:  # the checkpoint still says it is pending: the next resume tries again
        raise EvaluationFailed(f"evaluation at step {step}, run again on resume: {err}") from err
    record = {**logged_line(trainer, step), **figures}
    # The line of `step` is replaced, in metrics.jsonl and in TensorBoard, rather than added to.
    metrics = MetricsWriter(trainer.out, info, resume_step=step - 1)
    try:
        metrics.log(record)
        metrics.close()
    finally:
        metrics.abandon()
    best = best_after_evaluation(record, trainer.cfg.train, state.best, info, trainer.ckpt_root)
    if best is not None:
        state.best = best
    state.evaluation_pending = False
    trainer.checkpoints.save()  # step-N again: the task's state of this evaluation, and its best
