"""Command line: `distqa <command> ...`. Thin on purpose: parse, then hand over to a module."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence

from distqa.config import describe_keys
from distqa.errors import DistqaError, Preempted


def _task_in(argv: Sequence[str]) -> str | None:
    """The task an argument list selects (`task.name=X` or `task=X`), for `--help` to list its keys."""
    found = None
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in ("task", "task.name"):
            found = value
    return found


def _keys_reference(task: str | None = None) -> str:
    """Every key with its default and meaning; the task's own keys too (the default task's, or
    the one named on the command line)."""
    from distqa.config import TaskSettings, default_config
    from distqa.tasks import settings_class

    name = task or TaskSettings().name
    try:
        defaults = default_config(settings_class(name))
        note = ""
    except DistqaError as err:
        defaults, note = default_config(), f"\n(task {name!r}'s own keys are not listed: {err})"
    lines = [f"configuration keys (KEY=VALUE; default, then meaning), task.name={name!r}:"]
    for key, default, help_text in describe_keys(defaults):
        shown = "null" if default is None else repr(default) if isinstance(default, str) else default
        lines.append(f"  {key} = {shown}")
        lines.extend(textwrap.wrap(help_text, width=88, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines) + note


def _add_settings(command: argparse.ArgumentParser) -> None:
    """The settings every command that reads the config takes: a YAML file, then overrides."""
    command.add_argument("--config", metavar="FILE", help="YAML file of settings (see configs/)")
    command.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.lr=1e-4")


def build_parser(task: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distqa", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train",
        help="train a model (run it under torchrun for several processes)",
        description="Train with DDP. Settings: defaults < --config FILE < KEY=VALUE overrides.",
        epilog=_keys_reference(task),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_settings(train)
    train.add_argument(
        "--check-config",
        action="store_true",
        help="only load and check the settings, then exit (0, or 2 with the error); imports no torch, "
        "so launch scripts run it once before starting torchrun",
    )

    prepare = commands.add_parser(
        "prepare",
        help="turn Natural Questions JSONL into cached model features",
        description="Tokenize and window a Natural Questions JSONL file into a `datasets` folder "
        "(reused when input, tokenizer and settings are unchanged). Keys as for train "
        "(model.tokenizer, task.max_seq_len, task.doc_stride, task.max_query_len, task.keep_unknown, "
        "task.skip_bad_lines, seed).",
    )
    prepare.add_argument("--input", required=True, metavar="FILE", help="NQ JSONL (train, dev or test format)")
    prepare.add_argument("--output", required=True, metavar="DIR", help="folder to write the features to")
    prepare.add_argument("--num-proc", type=int, default=1, metavar="N", help="processes (default: 1)")
    prepare.add_argument(
        "--mode",
        choices=("train", "eval"),
        default="train",
        help="train: keep task.keep_unknown of the windows without an answer; eval: keep every window",
    )
    _add_settings(prepare)

    predict = commands.add_parser(
        "predict",
        help="write a Kaggle submission.csv for an NQ JSONL file",
        description="Predict a long and a short answer for every example of an NQ JSONL file "
        "(test, dev or train format) with a trained model, applying the thresholds chosen on "
        "data.valid during training. Keys as for train (task.max_seq_len, task.doc_stride, ...).",
    )
    predict.add_argument("--input", required=True, metavar="FILE", help="NQ JSONL file")
    predict.add_argument("--checkpoint", required=True, metavar="DIR", help="a model/ folder, or its output_dir")
    predict.add_argument("--output", required=True, metavar="FILE", help="submission.csv to write")
    _add_settings(predict)

    score = commands.add_parser(
        "score",
        help="the competition metric of a submission against gold NQ JSONL",
        description="Micro F1 over every _long and _short row; prints one JSON object as the last line.",
    )
    score.add_argument("--gold", required=True, metavar="FILE.jsonl", help="NQ JSONL with annotations")
    score.add_argument("--pred", required=True, metavar="submission.csv", help="Kaggle-format predictions")

    bench = commands.add_parser(
        "bench",
        help="measure training throughput and scaling for several process counts",
        description="Run the training loop under torchrun once per process count, time the steps after "
        "a warm-up, and write DIR/bench.json and DIR/bench.png: samples/s and tokens/s, scaling "
        "efficiency, the step-time breakdown, and MFU on GPUs. Keys as for train.",
    )
    bench.add_argument("--nproc", required=True, metavar="N[,N...]", help="process counts, e.g. 1,2")
    bench.add_argument("--output", required=True, metavar="DIR", help="folder for bench.json, bench.png, runs/")
    bench.add_argument(
        "--warmup", type=int, default=5, metavar="STEPS", help="steps not timed (default: 5, at least 2)"
    )
    bench.add_argument("--steps", type=int, default=20, metavar="STEPS", help="steps timed (default: 20)")
    bench.add_argument(
        "--baseline", action="store_true", help="also time a minimal hand-written DDP loop on the same model and data"
    )
    bench.add_argument("--repeats", type=int, default=1, metavar="R", help="runs per process count (default: 1)")
    bench.add_argument(
        "--timeout", type=float, default=1800, metavar="S", help="stop a launch that runs longer (default: 1800)"
    )
    bench.add_argument(
        "--peak-tflops",
        type=float,
        metavar="X",
        help="the device's peak TFLOP/s at train.precision, for MFU (default: the table in distqa/flops.py)",
    )
    _add_settings(bench)

    download = commands.add_parser(
        "download",
        help="fetch the Kaggle competition files (needs Kaggle credentials)",
        description="Download and unzip the tensorflow2-question-answering competition files. Credentials: "
        "KAGGLE_USERNAME/KAGGLE_KEY or ~/.kaggle/kaggle.json. Existing files are kept.",
    )
    download.add_argument("--output", default="data", metavar="DIR", help="folder to write to (default: data)")
    return parser


def _prepare(args: argparse.Namespace) -> None:
    from distqa.config import load_config
    from distqa.errors import ConfigError
    from distqa.nq.data import feature_settings, tokenizer_name
    from distqa.nq.prepare import prepare_features

    if args.num_proc < 1:
        raise ConfigError(f"--num-proc={args.num_proc} must be >= 1")
    cfg = load_config(args.config, args.overrides)
    result = prepare_features(
        args.input,
        args.output,
        tokenizer_name=tokenizer_name(cfg),
        settings=feature_settings(cfg, training=args.mode == "train"),
        num_proc=args.num_proc,
        skip_bad_lines=cfg.task.skip_bad_lines,
    )
    if result.reused:
        print(f"reused {result.path}: same input, tokenizer and settings, nothing to do")
        return
    if result.bad_lines:
        shown = ", ".join(str(line) for line, _ in result.bad_lines[:10])
        print(
            f"skipped {len(result.bad_lines)} malformed line(s) of {args.input}: line {shown}"
            + (" ..." if len(result.bad_lines) > 10 else "")
        )
        print(f"first reason: {result.bad_lines[0][1]}")
    print(
        f"wrote {result.features} features of {result.docs} documents to {result.path} "
        f"in {result.seconds:.1f} s with {args.num_proc} process(es): {result.docs_per_s:.1f} docs/s"
    )


def _run(args: argparse.Namespace) -> int:
    if args.command == "train":
        from distqa.config import load_config

        # Checked before the trainer (and torch with it) is imported: a mistake is said at once.
        # --check-config stops there (launch scripts run it once before torchrun, so a mistake is
        # said once, not once per rank and again in torchrun's failure report).
        cfg = load_config(args.config, args.overrides)
        if args.check_config:
            return 0
        from distqa.trainer import train

        train(cfg)
    elif args.command == "prepare":
        _prepare(args)
    elif args.command == "predict":
        from distqa.config import load_config
        from distqa.nq.predict import predict

        counts = predict(load_config(args.config, args.overrides), args.input, args.checkpoint, args.output)
        print(
            f"wrote {args.output}: {counts['examples']} examples, {counts['long']} long and "
            f"{counts['short']} short answers"
        )
    elif args.command == "score":
        from distqa.nq.metric import main_score

        return main_score(args.gold, args.pred)
    elif args.command == "bench":
        from distqa.bench.launch import print_table, run_bench

        result = run_bench(args)
        print_table(result)
        print(f"wrote {args.output}/bench.json and {args.output}/bench.png")
    elif args.command == "download":
        from pathlib import Path

        from distqa.nq.download import download

        return download(Path(args.output))
    return 0


def _report(line: str, *, show: bool = True) -> None:
    """Print the one-line message; also append it to DISTQA_ERROR_FILE when a launcher (worker.sh)
    asked for it, so the launcher can repeat it after torchrun's own failure report."""
    if show:
        print(line, file=sys.stderr, flush=True)
    path = os.environ.get("DISTQA_ERROR_FILE")
    if path:
        try:
            with open(path, "a") as f:
                f.write(line + "\n")
        except OSError:
            pass  # the message was printed; the copy is a convenience


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(_task_in(argv)).parse_args(argv)
    try:
        return _run(args)
    except Preempted as err:
        # Not a crash: the job was asked to stop and saved its state. Said once, by rank 0; every
        # rank leaves the line for its node's launcher, which has no rank 0 on nodes other than 0.
        _report(f"distqa: preempted: {err}", show=os.environ.get("RANK", "0") == "0")
        return err.exit_code
    except DistqaError as err:
        if os.environ.get("DISTQA_DEBUG") == "1":
            raise
        # Under torchrun every rank would print the same line; name the rank when there are several.
        rank = os.environ.get("RANK")
        where = f" [rank {rank}]" if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
        _report(f"distqa{where}: error: {err}")
        return err.exit_code
