"""The settings `distqa bench` runs the trainer with (`distqa.bench.worker._bench_config`): only
steady-state training steps are timed."""

from __future__ import annotations

import argparse

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
