"""A task that draws random numbers in `__getitem__` (augmentation) draws the same numbers for an
item whatever its DataLoader worker made before: a resume, which starts the epoch's workers afresh
at a later step, and another data.num_workers give the uninterrupted run's weights
(`distqa.sampler.ItemSeeded`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import SMALL, checkpoint_weights, max_abs_diff
from distqa.registry import load_config
from distqa.sampler import BatchSeeded, ItemSeeded, SeededCollate, item_seed
from distqa.trainer import train
from toy_data_tasks import NoisyBlobs, masking_collate

TOY = [arg for arg in SMALL if not arg.startswith(("task.", "data.num_workers"))]
TOY += ["task.name=toy_data_tasks:AugmentedTask", "task.size=64", "train.batch_size=4", "train.checkpoint_every=3"]
TOY += ["train.lr_schedule=constant", "train.warmup_ratio=0"]  # max_steps 3 then 6: one schedule


def test_an_item_draws_the_same_whatever_was_drawn_before():
    items = ItemSeeded(NoisyBlobs(16, seed=3), base=1234)
    forward = [items[i]["features"] for i in range(8)]
    torch.randn(100)  # the worker's stream moved on
    backward = [items[i]["features"] for i in reversed(range(8))][::-1]
    assert all(torch.equal(a, b) for a, b in zip(forward, backward, strict=True))
    assert not torch.equal(forward[0], forward[1])  # items draw apart
    assert not torch.equal(forward[0], ItemSeeded(NoisyBlobs(16, seed=3), base=1235)[0]["features"])  # epochs too
    assert len({item_seed(1234, i) for i in range(10_000)}) == 10_000


def test_a_dataset_that_reads_batches_is_seeded_per_batch():
    class Batched(NoisyBlobs):
        def __getitems__(self, indices):
            return [self[i] for i in indices]

    batches = BatchSeeded(Batched(16, seed=3), base=7)
    first = batches.__getitems__([4, 5])
    torch.randn(10)
    assert all(torch.equal(a["features"], b["features"]) for a, b in zip(first, batches.__getitems__([4, 5])))


def run(out: Path, *extra: str) -> Path:
    train(load_config(None, [*TOY, f"output_dir={out}", *extra]))
    return out


@pytest.mark.safety
def test_augmenting_workers_resume_exactly_and_their_number_does_not_matter(tmp_path):
    straight = checkpoint_weights(run(tmp_path / "straight", "data.num_workers=2", "train.max_steps=6"), 6)
    resumed = tmp_path / "resumed"
    run(resumed, "data.num_workers=2", "train.max_steps=3")
    assert max_abs_diff(straight, checkpoint_weights(run(resumed, "data.num_workers=2", "train.max_steps=6"), 6)) == 0
    one_worker = checkpoint_weights(run(tmp_path / "one", "data.num_workers=1", "train.max_steps=6"), 6)
    assert max_abs_diff(straight, one_worker) == 0
    # No workers: items made in the training process draw the same, and its own streams do not
    # move (a resume changing data.num_workers from 2 to 0 was 1.1e-4 off, without a word).
    switched = tmp_path / "switched"
    run(switched, "data.num_workers=2", "train.max_steps=3")
    assert max_abs_diff(straight, checkpoint_weights(run(switched, "data.num_workers=0", "train.max_steps=6"), 6)) == 0


def test_an_item_made_in_the_training_process_leaves_its_streams_where_they_were():
    import random

    import numpy as np

    items = ItemSeeded(NoisyBlobs(16, seed=3), base=1234, in_process=True)
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    made = items[3]["features"]
    after = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    untouched = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(after[0], untouched[0]) and after[1:] == untouched[1:]
    assert torch.equal(made, ItemSeeded(NoisyBlobs(16, seed=3), base=1234)[3]["features"])  # a worker's draw


def test_a_collate_draws_the_same_for_a_batch_whatever_was_drawn_before():
    """Masking in the collate drew from the stream the worker's last item left, or at
    data.num_workers=0 from the training process's own: a resume changing data.num_workers (which
    changes nothing computed) gave other weights, 0.018 off, without a word."""
    import random

    import numpy as np

    items = ItemSeeded(NoisyBlobs(16, seed=3), base=1234)
    collate = SeededCollate(masking_collate, base=99)
    first = collate(items.__getitems__([4, 5, 6]))["features"]
    torch.randn(100)  # the worker's stream moved on
    assert torch.equal(first, collate(items.__getitems__([4, 5, 6]))["features"])
    assert not torch.equal(first, SeededCollate(masking_collate, base=98)(items.__getitems__([4, 5, 6]))["features"])
    # In the training process: the same draw, and its own streams where they were.
    here = SeededCollate(masking_collate, base=99, in_process=True)
    in_process = ItemSeeded(NoisyBlobs(16, seed=3), base=1234, in_process=True)
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    made = here(in_process.__getitems__([4, 5, 6]))["features"]
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(made, first) and torch.equal(after, torch.rand(3))


@pytest.mark.safety
def test_a_masking_collate_gives_the_same_weights_whatever_data_num_workers(tmp_path):
    masked = ["task.name=toy_data_tasks:MaskedCollateTask", "train.max_steps=6"]
    two = checkpoint_weights(run(tmp_path / "two", *masked, "data.num_workers=2"), 6)
    switched = tmp_path / "switched"
    run(switched, *masked[:1], "data.num_workers=2", "train.max_steps=3")
    assert (
        max_abs_diff(two, checkpoint_weights(run(switched, *masked[:1], "data.num_workers=0", "train.max_steps=6"), 6))
        == 0
    )
    assert max_abs_diff(two, checkpoint_weights(run(tmp_path / "none", *masked, "data.num_workers=0"), 6)) == 0


def test_a_training_set_whose_length_changes_between_epochs_stops_in_one_line(tmp_path):
    """Its epochs were planned from the length at start: a shrunk set ended in a StopIteration
    traceback at the first step past its end, a grown one was read in part without a word."""
    from distqa.errors import DistqaError

    args = [*TOY, "task.name=toy_data_tasks:ShrinkingTask", "data.num_workers=0", "train.epochs=2"]
    with pytest.raises(
        DistqaError, match=r"^the training set's length changed during the run: 64 examples at start, 21 at epoch 1"
    ):
        train(load_config(None, [*args, f"output_dir={tmp_path / 'run'}"]))
