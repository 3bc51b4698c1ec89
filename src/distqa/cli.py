"""Command line: `distqa <command> ...`. Thin on purpose: parse, then hand over to a module."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from distqa import outcome
from distqa.argparsing import Parser, selected_task
from distqa.config_layers import describe_keys
from distqa.errors import DistqaError, PeerLost, Preempted


def _keys_reference(task: str | None = None, config_note: str = "") -> str:
    """Every key with its default and meaning; the task's own keys too (the default task's, or the
    one named on the command line or in its --config file; `config_note`: why that file did not say)."""
    from distqa.config import TaskSettings, default_config
    from distqa.registry import settings_class

    name = task or TaskSettings().name
    try:
        defaults = default_config(settings_class(name))
        note = ""
    except DistqaError as err:
        defaults, note = default_config(), f"\n(task {name!r}'s own keys are not listed: {err})"
    defaults.task.name = name  # the selected task, not the default one, as the header says
    lines = [f"configuration keys (KEY=VALUE; default, then meaning), task.name={name!r}:"]
    for key, default, help_text in describe_keys(defaults):
        shown = "null" if default is None else repr(default) if isinstance(default, str) else default
        lines.append(f"  {key} = {shown}")
        lines.extend(textwrap.wrap(help_text, width=88, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines) + note + (f"\n({config_note})" if config_note else "")


def _whole_words(formatter: type[argparse.HelpFormatter]) -> type[argparse.HelpFormatter]:
    """`formatter`, wrapping argument help at spaces only: an example's bert-base-uncased stays whole."""

    class WholeWords(formatter):  # type: ignore[valid-type, misc]
        def _split_lines(self, text: str, width: int) -> list[str]:
            return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    return WholeWords


class _OneConfig(argparse.Action):
    """--config given once: a second one replaced the first, whose settings were then dropped
    without a word (`make train ARGS="--config mine.yaml"` after the quick start's own)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        first = getattr(namespace, self.dest, None)
        if first is not None:
            parser.error(
                f"--config given twice ({first} and {values}): one file per run; give the other file's "
                "settings as KEY=VALUE, or merge the two files"
            )
        setattr(namespace, self.dest, values)


def _add_settings(command: argparse.ArgumentParser, example: str = "train.lr=1e-4 train.max_steps=500") -> None:
    """The settings every command that reads the config takes: a YAML file, then overrides
    (`example`: overrides that matter to this command, for its --help)."""
    command.formatter_class = _whole_words(command.formatter_class)
    command.add_argument(
        "--config",
        metavar="FILE",
        action=_OneConfig,
        help="YAML file of settings (see configs/); its task's keys and commands join --help",
    )
    command.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help=f"dotted overrides, before, between or after the options, e.g. {example}",
    )


DESCRIPTION = """\
distqa fine-tunes a Hugging Face encoder (BERT and the like) with PyTorch DDP: one process, several
GPUs of one machine, or several machines, launched by torchrun. Built-in tasks: Natural Questions
(Kaggle's TensorFlow 2.0 Question Answering; task.name=nq, the default) and text classification
from CSV or JSONL (task.name=textcls). Settings: defaults < --config FILE < KEY=VALUE overrides."""

EXAMPLES = """\
example (Natural Questions, 2 processes on this machine):
  distqa download --output data
  distqa split --input data/simplified-nq-train.jsonl --valid 2000 --output data/split
  torchrun --nproc-per-node 2 -m distqa train --config configs/bert-base.yaml output_dir=results/nq
  distqa predict --input data/simplified-nq-test.jsonl --checkpoint results/nq --output submission.csv

`distqa COMMAND --help` describes a command; `distqa train --help` lists every setting."""


def _add_task_commands(commands: Any, task: str | None) -> None:
    """The commands tasks bring (`Task.add_commands`): every built-in task's, and those of the
    fork's task named on the command line (`task.name=module:Class`) or in its --config file."""
    from distqa.registry import BUILTIN_COMMANDS, BUILTIN_TASKS, add_task_commands

    for name in BUILTIN_COMMANDS:
        add_task_commands(name, commands, _add_settings)
    if task is not None and task not in BUILTIN_TASKS:
        try:
            add_task_commands(task, commands, _add_settings)
        except DistqaError:
            pass  # reported when the command loads its configuration


def _add_bench(commands: Any) -> None:
    """`distqa bench`'s options (its keys are train's)."""
    bench = commands.add_parser(
        "bench",
        help="measure training throughput and scaling for several process counts",
        description="Run the training loop under torchrun for each process count, --repeats times in "
        "alternating rounds, time the steps after a warm-up, and write DIR/bench.json and DIR/bench.png: "
        "samples/s and tokens/s (the median of the repeats and their spread), scaling efficiency, the "
        "step-time breakdown, and MFU on GPUs; implausible figures are warned about on stderr. Keys as "
        "for train. MASTER_PORT (and MASTER_ADDR, default localhost) picks the rendezvous port; "
        "default: a free one.",
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
    bench.add_argument(
        "--dp",
        action="store_true",
        help="GPUs only: also time train.parallel=dp (torch.nn.DataParallel, one process) over as many GPUs as "
        "each row's processes, train.batch_size per GPU, as rows of their own",
    )
    bench.add_argument(
        "--profile",
        action="store_true",
        help="after the timed rounds, one more launch per process count profiles 3 steps after the warm-up "
        "(torch.profiler): DIR/profile-npN/ holds a Chrome trace per rank and rank 0's operators.txt",
    )
    bench.add_argument(
        "--repeats",
        type=int,
        default=3,
        metavar="R",
        help="rounds of runs, each launching every process count once; rows give the median and spread (default: 3)",
    )
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


def build_parser(task: str | None = None, config_note: str = "") -> argparse.ArgumentParser:
    """`distqa`'s parser, with the keys and commands of `task` (None: the default task's);
    `config_note`: why the --config file named no task (see `selected_task`)."""
    parser = Parser(
        prog="distqa", description=DESCRIPTION, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.config_note = config_note
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train",
        help="train a model (run it under torchrun for several processes)",
        description="Train with DDP. Settings: defaults < --config FILE < KEY=VALUE overrides.",
        epilog=_keys_reference(task, config_note),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_settings(train)
    train.add_argument(
        "--check-config",
        action="store_true",
        help="only load and check the settings, then exit (0, or 2 with the error); imports no torch for "
        "the built-in tasks, so launch scripts run it once before starting torchrun",
    )

    _add_bench(commands)

    export = commands.add_parser(
        "export",
        help="write a model/ folder from a checkpoint, e.g. the best one (OUTPUT/checkpoints/best)",
        description="Export the model of a checkpoint as the end of training exports its final one: the task's "
        "own model files and its settings, from the settings the checkpoint holds. Works in one process, "
        "without a GPU, for whole (ddp) and sharded (fsdp) checkpoints.",
    )
    export.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="OUTPUT/checkpoints/step-N, or OUTPUT/checkpoints/best (train.best_metric)",
    )
    export.add_argument("--output", metavar="DIR", help="where to write it (default: OUTPUT/model-step-N)")
    export.add_argument(
        "moved",
        nargs="*",
        metavar="model.name=DIR",
        help="the model's files at another place than training's (model.name=DIR, model.tokenizer=DIR): the "
        "checkpoint holds every weight, and its records of their config and tokenizer must match",
    )

    from distqa.newtask import add_command as add_new_task  # imports no torch: --help stays quick

    add_new_task(commands, _add_settings)
    _add_task_commands(commands, task)
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "train":
        from distqa.config_checks import check_fsdp_run, check_output_root, check_world_sizes
        from distqa.config_layers import check_training_data
        from distqa.registry import load_config

        # Checked before the trainer (and torch with it) is imported: a mistake is said at once.
        # --check-config stops there (launch scripts run it once before torchrun, so a mistake is
        # said once, not once per rank and again in torchrun's failure report).
        cfg = load_config(args.config, args.overrides)
        check_training_data(cfg)
        check_output_root(cfg.output_dir)
        check_world_sizes(cfg.train)
        check_fsdp_run(cfg.train)  # (a train.grad_accum set; one from global_batch: each round)
        if args.check_config:
            return 0
        from distqa.trainer import train

        # whole_process: once complete, every rank tells its node's launcher (distqa.outcome), so a
        # SIGTERM from then on (torchrun then fails) still ends as the success it is.
        train(cfg, whole_process=True)
    elif args.command == "export":
        from distqa.export import export_checkpoint

        export_checkpoint(args.checkpoint, args.output, args.moved)
    elif args.command == "bench":
        from distqa.bench.launch import print_table, run_bench

        result = run_bench(args)
        print_table(result)
        print(f"wrote {args.output}/bench.json and {args.output}/bench.png")
    else:  # a task's own command
        return args.run(args) or 0
    return 0


def run_and_exit() -> None:
    """The process's entry point: `python -m distqa`, torchrun's `-m distqa` and the `distqa` script."""
    from distqa.console import outlive_closed_output

    outlive_closed_output()  # a run outlives the tee or terminal that shows it
    code = main()
    # Interpreter teardown walks every object torch and transformers created: about 1.5 s per
    # process, paid by every rank of every launch, after the work is done. Everything is written
    # and closed by now, so the final collections may skip them (objects still get freed).
    gc.freeze()
    raise SystemExit(code)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # KEY=VALUE may come anywhere among a command's options (argparsing.Parser.parse_args).
    args = build_parser(*selected_task(argv)).parse_args(argv)
    try:
        return _run(args)
    except Preempted as err:
        # Not a crash: the job was asked to stop and saved its state. Said once, by rank 0; every
        # rank leaves the line for its node's launcher, which has no rank 0 on nodes other than 0.
        outcome.report(f"distqa: preempted: {err}", show=os.environ.get("RANK", "0") == "0")
        return err.exit_code
    except DistqaError as err:
        if os.environ.get("DISTQA_DEBUG") == "1":
            raise
        # Under torchrun every rank may meet the same error: it is printed once per node (the
        # first rank to report it names itself), and a different one on another rank still is.
        rank = os.environ.get("RANK")
        where = f" [rank {rank}]" if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
        # A lost peer ends every rank of the node alike, each naming another address: local rank 0 says it.
        show = not isinstance(err, PeerLost) or os.environ.get("LOCAL_RANK", "0") == "0"
        outcome.report(f"distqa{where}: error: {err}", show=show)
        return err.exit_code
