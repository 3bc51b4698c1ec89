"""`distqa predict`: a trained model and an NQ JSONL file to a Kaggle submission.csv."""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from distqa.checkpoint_verify import SOURCE_FILE, export_damage, recorded_source
from distqa.config import Config, ModelConfig
from distqa.console import quiet_libraries
from distqa.dist import autocast_dtype
from distqa.errors import DistqaError
from distqa.models import check_model_fits, holds_tokenizer, load_tokenizer, saved_tokenizer_difference
from distqa.nq.data import check_feature_ids, resolve_features
from distqa.nq.evaluate import final_answers, window_bests
from distqa.nq.features import TOKEN_TYPES
from distqa.nq.model import BertJointQA
from distqa.nq.postprocess import group_by_example
from distqa.nq.reader import NQExample, NQReader
from distqa.nq.submission import check_output_path, write_submission
from distqa.nq.thresholds import THRESHOLDS_FILE, Chosen, read_chosen
from distqa.task_settings import read_task_settings, with_trained_settings


def model_folder(path: str | Path) -> Path:
    """Accept the exported `model/` folder itself, or the training run's output_dir holding it."""
    folder = Path(path)
    try:
        os.listdir(folder)  # a folder it may not read made every check below a PermissionError traceback
    except PermissionError as err:
        raise DistqaError(f"--checkpoint {folder} cannot be read ({err.strerror or err})") from None
    except OSError:  # not there, or a file: said below
        pass
    for candidate in (folder, folder / "model"):
        if (candidate / "config.json").is_file():
            return candidate
    if (folder / "trainer_state.json").is_file():  # a training checkpoint: its weights, not yet a model folder
        raise DistqaError(
            f"--checkpoint {folder} is a training checkpoint, not an exported model: export it first "
            f"(distqa export --checkpoint {folder}) and give the folder it writes"
        )
    raise DistqaError(f"--checkpoint {folder}: no model there (expected config.json, or a model/ folder with one)")


def check_nq_model(cfg: Config, folder: Path) -> None:
    """`distqa predict` runs Natural Questions models alone: a model of another task (its
    distqa_task.json says so) or task.name set to another is refused before anything is loaded,
    naming that task's own predict command where it brings one (`Task.add_commands`)."""
    trained = (read_task_settings(folder) or {}).get("name", "nq")
    for name, where in ((cfg.task.name, "task.name"), (trained, f"the model in {folder} was trained with task.name")):
        if name == "nq":
            continue
        own = predict_commands(name)
        hint = (
            f"use its own command: distqa {own[0]} task.name={name}"
            if own
            else f"task {name} brings no predict command: load the model with its own code (docs/outputs.md)"
        )
        raise DistqaError(f"{where}={name}, but distqa predict serves Natural Questions (task.name=nq) alone: {hint}")


def predict_commands(task: str) -> list[str]:
    """The commands with "predict" in their name that `task` adds to distqa (`Task.add_commands`)."""
    import argparse

    from distqa.registry import add_task_commands

    commands = argparse.ArgumentParser().add_subparsers()
    try:
        add_task_commands(task, commands, lambda *args, **kwargs: None)
    except DistqaError:  # a fork that cannot be imported here: no command to name
        return []
    return sorted(name for name in commands.choices if "predict" in name)


def read_examples(input_path: str, *, skip_bad_lines: bool) -> tuple[dict[str, NQExample], list[tuple[int, str]]]:
    """(examples by id, skipped bad lines) of the file to predict: read before any model work, so
    that a repeated or unusable example id is one line at once, not a traceback after the forward."""
    # Not GoldIndex: the test file, the one a submission is for, has no annotations to read gold from.
    reader = NQReader(input_path, skip_bad_lines=skip_bad_lines, keyed_by_id=True)
    examples = {}
    for example in reader:
        example.tokens = []  # postprocessing needs the long-answer candidates, not the text
        examples[example.example_id] = example
    return examples, reader.bad_lines


def model_tokenizer(cfg: Config, folder: Path) -> Any:
    """The tokenizer saved with the model in `folder`; `model.tokenizer` when given (and set as
    cfg.model). One given for a model that has its own must turn text into the same ids: any other
    feeds the model the wrong words, and the submission is plausible and wrong."""
    given = cfg.model.tokenizer
    saved_files = holds_tokenizer(folder)
    if given is None and not saved_files:
        raise DistqaError(
            f"{folder} has no tokenizer files (a model trained without a tokenizer, e.g. on dummy data): "
            "set model.tokenizer to the tokenizer of its vocabulary, e.g. model.tokenizer=bert-base-uncased"
        )
    cfg.model = ModelConfig(name=str(folder), tokenizer=given or str(folder))
    tokenizer = load_tokenizer(cfg.model)
    if tokenizer is None:
        raise DistqaError(f"{folder} has no tokenizer files: set model.tokenizer")
    if given is not None and Path(given).resolve() != folder.resolve():
        if difference := saved_tokenizer_difference(tokenizer, cfg.model):
            raise DistqaError(
                f"model.tokenizer={given} is not the tokenizer saved with the model in {folder} ({difference}): "
                "leave model.tokenizer out to use the saved one"
            )
    return tokenizer


def _identity(folder: Path) -> tuple[int, int] | None:
    """The folder as the file system knows it (device, inode): an export renames a new one into place."""
    try:
        st = os.stat(folder)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def chosen_thresholds(path: Path, folder: Path) -> Chosen:
    """The thresholds saved with the model; refused when they say they were chosen at another step
    than the weights' (`distqa_source.json`): a file copied beside other weights."""
    chosen = read_chosen(path)
    chosen_at = chosen.step
    weights_at = (recorded_source(folder) or {}).get("step")
    if chosen_at is not None and isinstance(weights_at, int) and chosen_at != weights_at:
        raise DistqaError(
            f"{path} was chosen at step {chosen_at}, but the weights in {folder} are step {weights_at} "
            f"({SOURCE_FILE}): export the model again from one checkpoint, or remove the thresholds file to give "
            "every example its best answer"
        )
    return chosen


def scores_precision(chosen: Chosen, given: str) -> str:
    """The precision of predict's forward pass, on any device: the one the thresholds were chosen
    in (the training's evaluation ran in train.precision, under autocast on the CPU too), so that
    they compare scores computed alike; train.precision (given, or the default fp32) when no
    thresholds say which. bf16 and fp32 scores of one window differ by a tenth or more."""
    if chosen.precision is None or chosen.precision == given:
        return given
    print(f"scores in {chosen.precision}, the precision the thresholds were chosen in (not train.precision={given})")
    return chosen.precision


def predict(
    cfg: Config, input_path: str, checkpoint: str, output: str, *, given: Collection[str] = ()
) -> dict[str, Any]:
    """Write a submission for `input_path`. The `task.*` settings are the model's (saved with its
    export), except the keys in `given` (those the user set, `distqa.task_settings.given_task_keys`).
    Returns the counts of examples, long and short answers, and the numbers of the bad lines
    skipped (`skipped_lines`: no rows for them)."""
    quiet_libraries(is_main=True)  # no progress bars of the model load and preparation in a log
    if not Path(input_path).is_file():  # before the model loads: a typo costs nothing
        raise DistqaError(f"--input {input_path} does not exist or is not a file")
    check_output_path(output, input_path=input_path)
    folder = model_folder(checkpoint)
    # Its files are read one by one below: an export that replaces the folder meanwhile (a run
    # resumed into this output_dir, `distqa export --output` it) mixed one export's weights with
    # the other's thresholds. Which folder was read is compared once all of it is read.
    read_from = _identity(folder)
    check_nq_model(cfg, folder)
    # Every file the export wrote: a flipped byte in the weights loads and answers wrongly, and a
    # distqa_task.json, config.json or tokenizer file edited since builds other inputs without a
    # word. (The thresholds may be removed, or tuned by hand: read strictly, and by step, below.)
    damage = export_damage(folder, removable=(THRESHOLDS_FILE,))
    if damage is not None:
        raise DistqaError(f"the model in {folder} is damaged ({damage}): export it again (distqa export)")
    if "files" not in (recorded_source(folder) or {}):
        print(f"warning: {folder} records no hashes of its files (an export of an older distqa): they go unchecked")
    # Windows of another length or stride than training's give a plausible, wrong submission.
    cfg = with_trained_settings(cfg, folder, given)
    tokenizer = model_tokenizer(cfg, folder)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = BertJointQA.from_pretrained(folder).to(device)
    check_model_fits(
        model, cfg.model, max_seq_len=cfg.task.max_seq_len, tokenizer=tokenizer, exported=True, token_types=TOKEN_TYPES
    )
    thresholds_path = folder / THRESHOLDS_FILE
    # Without thresholds (a run with no data.valid) every example gets its best answer.
    there = thresholds_path.exists() or thresholds_path.is_symlink()  # a folder or a broken link: read, refused
    chosen = chosen_thresholds(thresholds_path, folder) if there else Chosen({})
    thresholds = chosen.thresholds
    if thresholds:
        # (A threshold no score passes, null in the file, is "never": that kind is never answered.)
        shown = {
            kind: "never" if thresholds.get(kind) == float("inf") else thresholds.get(kind)
            for kind in ("long", "short")
        }
        print(f"thresholds from {thresholds_path}: long {shown['long']}, short {shown['short']}")
    else:
        print(
            f"no {THRESHOLDS_FILE} in {folder} (no thresholds were chosen with these weights: trained without "
            "data.valid, or exported from a step that was not evaluated): every example gets its best long and "
            "short answer"
        )

    if _identity(folder) != read_from:
        raise DistqaError(
            f"the model in {folder} was replaced while predict read it (an export wrote it meanwhile): "
            "run predict again"
        )
    examples, bad_lines = read_examples(input_path, skip_bad_lines=cfg.task.skip_bad_lines)
    features = resolve_features(cfg, input_path, tokenizer, training=False)
    check_feature_ids(features, examples.keys(), input_path)
    bests = window_bests(
        model,
        features,
        device=device,
        batch_size=cfg.train.batch_size,
        pad_id=tokenizer.pad_token_id or 0,
        max_len=cfg.task.max_seq_len,
        autocast_dtype=autocast_dtype(scores_precision(chosen, cfg.train.precision)),
        max_answer_len=cfg.task.max_answer_len,
    )
    answers = final_answers(group_by_example(bests), examples, thresholds)
    write_submission(output, answers)
    return {
        "examples": len(answers),
        "long": sum(1 for long, _ in answers.values() if long),
        "short": sum(1 for _, short in answers.values() if short),
        "skipped_lines": [line for line, _ in bad_lines],
    }
