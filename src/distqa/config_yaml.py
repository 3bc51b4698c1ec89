"""What YAML makes of a value as typed, checked where it is not what the user wrote: a number in
another base (010 is 8), a text read as a number or a switch (1.10 is 1.1, no is False), a switch
given a number, a comment on the command line. The same checks reach into a setting's list and
mapping (a task's `list[str]` or `dict[str, float]`): `[no, 010]` was `['False', '8']`, exit 0.

Every failure is a `ConfigError`, one line naming the key (an item as `key[i]`) and what to give it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import types
import typing
from collections import abc
from collections.abc import Iterator
from typing import Any

import yaml

from distqa.config_checks import scalars_in
from distqa.errors import ConfigError

TEXT_HINTS = {"str": False, "str | None": True, "None | str": True, "Optional[str]": True}


def _leaf_hints(schema: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(full key, type hint) of every setting of a config dataclass, sections walked into; a hint
    that does not resolve stays the annotation as written (a string)."""
    try:
        hints: dict[str, Any] = typing.get_type_hints(type(schema))
    except Exception:  # noqa: BLE001 (a fork's annotation naming what only type checkers import)
        hints = {}
    for f in dataclasses.fields(schema):
        sub, key = getattr(schema, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(sub):
            yield from _leaf_hints(sub, f"{key}.")
        else:
            yield key, hints.get(f.name, f.type)


def text_keys(schema: Any, prefix: str = "") -> dict[str, bool]:
    """Every setting typed as text (`str`, or `str | None`): full key -> whether it may be None."""
    keys: dict[str, bool] = {}
    for key, hint in _leaf_hints(schema, prefix):
        if isinstance(hint, str):  # unresolved: the annotation as written
            optional = TEXT_HINTS.get(hint.replace(" ", "").replace("|", " | "))
        else:
            optional = False if hint is str else True if set(typing.get_args(hint)) == {str, type(None)} else None
        if optional is not None:
            keys[key] = optional
    return keys


def bool_keys(schema: Any) -> set[str]:
    """Every setting typed `bool` (or `bool | None`): full keys."""
    return {
        key
        for key, hint in _leaf_hints(schema)
        if hint in (bool, "bool", "bool | None", "Optional[bool]")
        or (not isinstance(hint, str) and set(typing.get_args(hint)) == {bool, type(None)})
    }


def check_bool(key: str, value: Any, source: str) -> None:
    """OmegaConf takes any whole number for a bool: train.compile=2 or train.deterministic=-1 turned
    the switch on, without a word. 1 and 0 stay (what true and false are often written as). So does
    a quoted number or one an interpolation gives: OmegaConf reads the text "2" as 2."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value not in (0, 1):
        raise ConfigError(f"{key}={value} in {source}: {key} is a switch: give true or false")


# YAML 1.1, which OmegaConf reads, takes an unquoted 010 for octal (8) and 1:30 for base 60 (90).
_OCTAL = re.compile(r"[-+]?0[0-7_]+")
_BASE_60 = re.compile(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?")


_RADIX = re.compile(r"[-+]?0[xb][0-9a-fA-F_]+")  # YAML 1.1's hexadecimal and binary integers


def check_yaml_number(key: str, raw: str, source: str) -> None:
    """An unquoted value that YAML reads as another number than the decimal it looks like:
    train.max_steps=010 trained 8 steps and seed=7_ was 7, without a word (1_000 is 1000, as in Python)."""
    raw, digits = raw.strip(), raw.strip().replace("_", "")
    if _OCTAL.fullmatch(raw) and int(digits, 8) != int(digits):
        read, fix = f"the octal number {int(digits, 8)}", f"write {int(digits)} without the leading zero"
    elif _BASE_60.fullmatch(raw):
        read, fix = "a base-60 number (1:30 is 90)", "write the number itself"
    elif _RADIX.fullmatch(raw):
        read, fix = f"the number {int(digits, 0)} in base {16 if 'x' in raw else 2}", f"write {int(digits, 0)}"
    elif "_" in raw and not _grouped(raw) and isinstance(number := _yaml_number(raw), (int, float)):
        read, fix = f"{number} (it drops underscores in a number)", f"write {number} if that is meant"
    elif raw.startswith("!"):
        read, fix = "a tagged value (!!int 010 is 8)", "write the value without the tag"
    else:
        return
    raise ConfigError(f"{key}={raw} in {source}: YAML reads it as {read}: {fix}")


_UNREADABLE = object()


def _yaml_value(raw: str) -> Any:
    """What YAML makes of `raw`, or _UNREADABLE."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return _UNREADABLE


def _yaml_number(raw: str) -> int | float | None:
    """What YAML makes of `raw` when that is a number (bools aside), else None."""
    value = _yaml_value(raw)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _grouped(raw: str) -> bool:
    """Underscores between digits only, as Python writes 1_000: the number it looks like."""
    try:
        float(raw)
    except ValueError:
        return False
    return True


def check_no_comment(key: str, value: str) -> None:
    """A command-line number or switch holding ` #`: YAML reads the rest as a comment, so
    train.max_steps=100 #1000 trained 100 steps (a text key keeps the text whole)."""
    typed = value.strip()
    for found in re.finditer(r"\s#", typed):
        # A comment only where YAML drops the rest: not inside quotes (['a #b'] is the text a #b).
        kept, whole = typed[: found.start()].strip(), _yaml_value(typed)
        if kept and whole is not _UNREADABLE and _yaml_value(kept) == whole:
            raise ConfigError(
                f"{key}={value} on the command line holds ' #', where YAML's comments start: it would be "
                f"{key}={kept}: remove the comment"
            )


def plain_scalars(node: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """(key, raw text) of every unquoted scalar under a composed YAML node (`yaml.compose`): a
    mapping's entries as `key.name`, a list's items as `key[i]`, at any depth."""
    if isinstance(node, yaml.ScalarNode):
        if node.style is None and key:
            yield key, node.value
    elif isinstance(node, yaml.MappingNode):
        for key_node, value in node.value:
            yield from plain_scalars(value, f"{key}.{key_node.value}" if key else str(key_node.value))
    elif isinstance(node, yaml.SequenceNode):
        for i, value in enumerate(node.value):
            yield from plain_scalars(value, f"{key}[{i}]")


def check_text(key: str, value: Any, optional: bool, source: str) -> None:
    """A text setting that YAML read as something else: the text is lost (010 is 8, 1.10 is 1.1,
    yes is True), and would be used as str(value) without a word. `None` where null was meant
    would name a folder or model 'None'."""
    if isinstance(value, (bool, int, float)):
        raise ConfigError(
            f"{key} in {source} is text, and YAML read its value as the {type(value).__name__} {value!r} "
            f"(010 becomes 8, 1.10 becomes 1.1): put the value in quotes"
        )
    if optional and value == "None":
        raise ConfigError(f"{key}=None in {source} would be the text 'None': for no value give null")


def _item_type(hint: Any, *, item: bool = False) -> type | None:
    """The type of the single values in a list, tuple or mapping setting (`list[str]`,
    `dict[str, bool]`, `list[list[str]]`, `list[str | None]`, optional or not), when they are
    text or switches: None otherwise (and for a plain `str`: that is `text_keys`')."""
    origin, args = typing.get_origin(hint), [a for a in typing.get_args(hint) if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:  # list[str] | None, str | None
        return _item_type(args[0], item=item)
    if origin in (list, tuple, abc.Sequence) and args:
        return _item_type(args[0], item=True)
    if origin in (dict, abc.Mapping) and len(args) == 2:
        return _item_type(args[1], item=True)
    return hint if item and hint in (str, bool) else None


def item_keys(schema: Any) -> dict[str, type]:
    """Every list or mapping setting whose items are text or switches: full key -> str or bool."""
    found = {key: _item_type(hint) for key, hint in _leaf_hints(schema) if not isinstance(hint, str)}
    return {key: kind for key, kind in found.items() if kind is not None}


def container_of(key: str, items: dict[str, type]) -> str | None:
    """The list or mapping setting of `items` that `key` (`task.words[2]`, `task.names.pos`) is in."""
    return next((k for k in items if key == k or key.startswith((f"{k}.", f"{k}["))), None)


def check_items(key: str, value: Any, kind: type, source: str) -> None:
    """Each item of a list or mapping setting of text (`kind` str) or switches (bool), as a single
    setting of that type is checked: a text that YAML read as a number or switch, a switch given a
    number."""
    for item_key, item in scalars_in(key, value):
        if isinstance(item, str) and "${" in item:  # an interpolation: checked once resolved
            continue
        if kind is bool:
            check_bool(item_key, item, source)
        elif isinstance(item, (bool, int, float)):
            raise ConfigError(
                f"{item_key} in {source} is text, and YAML read it as the {type(item).__name__} {item!r} "
                "(no becomes False, 010 becomes 8, 1.10 becomes 1.1): put the item in quotes"
            )


def check_yaml_numbers(key: str, raw: str, source: str, items: dict[str, type]) -> None:
    """`check_yaml_number` for a command-line value, into a list or mapping (`task.sizes=[010, 1]`
    was [8, 1]); items of text lists are `check_items`'s."""
    if raw.strip()[:1] not in ("[", "{"):
        check_yaml_number(key, raw, source)
        return
    with contextlib.suppress(yaml.YAMLError):  # not YAML: OmegaConf's own error names it
        for item_key, item_raw in plain_scalars(yaml.compose(raw), key):
            if container_of(item_key, items) is None:
                check_yaml_number(item_key, item_raw, source)
