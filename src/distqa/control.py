"""What happens after a training step: a plain function of the step number and the settings.

The trainer acts on the plan (HF's TrainerControl: should_log, should_evaluate, should_save,
should_training_stop); deciding it here keeps the loop short and lets the rules (the last step
always logs, evaluates and saves; weights are checked before anything of a step is written; a
SIGTERM means a checkpoint, then the stop) be tested without training anything.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distqa.config import TrainConfig


@dataclass(frozen=True)
class AfterStep:
    """What the trainer does after a step, in this order: check the replicas, evaluate, check the
    weights, log, save, stop. Nothing of a step is written before its weights are checked."""

    log: bool  # reduce the meters and write a metrics line
    evaluate: bool  # run the task's evaluation (into the same metrics line)
    save: bool  # write a checkpoint
    check_weights: bool  # check that the weights are finite before any of the above is written
    check_replicas: bool = False  # compare the replicas' weights across ranks (every step: train.check_replicas)
    replicas_on_write: bool = False  # and on each step that logs or saves (whole replicas: train.parallel=ddp)
    last: bool = False  # the run's last step
    stop: bool = False  # end the run here: SIGTERM (set by `on_stop_request`)
    check_optimizer: bool = False  # check the optimizer state too, before a save not planned for

    @property
    def compares_replicas(self) -> bool:
        """Whether the ranks' copies of the weights are compared after this step: with
        train.check_replicas every step, else every step that writes (logs, saves), as the weights
        are checked to be finite. A task's loss that calls the module inside DDP (`model.module`, or
        a model it kept from build_model) skips the all-reduce: each rank then trained alone, and
        rank 0's weights were saved and exported as the run's, exit 0. One checksum per tensor and
        two all-reduces of one number per tensor (docs/benchmarks.md: its cost)."""
        return self.check_replicas or (self.replicas_on_write and (self.log or self.save))

    def on_stop_request(self, requested: bool) -> AfterStep:
        """The plan once the ranks agreed whether a SIGTERM arrived: checkpoint, then stop. At the
        last step a SIGTERM changes nothing (the run saves and exports as planned). A save the plan
        did not foresee has its optimizer state checked first: the weights check left it out."""
        if not requested or self.last:
            return self
        return replace(self, stop=True, save=True, check_optimizer=not self.save)

    def on_new_best(self) -> AfterStep:
        """The plan once this step's evaluation improved on train.best_metric's record: a
        checkpoint of it (kept as checkpoints/best), its optimizer state checked if not planned."""
        return replace(self, save=True, check_optimizer=self.check_optimizer or not self.save)

    def on_failed_evaluation(self, save_outputs: bool) -> AfterStep:
        """The plan once the task's evaluation raised (before the weights check, which then covers
        the optimizer state too): the training figures are logged, no best is chosen, and the step
        is saved unless the run saves no outputs. A bug in the task's metric code then costs no
        trained step (with train.eval_every=0 that code first runs after the last step), and the
        resume runs that step's evaluation first (`distqa.evaluate_again`)."""
        return replace(self, evaluate=False, save=self.save or save_outputs)


def after_step(step: int, total_steps: int, train: TrainConfig, *, save_outputs: bool = True) -> AfterStep:
    """The plan after `step` (1-based) of `total_steps`. `save_outputs=False` (speed runs) skips
    the final checkpoint, which only exists to be exported and resumed from, and every evaluation:
    a task's own validation set (data.valid=None does not remove it) would be timed as a step."""
    last = step == total_steps
    evaluate = save_outputs and (last or (train.eval_every > 0 and step % train.eval_every == 0))
    log = last or evaluate or step % train.log_every == 0
    save = step % train.checkpoint_every == 0 or (last and save_outputs)
    # Every step that writes (metrics, a checkpoint; the last one, which logs, before the export) is
    # checked, so non-finite weights are never saved; train.check_finite checks every step, to name the first.
    return AfterStep(
        log=log,
        evaluate=evaluate,
        save=save,
        check_weights=log or save or train.check_finite,
        check_replicas=train.check_replicas,
        replicas_on_write=train.parallel == "ddp",
        last=last,
    )


# A loss that is not finite at step 1 comes from the initial weights, before any update: the learning
# rate is not its cause (under warm-up it is 0 there), and no checkpoint holds anything yet.
FIRST_LOSS_NOT_FINITE = (
    "the first step's loss, before any update: it comes from the data, the task's loss or the model's "
    "initial weights, not from train.lr; nothing was saved"
)


def diverged_hint(train: TrainConfig, newest: Path | None) -> str:
    """What to change when the loss or the weights stop being finite, and where the last finite
    weights are: `newest`, the checkpoint this run saved or resumed from last (None: none yet)."""
    clip = (
        "set train.max_grad_norm"
        if train.max_grad_norm == 0
        else f"lower train.max_grad_norm (now {train.max_grad_norm:g})"
    )
    fp16 = ", or use bf16 instead of fp16" if train.precision == "fp16" else ""
    # A checkpoint that predates this run (one train.resume=never set aside) holds none of its weights.
    kept = "no checkpoint was written, so none holds"
    if newest is not None:
        kept = f"the newest checkpoint, {newest}, holds"
    return f"the run diverged: lower train.lr (now {train.lr:g}) or {clip}{fp16}; {kept} the last finite weights"
