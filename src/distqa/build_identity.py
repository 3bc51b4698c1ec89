"""Every rank builds the same model with the same code, or none starts.

The settings are compared as text (`distqa.agreement`) and the data by fingerprint
(`distqa.data_identity`), but what a setting names is read from each node's own disk and image:
`model.name=./mdl` or a hub id whose cached snapshot differs, a tokenizer folder with other
vocabulary, another version of distqa, torch or transformers. A review ran each of these on two
nodes: both trained, averaged gradients of two different computations, and exited 0. So after the
model is built each rank hashes what it built and what it runs, and the ranks compare the hashes in
one small all-gather; a difference stops every rank with one line naming what differs.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import distqa
from distqa.dist import DistInfo, all_gather_objects
from distqa.errors import ConfigError

if TYPE_CHECKING:  # for hints only
    from distqa.task import Task

_PACKAGE = Path(distqa.__file__).resolve().parent


def source_hash(files: list[Path], root: Path) -> str:
    """A hash of these files' names (relative to `root`) and contents."""
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def code_identity(task: Task) -> dict[str, str]:
    """distqa's Python files, the task's module when it lives outside distqa (a fork's), and the
    versions of the libraries that compute: other code computes another loss or gradient."""
    identity = {
        "distqa code": source_hash([p for p in _PACKAGE.rglob("*.py") if "__pycache__" not in p.parts], _PACKAGE),
        "torch version": torch.__version__,
        "transformers version": importlib.metadata.version("transformers"),
    }
    module = sys.modules.get(type(task).__module__)
    task_file = getattr(module, "__file__", None)
    if task_file and not Path(task_file).resolve().is_relative_to(_PACKAGE):
        path = Path(task_file).resolve()
        identity["task code"] = source_hash([path], path.parent)
    return identity


def weights_hash(model: nn.Module) -> str:
    """A hash of every tensor of the model's state (names, dtypes, shapes and bytes). Called on the
    freshly built model, on the CPU as `Task.build_model` returns it: seeded alike, every rank
    builds the same weights, unless its pretrained files differ (about 0.25 s for BERT-base)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        if tensor.device.type != "meta":
            digest.update(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def model_identity(model: nn.Module) -> dict[str, str]:
    """The weights, and the model's Hugging Face config when it has one: settings such as
    `layer_norm_eps` or the attention kernel change what is computed and are no weights."""
    identity = {"model weights": weights_hash(model)}
    config = getattr(model, "config", None)
    if hasattr(config, "to_dict"):
        text = json.dumps(config.to_dict(), sort_keys=True, default=repr)
        identity["model config"] = hashlib.sha256(text.encode()).hexdigest()
    return identity


def tokenizer_hash(tokenizer: Any) -> str:
    """What turns text into ids: a fast tokenizer's whole definition (vocabulary, normalization,
    splitting, post-processing, added tokens) without its truncation and padding state, which
    tokenizing changes (a node's first process may have prepared data with it already); a slow
    one's class, vocabulary and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
    else:
        state = {
            "class": type(tokenizer).__name__,
            "vocab": sorted(tokenizer.get_vocab().items()),
            "lower": getattr(tokenizer, "do_lower_case", None),
        }
    state["special"] = getattr(tokenizer, "special_tokens_map", None)
    return hashlib.sha256(json.dumps(state, sort_keys=True, default=repr).encode()).hexdigest()


def check_same_build(model: nn.Module, task: Task, info: DistInfo) -> None:
    """Raise the same one-line ConfigError on every rank unless every rank runs the same code and
    built the same model (`Task.identity` adds the task's own parts: its tokenizer). Every rank
    must call it, with the model as `Task.build_model` returned it."""
    if not info.is_distributed:
        return
    mine = {**code_identity(task), **model_identity(model), **task.identity()}
    views: list[dict[str, str]] = all_gather_objects(mine, info)  # type: ignore[assignment]
    differ = sorted({key for view in views for key in view if any(v.get(key) != view.get(key) for v in views)})
    if not differ:
        return

    def shown(value: str | None) -> str:
        return "(none)" if value is None else value[:12] if len(value) == 64 else value

    parts = [
        f"{key} ({', '.join(f'rank {rank}: {shown(view.get(key))}' for rank, view in enumerate(views))})"
        for key in differ
    ]
    raise ConfigError(
        f"the processes of this run did not build the same thing: {'; '.join(parts)}: every node must run "
        "the same image or installation of distqa and find the same files for model.name and model.tokenizer"
    )
