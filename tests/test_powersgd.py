"""distqa's PowerSGD reduction on gloo (`powersgd.reduce_on_gloo`) against torch's `powerSGD_hook`:
the same reduced gradients and the same state, step after step, at one and at two processes."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from conftest import Bucket
from distqa.powersgd import reduce_on_gloo

# Shapes as in a BERT bucket: matrices PowerSGD compresses (two of one shape: torch groups P and Q
# by shape), and biases and a small matrix it sends whole.
SHAPES = [(40, 24), (40,), (40, 24), (16, 40), (3, 2), (16,)]
STEPS, START = 6, 2


def _state(rank: int = 4) -> powerSGD_hook.PowerSGDState:
    return powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=START, warm_start=True, random_seed=0
    )


def _both(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's reduced bucket from torch's hook and from distqa's, given this rank's gradients."""
    ours, theirs, out = _state(), _state(), []
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        grads = [torch.randn(shape, generator=generator) for shape in SHAPES]
        want = powerSGD_hook.powerSGD_hook(theirs, Bucket(grads)).wait()
        got = reduce_on_gloo(ours, Bucket(grads))
        out.append((want.clone(), got.clone()))
    for memory in ("error_dict", "p_memory_dict", "q_memory_dict"):
        a, b = getattr(theirs, memory)[0], getattr(ours, memory)[0]
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (memory, (a - b).abs().max())
    assert ours.iter == theirs.iter == STEPS
    return out


def _check(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for step, (want, got) in enumerate(pairs):
        assert torch.allclose(want, got, rtol=1e-4, atol=1e-5), (step, (want - got).abs().max())
    # PowerSGD did run: after its start, the reduction is not the (mean) gradient itself.
    assert pairs[START][0].abs().sum() > 0


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_the_result_does_not_move_with_the_gradient_s_place_in_the_bucket(group, rank):
    """A resume lays gradients out in other buckets (other offsets, other memory alignment) and
    must still reduce them bitwise as the uninterrupted run did. (Rank 1: a matrix-vector product,
    whose result moves with the alignment unless the matrix is copied.)"""
    generator = torch.Generator().manual_seed(7)
    steps = [torch.randn(512, 128, generator=generator) for _ in range(STEPS)]
    results = []
    for before in (0, 3, 5, 16):  # floats of another gradient ahead of it in the bucket
        state, reduced = _state(rank), []
        for grad in steps:
            bucket = Bucket([torch.ones(before), grad] if before else [grad])
            reduce_on_gloo(state, bucket)
            reduced.append(bucket.gradients()[-1].clone())
        results.append(reduced)
    assert not torch.equal(results[0][-1], steps[-1])  # compressed
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def _rank(rank: int, store: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        results[rank] = _both(rank)
    finally:
        dist.destroy_process_group()


def test_one_process_matches_torch_hook(group):
    _check(_both(0))


@pytest.mark.comm  # about 7 s: make test-comm, for make test's 5 minutes
def test_two_processes_match_torch_hook():
    """The mean over ranks, the Ps summed and the Qs averaged, as torch's hook does."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        context = mp.spawn(_rank, args=(os.path.join(tmp, "store"), results), nprocs=2, join=False)
        deadline = time.monotonic() + 120
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for proc in context.processes:
                    proc.kill()
                pytest.fail("the two ranks did not finish in 120 s")
        pairs = {rank: results[rank] for rank in (0, 1)}
    for rank in (0, 1):
        _check(pairs[rank])
    # The reduced gradient is the same on both ranks (not each rank's own).
    for (a, _), (b, _) in zip(pairs[0], pairs[1]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
