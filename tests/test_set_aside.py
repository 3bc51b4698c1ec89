"""Setting aside the later line of checkpoints (train.resume=an earlier step-N) loses nothing,
whatever stops it: a full disk, an error during the moves, or a SIGKILL at any point, followed by
a second try and the trainer cutting metrics.jsonl back to step N. On a made-up run folder: fast."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from conftest import fill, tmpfs
from distqa.dist import DistInfo
from distqa.errors import DistqaError
from distqa.resume import choose_checkpoint
from distqa.set_aside import set_aside_other_line

ONE = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
OTHER_CONFIG, UP_TO_STEP_4 = "train:\n  lr: 0.02\n", "train:\n  lr: 0.01\n"


def made_up_run(out: Path) -> None:
    """6 steps, a checkpoint every 2, `best` at step 4, and a resume at step 4 with other settings."""
    for step in (2, 4, 6):
        (out / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (out / "checkpoints" / f"step-{step}" / "trainer_state.json").write_text(json.dumps({"step": step}))
    os.symlink("step-4", out / "checkpoints" / "best")
    (out / "model").mkdir()
    (out / "model" / "model.safetensors").write_bytes(b"the other line's model")
    (out / "metrics.png").write_bytes(b"png")
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    (out / "config.yaml").write_text(OTHER_CONFIG)
    (out / "config-history").mkdir()
    (out / "config-history" / "4.yaml").write_text(UP_TO_STEP_4)


def set_aside(out: Path) -> Path | None:
    step2 = out / "checkpoints" / "step-2"
    return set_aside_other_line(out, step2, str(step2), ONE)


def resume_writes(out: Path) -> None:
    """What the trainer then does to the records: metrics.jsonl cut back to step 2."""
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 3)))


def check_nothing_lost(out: Path) -> None:
    """Everything of the other line is in earlier-runs/ (maybe split over two tries' folders), and
    output_dir holds step-2's line with the settings that trained up to step 2."""
    folders = [p for p in (out / "earlier-runs").iterdir()]
    assert all(not p.name.startswith(".") for p in folders)  # no staging folder left
    everything = {str(p.relative_to(f)): p for f in folders for p in f.rglob("*")}
    assert {"checkpoints/step-4", "checkpoints/step-6", "model", "metrics.png", "config-history/4.yaml"} <= set(
        everything
    )
    assert os.readlink(everything["checkpoints/best"]) == "step-4"
    metrics = [p.read_text() for f in folders for p in [f / "metrics.jsonl"] if p.exists()]
    assert any(len(text.splitlines()) == 6 for text in metrics)  # steps 3-6 of the records kept
    assert OTHER_CONFIG in [p.read_text() for f in folders for p in [f / "config.yaml"] if p.exists()]
    assert sorted(os.listdir(out / "checkpoints")) == ["step-2"]
    assert not (out / "model").exists() and not (out / "metrics.png").exists()
    assert (out / "config.yaml").read_text() == UP_TO_STEP_4
    assert not (out / "config-history").exists() or os.listdir(out / "config-history") == []


class Killed(BaseException):
    """A SIGKILL: nothing after it runs, no cleanup either (the test goes on with a copy of the
    folder as the kill left it)."""


@contextlib.contextmanager
def each_rename(before: Callable[[int], None]) -> Iterator[None]:
    """os.rename and os.replace patched: each call's number (1-based) goes to `before` first, which
    may raise instead of the rename."""
    calls = 0

    def wrapped(real):
        def call(*args, **kwargs):
            nonlocal calls
            calls += 1
            before(calls)
            return real(*args, **kwargs)

        return call

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "rename", wrapped(os.rename))
        patch.setattr(os, "replace", wrapped(os.replace))
        yield


def renames_of_a_set_aside(tmp_path: Path) -> int:
    out = tmp_path / "count"
    made_up_run(out)
    calls: list[int] = []
    with each_rename(calls.append):
        set_aside(out)
    return len(calls)


def stopped_set_aside(out: Path, snapshot: Path, at: int, stop: str) -> BaseException:
    """A set-aside of `out` stopped at its `at`-th rename (0-based): killed (`out` as the kill left
    it copied to `snapshot`) or failed; what it raised."""

    def stopping(call: int) -> None:
        if call == at + 1:
            if stop == "error":
                raise OSError(5, "Input/output error")
            shutil.copytree(out, snapshot, symlinks=True)
            raise Killed

    with each_rename(stopping), pytest.raises(Killed if stop == "kill" else DistqaError) as raised:
        set_aside(out)
    return raised.value


@pytest.mark.parametrize("stop", ["kill", "error"])
def test_a_set_aside_stopped_at_any_rename_loses_nothing_and_a_second_try_completes_it(tmp_path, stop):
    """Every os.rename/os.replace of a set-aside (the copies' and the moves'), in turn: a SIGKILL just
    before it, or an error instead of it (moved back: output_dir as it was)."""
    total = renames_of_a_set_aside(tmp_path)
    assert total >= 9  # the copies, then the moves
    for at in range(total):
        out, snapshot = tmp_path / f"run-{at}", tmp_path / f"killed-{at}"
        made_up_run(out)
        before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
        raised = stopped_set_aside(out, snapshot, at, stop)
        if stop == "error":
            assert str(raised).startswith(f"cannot move the checkpoints after train.resume={out}")
            assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if "earlier-runs" not in p.parts) == before
            assert not list((out / "earlier-runs").iterdir())
            snapshot = out
        set_aside(snapshot)  # the second try (when nothing later was left, it has nothing to do)
        resume_writes(snapshot)
        check_nothing_lost(snapshot)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs (root only)."""
    with tmpfs(tmp_path / "disk", "size=64k", "a full disk (a tmpfs mount)") as disk:
        yield disk


def test_a_full_disk_while_setting_a_line_aside_moves_nothing_and_a_second_try_completes(tiny_disk):
    out = tiny_disk / "run"
    made_up_run(out)
    before = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    filler = fill(tiny_disk, chunk=1024)
    with pytest.raises(DistqaError, match=r"aside \(No space left on device\): nothing was lost; free space in"):
        set_aside(out)
    assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    filler.unlink()
    assert set_aside(out) is not None
    resume_writes(out)
    check_nothing_lost(out)


def test_auto_moves_records_without_a_step_folder_aside_instead_of_overwriting_them(tmp_path, capsys):
    """A run folder whose checkpoints/ a user deleted: `auto` starts from step 0, as before, but
    only once the earlier records are in earlier-runs/<time>/ (as with `never`), said in one line."""
    out = tmp_path / "run"
    made_up_run(out)
    shutil.rmtree(out / "checkpoints")
    (out / "tb").mkdir()
    names = sorted(os.listdir(out))
    assert choose_checkpoint(out, "auto", ONE) is None
    moved = next((out / "earlier-runs").iterdir())
    assert sorted(os.listdir(moved)) == names and os.listdir(out) == ["earlier-runs"]
    said = capsys.readouterr().out
    assert said == (
        f"train.resume=auto: {out} holds an earlier run's records but no checkpoint to continue from: they "
        f"were moved to {moved}, and this run starts from step 0\n"
    )
    # Nothing of a run there (a folder made for it, a config.yaml of a run stopped before its first
    # step): nothing to move, nothing said.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.yaml").write_text(OTHER_CONFIG)
    assert choose_checkpoint(fresh, "auto", ONE) is None
    assert os.listdir(fresh) == ["config.yaml"] and capsys.readouterr().out == ""


def _tree(folder: Path) -> dict[str, bytes | str]:
    """Every path under `folder`: a file's bytes, a link's target, a folder's "dir"."""
    found: dict[str, bytes | str] = {}
    for path in folder.rglob("*"):
        name = str(path.relative_to(folder))
        found[name] = os.readlink(path) if path.is_symlink() else "dir" if path.is_dir() else path.read_bytes()
    return found


def _whole_run(out: Path) -> dict[str, bytes | str]:
    made_up_run(out)
    (out / "tb").mkdir()
    (out / "tb" / "events.out.tfevents.1").write_bytes(b"the earlier run's curves")
    return _tree(out)


@pytest.mark.parametrize("then", ["never", "auto"])
def test_a_whole_run_move_killed_at_any_rename_is_moved_back_at_the_next_start(tmp_path, then):
    """train.resume=never moves a whole run aside by renames. A SIGKILL before any one of them
    leaves the run half moved; the next start (the same command, or `auto`) first moves it back,
    so `never` sets it aside whole in one folder, and `auto` sees the run as it was (here: no
    usable checkpoint, the made-up ones have no manifest), with nothing left in output_dir for a
    new run to write into (tb/ events of two runs in one folder)."""
    calls: list[int] = []
    _whole_run(tmp_path / "count")
    with each_rename(calls.append):
        choose_checkpoint(tmp_path / "count", "never", ONE)
    assert len(calls) == 8  # seven of the run's paths, then the folder's own rename
    for at in range(len(calls)):
        out, snapshot = tmp_path / f"run-{at}", tmp_path / f"killed-{at}"
        before = _whole_run(out)

        def kill(call: int, at: int = at, out: Path = out, snapshot: Path = snapshot) -> None:
            if call == at + 1:
                shutil.copytree(out, snapshot, symlinks=True)
                raise Killed

        with each_rename(kill), pytest.raises(Killed):
            choose_checkpoint(out, "never", ONE)
        if then == "never":
            assert choose_checkpoint(snapshot, "never", ONE) is None
            (moved,) = (snapshot / "earlier-runs").iterdir()
            assert not moved.name.startswith(".") and _tree(moved) == before
            assert os.listdir(snapshot) == ["earlier-runs"]
        else:
            with pytest.raises(DistqaError, match="no usable checkpoint"):
                choose_checkpoint(snapshot, "auto", ONE)
            assert {k: v for k, v in _tree(snapshot).items() if not k.startswith("earlier-runs")} == before
            assert os.listdir(snapshot / "earlier-runs") == []


def test_a_whole_run_move_that_fails_moves_back_what_it_moved(tmp_path, capsys):
    out = tmp_path / "run"
    before = _whole_run(out)

    def fail(call: int, code: int = 5) -> None:
        if call == 4:
            raise OSError(code, os.strerror(code))

    with each_rename(fail), pytest.raises(DistqaError, match=r"move an earlier run aside: Input/output error"):
        choose_checkpoint(out, "never", ONE)
    assert {k: v for k, v in _tree(out).items() if not k.startswith("earlier-runs")} == before
    assert os.listdir(out / "earlier-runs") == []
    assert "was stopped" not in capsys.readouterr().out  # an error, not a kill: nothing to say of one
    # earlier-runs/ on another filesystem (a mount): renames cannot cross; said so, nothing moved.
    with each_rename(lambda call: fail(call, errno.EXDEV)), pytest.raises(DistqaError, match="another filesystem"):
        choose_checkpoint(out, "never", ONE)
    assert {k: v for k, v in _tree(out).items() if not k.startswith("earlier-runs")} == before
    # Where a file is both in the stopped move and back in output_dir: refused before moving any.
    stopped = out / "earlier-runs" / ".moving-20261127-100000"
    stopped.mkdir()
    (stopped / "a-first").write_text("moved back first, were the clash not checked first")
    (stopped / "metrics.jsonl").write_text("the stopped move's copy")
    with pytest.raises(DistqaError, match=r"and .*metrics.jsonl exists too: nothing was moved or lost"):
        choose_checkpoint(out, "never", ONE)
    assert sorted(os.listdir(stopped)) == ["a-first", "metrics.jsonl"] and not (out / "a-first").exists()


def test_a_checkpoint_named_inside_a_stopped_move_is_refused_naming_where_it_is_back(tmp_path):
    out = tmp_path / "run"
    _whole_run(out)

    def kill(call: int) -> None:
        if call == 4:  # config.yaml, metrics.jsonl and checkpoints/ are in the move's folder
            raise Killed

    with each_rename(kill), pytest.raises(Killed):
        choose_checkpoint(out, "never", ONE)
    (stopped,) = (out / "earlier-runs").iterdir()
    named = stopped / "checkpoints" / "step-4"
    with pytest.raises(DistqaError, match=rf"it is back at {out / 'checkpoints' / 'step-4'}: name that"):
        choose_checkpoint(out, str(named), ONE)
    assert (out / "checkpoints" / "step-4").is_dir() and not stopped.exists()
