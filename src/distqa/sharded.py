"""The sharded part of a `train.parallel=fsdp` checkpoint, written with torch.distributed.checkpoint.

Every rank writes its own shards of the model and optimizer state (`__R_0.distcp`) into the
checkpoint's temporary folder, and rank 0 writes DCP's index (`.metadata`); the rest of the
checkpoint (scheduler, RNG, trainer state, manifest) is `distqa.checkpoint`'s as for DDP. DCP
stores each tensor with its place in the whole, so a checkpoint written by N processes loads into
any other number of them (resharding) and into a plain model.

All ranks write into one folder, so on several nodes output_dir must be storage every node
shares; `require_shared` checks that at start and turns a folder that is not into one clear line
instead of a checkpoint with missing shards.

Loading unpickles nothing but DCP's own index classes and tensors: DCP's reader unpickles
`.metadata` and non-tensor entries (the optimizer's settings) without restriction, so both go
through a reader and planner that allow only what a checkpoint of ours contains.

Whether the weights are finite (resume never picks a checkpoint holding NaN/inf) is read from the
shards themselves, on the one process that verifies checkpoints, through that same reader: the
model's tensors only (not the optimizer's), a few hundred MB at a time. That costs one more read
of the weights, which the manifest's hashes read anyway; a flag the writer recorded would cost
nothing but would vouch for shards changed after it was written.
"""

from __future__ import annotations

import io
import pickle
import re
import secrets
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from distqa.dist import DistInfo, all_gather_objects
from distqa.errors import DistqaError
from distqa.parallel import all_finite
from distqa.rank0 import on_rank0, reason

METADATA_FILE = ".metadata"
_TOKEN_FILE = ".distqa-shared-check"


def sees_rank0_files(folder: Path, info: DistInfo) -> list[bool]:
    """Whether each rank sees the files rank 0 writes in `folder` (a file with a random name and
    content: a name never used before cannot be answered from a network file system's cache of
    names that do not exist). Every rank must call it."""

    def write_token() -> str:
        for stale in folder.glob(f"{_TOKEN_FILE}-*"):  # left by a run killed right here (one run per folder)
            stale.unlink(missing_ok=True)
        token = secrets.token_hex(16)
        (folder / f"{_TOKEN_FILE}-{token}").write_text(token)
        return token

    token = on_rank0(info, write_token, failure=lambda err: f"cannot write in output_dir {folder} ({reason(err)})")
    path = folder / f"{_TOKEN_FILE}-{token}"
    try:
        seen = path.read_text() == token
    except OSError:
        seen = False
    views: list[bool] = all_gather_objects(seen, info)  # type: ignore[assignment]
    if info.is_main:
        path.unlink(missing_ok=True)
    return views


def require_shared(folder: Path, info: DistInfo) -> None:
    """Every rank, at start: raise unless every rank sees the files rank 0 writes in `folder`, so
    that a run whose nodes do not share output_dir stops before its first step, not at its first
    checkpoint hours later."""
    blind = [rank for rank, ok in enumerate(sees_rank0_files(folder, info)) if not ok]
    if blind:
        raise DistqaError(
            f"rank(s) {', '.join(map(str, blind))} cannot see the files rank 0 writes in {folder}: with "
            "train.parallel=fsdp every rank writes its shards of each checkpoint there, so output_dir must be "
            "on storage every node shares (a network file system or a mounted bucket)"
        )


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Lines of torch.load's refusal that advise loading the file unsafely or allow-listing what it names.
_ADVICE = ("weights_only", "weights only", "trust", "safe_globals", "file an issue", "documentation of torch.load")


def error_line(err: BaseException) -> str:
    """One line saying why a file could not be loaded. torch.load's refusal of a pickle that is
    not tensors and plain values advises retrying with `weights_only=False` (how a crafted file's
    code would run) or allow-listing what it names: that advice is never passed on."""
    if isinstance(err, KeyError) and err.args:  # its text is the bare key
        return f"it has no entry {_ANSI.sub('', repr(err.args[0]))[:100]}"
    text = _ANSI.sub("", str(err))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    kept = [line for line in lines if not any(word in line.lower() for word in _ADVICE)]
    if "Weights only load failed" not in text and "WeightsUnpickler" not in text:
        return (kept or [type(err).__name__])[0][:300]
    named = re.search(r"GLOBAL (\S+?)(?: was not an allowed global| whose module)", text)
    if named:
        return f"it names {named.group(1)}, which a checkpoint never holds; refused unread"
    reason = kept[0].removeprefix("WeightsUnpickler error:").strip()[:200] if kept else ""
    return (
        f"not tensors and plain values ({reason}); refused unread"
        if reason
        else "not tensors and plain values; refused unread"
    )


def first_failure(err: CheckpointException) -> str:
    """DCP gathers every rank's exception into one whose message is a list of tracebacks: the
    first failure's own first line says more."""
    for exc, _ in err.failures.values():
        return error_line(exc)
    return error_line(err)


def write_shards(tmp: Path, model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo) -> list[Path]:
    """Every rank: write its shards of model and optimizer into `tmp`; return the files it wrote
    (each rank hashes its own, in parallel)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optimizer": optimizer_state}, storage_writer=dcp.FileSystemWriter(tmp))
    except CheckpointException as err:
        failure = next((exc for exc, _ in err.failures.values() if isinstance(exc, OSError)), None)
        raise failure or OSError(first_failure(err)) from err  # an OSError keeps its strerror (a full disk)
    mine = sorted(tmp.glob(f"__{info.rank}_*.distcp"))
    return [*mine, tmp / METADATA_FILE] if info.is_main else mine


# What DCP's index may name (seen in the files torch 2.11-2.13 write): its own classes, by name,
# and a few plain values.
_INDEX_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"WriteItemType", "LoadItemType"},
    "pathlib": {"PosixPath", "WindowsPath"},
    "pathlib._local": {"PosixPath", "WindowsPath"},  # Python 3.13's home of the same classes
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
}


class _IndexUnpickler(pickle._Unpickler):  # the Python one: its BUILD step can be checked
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        # Only plain names: a dotted one is looked up attribute by attribute, out of the module
        # into whatever it imported (`filesystem` / `os.system`).
        allowed = name in _INDEX_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout))
        )
        if "." in name or not allowed:
            raise pickle.UnpicklingError(f"{METADATA_FILE} names {module}.{name}, which a checkpoint index never holds")
        return super().find_class(module, name)

    def load_build(self) -> None:
        # BUILD sets attributes on the object below it; on a class, that would change the class
        # for the whole process (a method of DCP's reader replaced, say). Only instances.
        if isinstance(self.stack[-2], type):
            raise pickle.UnpicklingError(f"{METADATA_FILE} sets attributes of {self.stack[-2].__name__} itself")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


class _Reader(dcp.FileSystemReader):
    """DCP's reader with the index read through `_IndexUnpickler`, once. `index()` is called before
    `dcp.load`: DCP 2.11 drops a reader's exception and says only "metadata is None", so a damaged
    or planted index is reported here, as one ValueError naming the file (OSError stays OSError)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._index: Metadata | None = None

    def index(self) -> Metadata:
        if self._index is None:
            try:
                with open(Path(self.path) / METADATA_FILE, "rb") as f:
                    index = _IndexUnpickler(f).load()
            except OSError:
                raise
            except Exception as err:  # arbitrary bytes fail the unpickler in arbitrary ways (KeyError 255)
                text = " ".join(str(err).split())[:200]
                if not text.startswith(METADATA_FILE):
                    text = f"{METADATA_FILE} is damaged: {type(err).__name__} {text}".rstrip()
                raise ValueError(text) from err
            if not isinstance(index, Metadata):
                raise ValueError(f"{METADATA_FILE} holds a value of type {type(index).__name__}, not DCP's index")
            self._index = index
        return self._index

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self.index()
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # reset() gives each dcp.load its own
        return metadata


class _Planner(dcp.DefaultLoadPlanner):
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        # DCP's own planner loads these with weights_only=False; they are the optimizer's
        # settings (numbers, strings, lists), which weights_only allows. Placed as DCP places them.
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_restricted(state: dict[str, Any], reader: Path | _Reader, *, no_dist: bool = False) -> None:
    """`dcp.load` of `state` through the restricted reader and planner, the one way every load here
    goes: the index read first (`_Reader.index`), DCP's gathered failure as one ValueError.
    `no_dist`: in this process alone (verification, `distqa export`), with or without a group."""
    reader = reader if isinstance(reader, _Reader) else _Reader(reader)
    reader.index()
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=_Planner(), no_dist=no_dist)
    except CheckpointException as err:
        raise ValueError(first_failure(err)) from err


def first_nonfinite_weight(directory: Path, batch_bytes: int = 256 << 20) -> str | None:
    """The name of the first model tensor of a sharded checkpoint holding NaN/inf, or None. Read in
    this process alone (`no_dist`: rank 0 verifies while the others wait), `batch_bytes` at a time,
    through the restricted reader; raises ValueError or OSError on shards that cannot be read."""
    reader = _Reader(directory)
    metadata = reader.index()
    wanted = [
        (fqn, entry)
        for fqn, entry in metadata.state_dict_metadata.items()
        if fqn.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    ]
    batch: dict[str, torch.Tensor] = {}
    size = 0
    for number, (fqn, entry) in enumerate(wanted):
        tensor = torch.empty(entry.size, dtype=entry.properties.dtype)
        batch[fqn] = tensor
        size += tensor.numel() * tensor.element_size()
        if size < batch_bytes and number < len(wanted) - 1:
            continue
        load_restricted(batch, reader, no_dist=True)  # one reader: the index is read once
        bad = next((name for name, loaded in batch.items() if not all_finite([loaded])), None)
        if bad is not None:
            return bad.removeprefix("model.")
        batch, size = {}, 0
    return None


def read_shards(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank: load the model and optimizer state of `directory` into this rank's shards."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    load_restricted(state, directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
