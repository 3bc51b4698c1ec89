"""DummyDataset determinism and validity; data order independent of the world size."""

from __future__ import annotations

import pytest
import torch

from distqa.errors import ConfigError
from distqa.nq.dummy import DummyDataset
from distqa.sampler import GlobalBatchSampler, epoch_permutation, steps_per_epoch


def make(seed=0, size=200, length=64):
    return DummyDataset(size, length, vocab_size=30522, seed=seed)


def test_item_is_a_pure_function_of_seed_and_index():
    a, b = make(seed=3), make(seed=3)
    for i in (0, 17, 199):
        x, y = a[i], b[i]
        assert x.keys() == y.keys()
        assert all(torch.equal(x[k], y[k]) for k in x)
    # Asking in another order (as another worker or rank would) changes nothing.
    assert torch.equal(a[5]["input_ids"], make(seed=3)[5]["input_ids"])
    assert not torch.equal(make(seed=4)[5]["input_ids"], a[5]["input_ids"])
    assert not torch.equal(a[6]["input_ids"], a[5]["input_ids"])


def test_items_have_the_model_input_layout_and_valid_targets():
    data = make(size=300)
    types = set()
    for i in range(len(data)):
        item = data[i]
        ids, tt, mask = item["input_ids"], item["token_type_ids"], item["attention_mask"]
        assert ids.shape == tt.shape == mask.shape == (64,)
        assert ids.dtype == torch.long
        used = int(mask.sum())
        assert ids[0] == 101 and ids[used - 1] == 102  # [CLS] ... [SEP]
        assert bool((ids[used:] == 0).all()) and bool((mask[:used] == 1).all())
        seps = (ids == 102).nonzero().flatten().tolist()
        assert len(seps) == 2
        doc_begin, doc_end = seps[0] + 1, seps[1] - 1  # the document part, inclusive
        assert bool((tt[:doc_begin] == 0).all()) and bool((tt[doc_begin:used] == 1).all())
        start, end, kind = int(item["start_positions"]), int(item["end_positions"]), int(item["answer_type"])
        types.add(kind)
        if kind == 0:
            assert start == end == 0  # unknown points at [CLS]
        else:
            assert doc_begin <= start <= end <= doc_end
    assert types == {0, 1, 2, 3, 4}


def test_out_of_range_index():
    with pytest.raises(IndexError):
        make(size=3)[3]


def collect(world_size, batch_size, grad_accum=1, seed=1, epoch=0, start_step=0, n=64):
    """Per optimizer step, the set of indices all ranks see together."""
    samplers = [
        GlobalBatchSampler(
            n,
            batch_size=batch_size,
            grad_accum=grad_accum,
            rank=r,
            world_size=world_size,
            seed=seed,
            epoch=epoch,
            start_step=start_step,
        )
        for r in range(world_size)
    ]
    per_rank = [list(s) for s in samplers]
    steps = []
    for k in range(len(per_rank[0]) // grad_accum):
        step = []
        for batches in per_rank:
            for micro in batches[k * grad_accum : (k + 1) * grad_accum]:
                assert len(micro) == batch_size
                step.extend(micro)
        steps.append(step)
    return steps


def test_global_batches_do_not_depend_on_world_size():
    one = collect(1, 8)
    two = collect(2, 4)
    four_accum = collect(2, 2, grad_accum=2)
    assert len(one) == len(two) == len(four_accum) == 8
    for a, b, c in zip(one, two, four_accum):
        assert sorted(a) == sorted(b) == sorted(c)
    # Within a step the ranks are disjoint, and an epoch covers each example at most once.
    flat = [i for step in two for i in step]
    assert len(flat) == len(set(flat)) == 64


def test_order_depends_on_seed_and_epoch():
    assert collect(1, 8, epoch=0) != collect(1, 8, epoch=1)
    assert collect(1, 8, seed=1) != collect(1, 8, seed=2)
    assert (epoch_permutation(10, 1, 2) != epoch_permutation(10, 2, 1)).any()


def test_start_step_resumes_mid_epoch():
    full = collect(2, 4)
    assert collect(2, 4, start_step=3) == full[3:]


def test_too_few_examples_names_the_keys():
    assert steps_per_epoch(17, 4, 2, 2) == 1
    with pytest.raises(ConfigError, match="train.batch_size"):
        steps_per_epoch(15, 4, 2, 2)
