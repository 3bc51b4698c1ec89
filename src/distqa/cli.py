"""Command line: `distqa <command> ...`. Thin on purpose: parse, then hand over to a module."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence

from distqa.config import describe_keys
from distqa.errors import DistqaError


def _keys_reference() -> str:
    lines = ["configuration keys (KEY=VALUE; default, then meaning):"]
    for key, default, help_text in describe_keys():
        shown = "null" if default is None else repr(default) if isinstance(default, str) else default
        lines.append(f"  {key} = {shown}")
        lines.extend(textwrap.wrap(help_text, width=88, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distqa", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train",
        help="train a model (run it under torchrun for several processes)",
        description="Train with DDP. Settings: defaults < --config FILE < KEY=VALUE overrides.",
        epilog=_keys_reference(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", metavar="FILE", help="YAML file of settings (see configs/)")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.lr=1e-4")
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "train":
        from distqa.config import load_config
        from distqa.trainer import train

        train(load_config(args.config, args.overrides))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except DistqaError as err:
        if os.environ.get("DISTQA_DEBUG") == "1":
            raise
        # Under torchrun every rank would print the same line; name the rank when there are several.
        rank = os.environ.get("RANK")
        where = f" [rank {rank}]" if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
        print(f"distqa{where}: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
