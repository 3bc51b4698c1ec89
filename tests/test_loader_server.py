"""The training DataLoader's workers start from a fork server (distqa.loader_server): what they
cannot receive is named in one line, and the server imports the task's modules once."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.data import Dataset

from distqa import sampler
from distqa.dist import DistInfo
from distqa.errors import ConfigError
from distqa.loader_server import _module_of
from distqa.nq.data import pad_collate
from distqa.nq.dummy import DummyDataset
from distqa.registry import load_config

TOY = ["task=toy_task:ToyClassificationTask", "data.num_workers=1", "train.batch_size=2"]
CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def test_a_dataset_that_does_not_pickle_stops_the_run_in_one_line():
    class Local(Dataset):  # a class inside a function: pickle cannot name it
        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> int:
            return index

    cfg = load_config(None, TOY)
    with pytest.raises(ConfigError) as caught:
        sampler.training_batches(Local(), list, cfg, CPU, 0, 0)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("the training dataset (") and "Local" in message
    assert "data.num_workers=0" in message


def test_a_collate_that_does_not_pickle_is_named():
    cfg = load_config(None, TOY)
    with pytest.raises(ConfigError, match=r"^the task's collate_fn \(function\) cannot be pickled"):
        sampler.training_batches(list(range(8)), lambda items: items, cfg, CPU, 0, 0)


def test_without_workers_nothing_is_pickled():
    class Local(Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> int:
            return index

    cfg = load_config(None, [*TOY, "data.num_workers=0"])
    batches = list(sampler.training_batches(Local(), lambda items: items, cfg, CPU, 0, 0))
    assert sorted(sum(batches, [])) == list(range(8))  # every item, in the workers-off loader


def test_the_server_preloads_the_modules_a_worker_unpickles():
    partial = functools.partial(pad_collate, pad_id=0, max_len=8)
    assert _module_of(partial) == "distqa.nq.data"
    assert _module_of(DummyDataset(4, 16, vocab_size=2000, seed=0)) == "distqa.nq.dummy"
    assert _module_of(DummyDataset) == "distqa.nq.dummy"
    assert _module_of(DummyDataset(4, 16, vocab_size=2000, seed=0).fingerprint) == "distqa.nq.dummy"
    assert _module_of(list) is None and _module_of([1, 2]) is None  # builtins: nothing to import
