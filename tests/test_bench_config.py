"""The settings `distqa bench` runs the trainer with (`distqa.bench.worker._bench_config`): only
steady-state training steps are timed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from distqa.bench.worker import _bench_config


def bench_args(tmp_path, *overrides: str, warmup: int = 5, steps: int = 20) -> argparse.Namespace:
    return argparse.Namespace(
        config=None, overrides=list(overrides), dp_gpus=0, output_dir=str(tmp_path), warmup=warmup, steps=steps
    )


@pytest.mark.parametrize("warmup, start", [(5, 5), (12, 10), (2, 2)])
def test_powersgd_compresses_every_timed_step(tmp_path, capsys, warmup, start):
    """PowerSGD all-reduces uncompressed for train.powersgd_start_step steps (10): with bench's 5
    warm-up steps, timed steps 6 to 10 were plain all-reduce, counted as PowerSGD's."""
    cfg = _bench_config(bench_args(tmp_path, "train.ddp_comm_hook=powersgd", warmup=warmup))
    assert cfg.train.powersgd_start_step == start and cfg.train.max_steps == warmup + 20
    said = capsys.readouterr().out
    assert (f"PowerSGD starts after the {warmup} warm-up steps" in said) == (start < 10), said
    # A start the user set within the warm-up stays; other hooks are left alone.
    kept = _bench_config(bench_args(tmp_path, "train.ddp_comm_hook=powersgd", "train.powersgd_start_step=3"))
    assert kept.train.powersgd_start_step == 3
    assert _bench_config(bench_args(tmp_path, "train.ddp_comm_hook=fp16")).train.powersgd_start_step == 10


def test_mfu_of_fp32_without_tf32_is_not_taken_against_the_tf32_peak():
    """train.deterministic leaves TF32 off (full fp32 matmuls, 67 TFLOP/s on an H100 against 494.7):
    MFU against the TF32 peak read 7 times too low. Without an fp32 peak in the table it is left out."""
    from conftest import bench_result
    from distqa.bench.report import summarize

    tf32 = summarize(1, [bench_result(1.0, precision="fp32", fp32_matmul="high")], [], None)
    assert tf32["peak_tflops_per_process"] == 494.7 and tf32["mfu"] > 0
    full = summarize(1, [bench_result(1.0, precision="fp32", fp32_matmul="highest")], [], None)
    assert full["peak_tflops_per_process"] is None and full["mfu"] is None
    v100 = bench_result(1.0, precision="fp32", fp32_matmul="highest", device="Tesla V100-SXM2")
    assert summarize(1, [v100], [], None)["peak_tflops_per_process"] == 15.7
    # bf16 runs are not affected by the fp32 setting; an older result without the field reads as TF32.
    assert summarize(1, [bench_result(1.0, fp32_matmul="highest")], [], None)["peak_tflops_per_process"] == 989.4
    assert summarize(1, [bench_result(1.0, precision="fp32")], [], None)["peak_tflops_per_process"] == 494.7


def test_a_hang_up_ignored_as_under_nohup_stays_ignored():
    """The bench stops its launch on a SIGTERM or SIGHUP, but not on a hang-up nohup told it to ignore."""
    import signal

    from distqa.bench.launch import _launches_stopped_on_signals

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with _launches_stopped_on_signals(Path("out"), []):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert callable(signal.getsignal(signal.SIGTERM))  # the bench's own handler
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_signal_after_bench_json_was_written_says_it_was():
    """--profile's launches come after bench.json: a SIGTERM during them said "no bench.json
    written" of a file that was there, whole (a review)."""
    import signal

    from distqa.bench.launch import _launches_stopped_on_signals, _Signalled
    from distqa.errors import DistqaError

    for written, said in (([], "no bench.json written"), ([Path("out/bench.json")], "out/bench.json written")):
        with pytest.raises(DistqaError) as stopped, _launches_stopped_on_signals(Path("out"), written):
            raise _Signalled(signal.SIGTERM)
        assert str(stopped.value) == f"bench stopped by SIGTERM, its launch with it: {said} (logs in out/runs)"
        assert stopped.value.exit_code == 143
