"""A checkpoint written on the CPU holds no CUDA generator: restored on a GPU, the caller must seed
it per rank (CheckpointManager.restore), or every rank would draw the same dropout masks."""

from __future__ import annotations

import random

import torch

from distqa.rng_state import capture_rng_state, restore_rng_state


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


class FakeGpus:
    """torch.cuda's per-GPU generator states, for `n` GPUs, without a GPU: `get_rng_state(i)` and
    `set_rng_state(state, i)` on a byte tensor per GPU."""

    def __init__(self, monkeypatch, n: int) -> None:
        self.states = {i: torch.tensor([i], dtype=torch.uint8) for i in range(n)}
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: self.states[self._index(device)].clone())
        monkeypatch.setattr(
            torch.cuda, "set_rng_state", lambda state, device: self.states.update({self._index(device): state})
        )

    @staticmethod
    def _index(device) -> int:
        return device.index if isinstance(device, torch.device) else int(device)

    def draw(self) -> None:
        """Every GPU's generator moves on (a step's dropout on each of them)."""
        self.states = {i: s + 10 for i, s in self.states.items()}


def test_dp_saves_and_restores_every_replica_gpu_s_generator(monkeypatch, tmp_path):
    gpus = FakeGpus(monkeypatch, 3)
    gpu0 = torch.device("cuda", 0)
    state = capture_rng_state(gpu0, [1, 2])
    # Through a file, as a checkpoint holds it (weights_only loading).
    torch.save(state, tmp_path / "rng.pt")
    state = torch.load(tmp_path / "rng.pt", weights_only=True)
    saved = {i: s.clone() for i, s in gpus.states.items()}
    gpus.draw()
    assert restore_rng_state(state, gpu0, [1, 2]) is True
    assert all(torch.equal(gpus.states[i], saved[i]) for i in range(3))


def test_a_replica_gpu_the_checkpoint_did_not_save_is_reported(monkeypatch):
    gpus = FakeGpus(monkeypatch, 3)
    gpu0 = torch.device("cuda", 0)
    one_gpu = capture_rng_state(gpu0)  # a DDP process's, or DataParallel's on one GPU
    assert one_gpu["cuda_replicas"] == {}
    gpus.draw()
    drawn = {i: s.clone() for i, s in gpus.states.items()}
    # Resumed over 3 GPUs: GPUs 1 and 2 have no saved state, so the caller must seed them.
    assert restore_rng_state(one_gpu, gpu0, [1, 2]) is False
    assert all(torch.equal(gpus.states[i], drawn[i]) for i in range(3))
    # A checkpoint from before replicas were saved has no such entry at all: the same answer.
    del one_gpu["cuda_replicas"]
    assert restore_rng_state(one_gpu, gpu0, [1]) is False
    assert restore_rng_state(one_gpu, gpu0) is True


def test_dp_seeds_each_replica_gpu_apart_from_the_others(monkeypatch, tmp_path):
    """torch.manual_seed gives every GPU one seed: DataParallel's copies would draw the same dropout
    masks for their shares of the batch. Each replica GPU gets its own, also on a resume's reseed."""
    from distqa import parallel
    from distqa.checkpoint_manager import CheckpointManager
    from distqa.config import Config, TrainConfig
    from distqa.dist import DistInfo
    from distqa.sampler import derive_seed

    generators = tuple(torch.Generator() for _ in range(3))
    # This process's GPU is 1 (LOCAL_RANK=1): GPUs 0 and 2 are its replicas.
    monkeypatch.setattr(parallel, "dp_device_ids", lambda info: [1, 0, 2])
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "default_generators", generators)
    cfg = Config(train=TrainConfig(parallel="dp"))
    manager = CheckpointManager(tmp_path, cfg, DistInfo(0, 1, 1, torch.device("cuda", 1)), sharded=False, lock=None)
    assert manager.replicas == [0, 2]
    for parts in ((cfg.seed, 0), (cfg.seed, 0, 7)):  # a fresh start, a resume's reseed at step 7
        for g in generators:
            g.manual_seed(derive_seed(*parts))  # what seed_everything (or the reseed) leaves on every GPU
        manager._seed_replicas(*parts)
        seeds = [g.initial_seed() for g in generators]
        assert len(set(seeds)) == 3, seeds
    # DDP (one GPU per process): nothing to seed beyond the process's own GPU.
    assert (
        CheckpointManager(tmp_path, Config(), DistInfo(0, 0, 1, torch.device("cpu")), sharded=False, lock=None).replicas
        == []
    )
