"""The training data's fingerprint covers every example, in order (issue 24, "Must work" 3 and M1).

The earlier fingerprint hashed the length and 64 evenly spaced items, so a same-length file whose
other rows were relabelled or reordered resumed silently. Every change below touches only rows
between two of those samples (`between_samples`): these tests fail if the fingerprint samples again.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch

import distqa.data_agreement as agreement
import distqa.data_identity as identity
from distqa.data_agreement import agreed_identity, agreed_samples
from distqa.data_identity import arrow_fingerprint, fingerprint
from distqa.dist import DistInfo
from distqa.errors import DistqaError
from distqa.nq.data import TRAIN_COLUMNS, FeatureDataset, train_data_fingerprint
from distqa.nq.dummy import DummyDataset
from distqa.nq.features import FeatureSettings
from distqa.nq.prepare import FINGERPRINT_FILE, prepare_features
from distqa.textcls.data import Example, ExampleDataset
from test_resume_safety import run

NQ_SAMPLE = Path(__file__).parent / "fixtures" / "nq"


def between_samples(length: int) -> int:
    """A row that 64 evenly spaced samples never read: the one after the middle sample (its
    neighbour after it is unread too, given at least 3 rows between samples)."""
    assert length >= 200
    return round(31 * (length - 1) / 63) + 1


def relabelled(items: list, index: int, relabel) -> list:  # noqa: ANN001 - a small test helper
    changed = list(items)
    changed[index] = relabel(changed[index])
    return changed


def swapped(items: list, index: int) -> list:
    changed = list(items)
    changed[index], changed[index + 1] = changed[index + 1], changed[index]
    return changed


# ---------------------------------------------------------------------------- plain datasets
def text_examples(n: int) -> tuple[list, object]:
    """textcls's rows (it has no path of its own: the generic one) and how to relabel one."""
    return [Example(f"text {i}", None, i % 3) for i in range(n)], lambda e: e._replace(label=(e.label + 1) % 3)


def token_rows(n: int) -> tuple[list, object]:
    """Tokenized rows as plain lists, as many forks' datasets return them."""
    rows = [{"input_ids": [101, 1000 + i, 102], "label": i % 2} for i in range(n)]
    return rows, lambda r: {**r, "label": 1 - r["label"]}


def tensor_rows(n: int) -> tuple[list, object]:
    """Tensors, as the DummyDataset and the toy task return them."""
    rows = [{"input_ids": torch.arange(i, i + 8), "answer_type": torch.tensor(i % 5)} for i in range(n)]
    return rows, lambda r: {**r, "answer_type": (r["answer_type"] + 1) % 5}


@pytest.mark.parametrize("make", [text_examples, token_rows, tensor_rows])
def test_a_same_length_relabelled_or_reordered_dataset_changes_the_fingerprint(make):
    rows, relabel = make(1000)
    index = between_samples(len(rows))
    original = fingerprint(ExampleDataset(rows))
    assert fingerprint(ExampleDataset(list(rows))) == original  # a fresh copy: same content, same digest
    assert fingerprint(ExampleDataset(relabelled(rows, index, relabel))) != original
    assert fingerprint(ExampleDataset(swapped(rows, index))) != original


def test_equal_values_in_other_containers_agree_and_nearby_values_do_not():
    assert fingerprint([(1, [2, 3])]) == fingerprint([[1, (2, 3)]])  # type: ignore[arg-type]
    different = [[[1, 2], 3]], [[1, [2, 3]]], [[1, 2, 3]], [[12, 3]], [[1, 23]], [["1", 2, 3]], [[True, 2, 3]]
    assert len({fingerprint(rows) for rows in different}) == len(different)  # type: ignore[arg-type]


@dataclasses.dataclass
class Features:
    """A fork's item as a dataclass: its repr shows a large tensor as `[0, 1, 2, ..., 997, 998, 999]`."""

    input_ids: torch.Tensor
    label: int


@dataclasses.dataclass
class Other:  # the same fields under another class
    input_ids: torch.Tensor
    label: int


def test_dataclass_items_differing_where_their_repr_elides_change_the_fingerprint():
    """A repr was hashed for a dataclass item, and torch prints 6 of a large tensor's values: two
    datasets differing in the others had one fingerprint, so a resume on changed data went on."""
    ids = torch.arange(2000)
    changed = ids.clone()
    changed[1000] = 7
    assert repr(Features(ids, 1)) == repr(Features(changed, 1))  # what the hash read before
    original = fingerprint([Features(ids, 1)])  # type: ignore[arg-type]
    assert fingerprint([Features(ids.clone(), 1)]) == original  # type: ignore[arg-type]
    assert fingerprint([Features(changed, 1)]) != original  # type: ignore[arg-type]
    assert fingerprint([Features(ids, 2)]) != original  # type: ignore[arg-type]
    assert fingerprint([Other(ids, 1)]) != original  # type: ignore[arg-type]
    assert agreement.sample_digest([Features(changed, 1)]) != agreement.sample_digest([Features(ids, 1)])  # type: ignore[arg-type]


class Pixels:
    """A plain object: its repr, `<...Pixels object at 0x...>`, is another in every build."""

    def __init__(self, values: list[int]) -> None:
        self.values = values


def test_objects_are_fingerprinted_by_content_not_by_a_repr_with_an_address_or_elided_values():
    """A PIL image's repr holds its address: every build of an image dataset had another
    fingerprint, so each resume was refused as other data, and a second node's copy too; a pandas
    Series' repr leaves out its middle rows, so a change there went unseen."""
    import pandas as pd
    from PIL import Image

    def images(value: int) -> list:
        return [{"image": Image.fromarray(np.full((8, 8, 3), value, np.uint8)), "label": 1} for _ in range(3)]

    assert fingerprint(images(0)) == fingerprint(images(0))  # type: ignore[arg-type]
    assert fingerprint(images(0)) != fingerprint(images(1))  # type: ignore[arg-type]
    assert fingerprint([Pixels([1, 2])]) == fingerprint([Pixels([1, 2])]) != fingerprint([Pixels([1, 3])])  # type: ignore[arg-type]
    series = pd.Series(range(1000))
    changed = series.copy()
    changed[500] = 7
    assert repr(series) == repr(changed)
    assert fingerprint([series]) == fingerprint([series.copy()]) != fingerprint([changed])  # type: ignore[arg-type]


ACROSS_PROCESSES = """
import dataclasses, threading, types
import torch
from distqa.data_identity import fingerprint

@dataclasses.dataclass
class Node:
    name: str
    children: list
    parent: object = None

root = Node("root", [])
root.children.append(Node("kid", [], root))  # a cycle: a RecursionError before
item = {"tags": {"a", "b", "c", "d" * 9}, "ns": types.SimpleNamespace(ids=torch.arange(3)), "lock": threading.Lock()}
print(fingerprint([{**item, "tree": root}]))
"""


@pytest.mark.safety  # about 9 s: make test-safety, for make test's 5 minutes
def test_items_are_fingerprinted_alike_in_every_process():
    """What differs between processes is no content: a set of strings iterates in the order its
    process's hash seed sets; a pickle, read instead of a repr for a while, holds a tensor's storage
    address (an object holding a tensor had another fingerprint in every process: each resume and
    each second node refused, found by a review); a lock's repr holds its address."""
    seen = {
        subprocess.run(
            [sys.executable, "-c", ACROSS_PROCESSES],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(seen) == 1
    assert fingerprint([{"tags": {"a", "b"}}]) != fingerprint([{"tags": {"a", "c"}}])  # type: ignore[arg-type]
    one, two = (types.SimpleNamespace(ids=torch.arange(3) + k) for k in (0, 1))
    assert fingerprint([one]) != fingerprint([two])  # type: ignore[arg-type]


class Reused:
    """A dataset that fills one record anew for each item, as some readers reuse a buffer."""

    class Record:
        label = 0

    def __init__(self, labels: list[int]) -> None:
        self.labels, self.record = labels, self.Record()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        self.record.label = self.labels[index]
        return {"ex": self.record}


def test_a_record_a_dataset_fills_anew_for_each_item_is_read_for_each_item():
    """A memo of the whole pass, by id, read the record's first content for every item: three
    datasets of other labels had one fingerprint (found by a review)."""
    seen = {fingerprint(Reused(labels)) for labels in ([0, 1, 1, 0], [0, 0, 0, 0], [0, 1, 0, 1])}  # type: ignore[arg-type]
    assert len(seen) == 3
    assert fingerprint([{"raw": memoryview(b"cat")}]) != fingerprint([{"raw": memoryview(b"dog")}])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- Arrow datasets
def arrow_rows(n: int) -> datasets.Dataset:
    rng = np.random.default_rng(0)
    return datasets.Dataset.from_dict(
        {
            "input_ids": [rng.integers(0, 30000, size=rng.integers(4, 12)).tolist() for _ in range(n)],
            "label": rng.integers(0, 5, size=n).tolist(),
            "note": [None if i % 7 == 0 else f"row {i}" for i in range(n)],  # nulls and strings
        }
    )


def as_dataset(table: pa.Table) -> datasets.Dataset:
    return datasets.Dataset(datasets.table.InMemoryTable(table))


def with_column(table: pa.Table, name: str, values: list) -> pa.Table:
    column = pa.array(values, type=table.schema.field(name).type)
    return table.set_column(table.column_names.index(name), name, column)


def test_arrow_relabelled_or_reordered_rows_change_the_fingerprint_and_chunking_does_not(monkeypatch):
    monkeypatch.setattr(identity, "LEAF_ROWS", 64)  # several blocks, hashed on several threads
    data = arrow_rows(1000)
    index = between_samples(len(data))
    original = fingerprint(data)
    rechunked = pa.Table.from_batches(data.data.table.to_batches(max_chunksize=37))
    assert arrow_fingerprint(as_dataset(rechunked), threads=1) == original
    table = data.data.table
    relabel = relabelled(data["label"], index, lambda v: (v + 1) % 5)
    assert fingerprint(as_dataset(with_column(table, "label", relabel))) != original
    assert (
        fingerprint(as_dataset(with_column(table, "note", relabelled(data["note"], index - 1, lambda v: None))))
        != original
    )
    order = swapped(list(range(len(data))), index)
    assert fingerprint(data.select(order)) != original  # an indices mapping: the order it sets counts
    assert fingerprint(as_dataset(table.take(order))) != original


# ---------------------------------------------------------------------------- Natural Questions
@pytest.fixture(scope="module")
def nq_features(tmp_path_factory, minilm_dir) -> Path:
    """The fixture documents prepared with every window kept: about a thousand features."""
    folder = tmp_path_factory.mktemp("nq") / "features"
    source = tmp_path_factory.mktemp("nq-source") / "train.jsonl"
    source.write_text((NQ_SAMPLE / "simplified-nq-sample.jsonl").read_text())
    settings = FeatureSettings(max_seq_len=128, doc_stride=64, keep_unknown=1.0)
    prepare_features(source, folder, tokenizer_name=str(minilm_dir), settings=settings)
    return folder


def rewritten(source: Path, dest: Path, change) -> FeatureDataset:  # noqa: ANN001 - a small test helper
    """`source`'s features with `change` applied to its whole Arrow table, saved as `prepare` would."""
    table = change(datasets.load_from_disk(str(source)).data.table)
    as_dataset(table).save_to_disk(str(dest))
    shutil.copy(source / FINGERPRINT_FILE, dest / FINGERPRINT_FILE)  # the stamp says nothing of content
    return FeatureDataset(dest, TRAIN_COLUMNS)


def test_nq_prepared_features_relabelled_or_reordered_change_the_fingerprint(nq_features, tmp_path):
    original = FeatureDataset(nq_features, TRAIN_COLUMNS)
    n = len(original)
    index = between_samples(n)
    assert train_data_fingerprint(original) == original.fingerprint()
    assert rewritten(nq_features, tmp_path / "copy", lambda t: t).fingerprint() == original.fingerprint()

    def relabel(table: pa.Table) -> pa.Table:
        kinds = relabelled(table.column("answer_type").to_pylist(), index, lambda v: (v + 1) % 5)
        return with_column(table, "answer_type", kinds)

    def untrained(table: pa.Table) -> pa.Table:  # a column no step reads
        return with_column(table, "example_id", relabelled(table["example_id"].to_pylist(), index, lambda v: v + "x"))

    relabelled_set = rewritten(nq_features, tmp_path / "relabelled", relabel)
    reordered_set = rewritten(nq_features, tmp_path / "reordered", lambda t: t.take(swapped(list(range(n)), index)))
    assert len(relabelled_set) == len(reordered_set) == n
    assert relabelled_set.fingerprint() != original.fingerprint()
    assert reordered_set.fingerprint() != original.fingerprint()
    assert rewritten(nq_features, tmp_path / "ids", untrained).fingerprint() == original.fingerprint()


def test_nq_reordered_jsonl_is_prepared_anew_with_another_fingerprint(nq_features, tmp_path, minilm_dir):
    lines = (NQ_SAMPLE / "simplified-nq-sample.jsonl").read_text().splitlines(keepends=True)
    source = tmp_path / "train.jsonl"
    source.write_text("".join(swapped(lines, len(lines) // 2)))
    settings = FeatureSettings(max_seq_len=128, doc_stride=64, keep_unknown=1.0)
    prepare_features(source, tmp_path / "features", tokenizer_name=str(minilm_dir), settings=settings)
    reordered = FeatureDataset(tmp_path / "features", TRAIN_COLUMNS)
    original = FeatureDataset(nq_features, TRAIN_COLUMNS)
    assert len(reordered) == len(original) and reordered.fingerprint() != original.fingerprint()


def test_the_dummy_dataset_is_identified_by_what_makes_its_items():
    base = {"size": 300, "max_seq_len": 64, "vocab_size": 2000, "seed": 1}
    same = train_data_fingerprint(DummyDataset(**base))  # type: ignore[arg-type]
    assert train_data_fingerprint(DummyDataset(**base)) == same  # type: ignore[arg-type]
    for key, value in (("seed", 2), ("size", 301), ("max_seq_len", 65), ("vocab_size", 2001)):
        assert train_data_fingerprint(DummyDataset(**{**base, key: value})) != same  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- across ranks
def test_one_rank_per_node_hashes_and_a_node_that_differs_is_named_in_one_line(monkeypatch):
    """4 ranks on 2 nodes (torchrun sets GROUP_RANK): only local rank 0 hashes; node 1's files differ."""
    others = [
        {"node": "0", "examples": 5, "fingerprint": "aaa"},
        {"node": "0", "examples": 5, "fingerprint": None},
        {"node": "1", "examples": 5, "fingerprint": "bbb"},
        {"node": "1", "examples": 5, "fingerprint": None},
    ]
    calls = []
    monkeypatch.setattr(agreement, "all_gather_objects", lambda mine, info: others)
    monkeypatch.setenv("GROUP_RANK", "0")
    info = DistInfo(rank=1, local_rank=1, world_size=4, device=torch.device("cpu"))
    with pytest.raises(DistqaError) as stopped:
        agreed_identity(lambda d: calls.append(d) or "aaa", [0] * 5, info, "train.jsonl")  # type: ignore[arg-type]
    assert calls == []  # not local rank 0: its node's rank 0 hashed for it
    message = str(stopped.value)
    assert "\n" not in message and "data.train='train.jsonl'" in message
    assert "ranks 0-1: 5 examples, fingerprint aaa; ranks 2-3: 5 examples, fingerprint bbb" in message

    others[2]["fingerprint"] = "aaa"
    assert agreed_identity(lambda d: "unused", [0] * 5, info, "t")["fingerprint"] == "aaa"  # type: ignore[arg-type]

    # Node 1's rank 0 could not read its files: every rank stops with its line, none waits.
    others[2]["problem"] = "rank 2 cannot hash data.train='t': [Errno 5] Input/output error"
    with pytest.raises(DistqaError, match=r"^rank 2 cannot hash data.train='t': \[Errno 5\]"):
        agreed_identity(lambda d: "unused", [0] * 5, info, "t")  # type: ignore[arg-type]


def test_ranks_whose_datasets_hold_other_items_at_an_index_stop_in_one_line(monkeypatch):
    """Only local rank 0 hashes the whole set; every process samples the set it built itself."""
    views = [([(5, "s0"), None], None), ([(5, "s1"), None], None)]
    monkeypatch.setattr(agreement, "all_gather_objects", lambda mine, info: views)
    info = DistInfo(rank=1, local_rank=1, world_size=2, device=torch.device("cpu"))
    named = [("data.train", [0] * 5, "t"), ("data.valid", None, None)]
    with pytest.raises(DistqaError, match=r"^the ranks' training datasets hold other items at the same indices "):
        agreed_samples(info, named)  # type: ignore[arg-type]
    views[1] = ([(5, "s0"), None], None)
    agreed_samples(info, named)  # type: ignore[arg-type]
    views[1] = ([(6, "s1"), None], None)  # another length: agreed_identity names it, with the fingerprints
    agreed_samples(info, named)  # type: ignore[arg-type]
    views[1] = ([], "rank 1 cannot read an item of data.train: boom")
    with pytest.raises(DistqaError, match="^rank 1 cannot read an item of data.train: boom$"):
        agreed_samples(info, named)  # type: ignore[arg-type]
    # A stream is not sampled (yet counted as a set): agreed_identity then says it must be a map-style dataset.
    sent = []
    monkeypatch.setattr(agreement, "all_gather_objects", lambda mine, info: sent.append(mine) or [mine, mine])

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    agreed_samples(info, [("data.train", Stream(), "t")])  # type: ignore[arg-type]
    assert sent == [([()], None)]


def test_a_sample_reads_items_with_seeded_streams_and_counts_other_objects_by_their_type():
    """A PIL image's repr holds its address: two processes' samples of an image column differed and
    refused a good run. Objects the hash cannot read count by their type in a sample."""

    class Picture:  # repr: <...Picture object at 0x...>, other in every process
        pass

    assert agreement.sample_digest([{"image": Picture()}] * 3) == agreement.sample_digest([{"image": Picture()}] * 3)
    items = [torch.rand(2) for _ in range(40)]
    state = torch.get_rng_state()
    assert len(agreement.sample_digest(items)) == 16 and torch.equal(torch.get_rng_state(), state)
    assert agreement.sample_digest(items) != agreement.sample_digest(items[::-1])


@pytest.mark.safety
@pytest.mark.parametrize("task", ["PerProcessOrderTask", "SharedGeneratorTask"])
def test_a_dataset_each_process_builds_in_another_order_stops_both_ranks(tmp_path, task):
    """`list(set(rows))` in a fork's dataset: each rank of the node trained and scored other items
    (4 of 15 twice, 4 never), exit 0, since only the node's first process hashed the whole set. A
    generator the dataset keeps, shared by training and validation, is no such order: every
    process samples before the node's first reads a set whole (a review saw it refused)."""
    from conftest import SMALL, run_train

    args = [arg for arg in SMALL if not arg.startswith("task.")] + [f"task.name=toy_data_tasks:{task}"]
    proc = run_train([*args, "train.max_steps=2", f"output_dir={tmp_path / 'run'}"], nproc=2, timeout=120, check=False)
    refused = "the ranks' training datasets hold other items at the same indices" in proc.stderr
    if task == "PerProcessOrderTask":
        assert proc.returncode != 0 and refused and not (tmp_path / "run" / "checkpoints").exists()
    else:
        assert proc.returncode == 0 and not refused, proc.stderr[-2000:]


# ---------------------------------------------------------------------------- resume
def test_resume_on_a_relabelled_or_reordered_file_of_the_same_length_is_refused_naming_data_train(tmp_path, minilm_dir):
    rows = [f"text {i} {'good' if i % 2 else 'bad'},{i % 2}" for i in range(200)]
    index = between_samples(len(rows))
    data = tmp_path / "train.csv"
    data.write_text("text,label\n" + "\n".join(rows) + "\n")
    args = ["task.name=textcls", "task.labels=a,b", f"model.tokenizer={minilm_dir}", f"data.train={data}"]
    args += ["train.optimizer=sgd", "train.checkpoint_every=1"]  # one cheap step makes the checkpoint
    out = run(tmp_path / "run", *args, "train.max_steps=1")

    for changed in (relabelled(rows, index, lambda r: r[:-1] + str(1 - int(r[-1]))), swapped(rows, index)):
        data.write_text("text,label\n" + "\n".join(changed) + "\n")
        with pytest.raises(DistqaError) as refused:
            run(out, *args, "train.max_steps=2")
        message = str(refused.value)
        assert "\n" not in message and f"data.train='{data}' is not the data checkpoint" in message
        assert "200 examples" in message and "train.allow_data_change=true" in message


def test_a_fingerprint_that_cannot_be_read_is_said_on_every_rank(monkeypatch):
    """The rank that hashes reports its failure through the gather, so no rank waits for it."""
    monkeypatch.setattr(agreement, "all_gather_objects", lambda mine, info: [mine, {**mine, "problem": None}])
    monkeypatch.delenv("GROUP_RANK", raising=False)
    info = DistInfo(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))

    def unreadable(dataset):
        raise OSError(5, "Input/output error")

    with pytest.raises(DistqaError, match=r"^rank 0 cannot hash data.train='t': \[Errno 5\] Input/output error$"):
        agreed_identity(unreadable, [0] * 5, info, "t")  # type: ignore[arg-type]
