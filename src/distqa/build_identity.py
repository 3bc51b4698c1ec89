"""Every rank builds the same model with the same code, or none starts.

The settings are compared as text (`distqa.agreement`) and the data by fingerprint
(`distqa.data_identity`), but what a setting names is read from each node's own disk and image:
`model.name=./mdl` or a hub id whose cached snapshot differs, a tokenizer folder with other
vocabulary, another version of distqa, torch or transformers. A review ran each of these on two
nodes: both trained, averaged gradients of two different computations, and exited 0. So after the
model is built each rank hashes what it runs and the model's config and tokenizer, sums its weights
tensor by tensor, and the ranks compare them in one small all-gather; a difference stops every rank
with one line naming what differs.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import distqa
from distqa.agreement import differences
from distqa.dist import DistInfo, all_gather_objects
from distqa.errors import ConfigError

if TYPE_CHECKING:  # for hints only
    from distqa.task import Task

_PACKAGE = Path(distqa.__file__).resolve().parent
# Weights built from the same files agree to float rounding; random ones drawn on two kinds of CPU
# (another SIMD path of `normal_`) differ in their last bits, and DDP broadcasts rank 0's anyway.
_WEIGHTS_RTOL = 1e-4


def python_files(folder: Path) -> list[Path]:
    """The .py files below `folder`: no caches, and no dot-files (an editor's lock of a file being
    edited is a dangling link that cannot be read)."""
    return [
        p for p in folder.rglob("*.py") if "__pycache__" not in p.parts and not p.name.startswith(".") and p.is_file()
    ]


def source_hash(files: list[Path], root: Path) -> str:
    """A hash of these files' names (relative to `root`) and contents."""
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def code_identity(task: Task) -> dict[str, str]:
    """distqa's Python files, a fork's task package (or module), and the versions of the libraries
    that compute: other code computes another loss or gradient. (A local build's suffix, +cu124 or
    +cpu, is left out: the same release on other drivers computes the same.)"""
    import transformers  # (loaded already: the model is built)

    identity = {
        "distqa code": source_hash(python_files(_PACKAGE), _PACKAGE),
        "torch version": torch.__version__.split("+")[0],
        "transformers version": transformers.__version__,
    }
    task_file = getattr(sys.modules.get(type(task).__module__), "__file__", None)
    if task_file and not Path(task_file).resolve().is_relative_to(_PACKAGE):
        path = Path(task_file).resolve()
        # A task in a package (my_task/task.py beside model.py, data.py): the whole package.
        files = python_files(path.parent) if (path.parent / "__init__.py").is_file() else [path]
        identity["task code"] = source_hash(files, path.parent)
    return identity


def _installed_roots() -> list[Path]:
    """Where the standard library and installed packages lie: code there is the same release on
    every node (the versions compared above, or the image's), and hashing it all would read torch."""
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(key)}
    return [Path(root).resolve() for root in roots]


def _project_packages(task: Task) -> set[str]:
    """The top-level packages that are the project's own wherever they are installed: the task's,
    and every one its distribution or distqa's installs (the Dockerfile's `pip install ./` puts a
    fork's src/ packages into site-packages beside distqa)."""
    tops = {type(task).__module__.split(".")[0]}
    by_top = importlib.metadata.packages_distributions()
    dists = {dist for top in (*tops, "distqa") for dist in by_top.get(top, ())}
    tops |= {top for top, owners in by_top.items() if dists.intersection(owners)}
    return tops - {"distqa"}


def own_modules(task: Task) -> dict[str, str]:
    """Module name -> a hash of its file, for every loaded module of the project's own code that is
    not distqa's (compared whole above): a fork's modules beside its task, above it, or installed
    with it; and any module from outside the standard library and the installed packages. A review
    trained two nodes whose task module was the same and whose loss, in a module it imports
    (flatloss.py beside it, a package one level up), differed: exit 0. By name, not path: nodes may
    keep the same code in other folders. Ranks compare the modules they have both loaded: a module
    one process imports alone (a cache built once per node) is no difference, and one imported
    after the model is built is not seen."""
    installed, project = _installed_roots(), _project_packages(task)
    hashes: dict[str, str] = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not (isinstance(file, str) and os.path.isabs(file) and file.endswith((".py", ".pyc"))):
            continue  # built in, an extension, or a relative name (torch.ops' '_ops.py') that no path holds
        path = Path(file).resolve()
        if path.is_relative_to(_PACKAGE):
            continue
        elsewhere = any(path.is_relative_to(root) for root in installed) or not {
            "site-packages",
            "dist-packages",
        }.isdisjoint(path.parts)
        if elsewhere and name.split(".")[0] not in project:
            continue
        try:
            hashes[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
        except OSError:  # deleted or unreadable since it was imported: what ran is unknown
            hashes[name] = "unreadable"
    return hashes


def module_differences(gathered: list[dict[str, str]]) -> str:
    """'flatloss (rank 0: 'ab12...', rank 1: 'cd34...')' for each module whose file differs
    between ranks that loaded it."""
    names = sorted({name for modules in gathered for name in modules})
    parts = []
    for name in names:
        seen = {rank: modules[name] for rank, modules in enumerate(gathered) if name in modules}
        if len(set(seen.values())) > 1:
            parts.append(f"{name} ({', '.join(f'rank {rank}: {digest!r}' for rank, digest in seen.items())})")
    return "; ".join(parts)


def _config_text(config: Any) -> str:
    """A Hugging Face config as JSON text, keys sorted. A value JSON cannot hold counts by its type
    (its repr may hold an address, other in every process)."""
    return json.dumps(config.to_dict(), sort_keys=True, default=lambda value: type(value).__qualname__)


def config_identity(model: nn.Module) -> dict[str, str]:
    """The model's Hugging Face config, when it has one: settings such as `layer_norm_eps` change what
    is computed and are no weights."""
    config = getattr(model, "config", None)
    if not hasattr(config, "to_dict"):
        return {}
    text = _config_text(config)
    identity = {"model config": hashlib.sha256(text.encode()).hexdigest()}
    # The attention kernel transformers picked where model.attn_implementation is unset (what the
    # node's packages allow): to_dict leaves it out, and kernels differ in their rounding.
    kernel = getattr(config, "_attn_implementation", None)
    if kernel is not None:
        identity["attention kernel"] = str(kernel)
    return identity


# Keys of a Hugging Face config that do not decide what the trained model computes: where it came
# from and with which version, flags of what a forward returns, how weights are initialised (they
# come from the checkpoint), the feed-forward's chunking (the same numbers, computed in pieces), the
# class names (a head of another size fails to load anyway). The dropout rates are kept, and
# compared apart (`dropout_keys`): model.dropout sets them, a change applied on resume.
_NOT_COMPUTED = {
    "transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "use_cache",
    "return_dict", "output_attentions", "output_hidden_states", "gradient_checkpointing", "initializer_range",
    "chunk_size_feed_forward", "id2label", "label2id",
}  # fmt: skip


def dropout_keys(settings: dict[str, Any]) -> list[str]:
    """The dropout rates among `model_settings`' keys (names differ between architectures)."""
    return sorted(key for key in settings if "dropout" in key)


def model_settings(model: nn.Module) -> dict[str, Any] | None:
    """The model's Hugging Face config as JSON values, less `_NOT_COMPUTED`; None for a model
    without one. Checkpoints keep it: a resume or an export builds the model again
    from model.name's files, and a config.json edited since (another activation, layer_norm_eps or
    position embedding) loads the same tensors into another computation
    (`resume.check_model_settings`)."""
    config = getattr(model, "config", None)
    if not hasattr(config, "to_dict"):
        return None
    values = json.loads(_config_text(config))
    return {key: value for key, value in values.items() if key not in _NOT_COMPUTED}


def weight_summary(model: nn.Module) -> dict[str, tuple[float, float, float]]:
    """Sum, L1 and L2 norm of every tensor of the model's state, in float64: weights from other files
    differ in all three, rounding in none beyond `_WEIGHTS_RTOL`. Called on the freshly built model,
    on the CPU as `Task.build_model` returns it (about half a second for BERT-base)."""
    summary = {}
    for name, tensor in model.state_dict().items():
        if tensor.device.type == "meta":
            continue
        values = tensor.detach() if tensor.is_floating_point() else tensor.detach().double()
        norms = [torch.linalg.vector_norm(values, ord, dtype=torch.float64) for ord in (1, 2)]
        summary[name] = (float(torch.sum(values, dtype=torch.float64)), *map(float, norms))
    return summary


def weights_differ(mine: dict[str, tuple[float, ...]], reference: dict[str, tuple[float, ...]]) -> list[str]:
    """The tensors whose summaries differ beyond rounding (or that only one side has)."""
    names = sorted(mine.keys() | reference.keys())
    differ = [n for n in names if n not in mine or n not in reference]
    for name in (n for n in names if n in mine and n in reference):
        (total, l1, l2), (ref_total, ref_l1, ref_l2) = mine[name], reference[name]
        scale = max(l1, ref_l1, 1e-12)
        close = abs(total - ref_total) <= _WEIGHTS_RTOL * scale and abs(l1 - ref_l1) <= _WEIGHTS_RTOL * scale
        if not (close and abs(l2 - ref_l2) <= _WEIGHTS_RTOL * max(l2, ref_l2, 1e-12)):
            differ.append(name)
    return differ


_CALL = ("padding_side", "truncation_side", "model_input_names")


def tokenizer_hash(tokenizer: Any) -> str | None:
    """What turns text into ids: a fast tokenizer's whole definition (vocabulary, normalization,
    splitting, post-processing, added tokens) without its truncation and padding state, which
    tokenizing changes (a node's first process may have prepared data with it already); a slow
    one's class, vocabulary and special tokens. None for another kind of tokenizer (a fork's own,
    whose `Task.identity` says what identifies it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
    elif hasattr(tokenizer, "get_vocab"):
        state = {
            "class": type(tokenizer).__name__,
            "vocab": sorted(tokenizer.get_vocab().items()),
            "lower": getattr(tokenizer, "do_lower_case", None),
        }
    else:
        return None
    state["special"] = getattr(tokenizer, "special_tokens_map", None)
    # How a call pads, truncates and what it returns, set in tokenizer_config.json outside the
    # backend's definition: a copy that pads on the left moved every padded text's positions, exit 0
    # (a review). Hashed only where it is not the class's own, so a usual tokenizer's hash stays.
    call = {name: getattr(tokenizer, name, None) for name in _CALL}
    if call != {name: getattr(type(tokenizer), name, None) for name in _CALL}:
        state["call"] = call
    return hashlib.sha256(json.dumps(state, sort_keys=True, default=repr).encode()).hexdigest()


def full_identity(task: Task) -> dict[str, str]:
    """`Task.identity` with the tokenizer's hash always in (when the task keeps one as
    `self.tokenizer`): a fork's override that returned only its own parts dropped it, and a resume
    onto a tokenizer with two ids swapped went on, exit 0."""
    digest = tokenizer_hash(getattr(task, "tokenizer", None))
    return {**({} if digest is None else {"tokenizer": digest}), **task.identity()}


def check_same_build(model: nn.Module, task: Task, info: DistInfo) -> tuple[dict[str, str], dict[str, Any] | None]:
    """Raise the same one-line ConfigError on every rank unless every rank runs the same code and
    built the same model (`Task.identity` adds the task's own parts: its tokenizer). Every rank
    must call it, with the model as `Task.build_model` returned it. Returns `Task.identity` and
    `model_settings`, which checkpoints keep for a resume and an export to compare (`distqa.resume`)."""
    if not isinstance(model, nn.Module):  # the same on every rank: the same code built it
        raise ConfigError(
            f"the task's build_model() returned a {type(model).__name__}, not a torch.nn.Module: return the "
            "model itself (its loss and outputs are the task's loss and eval_step's)"
        )
    task_identity, settings = full_identity(task), model_settings(model)
    if not info.is_distributed:
        return task_identity, settings
    mine = {**code_identity(task), **config_identity(model), **task_identity}
    gathered = all_gather_objects((mine, weight_summary(model), own_modules(task)), info)
    # Hashes shown by their first 12 characters, versions whole; named as the settings' are.
    views = [{key: v[:12] if len(v) == 64 else v for key, v in view.items()} for view, _, _ in gathered]  # type: ignore[misc]
    parts = [found] if (found := differences(views)) else []
    if modules := module_differences([own for _, _, own in gathered]):  # type: ignore[misc]
        parts.append(f"code of {modules}")
    reference = gathered[0][1]  # type: ignore[index]
    odd = {rank: weights_differ(summary, reference) for rank, (_, summary, _) in enumerate(gathered)}  # type: ignore[misc]
    odd = {rank: names for rank, names in odd.items() if names}
    if odd:
        first = next(iter(odd.values()))
        parts.append(
            f"model weights (rank(s) {', '.join(map(str, odd))} built {len(first)} of {len(reference)} tensors "
            f"other than rank 0's, e.g. {first[0]})"
        )
    if not parts:
        return task_identity, settings
    raise ConfigError(
        f"the processes of this run did not build the same thing: {'; '.join(parts)}: every node must run "
        "the same image or installation of distqa and find the same files for model.name and model.tokenizer"
    )
