"""The checks behind `load_config`: ranges and choices that the dataclasses call from
`__post_init__`, and the checks of a whole layer (a YAML file, the command line) that OmegaConf's
own errors would not name: a section that is not a mapping, a float that is not a number.

Every failure is a `ConfigError`, one line naming the key and what to give it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from distqa.errors import ConfigError


def check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}")


def check_attention(value: str | None) -> None:
    """model.attn_implementation: a kernel transformers knows, or a hub kernel (`org/repo`). Any
    text passed `--check-config`, and the run ended in a traceback from transformers' from_config
    (a pretrained model's was blamed on model.name) (a review)."""
    if value is None or "/" in value:
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # (only when set: a second to import)

    known = ("eager", *sorted(ALL_ATTENTION_FUNCTIONS.valid_keys()))
    if value not in known:
        raise ConfigError(
            f"model.attn_implementation={value!r} is not an attention kernel transformers knows: use one of "
            f"{', '.join(known)} (or leave it unset: SDPA where the model supports it)"
        )


def scalars_in(key: str, value: Any) -> Iterator[tuple[str, Any]]:
    """(key, value) of every single value in a setting's value: itself, or the items of a list
    (`key[i]`) or mapping (`key.name`) setting, at any depth."""
    if isinstance(value, Mapping):
        for name, item in value.items():
            yield from scalars_in(f"{key}.{name}", item)
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        for i, item in enumerate(value):
            yield from scalars_in(f"{key}[{i}]", item)
    else:
        yield key, value


def check_finite(key: str, value: Any, default: Any = None, *, inf: bool = False) -> None:
    """A float setting must be a number: nan passes every `<` test and inf every `>` one, so a
    range check alone lets `train.lr=nan` train NaN weights to the end. The items of a list or
    mapping setting too (`task.class_weights=[nan, 1]`); with `inf`, +-inf may pass (never nan)."""
    for item_key, item in scalars_in(key, value):
        if not isinstance(item, float) or math.isfinite(item) or (inf and math.isinf(item)):
            continue
        shown = f" (default: {default})" if isinstance(default, int | float) and not isinstance(default, bool) else ""
        raise ConfigError(f"{item_key}={item} is not a finite number: give {item_key} a finite value{shown}")


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
        else:
            check_finite(key, value, sub, inf=f.metadata.get("finite") is False)


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


def check_fsdp_run(train: Any) -> None:
    """What FSDP cannot train with, checked where a run starts (`resolve_global_batch`, `distqa
    train --check-config`), not where settings are read: `distqa export` reads older checkpoints'.
    - A 16-bit train.ddp_comm_hook with train.grad_accum > 1 (set, or derived from
      train.global_batch): FSDP keeps the micro-batches' gradients in its reduce dtype and summed
      them in bf16 or fp16 (DDP sums in fp32 and rounds only what it sends), 2 to 3 times DDP's
      error at grad_accum 32 (a review measured it), without a word.
    - train.find_unused_parameters=true: FSDP reduce-scatters a module's gradients as its backward
      ends, so a part one rank skipped left the collectives unmatched and gloo aborted the process;
      the key was accepted and did nothing (a review saw both)."""
    if train.parallel != "fsdp":
        return
    if train.ddp_comm_hook in ("bf16", "fp16") and train.grad_accum > 1:
        raise ConfigError(
            f"train.ddp_comm_hook={train.ddp_comm_hook} with train.parallel=fsdp and train.grad_accum="
            f"{train.grad_accum}: FSDP would sum the micro-batches' gradients in {train.ddp_comm_hook}, not "
            "fp32; use train.ddp_comm_hook=none, or a batch that needs no accumulation"
        )
    if train.find_unused_parameters:
        raise ConfigError(
            "train.find_unused_parameters=true is a DDP setting: train.parallel=fsdp needs every rank to use "
            "the same parameters in each step; use train.parallel=ddp for a model that leaves some unused"
        )


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


def check_output_root(output_dir: str | Path) -> None:
    """A launch whose containers keep one mounted folder and nothing else (scripts/run_docker_nodes.sh
    mounts RESULTS_DIR at /app/results, .neuro/live.yml the results volume) names it in
    DISTQA_OUTPUT_ROOT: an output_dir elsewhere was written inside the container and removed with
    it, the script saying 'finished; results in ...' over an empty folder, exit 0. Checked by
    `distqa train --check-config` too, so that a launch script refuses it before torchrun starts.
    So is an output_dir that is a file or lies under one: --check-config passed it, and the run
    stopped only after every rank had started."""
    _refuse_a_file(Path(output_dir))
    root = os.environ.get("DISTQA_OUTPUT_ROOT")
    if not root:
        return
    where, kept = Path(output_dir).resolve(), Path(root).resolve()
    if not where.is_relative_to(kept):
        raise ConfigError(
            f"output_dir={str(output_dir)!r} ({where}) is not under {kept}, the only folder of this container "
            f"that outlives it (DISTQA_OUTPUT_ROOT, set by the launch that mounts it): set output_dir to a folder in "
            f"{kept}, e.g. output_dir={kept}/{where.name}"
        )


def _refuse_a_file(output_dir: Path) -> None:
    # (durable.file_in_the_way's walk, written here: the configuration imports nothing above it)
    try:
        blocker = next((p for p in (output_dir, *output_dir.parents) if p.exists() and not p.is_dir()), None)
    except OSError:  # a folder this user may not search: the run's own claim says so
        return
    if blocker is not None:
        where = "is a file, not a folder" if blocker == output_dir else f"lies under {blocker}, which is a file"
        raise ConfigError(f"output_dir={str(output_dir)!r} {where}: name another output_dir")


WORLD_SIZES_ENV = "DISTQA_CHECK_WORLD_SIZES"  # worker.sh: "SIZE ...|NNODES=1:2 x NPROC_PER_NODE=1"


def check_world_sizes(train: Any) -> None:
    """The process counts a launch may have, from worker.sh (`WORLD_SIZES_ENV`), checked against
    the global batch before torchrun starts, by the rule each round applies
    (`TrainConfig.resolve_global_batch`). An elastic run (NNODES=MIN:MAX) whose global batch did
    not split over a node count it reached (or whose train.grad_accum contradicted it there), or
    that set no train.global_batch at all (the batch then follows the process count, and a resume
    refuses another), trained on alone until a node joined, then every round stopped: the healthy
    node too, and a run already exported reported failed (reviews saw both)."""
    given = os.environ.get(WORLD_SIZES_ENV, "")
    sizes_text, _, label = given.partition("|")
    sizes = sorted({int(size) for size in sizes_text.split()})
    shown = ", ".join(map(str, sizes[:8])) + (", ..." if len(sizes) > 8 else "")
    if len(sizes) > 1 and not train.global_batch:
        raise ConfigError(
            f"{label} lets the number of processes change ({shown}), and a checkpoint resumes only with "
            f"the global batch it was trained with: set train.global_batch {_multiple(train.batch_size, sizes)}, "
            "so that train.grad_accum follows"
        )
    for size in sizes if train.global_batch else []:
        try:
            dataclasses.replace(train).resolve_global_batch(size)
        except ConfigError as err:
            raise ConfigError(f"{err} ({label} allows {size} process(es))") from None


def _multiple(batch_size: int, sizes: list[int]) -> str:
    lcm = math.lcm(*(batch_size * size for size in sizes))
    if lcm > 10**7:
        return "(none splits over so many counts: narrow NNODES)"
    return f"to a multiple of train.batch_size x each ({lcm})"
