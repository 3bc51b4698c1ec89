"""What `distqa`'s command line does beyond argparse: KEY=VALUE settings anywhere among a command's
options, one-line errors for what is neither, and the task a command line selects.

argparse alone takes a command's `KEY=VALUE ...` as one positional run: settings before an option
and more after it were "unrecognized arguments". `parse_known_args` already keeps every token that
an option does not take (`--output a=b` stays the option's value), so `Parser.parse_args` sorts the
leftovers: KEY=VALUE joins the command's settings in command-line order (later wins), anything else
is an error naming it. `parse_intermixed_args` would do the first part but refuses subcommands.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import DictConfig, OmegaConf

# A setting as load_config reads it: a dotted key, '=', a value (possibly empty, possibly with '=').
_SETTING = re.compile(r"[A-Za-z_][\w.]*=")
_NEGATIVE_NUMBER = re.compile(r"-\d+$|-\d*\.\d+$")


def is_setting(token: str) -> bool:
    return _SETTING.match(token) is not None


def _is_option(token: str) -> bool:
    return len(token) > 1 and token.startswith("-") and not _NEGATIVE_NUMBER.match(token)


class Parser(argparse.ArgumentParser):
    """`distqa`'s parser and each command's (argparse builds the commands' parsers of this class).

    `parse_args` accepts a command's KEY=VALUE settings anywhere among its options; a command
    without settings, a bare word or an unknown option is one error line after the usage."""

    config_note = ""  # why the --config file did not say which task (build_parser sets it)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        # Kept so that `error` can name a misspelled option instead of the required one it hid.
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        parsed, leftovers = self.parse_known_args(args, namespace)
        command = self._command_parser(parsed)
        takes_settings = hasattr(parsed, "overrides")
        # Positionally taken settings come first on the command line, the leftovers after them.
        tokens = [*((parsed.overrides or []) if takes_settings else []), *leftovers]
        # An unknown option first: the word after it (its value, as meant) is no news.
        for token in filter(_is_option, tokens):
            command.error(_unknown_option(command, token))
        for token in tokens:
            if not is_setting(token):
                command.error(f"unrecognized argument {token!r}: neither an option nor a KEY=VALUE setting")
            if not takes_settings:
                command.error(f"unrecognized argument {token!r}: {command.prog} takes no KEY=VALUE settings")
        if takes_settings:
            parsed.overrides = tokens
        return parsed

    def error(self, message: str) -> NoReturn:
        # A misspelled required option shows as "required: --output"; the misspelling is the news.
        unknown = next((t for t in getattr(self, "_given", []) if _is_option(t) and not _known(self, t)), None)
        if unknown is not None and message.startswith("the following arguments are required"):
            message = _unknown_option(self, unknown)
        elif self.config_note and "invalid choice" in message:
            message = f"{message}; {self.config_note}"
        elif "invalid choice" in message and self.prog == "distqa":
            message += _unknown_command_hint(self)
        super().error(message)

    def _command_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices[getattr(parsed, action.dest)]
        return self


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings]


def _known(parser: argparse.ArgumentParser, token: str) -> bool:
    name = token.partition("=")[0]
    options = _option_strings(parser)
    # argparse takes a unique prefix of a long option (`--out` for `--output`).
    return name in options or (
        parser.allow_abbrev and name.startswith("--") and any(o.startswith(name) for o in options)
    )


def _unknown_option(parser: argparse.ArgumentParser, token: str) -> str:
    name = token.partition("=")[0]
    close = difflib.get_close_matches(name, [o for o in _option_strings(parser) if o.startswith("--")], n=1)
    return f"unrecognized option {name!r}" + (f" (did you mean {close[0]}?)" if close else "")


def selected_task(argv: Sequence[str]) -> tuple[str | None, str]:
    """The task `argv` selects, for the keys and commands `--help` lists: the last `task.name=X`
    (or `task=X`), else the `task.name` of its `--config FILE`, else None (the default task).
    Second: why the file could not say (empty if it could); the command itself reports the file."""
    found, path = None, None
    tokens = iter(argv)
    for token in tokens:
        key, sep, value = token.partition("=")
        if token == "--config":
            path = next(tokens, None)
        elif key == "--config" and sep:
            path = value
        elif sep and key in ("task", "task.name"):
            found = value
    if found is not None or path is None:
        return found, ""
    return _task_in_yaml(path)


def _task_in_yaml(path: str) -> tuple[str | None, str]:
    """`task.name` (or the shorthand `task: NAME`) of a YAML file, read without the schema: cheap, and a
    file that is not even YAML leaves `--help` working."""
    try:
        if Path(path).exists() and not Path(path).is_file():  # a FIFO or a device blocks the read for ever (a review)
            raise ValueError("not a regular file")
        layer = OmegaConf.load(path)
        task = layer.get("task") if isinstance(layer, DictConfig) else None
        name = task.get("name") if isinstance(task, DictConfig) else task
    except Exception as err:  # missing file, YAML syntax, a bad interpolation: all only a note here
        detail = (str(err).splitlines() or [type(err).__name__])[0]
        return None, f"note: --config {path} was not read ({detail}), so its task's keys and commands are not listed"
    return (None if name is None else str(name)), ""


def _unknown_command_hint(parser: argparse.ArgumentParser) -> str:
    """A misspelt command's likely name; else where a fork's own commands come from (they exist
    once its task is named), the likeliest cause of an unknown one."""
    given = next((t for t in getattr(parser, "_given", []) if not t.startswith("-")), "")
    choices = [c for a in parser._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices]
    close = difflib.get_close_matches(given, choices, n=1, cutoff=0.8)
    if close:
        return f"; did you mean {close[0]}?"
    return "; a task's own commands appear when it is named: add task.name=module:Class or --config FILE"
