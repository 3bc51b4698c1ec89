"""A write into output_dir that fails is one line on every rank, with the advice its error calls for:
free space for a full disk, permissions for a refused write, the error itself otherwise. Fast: each
write is made to fail where it happens (a tmpfs for a full disk needs root)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import fill, tmpfs
from distqa.dist import DistInfo
from distqa.errors import DistqaError
from distqa.metrics import MetricsWriter
from distqa.outdir import claim, export_atomically
from distqa.rank0 import fix_for
from distqa.runlock import LOCK_NAME
from test_output_safety import save

ONE = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))

ADVICE = {
    "space": "free space in {where}",
    "permissions": "make {where} writable (its permissions, or a read-only mount)",
    "other": "fix what the error names in {where}",
}
ERRORS = {
    "full disk": (OSError(errno.ENOSPC, "No space left on device"), "space"),
    "over quota": (OSError(errno.EDQUOT, "Disk quota exceeded"), "space"),
    "no permission": (PermissionError(errno.EACCES, "Permission denied"), "permissions"),
    "not permitted": (PermissionError(errno.EPERM, "Operation not permitted"), "permissions"),
    "read-only": (OSError(errno.EROFS, "Read-only file system"), "permissions"),
    "a file in the way": (NotADirectoryError(errno.ENOTDIR, "Not a directory"), "other"),
    "an I/O error": (OSError(errno.EIO, "Input/output error"), "other"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_the_final_export_s_advice_follows_the_error(tmp_path, case):
    err, kind = ERRORS[case]

    def save_failing(folder: Path) -> None:
        folder.mkdir()
        raise err

    note = "the final checkpoint holds the same weights: {fix} and run the same command again"
    with pytest.raises(DistqaError) as raised:
        export_atomically(save_failing, tmp_path / "model", ONE, note)
    advice = ADVICE[kind].format(where=tmp_path)
    assert str(raised.value) == (
        f"cannot write {tmp_path / 'model'} ({err.strerror}): the final checkpoint holds the same weights: "
        f"{advice} and run the same command again"
    )
    assert os.listdir(tmp_path) == []  # no half export left


def test_a_checkpoint_that_cannot_be_written_for_a_file_in_the_way_is_no_space_problem(tmp_path):
    root = tmp_path / "checkpoints"
    root.write_text("a file where the checkpoints' folder must be")
    with pytest.raises(DistqaError) as raised:
        save(root, 1)
    message = str(raised.value)
    assert message.startswith(f"cannot write checkpoint {root / 'step-1'} (Not a directory")
    assert message.endswith(": fix what the error names in output_dir and run again to resume")
    assert "free space in output_dir" not in message


def test_a_full_disk_s_advice_names_the_checkpoints_that_may_go(tmp_path):
    """Not "lower train.keep_checkpoints": it prunes only after a save, so a rerun with it lowered
    trained the same steps again and failed at the same save."""
    from distqa.checkpoint import _cannot_write

    root = tmp_path / "checkpoints"
    save(root, 2)
    full = OSError(errno.ENOSPC, "No space left on device")
    assert _cannot_write(root / "step-4", root, full).endswith(
        "the previous checkpoint step-2 is intact: free space in output_dir and run again to resume"
    )
    save(root, 4)
    message = _cannot_write(root / "step-6", root, full)
    assert message.endswith(
        "the previous checkpoint step-4 is intact: free space in output_dir (the checkpoints before step-4 may be "
        "removed) and run again to resume"
    ), message
    assert "keep_checkpoints" not in message
    # The best model's folder is kept by pruning, and by this advice (it named it: a review).
    save(root, 6)
    (root / "best").symlink_to("step-2")
    assert _cannot_write(root / "step-8", root, full).endswith(
        "free space in output_dir (the checkpoints before step-6 may be removed, but not step-2: checkpoints/best "
        "names it) and run again to resume"
    )


@pytest.mark.parametrize("case", ERRORS)
def test_the_advice_is_chosen_by_errno_also_through_a_wrapping_error(case):
    err, kind = ERRORS[case]
    assert fix_for(err) == ADVICE[kind].format(where="output_dir")
    try:  # torch and safetensors raise their own error from the OSError
        raise RuntimeError("file write failed") from err
    except RuntimeError as wrapped:
        assert fix_for(wrapped) == fix_for(err)
    assert fix_for(RuntimeError("PytorchStreamWriter failed writing file")) == "free space in output_dir"


@pytest.fixture
def read_only_disk(tmp_path):
    """A read-only tmpfs (root only)."""
    with tmpfs(tmp_path / "ro", "ro,size=64k", "a read-only mount") as disk:
        yield disk


def test_a_checkpoint_on_a_read_only_disk_says_to_make_it_writable(read_only_disk):
    with pytest.raises(DistqaError) as raised:
        save(read_only_disk / "checkpoints", 1)
    message = str(raised.value)
    assert "(Read-only file system" in message and "free space" not in message
    assert message.endswith("make output_dir writable (its permissions, or a read-only mount) and run again to resume")


@pytest.fixture
def small_disk(tmp_path):
    """A 32 KiB tmpfs (root only), and a function that fills it."""
    with tmpfs(tmp_path / "disk", "size=32k", "a full disk (a tmpfs mount)") as disk:
        yield disk


AGAIN = ": free space in output_dir and run the same command again to resume"


def test_tensorboard_on_a_full_disk_is_one_line_when_opened_and_when_written(small_disk, monkeypatch):
    printed = []  # what Python would print for an error in a thread: TensorBoard's writer's is left out
    monkeypatch.setattr(threading, "excepthook", printed.append)
    with pytest.raises(DistqaError) as raised:  # tb/ on a disk full from the start
        fill(small_disk)
        MetricsWriter(small_disk, ONE)
    assert str(raised.value) == f"cannot write {small_disk / 'tb'} (No space left on device){AGAIN}"
    (small_disk / "filler").unlink()
    shutil.rmtree(small_disk / "tb", ignore_errors=True)
    writer = MetricsWriter(small_disk, ONE)
    writer.log({"step": 1, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0})  # each file has its first page
    fill(small_disk)
    with pytest.raises(DistqaError) as raised:  # metrics.jsonl's page still has room, tb/'s fills first
        for step in range(2, 200):
            writer.log({"step": step, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0})
    assert str(raised.value) == f"cannot write {small_disk / 'tb'} (No space left on device){AGAIN}"
    writer.abandon()
    assert printed == []


def test_tensorboard_s_folder_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "tb").write_text("a file where tb/ must be")
    with pytest.raises(DistqaError, match=rf"^cannot write {tmp_path / 'tb'} \(.+\): fix what the error names in"):
        MetricsWriter(tmp_path, ONE)


def test_cutting_metrics_back_on_a_full_disk_is_one_line_and_keeps_the_file(small_disk):
    records = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 7)).encode()
    (small_disk / "metrics.jsonl").write_bytes(records)
    fill(small_disk)
    with pytest.raises(DistqaError) as raised:
        MetricsWriter(small_disk, ONE, resume_step=2)
    assert str(raised.value) == f"cannot rewrite {small_disk / 'metrics.jsonl'} (No space left on device){AGAIN}"
    assert (small_disk / "metrics.jsonl").read_bytes() == records
    assert not (small_disk / "tb").exists()  # stopped before TensorBoard


def test_a_claim_that_fails_on_a_full_disk_leaves_no_empty_lock(small_disk):
    fill(small_disk)
    with pytest.raises(DistqaError) as raised:
        claim(small_disk, ONE)
    assert str(raised.value) == f"output_dir={str(small_disk)!r} cannot be written: No space left on device"
    assert not (small_disk / LOCK_NAME).exists()  # the next run would wait 60 s for "an unknown run"
    (small_disk / "filler").unlink()
    lock = claim(small_disk, ONE)  # at once
    assert lock is not None
    lock.release()


def test_a_claim_whose_write_fails_removes_its_own_file(tmp_path, monkeypatch):
    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(DistqaError, match="cannot be written: No space left on device$"):
        claim(tmp_path, ONE)
    assert os.listdir(tmp_path) == []


def test_two_exports_to_one_folder_at_once_each_finish_whole(tmp_path, capsys):
    """Both staged in .tmp-model: the second removed the first's folder while it was written, and
    the first then renamed the second's half-written one into place. Now the second waits."""
    started, second_called, errors = threading.Event(), threading.Event(), []

    def save(tag: str) -> Callable[[Path], None]:
        def write(folder: Path) -> None:
            folder.mkdir()
            (folder / "a").write_text(tag)
            if tag == "first":
                started.set()
                assert second_called.wait(10)
                time.sleep(0.5)  # the second is in export_atomically by now: it waits, or (unlocked) clobbers
            (folder / "b").write_text(tag)

        return write

    def export(tag: str) -> None:
        try:
            export_atomically(save(tag), tmp_path / "model", ONE, "{fix}")
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    first = threading.Thread(target=export, args=("first",))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=lambda: (second_called.set(), export("second")))
    second.start()
    first.join(30)
    second.join(30)
    assert errors == []
    assert f"waiting for another export to {tmp_path / 'model'}" in capsys.readouterr().out
    assert [(tmp_path / "model" / name).read_text() for name in ("a", "b")] == ["second", "second"]
    assert os.listdir(tmp_path) == ["model"]
    # A folder that does not exist yet (distqa export --output new/dir/model) is made, as before the lock.
    export_atomically(save("third"), tmp_path / "new" / "dir" / "model", ONE, "{fix}")
    assert (tmp_path / "new" / "dir" / "model" / "b").read_text() == "third"
