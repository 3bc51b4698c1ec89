"""What the training data was: its length and a fingerprint of its content.

A checkpoint records both, so that resuming on changed data (a training file that lost lines, a
cache prepared with other settings) is refused instead of continuing silently on other examples;
and every rank compares them at start, because nodes whose `data.train` differ at the same path
would otherwise train on different data and hang at the end of the shorter epoch.

The default fingerprint hashes the length and `SAMPLES` evenly spaced items, so it costs
milliseconds on any dataset (hashing a 17 GB file at every start would not). It sees any change of
length and any change of a sampled item; a change that keeps both passes. A task with a cheaper
exact identity (a content hash it already has) can override `Task.data_fingerprint`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from distqa.dist import DistInfo, all_gather_objects
from distqa.errors import DistqaError

SAMPLES = 64


def _feed(h: Any, obj: Any) -> None:
    """Hash `obj` canonically: the same value gives the same bytes whatever its container types."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        h.update(f"A{obj.dtype}{obj.shape}".encode())
        h.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for key in sorted(obj, key=str):
            _feed(h, str(key))
            _feed(h, obj[key])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(f"[{len(obj)}".encode())
        for item in obj:
            _feed(h, item)
    elif isinstance(obj, str):
        data = obj.encode("utf-8", errors="surrogatepass")
        h.update(b"s" + struct.pack("<Q", len(data)) + data)
    elif isinstance(obj, bytes):
        h.update(b"b" + struct.pack("<Q", len(obj)) + obj)
    elif isinstance(obj, (bool, int, float, type(None), np.generic)):
        h.update(f"n{type(obj).__name__}:{obj!r}".encode())
    else:
        h.update(f"o{type(obj).__qualname__}:{obj!r}".encode())


def sample_indices(length: int, samples: int = SAMPLES) -> list[int]:
    """`samples` indices spread evenly over [0, length), first and last included."""
    if length <= samples:
        return list(range(length))
    return sorted({round(i * (length - 1) / (samples - 1)) for i in range(samples)})


def fingerprint(dataset: Dataset, samples: int = SAMPLES) -> str:
    """A short hex digest of the dataset's length and of evenly spaced items."""
    length = len(dataset)  # type: ignore[arg-type]
    h = hashlib.sha256(f"len={length}".encode())
    for index in sample_indices(length, samples):
        _feed(h, index)
        _feed(h, dataset[index])
    return h.hexdigest()[:16]


def agreed_identity(
    fingerprint_of: Callable[[Dataset], str], dataset: Dataset, info: DistInfo, data_train: str
) -> dict[str, Any]:
    """This dataset's identity, checked to be the same on every rank (one line on every rank if
    not, before any step: a rank with fewer batches would leave the others waiting forever)."""
    mine = {"examples": len(dataset), "fingerprint": fingerprint_of(dataset)}  # type: ignore[arg-type]
    views = all_gather_objects(mine, info)
    if any(view != mine for view in views):
        seen = ", ".join(
            f"rank {rank}: {view['examples']} examples ({view['fingerprint']})"  # type: ignore[index]
            for rank, view in enumerate(views)
        )
        raise DistqaError(
            f"the ranks do not see the same training data ({seen}): data.train={data_train!r} "
            "must be the same data on every node"
        )
    return {**mine, "train": data_train}
