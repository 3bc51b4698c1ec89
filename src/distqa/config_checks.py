"""The checks behind `load_config`: ranges and choices that the dataclasses call from
`__post_init__`, and the checks of a whole layer (a YAML file, the command line) that OmegaConf's
own errors would not name: a section that is not a mapping, a float that is not a number.

Every failure is a `ConfigError`, one line naming the key and what to give it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import re
import typing
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

import yaml
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from distqa.errors import ConfigError


def check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}")


def check_finite(key: str, value: Any, default: Any = None) -> None:
    """A float setting must be a number: nan passes every `<` test and inf every `>` one, so a
    range check alone lets `train.lr=nan` train NaN weights to the end."""
    if isinstance(value, float) and not math.isfinite(value):
        shown = f" (default: {default})" if isinstance(default, int | float) and not isinstance(default, bool) else ""
        raise ConfigError(f"{key}={value} is not a finite number: give {key} a finite value{shown}")


def check_min(key: str, value: float, low: float, *, strict: bool = False) -> None:
    check_finite(key, value)
    if value < low or (strict and value == low):
        raise ConfigError(f"{key}={value} must be {'>' if strict else '>='} {low}")


def check_fraction(key: str, value: float | None) -> None:
    """A rate in [0, 1) (None: unset): a dropout, the warm-up's share, SGD's momentum (at 1 or more
    its velocity grows without bound: NaN hours later, or a short run's exit 0 on weights gone astray)."""
    check_finite(key, value)
    if value is not None and not 0.0 <= value < 1.0:
        raise ConfigError(f"{key}={value} must be in [0, 1)")


def check_sections(values: Any, schema: Any, source: str, prefix: str = "") -> None:
    """A section (`train:`, `model:`, ...) given as something other than a mapping: OmegaConf's
    merge error names no key ('?'), so name it here. `values`: the layer as plain containers,
    `schema`: the defaults (a dataclass instance)."""
    if not isinstance(values, dict):
        return
    for f in dataclasses.fields(schema):
        sub, value = getattr(schema, f.name), values.get(f.name)
        if not dataclasses.is_dataclass(sub) or value is None:  # None: OmegaConf names the key
            continue
        key = f"{prefix}{f.name}"
        if not isinstance(value, dict):
            example = next((g.name for g in dataclasses.fields(sub) if g.name != "name"), "KEY")
            raise ConfigError(
                f"'{key}' in {source} must be a mapping of settings ({key}: followed by indented lines "
                f"such as `{example}: VALUE`), not {value!r}"
            )
        check_sections(value, sub, source, f"{key}.")


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


def plain_scalars(node: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, raw text) of every unquoted scalar of a composed YAML mapping (`yaml.compose`)."""
    if not isinstance(node, yaml.MappingNode):
        return
    for key_node, value in node.value:
        key = f"{prefix}{key_node.value}"
        if isinstance(value, yaml.ScalarNode) and value.style is None:
            yield key, value.value
        elif isinstance(value, yaml.MappingNode):
            yield from plain_scalars(value, f"{key}.")


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


def check_floats(values: Any, schema: Any, prefix: str = "") -> None:
    """Every float setting, a task's own too, is a finite number; a task's setting declared with
    `setting(..., finite=False)` may be +-inf (never nan). Run on the merged layers before any
    `__post_init__`, so a task's own range checks never see nan."""
    if not isinstance(values, dict):
        return
    for f in dataclasses.fields(schema):
        sub, value, key = getattr(schema, f.name), values.get(f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(sub):
            check_floats(value, sub, f"{key}.")
        elif not (f.metadata.get("finite") is False and isinstance(value, float) and math.isinf(value)):
            check_finite(key, value, sub)


def check_not_a_section(key: str, known: list[str]) -> None:
    """`train=5` on the command line: a section given a value."""
    if key in {k.rpartition(".")[0] for k in known}:
        first = next((k for k in known if k.startswith(f"{key}.") and k != "task.name"), f"{key}.KEY")
        raise ConfigError(f"{key} is a section, not a setting: give its keys, e.g. {first}=VALUE")


def suggest(key: str, known: list[str]) -> str:
    """The closest full key: first one with the same last part (`model.lr` -> `train.lr`), else the
    closest spelling of the whole key."""
    last = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in known if k.rsplit(".", 1)[-1] == last]
    close = same_leaf[:1] or difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    return f" (did you mean {close[0]}?)" if close else ""


def unknown_key(key: str, source: str, known: list[str], renamed: Mapping[str, str]) -> ConfigError:
    """The error for a key the schema does not have: its new name when it was renamed (`renamed`:
    old full key -> new one, `distqa.config_layers.renamed_keys`), else the closest known key."""
    if key in renamed:
        return ConfigError(f"unknown config key '{key}' in {source}: {key} is now {renamed[key]}; give {renamed[key]}")
    return ConfigError(f"unknown config key '{key}' in {source}{suggest(key, known)}")


def raise_config_error(
    err: OmegaConfBaseException, source: str, known: list[str], renamed: Mapping[str, str]
) -> NoReturn:
    key = getattr(err, "full_key", None) or "?"
    if isinstance(err, ConfigKeyError):
        raise unknown_key(key, source, known, renamed) from err
    # OmegaConf's own message names the expected type and the value it got; keep its first line.
    detail = str(err).splitlines()[0]
    raise ConfigError(f"bad value for '{key}' in {source}: {detail}") from err


def check_parallel(train: Any) -> None:
    """`train.parallel` against the settings that depend on it: the gradient hook, PowerSGD's, and
    what DataParallel and FSDP cannot do, said before anything runs."""
    if train.parallel == "fsdp" and train.check_replicas:
        raise ConfigError(
            "train.check_replicas=true compares the ranks' whole copies of the model, which "
            "train.parallel=fsdp does not keep (each rank holds a different shard): turn one off"
        )
    check_choice("train.ddp_comm_hook", train.ddp_comm_hook, ("none", "fp16", "bf16", "powersgd"))
    _check_dp(train)
    if train.parallel == "fsdp" and train.ddp_comm_hook == "powersgd":
        raise ConfigError(
            "train.ddp_comm_hook=powersgd is a DDP hook, and train.parallel=fsdp reduce-scatters shards: "
            "use train.ddp_comm_hook=bf16 or fp16 with fsdp, or train.parallel=ddp"
        )
    if train.ddp_comm_hook == "powersgd" and train.precision == "fp16":
        # (Found by a review: the scale fell to 1.0 and 16 of 30 steps were skipped, exit 0.)
        raise ConfigError(
            "train.ddp_comm_hook=powersgd cannot run with train.precision=fp16: PowerSGD keeps what it left out of "
            "each gradient (its error feedback) in fp16's loss-scaled units, and the first overflow, which the loss "
            "scaler meets by design, leaves that memory NaN and every later step skipped: use train.precision=bf16 "
            "or fp32 with powersgd, or train.ddp_comm_hook=fp16"
        )
    check_min("train.powersgd_rank", train.powersgd_rank, 1)
    if train.powersgd_start_step < 2:
        raise ConfigError(
            f"train.powersgd_start_step={train.powersgd_start_step} must be >= 2: PowerSGD's error feedback "
            "needs DDP's buckets rebuilt after the first step"
        )
    check_min("train.bucket_cap_mb", train.bucket_cap_mb, 0.0, strict=True)


def _check_dp(train: Any) -> None:
    """What train.parallel=dp cannot do, said before anything runs. (Where it cannot run, the
    CPU or several processes, is known only once the device is: `distqa.parallel.dp_device_ids`.)"""
    if train.parallel != "dp":
        return
    if train.ddp_comm_hook != "none":
        # DataParallel sums the replicas' gradients on GPU 0 itself: there is no DDP reducer to hook.
        raise ConfigError(
            f"train.ddp_comm_hook={train.ddp_comm_hook} hooks DDP's all-reduce, and train.parallel=dp has "
            "none (DataParallel sums gradients on GPU 0): use train.ddp_comm_hook=none, or train.parallel=ddp"
        )
    if train.compile:
        # DataParallel copies the module every step and runs the copies in threads of its own,
        # which torch.compile does not follow: the compiled step would be neither faster nor tested.
        raise ConfigError(
            "train.compile=true is not supported with train.parallel=dp (DataParallel runs fresh "
            "copies of the model in threads each step): use train.compile=false, or train.parallel=ddp"
        )


_BEFORE_INTERPOLATION = re.compile(r"(\\*)\$\{")


def escaped(value: Any) -> Any:
    """`value` (settings as plain containers) with each text's `${` escaped, so that OmegaConf reads
    back the resolved text: a value given as `\\${x}` is the text `${x}`, which config.yaml (and an
    export's reading of a checkpoint's settings) wrote as is, and which resolved to x's value when
    read again. Backslashes before it are doubled, as OmegaConf's grammar reads them."""
    if isinstance(value, str):
        return _BEFORE_INTERPOLATION.sub(lambda m: m.group(1) * 2 + "\\${", value)
    if isinstance(value, Mapping):
        return {key: escaped(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [escaped(item) for item in value]
    return value
