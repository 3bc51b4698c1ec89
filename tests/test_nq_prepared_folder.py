"""A folder `distqa prepare` wrote, used as data.train or data.valid: it must be what the run would
make (its tokenizer, lengths, sampling and mode), and whole. Otherwise the run trained on it with
exit 0: windows of 256 tokens under task.max_seq_len=64, ids of another vocabulary, every window of
an eval folder, or the first 1000 of 1056 features of a folder cut short by an interrupted copy, while
config.yaml and the export said otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TESTS
from distqa.errors import DistqaError
from distqa.models import load_tokenizer
from distqa.nq.data import feature_settings, resolve_features
from distqa.nq.prepare import FINGERPRINT_FILE, load_features, prepare_features
from distqa.registry import load_config

SAMPLE = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"
PREPARED = ["task.max_seq_len=128", "task.keep_unknown=0.3"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, minilm_dir) -> dict[str, Path]:
    """A train-mode and an eval-mode folder of the sample, prepared with PREPARED's settings."""
    root = tmp_path_factory.mktemp("prepared")
    cfg = config(minilm_dir)
    folders = {"train": root / "train", "eval": root / "eval"}
    for mode, folder in folders.items():
        settings = feature_settings(cfg, training=mode == "train")
        prepare_features(SAMPLE, folder, tokenizer_name=str(minilm_dir), settings=settings)
    return folders


def config(minilm_dir: Path, *overrides: str):
    return load_config(None, ["model.name=tiny", f"model.tokenizer={minilm_dir}", *PREPARED, *overrides])


def refusal(folder: Path, cfg, tokenizer, *, training: bool) -> str:
    with pytest.raises(DistqaError) as caught:
        resolve_features(cfg, str(folder), tokenizer, training=training)
    said = str(caught.value)
    assert said.startswith(f"the features at {folder} were prepared otherwise than this run reads them: "), said
    assert "\n" not in said
    return said


def test_a_prepared_folder_is_used_only_with_the_settings_and_tokenizer_it_was_made_with(prepared, minilm_dir):
    cfg = config(minilm_dir)
    tokenizer = load_tokenizer(cfg.model, required=True)
    assert resolve_features(cfg, str(prepared["train"]), tokenizer, training=True) == prepared["train"]
    assert resolve_features(cfg, str(prepared["eval"]), tokenizer, training=False) == prepared["eval"]
    said = refusal(prepared["train"], config(minilm_dir, "task.max_seq_len=64"), tokenizer, training=True)
    assert "task.max_seq_len=128 there, 64 here" in said and "--mode train" in said
    said = refusal(prepared["train"], config(minilm_dir, "task.keep_unknown=0.02", "seed=7"), tokenizer, training=True)
    assert said.count("there") == 1 and "task.keep_unknown=0.3 there, 0.02 here: give" in said
    # Another seed alone is no difference: it drew which unknown windows were kept, a sample as fair.
    assert resolve_features(config(minilm_dir, "seed=7"), str(prepared["train"]), tokenizer, training=True)
    # Evaluation keeps every window whatever keep_unknown and seed say: those do not matter there.
    assert resolve_features(config(minilm_dir, "task.keep_unknown=0.02"), str(prepared["eval"]), tokenizer,
                            training=False) == prepared["eval"]  # fmt: skip
    said = refusal(prepared["eval"], cfg, tokenizer, training=True)
    assert "prepared with --mode eval, used here for training" in said
    assert "prepared with --mode train, used here for evaluation" in refusal(
        prepared["train"], cfg, tokenizer, training=False
    )
    # The vocabulary by its contents: a tokenizer of the same kind with other ids is another one.
    from transformers import BertTokenizer

    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat"])}
    other = BertTokenizer(vocab=vocab, do_lower_case=True)
    assert "another tokenizer" in refusal(prepared["train"], cfg, other, training=True)


def test_a_damaged_prepared_folder_is_one_line_and_a_damaged_cache_entry_is_made_again(tmp_path, prepared, minilm_dir):
    import shutil

    settings = feature_settings(config(minilm_dir), training=True)
    counted = tmp_path / "counted"
    shutil.copytree(prepared["train"], counted)
    stamp = json.loads((counted / FINGERPRINT_FILE).read_text())
    features = stamp["features"]
    # A batch boundary cut by a copy gives fewer rows and no error from the reader: the stamp's count shows it.
    (counted / FINGERPRINT_FILE).write_text(json.dumps({**stamp, "features": features + 1}))
    with pytest.raises(DistqaError, match=rf"the features at {counted} are damaged: {features} where its stamp counts"):
        load_features(counted)
    cut = tmp_path / "cut"
    shutil.copytree(prepared["train"], cut)
    (arrow,) = cut.glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[:3000])
    with pytest.raises(DistqaError, match=rf"the features at {cut} are damaged \(.+\): delete {cut} and prepare"):
        load_features(cut)
    arrow.unlink()
    with pytest.raises(DistqaError, match=rf"the features at {cut} are damaged"):
        load_features(cut)
    shutil.rmtree(cut)
    for name, text in (("state.json", "{}"), ("state.json", '{"_data_files": []}'), ("dataset_info.json", "[1]")):
        shutil.copytree(prepared["train"], cut)
        (cut / name).write_text(text)  # JSON of another shape: KeyError, IndexError, ... in `datasets`
        with pytest.raises(DistqaError, match=rf"the features at {cut} are damaged"):
            load_features(cut)
        shutil.rmtree(cut)
    # A cache entry (a folder prepare_features made for a file) in that state is made again, then reused.
    entry = tmp_path / "entry"
    assert not prepare_features(SAMPLE, entry, tokenizer_name=str(minilm_dir), settings=settings).reused
    (arrow,) = entry.glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[:3000])
    again = prepare_features(SAMPLE, entry, tokenizer_name=str(minilm_dir), settings=settings)
    assert not again.reused and len(load_features(entry)) == features
    assert prepare_features(SAMPLE, entry, tokenizer_name=str(minilm_dir), settings=settings).reused


def test_features_prepared_again_during_a_run_stop_it_in_its_dataloader_workers(tmp_path, prepared, minilm_dir):
    """DataLoader workers get the dataset pickled at each epoch, and the Arrow table comes back by
    path: a folder prepared again meanwhile fed the workers its new windows (length 128 where the run
    had 64) while the training process, its length and its fingerprint kept the old ones, exit 0."""
    import pickle
    import shutil

    from distqa.nq.data import TRAIN_COLUMNS, FeatureDataset

    folder = tmp_path / "features"
    shutil.copytree(prepared["train"], folder)
    dataset = FeatureDataset(folder, TRAIN_COLUMNS)
    same = pickle.loads(pickle.dumps(dataset))  # as a worker gets it while nothing changed
    assert len(same) == len(dataset) and same[0] == dataset[0]
    settings = feature_settings(config(minilm_dir, "task.max_seq_len=64"), training=True)
    prepare_features(SAMPLE, folder, tokenizer_name=str(minilm_dir), settings=settings)  # the folder, again
    moved = pickle.loads(pickle.dumps(dataset))
    with pytest.raises(DistqaError, match=rf"the features at {folder} changed during the run"):
        moved[0]
    with pytest.raises(DistqaError, match="changed during the run"):  # not an AttributeError: it has no table
        len(moved)
    assert len(dataset[0]["input_ids"]) == len(same[0]["input_ids"])  # this process keeps its own files
    # Written again under other file names (more shards, a folder deleted and made anew): the same
    # one line, not a worker's traceback while it reopens a file that is gone.
    shutil.rmtree(folder)
    shutil.copytree(prepared["train"], folder)
    (arrow,) = folder.glob("*.arrow")
    arrow.rename(folder / "data-00000-of-00002.arrow")
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] = [{"filename": "data-00000-of-00002.arrow"}]
    (folder / "state.json").write_text(json.dumps(state))
    renamed = pickle.loads(pickle.dumps(dataset))
    with pytest.raises(DistqaError, match=rf"the features at {folder} changed during the run"):
        renamed[0]
