"""What the training data was: its length and a fingerprint of its whole content, in order.

A checkpoint records both, so that resuming on changed data (a training file that lost lines, a
relabelled or reordered file of the same length, a cache prepared with other settings) is refused
instead of continuing silently on other examples; and every rank compares them at start, because
nodes whose `data.train` differ at the same path would otherwise train on different data (or hang
at the end of the shorter epoch). Each node hashes the copy it reads (`distqa.data_agreement`).

The fingerprint covers every example: a sample would pass a same-length file whose unsampled rows
changed. A plain dataset is hashed item by item (`fingerprint`); an Arrow-backed `datasets.Dataset`
column by column straight from its memory-mapped buffers (`arrow_fingerprint`), which reads the
data once at memory speed (docs/benchmarks.md, "Data fingerprint cost"). A task whose data is a
pure function of a few settings may override `Task.data_fingerprint` with those settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import struct
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from distqa.dist import usable_cpus

DIGEST_CHARS = 32  # 128 bits; fingerprints of the earlier, sampling scheme had 16
# What `feed` reads; checkpoints record it (those before format 2 have none). 2: a dataclass item
# is hashed field by field (its repr, hashed before, elides a large tensor's values as `...`), a
# set in sorted order, and another object by its reduced state (its repr may hold an address).
FINGERPRINT_FORMAT = 2
LEAF_ROWS = 16_384  # rows per block that `arrow_fingerprint` hashes on one thread


def feed(h: Any, obj: Any, exact: bool = True, walk: _Walk | None = None) -> None:
    """Hash `obj` canonically and self-delimited: the same value gives the same bytes whatever its
    container types, and no two different sequences of values give the same bytes. `exact=False`
    (`sample_digest`): an object of a kind not known here counts by its type only. `walk` carries
    what the reading of this value has met (`_Walk`); each top-level call (an item) gets its own."""
    walk = walk if walk is not None else _Walk()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy
    elif isinstance(obj, np.ndarray):
        h.update(f"A{obj.dtype}{obj.shape}".encode())
        if obj.dtype.hasobject:  # its bytes would be pointers: hash the values
            feed(h, obj.tolist(), exact, walk)
        else:
            h.update(np.ascontiguousarray(obj).reshape(-1).view(np.uint8))
    elif isinstance(obj, Mapping):
        h.update(f"{{{len(obj)}".encode())
        for key in sorted(obj, key=str):
            feed(h, str(key), exact, walk)
            feed(h, obj[key], exact, walk)
    elif isinstance(obj, (list, tuple)):
        h.update(f"[{len(obj)}".encode())
        ints = _as_int64(obj)
        if ints is not None:  # token ids: one buffer, ~100x faster than an item each
            h.update(b"I")
            h.update(ints)
            return
        for item in obj:
            feed(h, item, exact, walk)
    elif isinstance(obj, str):
        _feed_bytes(h, b"s", obj.encode("utf-8", errors="surrogatepass"))
    elif isinstance(obj, (bytes, bytearray, memoryview)):  # (a memoryview: LMDB's buffers=True)
        _feed_bytes(h, b"b", bytes(obj))
    elif isinstance(obj, (bool, int, float, type(None), np.generic)):
        h.update(f"n{type(obj).__name__}:{obj!r};".encode())
    elif isinstance(obj, (set, frozenset)):  # in each process's order (a string's hash is seeded): sorted
        members = sorted(walk.value_digest(item, exact) for item in obj)
        h.update(f"({len(members)}".encode())
        h.update(b"".join(members))
    elif isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__"):  # a class, a function
        _feed_bytes(h, b"c", _name(obj).encode("utf-8", errors="surrogatepass"))
    else:
        _feed_bytes(h, b"o", _name(type(obj)).encode("utf-8", errors="surrogatepass"))
        if dataclasses.is_dataclass(obj) or exact:  # (a sample reads other objects by their type alone)
            h.update(walk.object_digest(obj, exact))


class _Walk:
    """What the reading of one value (an item) has met: the digests of the objects it read and the
    objects being read. An object met twice in an item is read once; one met again inside itself
    (a parent and its children) counts as a cycle, not a RecursionError. Never across items: a
    dataset may fill one object anew for each item (a reused record), and a memo of the pass read
    its first content for all, and held a thousand items' images alive."""

    def __init__(self) -> None:
        self.memo: dict[int, tuple[Any, bytes]] = {}  # id -> (the object, kept alive: its id is its own; digest)
        self.open: set[int] = set()

    def value_digest(self, value: Any, exact: bool) -> bytes:
        """Any value's digest, on its own (a set's member)."""
        one = hashlib.sha256()
        feed(one, value, exact, self)
        return one.digest()

    def object_digest(self, obj: Any, exact: bool) -> bytes:
        """An object's contents (`_feed_state`), memoised by id; b"cycle" inside itself."""
        key = id(obj)
        if key in self.memo:
            return self.memo[key][1]
        if key in self.open:
            return b"cycle"
        self.open.add(key)
        try:
            one = hashlib.sha256()
            _feed_state(one, obj, exact, self)
        finally:
            self.open.discard(key)
        self.memo[key] = (obj, one.digest())
        return self.memo[key][1]


def _feed_state(h: Any, obj: Any, exact: bool, walk: _Walk) -> None:
    """An object's contents. A dataclass by its fields (its repr elides a large tensor's values as
    `...`); another by what pickle would keep of it (`__reduce_ex__`: its class, arguments and
    state: a PIL image's mode, size, palette and pixels, a plain object's attributes), each part
    hashed as a value, never as pickle's bytes, which hold a tensor's storage address and a set's
    process-own order. Its repr only where there is no such state (a lock)."""
    if dataclasses.is_dataclass(obj):
        fields = dataclasses.fields(obj)
        h.update(f"D{len(fields)}".encode())
        for field in fields:
            feed(h, field.name, exact, walk)
            feed(h, getattr(obj, field.name), exact, walk)
        return
    try:
        reduced = obj.__reduce_ex__(4)
    except Exception:  # (a lock, a C object without pickle support)
        reduced = None
    if isinstance(reduced, str):  # a module-level singleton, named
        _feed_bytes(h, b"g", reduced.encode("utf-8", errors="surrogatepass"))
    elif isinstance(reduced, tuple) and len(reduced) >= 2:
        parts = [None if part is None else list(part) if i >= 3 else part for i, part in enumerate(reduced[:5])]
        feed(h, parts, exact, walk)
    else:  # its repr, unless it shows an address (other in every process): then its type alone
        shown = repr(obj)
        _feed_bytes(h, b"r", b"" if _ADDRESS.search(shown) else shown.encode("utf-8", errors="surrogatepass"))


_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")


def _name(kind: Any) -> str:
    return f"{getattr(kind, '__module__', '')}.{getattr(kind, '__qualname__', repr(kind))}"


def _as_int64(items: list | tuple) -> np.ndarray | None:
    """`items` as int64s when every one is a plain int that fits, else None (then each is fed)."""
    if not items or not all(type(item) is int for item in items):  # bools are not ints here
        return None
    try:
        return np.array(items, dtype=np.int64)
    except OverflowError:
        return None


def _feed_bytes(h: Any, tag: bytes, data: bytes) -> None:
    h.update(tag + struct.pack("<Q", len(data)))
    h.update(data)


def digest_of(*values: Any) -> str:
    """A fingerprint of a few values (the settings a synthetic dataset is a function of), hashed
    as `fingerprint` hashes items."""
    h = hashlib.sha256(b"values")
    feed(h, list(values))
    return h.hexdigest()[:DIGEST_CHARS]


def fingerprint(dataset: Dataset) -> str:
    """A hex digest of every item of `dataset`, in order (an Arrow-backed `datasets.Dataset`
    goes through `arrow_fingerprint`, which gives the same guarantee far faster)."""
    hf = sys.modules.get("datasets")  # never imported here: runs without `datasets` stay light
    if hf is not None and isinstance(dataset, hf.Dataset):
        return arrow_fingerprint(dataset)
    length = len(dataset)  # type: ignore[arg-type]
    h = hashlib.sha256(f"len={length}".encode())
    for index in range(length):
        feed(h, dataset[index])
    return h.hexdigest()[:DIGEST_CHARS]


def arrow_fingerprint(dataset: Any, threads: int | None = None) -> str:
    """A hex digest of every value of every column of a `datasets.Dataset`, in row order.

    Read straight from the Arrow buffers (memory-mapped for a dataset saved to disk), without
    building Python rows: the cost is reading the data once. The rows are cut into blocks of
    `LEAF_ROWS`, hashed on `threads` threads (default: every CPU this process may use; xxhash and
    pyarrow release the GIL) and their digests hashed in order. Within a block each column is
    hashed as separate streams of its values, its list lengths and its null positions, so how Arrow cut
    the table into chunks or files (`prepare --num-proc`) and the thread count do not change the
    digest, while any changed, moved, added or removed value does. A dataset with an indices
    mapping (after `select` or `shuffle`) adds the mapping, which sets the order rows are read in.
    """
    table = dataset.data.table  # the pyarrow.Table behind the dataset (only its selected columns)
    h = hashlib.sha256(f"len={len(dataset)}".encode())
    for field in table.schema:
        h.update(f"column {field.name!r}: {field.type};".encode())
    parts = [table.slice(start, LEAF_ROWS) for start in range(0, table.num_rows, LEAF_ROWS)]
    with ThreadPoolExecutor(max(1, min(threads or usable_cpus(), len(parts)))) as pool:
        for digest in pool.map(_leaf_digest, parts):
            h.update(digest.encode())
    indices = getattr(dataset, "_indices", None)  # datasets keeps the mapping as a private Table
    if indices is not None:
        h.update(f"indices:{_leaf_digest(indices.table)}".encode())
    return h.hexdigest()[:DIGEST_CHARS]


def _leaf_digest(table: Any) -> str:
    """The digest of one block of rows: one stream per (column path, role), in a fixed order."""
    streams = _Streams()
    for name in table.column_names:
        for chunk in table.column(name).chunks:
            _feed_arrow(streams, (name,), chunk)
    return streams.digest()


class _Streams:
    """Hashers by (column path, role), and how many values each path has had so far: the same
    values give the same digests however they are cut into chunks."""

    def __init__(self) -> None:
        self.hashers: dict[tuple[str, ...], Any] = {}
        self.seen: dict[tuple[str, ...], int] = {}

    def __call__(self, key: tuple[str, ...]) -> Any:
        import xxhash  # a dependency of `datasets`: present wherever an Arrow dataset is

        # xxh3-128: tens of GB/s on one core, so reading the memory, not hashing, bounds the cost.
        return self.hashers.setdefault(key, xxhash.xxh3_128())

    def digest(self) -> str:
        return "".join(f"{key!r}={self.hashers[key].hexdigest()};" for key in sorted(self.hashers)) + "|"


def _feed_arrow(stream: _Streams, path: tuple[str, ...], array: Any) -> None:
    """Feed one Arrow array (a chunk) into the streams of `path` (column name, then "[]" per list
    level), one per role: values, lengths, null positions. Nested lists recurse."""
    import pyarrow as pa
    import pyarrow.compute as pc

    first = stream.seen.get(path, 0)  # this chunk's first value's position along the path
    stream.seen[path] = first + len(array)
    if array.null_count:
        valid = array.is_valid().to_numpy(zero_copy_only=False)
        stream((*path, "nulls")).update(np.flatnonzero(~valid).astype(np.int64) + first)
        array = array.drop_null()  # a null's slot holds arbitrary bytes: only valid values count
    if len(array) == 0:
        return
    kind = array.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        stream((*path, "lengths")).update(pc.list_value_length(array).to_numpy().astype(np.int64))
        _feed_arrow(stream, (*path, "[]"), array.flatten())  # flatten() honours the chunk's slice offset
    elif (
        pa.types.is_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_large_binary(kind)
    ):
        large = pa.types.is_large_string(kind) or pa.types.is_large_binary(kind)
        _, offsets_buffer, data_buffer = array.buffers()
        offsets = np.frombuffer(offsets_buffer, dtype=np.int64 if large else np.int32)
        offsets = offsets[array.offset : array.offset + len(array) + 1]
        stream((*path, "lengths")).update(np.diff(offsets).astype(np.int64))
        if data_buffer is not None:
            stream((*path, "values")).update(memoryview(data_buffer)[int(offsets[0]) : int(offsets[-1])])
    elif pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        stream((*path, "values")).update(np.ascontiguousarray(array.to_numpy(zero_copy_only=False)).view(np.uint8))
    else:  # structs, dictionaries, dates...: rare in training data, hashed through Python values
        h = stream((*path, "python"))
        for value in array.to_pylist():
            feed(h, value)
