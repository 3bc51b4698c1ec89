"""A checkpoint written on the CPU holds no CUDA generator: restored on a GPU, the caller must seed
it per rank (CheckpointManager.restore), or every rank would draw the same dropout masks."""

from __future__ import annotations

import random

import torch

from distqa.checkpoint import capture_rng_state, restore_rng_state


def test_a_cpu_state_restores_everything_and_says_when_the_gpu_generator_is_missing():
    state = capture_rng_state(torch.device("cpu"))
    assert state["cuda"] is None
    expected = (random.random(), torch.rand(3))
    assert restore_rng_state(state, torch.device("cpu")) is True
    again = (random.random(), torch.rand(3))
    assert again[0] == expected[0] and torch.equal(again[1], expected[1])
    # On a GPU the CPU generators are restored all the same; the CUDA one is reported missing
    # (the check comes before any CUDA call, so it runs without a GPU too).
    assert restore_rng_state(state, torch.device("cuda", 0)) is False
    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])
