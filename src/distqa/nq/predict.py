"""`distqa predict`: a trained model and an NQ JSONL file to a Kaggle submission.csv."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch

from distqa.config import Config, ModelConfig
from distqa.console import quiet_libraries
from distqa.dist import autocast_dtype
from distqa.errors import DistqaError
from distqa.models import check_model_fits, load_tokenizer
from distqa.nq.data import resolve_features
from distqa.nq.evaluate import final_answers, window_bests
from distqa.nq.model import BertJointQA
from distqa.nq.postprocess import group_by_example
from distqa.nq.reader import NQReader
from distqa.nq.submission import write_submission
from distqa.nq.thresholds import THRESHOLDS_FILE, read_thresholds
from distqa.task import with_trained_settings


def model_folder(path: str | Path) -> Path:
    """Accept the exported `model/` folder itself, or the training run's output_dir holding it."""
    folder = Path(path)
    for candidate in (folder, folder / "model"):
        if (candidate / "config.json").is_file():
            return candidate
    raise DistqaError(f"--checkpoint {folder}: no model there (expected config.json, or a model/ folder with one)")


# Files a saved tokenizer consists of (any one will do): without them, AutoTokenizer would build a
# BERT tokenizer with only its 5 special tokens from config.json, and every word would become [UNK].
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "spiece.model", "vocab.json")


def predict(
    cfg: Config, input_path: str, checkpoint: str, output: str, *, given: Collection[str] = ()
) -> dict[str, int]:
    """Write a submission for `input_path`. The `task.*` settings are the model's (saved with its
    export), except the keys in `given` (those the user set, `distqa.task.given_task_keys`)."""
    quiet_libraries(is_main=True)  # no progress bars of the model load and preparation in a log
    folder = model_folder(checkpoint)
    # Windows of another length or stride than training's give a plausible, wrong submission.
    cfg = with_trained_settings(cfg, folder, given)
    # The export carries its tokenizer (when training had one); an explicit model.tokenizer wins.
    if cfg.model.tokenizer is None and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise DistqaError(
            f"{folder} has no tokenizer files (a model trained without a tokenizer, e.g. on dummy data): "
            "set model.tokenizer to the tokenizer of its vocabulary, e.g. model.tokenizer=bert-base-uncased"
        )
    cfg.model = ModelConfig(name=str(folder), tokenizer=cfg.model.tokenizer or str(folder))
    tokenizer = load_tokenizer(cfg.model)
    if tokenizer is None:
        raise DistqaError(f"{folder} has no tokenizer files: set model.tokenizer")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = BertJointQA.from_pretrained(folder).to(device)
    check_model_fits(model, cfg.model, max_seq_len=cfg.task.max_seq_len, tokenizer=tokenizer, exported=True)
    thresholds_path = folder / THRESHOLDS_FILE
    # Without thresholds (a run with no data.valid) every example gets its best answer.
    thresholds = read_thresholds(thresholds_path) if thresholds_path.is_file() else {}
    if thresholds:
        print(f"thresholds from {thresholds_path}: long {thresholds.get('long')}, short {thresholds.get('short')}")
    else:
        print(
            f"no {THRESHOLDS_FILE} in {folder} (the model was trained without data.valid): every example "
            "gets its best long and short answer"
        )

    features = resolve_features(cfg, input_path, tokenizer, training=False)
    bests = window_bests(
        model,
        features,
        device=device,
        batch_size=cfg.train.batch_size,
        pad_id=tokenizer.pad_token_id or 0,
        max_len=cfg.task.max_seq_len,
        autocast_dtype=autocast_dtype(cfg.train.precision) if device.type == "cuda" else None,
    )
    # Not GoldIndex: the test file, the one a submission is for, has no annotations to read gold from.
    examples = {}
    for example in NQReader(input_path, skip_bad_lines=cfg.task.skip_bad_lines):
        example.tokens = []  # postprocessing needs the long-answer candidates, not the text
        examples[example.example_id] = example
    answers = final_answers(group_by_example(bests), examples, thresholds)
    write_submission(output, answers)
    return {
        "examples": len(answers),
        "long": sum(1 for long, _ in answers.values() if long),
        "short": sum(1 for _, short in answers.values() if short),
    }
