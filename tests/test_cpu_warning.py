"""A slow set-up on the CPU (bf16/fp16, or a model over 100M parameters) is said before the first
step and, once it ends, in one line with its FLOPs, its time, the time to expect and what to try
instead; every run reports its first step at once. Forced through a toy model in bf16."""

from __future__ import annotations

import re

from distqa.flops import ModelShape
from distqa.registry import load_config
from distqa.slow_start import BIG_MODEL, estimate_line, slow_reasons, step_flops
from distqa.trainer import train
from toy_task import ToyClassificationTask


def test_which_set_ups_are_slow():
    assert slow_reasons("cuda", "bf16", 10 * BIG_MODEL) == []
    assert slow_reasons("cpu", "fp32", BIG_MODEL) == []
    assert slow_reasons("cpu", "fp16", 1000) == ["fp16 (emulated on most CPUs: slower than fp32)"]
    assert slow_reasons("cpu", "fp32", 110_000_000) == ["110M parameters"]


class ShapedTask:
    def model_shape(self, model):
        return ModelShape(non_embedding_params=1000, layers=2, hidden_size=8)


def test_the_estimate_comes_from_the_flop_count_and_the_measured_step():
    flops = step_flops(ShapedTask(), None, samples=4, tokens=4 * 512)
    assert flops == (6 * 1000 + 12 * 2 * 512 * 8) * 4 * 512
    cfg = load_config(None, ["model.name=bert-base-random", "task.max_seq_len=512", "train.precision=bf16"])
    line = estimate_line(["bf16", "110M parameters"], 90.0, 2.7e12, 40, cfg)
    assert line == (
        "warning: step 1: 2.7 TFLOP in 90.0 s (30 GFLOP/s) on the CPU with bf16, 110M parameters: expect up to "
        "90 s per step, 1h00m for the 40 steps left; to go faster try task.max_seq_len=128 (now 512), "
        "model.name=tiny, train.precision=fp32, or a GPU"
    )


class ShapedToyTask(ToyClassificationTask):
    """The toy task with a shape for the FLOPs formula, and each feature counted as a token."""

    def count_tokens(self, batch):
        return batch["features"].numel()

    def model_shape(self, model):
        return ModelShape(non_embedding_params=sum(p.numel() for p in model.parameters()), layers=2, hidden_size=32)


TOY = ["task.size=64", "data.num_workers=0", "train.batch_size=4", "train.max_steps=2", "train.log_every=10"]


def test_a_bf16_run_on_the_cpu_says_so_before_and_after_its_first_step(tmp_path, capsys):
    task = "task.name=test_cpu_warning:ShapedToyTask"
    train(load_config(None, [task, *TOY, "train.precision=bf16", f"output_dir={tmp_path / 'a'}"]))
    lines = capsys.readouterr().out.splitlines()
    before = next(i for i, line in enumerate(lines) if line.startswith("warning: training on the CPU with bf16"))
    first = next(i for i, line in enumerate(lines) if line.startswith("first step done in "))
    estimate = [line for line in lines if line.startswith("warning: step 1: ")]
    assert before < first and len(estimate) == 1, lines
    # 4 examples of 16 "tokens": (6 x 676 parameters + 12 x 2 layers x 16 x 32) x 64 FLOPs.
    flops = (6 * 676 + 12 * 2 * 16 * 32) * 64
    assert re.fullmatch(
        rf"warning: step 1: {flops / 1e9:.3g} GFLOP in [0-9.]+ s \([0-9.e+-]+ GFLOP/s\) on the CPU with bf16 "
        r"\(emulated on most CPUs: slower than fp32\): expect up to [0-9.e+-]+ s per step, 0m0\ds for the 1 steps left;"
        r" to go faster try train.precision=fp32, or a GPU",
        estimate[0],
    ), estimate[0]
    # Resumed at step 2 (of 3): the lines name the step that runs first, not "step 1".
    train(load_config(None, [task, *TOY, "train.precision=bf16", "train.max_steps=3", f"output_dir={tmp_path / 'a'}"]))
    resumed = capsys.readouterr().out
    assert "steps may take minutes; step 3 is running" in resumed and "warning: step 3: " in resumed, resumed
    # fp32: nothing to warn about, and the first step (no log step) is still reported at once.
    train(load_config(None, [task, *TOY, f"output_dir={tmp_path / 'b'}"]))
    out = capsys.readouterr().out
    assert "warning: " not in out and re.search(r"^first step done in [0-9.]+ s \(step 1/2\)$", out, re.M)
