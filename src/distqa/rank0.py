"""Rank 0 does the file work, and every rank learns how it went.

Files in output_dir (the run lock, config.yaml, a checkpoint's folder, the exported model) are
written by rank 0 alone. If rank 0 then failed on its own, the other ranks would wait in their next
collective until a timeout, and the user would read a hang instead of the reason. So rank 0's
outcome is broadcast: each rank raises the same one-line error, or none does. Every rank must
call these functions, in the same order (each is one broadcast).
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from distqa.dist import DistInfo, all_gather_objects, broadcast_object
from distqa.errors import DistqaError

T = TypeVar("T")


def raise_on_every_rank(problem: str | DistqaError | None) -> None:
    """Rank 0's outcome to every rank (`problem` from rank 0; what the others pass is ignored):
    each raises the same one line, or none does. A DistqaError keeps its class (a ConfigError
    stays one)."""
    problem = broadcast_object(problem)  # type: ignore[assignment]
    if isinstance(problem, DistqaError):
        raise problem
    if problem:
        raise DistqaError(str(problem))


def raise_on_any_rank(problem: DistqaError | None, info: DistInfo) -> None:
    """Each rank's own outcome to every rank: if any rank has a problem, every rank raises one
    (its own, or the lowest failing rank's), so none goes on alone into a collective."""
    found = all_gather_objects(problem, info)
    if problem is not None:
        raise problem  # this rank's own: it keeps its cause
    first = next((p for p in found if p is not None), None)
    if first is not None:
        raise first


def on_rank0(
    info: DistInfo,
    work: Callable[[], T],
    *,
    failure: Callable[[BaseException], str] | None = None,
    catch: tuple[type[BaseException], ...] = (OSError,),
    error: type[DistqaError] = DistqaError,
) -> T | None:
    """Rank 0 runs `work()`; every rank returns its result (broadcast, so it must pickle) or raises
    its error. A DistqaError raised by `work` is passed on as it is; an error of a `catch` type
    becomes `error(failure(err))`, one line naming the file and the fix (without `failure`, it
    propagates on rank 0 alone: a bug, not the user's problem, and keeps its traceback)."""
    result: T | None = None
    problem: DistqaError | None = None
    if info.is_main:
        try:
            result = work()
        except DistqaError as err:
            problem = err
        except catch as err:
            if failure is None:
                raise
            problem = error(failure(err))
            problem.__cause__ = err  # (rank 0's own copy, which it raises: DISTQA_DEBUG shows the cause)
    result, problem = broadcast_object((result, problem))  # type: ignore[misc]
    if problem is not None:
        raise problem
    return result


def reason(err: BaseException) -> str:
    """The first line of why an operation failed: an OSError's own text (`No space left on
    device`) without the path, which the message names itself, else the error's first line."""
    return getattr(err, "strerror", None) or (str(err).strip().splitlines() or [type(err).__name__])[0]


def with_free_space(text: str, folder: Path) -> str:
    """`text` with the free space in `folder`: a full disk shows in some writers' errors only as a
    short write, so the number says what the error may not."""
    with contextlib.suppress(OSError):
        text += f"; {shutil.disk_usage(folder).free / 2**20:.1f} MiB free there"
    return text


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NOT_ALLOWED = (errno.EACCES, errno.EPERM, errno.EROFS)


def _errno(err: BaseException | None) -> int | None:
    """The errno of `err` or of the OSError it was raised from (torch and safetensors wrap theirs)."""
    while err is not None:
        if isinstance(err, OSError) and err.errno is not None:
            return err.errno
        err = err.__cause__ or err.__context__
    return None


def fix_for(err: BaseException, where: str = "output_dir") -> str:
    """What to do about a write into `where` that failed with `err`, chosen by its errno: free
    space (a full disk or quota), make it writable (no permission, a read-only mount), or fix what
    the error names (a file where a folder must be, an I/O error). A write error without an errno
    (torch's and safetensors' own, on a short write) is most often a full disk."""
    code = _errno(err)
    if code is None or code in _NO_SPACE:
        return f"free space in {where}"
    if code in _NOT_ALLOWED:
        return f"make {where} writable (its permissions, or a read-only mount)"
    return f"fix what the error names in {where}"
