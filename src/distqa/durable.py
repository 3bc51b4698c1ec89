"""fsync, in a module that imports no torch, so that commands which only move files (`distqa split`)
can make their writes durable without loading the training stack."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's data (or a folder's entries) to the disk, so a crash cannot leave it empty
    or a rename pointing at nothing."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
