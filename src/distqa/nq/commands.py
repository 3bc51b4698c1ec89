"""Natural Questions' own commands: `distqa prepare`, `predict`, `score`, `download` and `split`.

Added to the command line through the task registry (`distqa.registry.BUILTIN_COMMANDS`), without
importing torch: the handlers import what they need when they run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def add_commands(commands: Any, add_settings: Callable[..., None]) -> None:
    """`Task.add_commands` for Natural Questions: prepare, predict, score, download, split."""
    _add_prepare_and_predict(commands, add_settings)
    _add_file_commands(commands)


def _add_prepare_and_predict(commands: Any, add_settings: Callable[..., None]) -> None:
    """The commands that read the configuration (--config and KEY=VALUE)."""
    prepare = commands.add_parser(
        "prepare",
        help="turn Natural Questions JSONL into cached model features",
        description="Tokenize and window a Natural Questions JSONL file into a `datasets` folder "
        "(reused when input, tokenizer and settings are unchanged). Keys as for train "
        "(model.tokenizer, task.max_seq_len, task.doc_stride, task.max_query_len, task.keep_unknown, "
        "task.skip_bad_lines, seed).",
    )
    prepare.add_argument("--input", required=True, metavar="FILE", help="NQ JSONL (train, dev or test format)")
    prepare.add_argument(
        "--output",
        metavar="DIR",
        help="folder to write the features to (default: the cache entry `distqa train` looks up for "
        "data.train/data.valid=FILE with these settings, under task.cache_dir)",
    )
    prepare.add_argument("--num-proc", type=int, default=1, metavar="N", help="processes (default: 1)")
    prepare.add_argument(
        "--mode",
        choices=("train", "eval"),
        default="train",
        help="train: keep task.keep_unknown of the windows without an answer; eval: keep every window",
    )
    add_settings(prepare, example="model.tokenizer=bert-base-uncased task.max_seq_len=384")
    prepare.set_defaults(run=_prepare)

    predict = commands.add_parser(
        "predict",
        help="write a Kaggle submission.csv for an NQ JSONL file",
        description="Predict a long and a short answer for every example of an NQ JSONL file "
        "(test, dev or train format) with a trained model, applying the thresholds chosen on "
        "data.valid during training and the task settings it was trained with (task.max_seq_len, "
        "task.doc_stride, ...: saved in its model/ folder). Keys as for train; a task key given here "
        "that differs from the trained value is used, with a warning.",
    )
    predict.add_argument("--input", required=True, metavar="FILE", help="NQ JSONL file")
    predict.add_argument("--checkpoint", required=True, metavar="DIR", help="a model/ folder, or its output_dir")
    predict.add_argument("--output", required=True, metavar="FILE", help="submission.csv to write")
    add_settings(predict, example="train.batch_size=64 task.cache_dir=features")
    predict.set_defaults(run=_predict)


def _add_file_commands(commands: Any) -> None:
    """The commands that only read and write files, without settings."""
    score = commands.add_parser(
        "score",
        help="the competition metric of a submission against gold NQ JSONL",
        description="Micro F1 over every _long and _short row; prints one JSON object as the last line.",
    )
    score.add_argument("--gold", required=True, metavar="FILE.jsonl", help="NQ JSONL with annotations")
    score.add_argument("--pred", required=True, metavar="submission.csv", help="Kaggle-format predictions")
    score.set_defaults(run=_score)

    download = commands.add_parser(
        "download",
        help="fetch the Kaggle competition files (needs Kaggle credentials)",
        description="Download and unzip the tensorflow2-question-answering competition files. Credentials "
        "(the kaggle package's): an API token in KAGGLE_API_TOKEN or ~/.kaggle/access_token; or a key, as "
        "KAGGLE_USERNAME/KAGGLE_KEY or as kaggle.json in KAGGLE_CONFIG_DIR (default ~/.kaggle; on Linux "
        "~/.config/kaggle while ~/.kaggle does not exist). Existing files are kept.",
    )
    download.add_argument("--output", default="data", metavar="DIR", help="folder to write to (default: data)")
    download.set_defaults(run=_download)

    split = commands.add_parser(
        "split",
        help="set aside validation examples of an NQ train JSONL file",
        description="Copy the lines of an NQ JSONL file (Kaggle's simplified-nq-train.jsonl, or .jsonl.gz) "
        "unchanged into DIR/train.jsonl and DIR/valid.jsonl, and record the split in DIR/split.json. valid "
        "holds the N examples with the smallest SHA-256 of '<seed>:<example_id>': the same examples whatever "
        "the line order or the machine. Two streaming passes; nothing is left in DIR if it fails.",
    )
    split.add_argument("--input", required=True, metavar="FILE", help="NQ JSONL with an example_id on every line")
    split.add_argument("--valid", required=True, type=int, metavar="N", help="number of validation examples")
    split.add_argument("--output", required=True, metavar="DIR", help="folder for train.jsonl, valid.jsonl, split.json")
    split.add_argument(
        "--seed", type=int, default=0, help="mixed into the hash: another seed, another valid set (default: 0)"
    )
    split.add_argument("--overwrite", action="store_true", help="replace DIR/train.jsonl and DIR/valid.jsonl if there")
    split.set_defaults(run=_split)


def _prepare(args: argparse.Namespace) -> None:
    from distqa.console import quiet_libraries
    from distqa.errors import ConfigError
    from distqa.nq.data import feature_settings, tokenizer_name
    from distqa.nq.prepare import prepare_features
    from distqa.registry import load_config

    if args.num_proc < 1:
        raise ConfigError(f"--num-proc={args.num_proc} must be >= 1")
    from distqa.dist import usable_cpus

    if args.num_proc > (cpus := usable_cpus()):  # more tokenize no faster; 10**11 of them filled the memory
        print(f"--num-proc {args.num_proc} is more than the {cpus} CPU(s) this process may use: {cpus} process(es)")
        args.num_proc = cpus
    # --input is the one file read: the config's data.train/data.valid need not exist (yet).
    cfg = load_config(args.config, args.overrides, data_paths=False)
    quiet_libraries(is_main=True)  # datasets' bars on a terminal only; the summary below in any case
    output = args.output
    if output is None:  # the entry resolve_features (distqa train) finds for this file and these settings
        from distqa.models import load_tokenizer
        from distqa.nq.data import feature_cache_entry

        training = args.mode == "train"
        output = feature_cache_entry(cfg, args.input, load_tokenizer(cfg.model, required=True), training=training)
    result = prepare_features(
        args.input,
        output,
        tokenizer_name=tokenizer_name(cfg),
        settings=feature_settings(cfg, training=args.mode == "train"),
        num_proc=args.num_proc,
        skip_bad_lines=cfg.task.skip_bad_lines,
    )
    note = result.skipped_note(args.input)  # also on a reuse: the features still lack those lines
    if result.reused:
        print(
            f"reused {result.path}: same input, tokenizer and settings, nothing to do" + (f"; {note}" if note else "")
        )
        return
    if note:
        print(note)
    print(
        f"wrote {result.features} features of {result.docs} documents to {result.path} "
        f"in {result.seconds:.1f} s with {args.num_proc} process(es): {result.docs_per_s:.1f} docs/s"
    )


def _predict(args: argparse.Namespace) -> None:
    from distqa.registry import load_config

    # A settings mistake is said before torch and transformers are imported (seconds); as for
    # prepare, --input is the data: the config's data.train/data.valid need not exist.
    cfg = load_config(args.config, args.overrides, data_paths=False)
    from distqa.nq.predict import predict
    from distqa.nq.reader import shown_lines
    from distqa.task_settings import given_task_keys

    # The model's saved task settings apply unless the user set a key (then with a warning if it differs).
    given = given_task_keys(args.config, args.overrides)
    counts = predict(cfg, args.input, args.checkpoint, args.output, given=given)
    lacking, skipped = "", counts["skipped_lines"]
    if skipped:  # said last, where a reader of the log looks: the submission lacks those examples
        lacking = (
            f"; no rows for the {len(skipped)} bad line(s) skipped (task.skip_bad_lines): line {shown_lines(skipped)}"
        )
    print(
        f"wrote {args.output}: {counts['examples']} examples, {counts['long']} long and {counts['short']} short answers"
        + lacking
    )


def _score(args: argparse.Namespace) -> int:
    from distqa.nq.metric import main_score

    return main_score(args.gold, args.pred)


def _download(args: argparse.Namespace) -> int:
    from pathlib import Path

    from distqa.nq.download import download

    return download(Path(args.output))


def _split(args: argparse.Namespace) -> None:
    from distqa.nq.split import split_file

    result = split_file(args.input, args.output, args.valid, seed=args.seed, overwrite=args.overwrite)
    megabytes = result.bytes_read / 1e6
    print(
        f"wrote {result.output}: {result.train:,} train and {result.valid:,} valid examples "
        f"({megabytes:,.1f} MB read in {result.seconds:.1f} s, {megabytes / max(result.seconds, 1e-9):,.0f} MB/s)"
    )
