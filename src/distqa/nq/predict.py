"""`distqa predict`: a trained model and an NQ JSONL file to a Kaggle submission.csv."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from distqa.config import Config, ModelConfig
from distqa.dist import autocast_dtype
from distqa.errors import DistqaError
from distqa.nq.data import resolve_features
from distqa.nq.evaluate import GoldIndex, final_answers, window_bests
from distqa.nq.model import BertJointQA
from distqa.nq.postprocess import group_by_example
from distqa.nq.submission import write_submission
from distqa.nq.task import THRESHOLDS_FILE, load_tokenizer


def model_folder(path: str | Path) -> Path:
    """Accept the exported `model/` folder itself, or the training run's output_dir holding it."""
    folder = Path(path)
    for candidate in (folder, folder / "model"):
        if (candidate / "config.json").is_file():
            return candidate
    raise DistqaError(f"--checkpoint {folder}: no model there (expected config.json, or a model/ folder with one)")


def predict(cfg: Config, input_path: str, checkpoint: str, output: str) -> dict[str, int]:
    folder = model_folder(checkpoint)
    # The export carries its tokenizer; an explicit model.tokenizer still wins.
    cfg.model = ModelConfig(name=str(folder), tokenizer=cfg.model.tokenizer or str(folder))
    tokenizer = load_tokenizer(cfg)
    if tokenizer is None:
        raise DistqaError(f"{folder} has no tokenizer files: set model.tokenizer")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = BertJointQA.from_pretrained(folder).to(device)
    thresholds_path = folder / THRESHOLDS_FILE
    # Without thresholds (a run with no data.valid) every example gets its best answer.
    thresholds = json.loads(thresholds_path.read_text()) if thresholds_path.is_file() else {}

    features = resolve_features(cfg, input_path, tokenizer, training=False)
    bests = window_bests(
        model,
        features,
        device=device,
        batch_size=cfg.train.batch_size,
        pad_id=tokenizer.pad_token_id or 0,
        max_len=cfg.data.max_seq_len,
        autocast_dtype=autocast_dtype(cfg.train.precision) if device.type == "cuda" else None,
    )
    examples = GoldIndex(input_path, skip_bad_lines=cfg.data.skip_bad_lines).examples
    answers = final_answers(group_by_example(bests), examples, thresholds)
    write_submission(output, answers)
    return {
        "examples": len(answers),
        "long": sum(1 for long, _ in answers.values() if long),
        "short": sum(1 for _, short in answers.values() if short),
    }
