"""Durable writes that follow no symbolic link, in a module that imports no torch, so that commands
which only move files (`distqa split`) can use them without loading the training stack.

A link planted in output_dir (`config.yaml` -> some file of the user's) must not turn a run's
writes into writes elsewhere: new files are created with O_EXCL (which never follows a link) under
a fresh name and renamed over the old name (a rename replaces a link, it does not write through
it); files that are appended to are opened with O_NOFOLLOW.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any


def fsync_path(path: Path) -> None:
    """Flush a file's data (or a folder's entries) to the disk, so a crash cannot leave it empty
    or a rename pointing at nothing."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` by a file holding `data`: written beside it under a fresh name, fsynced and
    renamed over it, so readers see the old file or the new one, never a part, and a link at
    `path` is replaced, never followed. Raises OSError."""
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def open_append(path: Path) -> int:
    """A descriptor to append to `path` (created if missing), refusing a link (OSError ELOOP)."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)


def read_no_link(path: Path) -> bytes:
    """The bytes of `path`, refusing a link (OSError ELOOP): what is read is this folder's own file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def file_in_the_way(folder: Path) -> Path | None:
    """The first of `folder` and its parents that exists and is not a folder (a file where a folder
    must be created or written into), or None."""
    return next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)


# The descriptors of the locks this process holds (`held_exclusively`). A process forked meanwhile
# (a `datasets` pool worker, its manager, a DataLoader worker) shares each open file and so the
# flock: once the holder was killed, such an orphan kept the lock, and every later writer waited for
# ever. So a forked child closes them at once: the lock stays the holder's alone. (exec'd children
# get none: O_CLOEXEC.)
_HELD: set[int] = set()


def _drop_held_locks() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()  # (a child that went on to leave the `with` then closes none: the numbers may be reused)


os.register_at_fork(after_in_child=_drop_held_locks)


@contextlib.contextmanager
def held_exclusively(lock_file: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    """Hold an exclusive flock on `lock_file` (created if missing, never through a link; a folder
    is locked itself, with no file) for the body; when another process holds it, call `on_wait`
    once, then wait for it. The lock goes with the process (a killed holder leaves no stale lock,
    and a child it forked holds none), and the file is never removed: a waiter would otherwise lock
    a file nobody else sees. Raises OSError."""
    if lock_file.is_dir():
        fd = os.open(lock_file, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    else:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    _HELD.add(fd)
    owner = os.getpid()
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if os.getpid() == owner:  # (a forked child closed its copy at the fork)
            _HELD.discard(fd)
            os.close(fd)  # releases the lock


def file_digest(path: Path, hasher: Any) -> str:
    """The hex digest of a file's bytes by `hasher` (hashlib's or xxhash's), read in 4 MB pieces."""
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            hasher.update(chunk)
    return hasher.hexdigest()


def lock_while_writing(fd: int) -> None:
    """Hold an flock on scratch a process is writing (a file or folder, by its open `fd`) until the
    descriptor is closed: `abandoned` then tells a killed writer's leftover from a live one's."""
    fcntl.flock(fd, fcntl.LOCK_EX)


def abandoned(path: Path, min_age_s: float = 60.0) -> bool:
    """Whether scratch `path` has no writer left: none holds its lock (`lock_while_writing`; a
    SIGKILLed writer's lock went with it) and it is older than `min_age_s` (the moment between its
    creation and its writer's lock). A link is never scratch of ours."""
    try:
        if path.is_symlink() or time.time() - path.stat().st_mtime < min_age_s:
            return False
        # Written for a file: an exclusive flock on NFS (byte-range locks underneath) needs it.
        mode = os.O_RDONLY | os.O_DIRECTORY if path.is_dir() else os.O_RDWR
        fd = os.open(path, mode | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def umask() -> int:
    """This process's umask, read without setting it (os.umask sets it, for every thread) where
    Linux says it (/proc/self/status, since 4.7)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0)
    os.umask(mask)
    return mask


def as_umask_allows(paths: Iterable[Path]) -> None:
    """Open to group and others, as far as the umask allows, the `.safetensors` files among
    `paths` that only their owner may read: safetensors writes its files 0600, and a host user of
    another uid than the container's (the image runs as uid 1000) read every file of a run but its
    weights (a review saw it). Only those: a fork's own files keep the modes it gave them (a first
    version set every file to 0644, which took a script's exec bit). Links are left alone."""
    mask = umask()
    for path in paths:
        if path.suffix != ".safetensors" or path.is_symlink() or not path.is_file():
            continue
        mode = path.stat().st_mode & 0o777
        if mode & 0o077 == 0:
            owner = mode & 0o700
            os.chmod(path, (mode | owner >> 3 | owner >> 6) & ~mask & 0o777 | owner)
