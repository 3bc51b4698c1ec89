"""A damaged metrics.jsonl never blocks a resume or the plot: damaged lines are skipped with one
warning naming them, good lines up to the resume step are kept byte for byte."""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conftest import SMALL
from distqa.dist import DistInfo
from distqa.metrics import MetricsWriter, plot_metrics
from distqa.registry import load_config
from distqa.trainer import train

MAIN = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))

# Lines that once raised on every resume, and a few more of the kind a crash or an editor leaves.
NAMED_DAMAGE = [
    b"[]",
    b"5",
    b'"x"',
    b"null",
    b"",
    b'{"step": "3"}',
    b'{"step": true}',
    b'{"step": null}',
    b'{"loss": 1.0}',
    b'{"step": NaN}',
    b'{"step": 1e999}',
    '{"step": 1}'.encode("utf-16"),  # json.loads of bytes would decode it; metrics.jsonl is UTF-8
    b'{"step": 2, "lo',  # cut short mid-write
    b"[" * 100_000,  # deep enough to exhaust the JSON parser's recursion
    b'{"step": 1' + b"0" * 400 + b"}",  # a step too large for a float (it was a traceback)
]


def is_record(raw: bytes) -> bool:
    """Whether arbitrary bytes happen to form a good line (then they are not damage)."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return False
    step = record.get("step") if isinstance(record, dict) else None
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        return False
    return abs(step) < 2**63 if isinstance(step, int) else math.isfinite(step)


def good_line(step: int, loss: float) -> bytes:
    # Spacing and key order of a hand-edited line: kept lines must come back byte for byte.
    return b'{"loss":%r,  "step": %d}' % (loss, step)


junk = st.one_of(st.sampled_from(NAMED_DAMAGE), st.binary(max_size=80).map(lambda b: b.replace(b"\n", b"")))


def metrics_file(draw_steps: list[int], junk_after: list[list[bytes]]) -> tuple[bytes, list[bytes], list[int]]:
    """The file's bytes, its good lines in order, and the line numbers of the junk lines."""
    lines: list[bytes] = []
    good: list[bytes] = []
    damaged: list[int] = []
    for i, step in enumerate(draw_steps):
        good.append(good_line(step, step / 7))
        lines.append(good[-1])
        for extra in junk_after[i]:
            lines.append(extra)
            damaged.append(len(lines))
    return b"".join(line + b"\n" for line in lines), good, damaged


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(st.integers(0, 12), min_size=0, max_size=8),
    junk_lines=st.lists(st.lists(junk, max_size=3), min_size=8, max_size=8),
    resume_step=st.integers(0, 12),
)
def test_resume_keeps_exactly_the_good_lines_up_to_the_resume_step(steps, junk_lines, resume_step):
    assume(not any(is_record(j) for js in junk_lines for j in js))
    data, good, damaged = metrics_file(steps, junk_lines)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        (out / "metrics.jsonl").write_bytes(data)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            MetricsWriter(out, MAIN, resume_step=resume_step).close()
        kept = [line for line, step in zip(good, steps) if step <= resume_step]
        assert (out / "metrics.jsonl").read_bytes() == b"".join(line + b"\n" for line in kept)
        warnings = printed.getvalue().splitlines()
        if damaged:
            shown = ", ".join(map(str, damaged[:10])) + (", ..." if len(damaged) > 10 else "")
            assert warnings == [
                f"warning: {out / 'metrics.jsonl'}: skipped {len(damaged)} damaged line(s) (lines {shown})"
            ]
        else:
            assert warnings == []


def test_a_last_line_without_its_newline_is_kept_and_ended(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(good_line(1, 0.5) + b"\n" + good_line(2, 0.25))  # the newline never written
    MetricsWriter(tmp_path, MAIN, resume_step=2).close()
    assert path.read_bytes() == good_line(1, 0.5) + b"\n" + good_line(2, 0.25) + b"\n"
    assert capsys.readouterr().out == ""
    # Resuming past the end appends after the kept lines, not onto the last one.
    writer = MetricsWriter(tmp_path, MAIN, resume_step=2)
    writer.log({"step": 3, "loss": 0.125})
    writer.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


@pytest.mark.safety  # about 4 s: make test-safety, for make test's 5 minutes
@settings(max_examples=12, deadline=None)
@given(
    steps=st.lists(st.integers(0, 12), max_size=5),
    junk_lines=st.lists(st.lists(junk, max_size=2), min_size=5, max_size=5),
    values=st.sampled_from([1.0, None, "x", [], True, {"a": 1}]),
)
def test_plot_is_drawn_from_the_good_lines_or_not_at_all(steps, junk_lines, values):
    assume(not any(is_record(j) for js in junk_lines for j in js))
    data, _, damaged = metrics_file(steps, junk_lines)
    with tempfile.TemporaryDirectory() as folder:
        metrics, png = Path(folder) / "metrics.jsonl", Path(folder) / "metrics.png"
        # A good line whose fields have the wrong types is a gap in the curves, not a crash.
        odd = json.dumps({"step": 13, "loss": values, "lr": values, "eval_micro_f1": values}).encode()
        metrics.write_bytes(data + (odd + b"\n" if steps else b""))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            plot_metrics(metrics, png)
        assert png.is_file() == bool(steps)
        assert printed.getvalue().count("warning:") == (1 if damaged else 0)


def in_process(out: Path, *extra: str) -> None:
    """A tiny training run in this process (no torchrun): milliseconds a step on one core."""
    settings = [*SMALL, "train.batch_size=2", "train.lr=1e-3", "train.lr_schedule=constant", "train.warmup_ratio=0"]
    train(load_config(None, [*settings, f"output_dir={out}", *extra]))


@pytest.mark.safety  # about 4 s: make test-safety, for make test's 5 minutes
def test_resume_over_garbage_in_metrics_completes_with_every_step_once(tmp_path, capsys):
    out = tmp_path / "run"
    in_process(out, "train.max_steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=0")
    metrics = out / "metrics.jsonl"
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4]
    # Resume from step 2, so that the lines of steps 3 and 4 must go, and after them garbage.
    shutil.rmtree(out / "checkpoints" / "step-4")
    garbage = [b"[]", b"5", b'"x"', b"null", b'{"step": "3"}', b'{"step": true}', b"\xff\xfe\x00\x9c"]
    garbage.append(b'{"step": 1' + b"0" * 400 + b"}")
    with metrics.open("ab") as f:
        f.write(b"\n".join(garbage) + b'\n{"step": 9, "lo')
    capsys.readouterr()
    in_process(out, "train.max_steps=6", "train.checkpoint_every=2", "train.keep_checkpoints=0")
    printed = capsys.readouterr().out
    assert "resumed from" in printed and "step-2" in printed
    assert f"warning: {metrics}: skipped 9 damaged line(s) (lines 5, 6, 7, 8, 9, 10, 11, 12, 13)" in printed
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert (out / "metrics.png").is_file() and (out / "model").is_dir()
