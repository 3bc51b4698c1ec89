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
    # A stamp cut short or of random bytes: damage, not features of other settings or of an older distqa.
    cfg = config(minilm_dir)
    for text in (json.dumps(stamp)[:300], "\x00\xff garbage"):
        shutil.copytree(prepared["train"], cut)
        (cut / FINGERPRINT_FILE).write_text(text)
        damaged = rf"^the features at {cut} are damaged: their stamp {FINGERPRINT_FILE} cannot be read"
        with pytest.raises(DistqaError, match=damaged):
            load_features(cut, verify=True)
        with pytest.raises(DistqaError, match=damaged):
            resolve_features(cfg, str(cut), load_tokenizer(cfg.model, required=True), training=True)
        shutil.rmtree(cut)
    # A cache entry (a folder prepare_features made for a file) in that state is made again, then reused.
    entry = tmp_path / "entry"
    assert not prepare_features(SAMPLE, entry, tokenizer_name=str(minilm_dir), settings=settings).reused
    (arrow,) = entry.glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[:3000])
    again = prepare_features(SAMPLE, entry, tokenizer_name=str(minilm_dir), settings=settings)
    assert not again.reused and len(load_features(entry)) == features
    assert prepare_features(SAMPLE, entry, tokenizer_name=str(minilm_dir), settings=settings).reused


def zero_middle(arrow: Path) -> None:
    """Zero the middle third of a file in place (same size): an interrupted copy into space set
    aside for it. Arrow keeps no checksum of its data, and the row count survives."""
    data = bytearray(arrow.read_bytes())
    third = len(data) // 3
    data[third : 2 * third] = bytes(third)
    arrow.write_bytes(bytes(data))


def test_features_zeroed_in_part_are_refused_or_made_again_never_trained_on(
    tmp_path, prepared, minilm_dir, monkeypatch
):
    """Such a folder loaded with its count intact, and a run trained on empty attention masks,
    exit 0. The stamp records a digest of every value; the node's first process compares it."""
    import shutil

    from distqa.data_identity import arrow_fingerprint

    cfg = config(minilm_dir)
    tokenizer = load_tokenizer(cfg.model, required=True)
    damaged = tmp_path / "damaged"
    shutil.copytree(prepared["train"], damaged)
    (arrow,) = damaged.glob("*.arrow")
    zero_middle(arrow)
    assert len(load_features(damaged)) == json.loads((damaged / FINGERPRINT_FILE).read_text())["features"]
    with pytest.raises(DistqaError, match=rf"^the features at {damaged} are damaged: their content is not what"):
        resolve_features(cfg, str(damaged), tokenizer, training=True)
    # Another process of the node (LOCAL_RANK 1) comes after the first, which checked: it does not read it all again.
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_features(cfg, str(damaged), tokenizer, training=True) == damaged
    monkeypatch.delenv("LOCAL_RANK")
    # A folder stamped before the digest was recorded cannot be checked: prepared again, said in one line.
    old = tmp_path / "old"
    shutil.copytree(prepared["train"], old)
    stamp = json.loads((old / FINGERPRINT_FILE).read_text())
    del stamp["content"]
    (old / FINGERPRINT_FILE).write_text(json.dumps(stamp))
    with pytest.raises(DistqaError, match=rf"^the features at {old} cannot be checked: .*: delete {old} and prepare"):
        resolve_features(cfg, str(old), tokenizer, training=True)
    # A cache entry in that state is made again, the same as it was first made.
    settings = feature_settings(cfg, training=True)
    entry = tmp_path / "entry"
    assert not prepare_features(SAMPLE, entry, tokenizer_name=str(minilm_dir), settings=settings).reused
    first = arrow_fingerprint(load_features(entry))
    (arrow,) = entry.glob("*.arrow")
    zero_middle(arrow)
    assert arrow_fingerprint(load_features(entry)) != first
    assert not prepare_features(SAMPLE, entry, tokenizer_name=str(minilm_dir), settings=settings).reused
    assert arrow_fingerprint(load_features(entry)) == first
    assert prepare_features(SAMPLE, entry, tokenizer_name=str(minilm_dir), settings=settings).reused


def test_an_input_edited_in_place_with_its_size_and_mtime_kept_is_prepared_again(tmp_path, minilm_dir):
    """The cache was keyed on path, size and mtime alone: a short answer corrected in place (213 ->
    214, the same bytes) with `touch -r` afterwards reused the old features, old labels and all, exit 0."""
    import os

    from distqa.data_identity import arrow_fingerprint

    cfg = config(minilm_dir, f"task.cache_dir={tmp_path / 'cache'}", "task.keep_unknown=0")
    tokenizer = load_tokenizer(cfg.model, required=True)
    lines = SAMPLE.read_text().splitlines()
    short = json.loads(lines[0])["annotations"][0]["short_answers"][0]
    assert short["end_token"] - short["start_token"] >= 2
    source = tmp_path / "train.jsonl"
    source.write_text("\n".join(lines) + "\n")
    entry = resolve_features(cfg, str(source), tokenizer, training=True)
    before = arrow_fingerprint(load_features(entry))
    stat = source.stat()
    old = f'"start_token": {short["start_token"]}, "end_token": {short["end_token"]}'
    new = f'"start_token": {short["start_token"] + 1}, "end_token": {short["end_token"]}'
    assert len(old) == len(new) and old in lines[0]
    source.write_text(source.read_text().replace(old, new, 1))
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (source.stat().st_size, source.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    assert resolve_features(cfg, str(source), tokenizer, training=True) == entry  # the same key, made again
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(source.read_bytes())
    fresh = tmp_path / "fresh"
    prepare_features(copy, fresh, tokenizer_name=str(minilm_dir), settings=feature_settings(cfg, training=True))
    after = arrow_fingerprint(load_features(entry))
    assert after == arrow_fingerprint(load_features(fresh)) and after != before


def test_an_input_whose_metadata_alone_changed_is_hashed_once_and_reused(tmp_path, minilm_dir, monkeypatch, capsys):
    """A chmod, a chown, a hard link or a Kubernetes fsGroup re-chown moves the change time without
    touching a byte: the features are reused after one hash of the input, not prepared again."""
    import os

    from distqa.nq import feature_stamp

    cfg = config(minilm_dir, f"task.cache_dir={tmp_path / 'cache'}")
    tokenizer = load_tokenizer(cfg.model, required=True)
    source = tmp_path / "train.jsonl"
    source.write_bytes(SAMPLE.read_bytes())
    entry = resolve_features(cfg, str(source), tokenizer, training=True)
    made = (entry / "data-00000-of-00001.arrow").stat().st_mtime_ns
    hashed: list[Path] = []
    digest = feature_stamp.input_digest
    monkeypatch.setattr(feature_stamp, "input_digest", lambda path: hashed.append(path) or digest(path))
    capsys.readouterr()
    assert resolve_features(cfg, str(source), tokenizer, training=True) == entry and hashed == []  # as it was
    os.link(source, tmp_path / "backup.jsonl")  # a hard link: the change time moves
    source.chmod(0o600)
    assert resolve_features(cfg, str(source), tokenizer, training=True) == entry
    assert hashed == [source] and "prepared" not in capsys.readouterr().out
    assert (entry / "data-00000-of-00001.arrow").stat().st_mtime_ns == made  # reused, not made again
    assert resolve_features(cfg, str(source), tokenizer, training=True) == entry and hashed == [source]  # quick again


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


def edit_label_in_place(source: Path) -> None:
    """A short answer moved by one token, the same bytes long, the mtime set back (`touch -r`)."""
    import os

    stat = source.stat()
    text = source.read_text()
    short = json.loads(text.splitlines()[0])["annotations"][0]["short_answers"][0]
    old = f'"start_token": {short["start_token"]}, "end_token": {short["end_token"]}'
    new = f'"start_token": {short["start_token"] + 1}, "end_token": {short["end_token"]}'
    source.write_text(text.replace(old, new, 1))
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.safety  # about 6 s: make test-safety, for make test's 5 minutes
def test_an_edit_while_the_input_is_hashed_or_prepared_is_never_blessed(tmp_path, minilm_dir, monkeypatch):
    """The stamp once took the change time read after the hash (an edit during it was reused for
    good), and the digest read before a preparation beside features of an edit made during it (a
    later restore of the old bytes reused them)."""
    import os

    from distqa.data_identity import arrow_fingerprint
    from distqa.nq import feature_stamp, prepare

    cfg = config(minilm_dir, f"task.cache_dir={tmp_path / 'cache'}", "task.keep_unknown=0")
    tokenizer = load_tokenizer(cfg.model, required=True)
    source = tmp_path / "train.jsonl"
    source.write_bytes(SAMPLE.read_bytes())
    entry = resolve_features(cfg, str(source), tokenizer, training=True)
    original = arrow_fingerprint(load_features(entry))
    os.chmod(source, 0o600)  # the change time moves: the next use hashes
    digest = feature_stamp.input_digest

    def edited_while_hashed(path: Path) -> str:
        found = digest(path)
        edit_label_in_place(path)
        return found

    monkeypatch.setattr(feature_stamp, "input_digest", edited_while_hashed)
    assert resolve_features(cfg, str(source), tokenizer, training=True) == entry  # the bytes it hashed: reused
    monkeypatch.setattr(feature_stamp, "input_digest", digest)
    resolve_features(cfg, str(source), tokenizer, training=True)  # hashed again: the edit is seen
    assert arrow_fingerprint(load_features(entry)) != original
    stamp = (entry / FINGERPRINT_FILE).read_bytes()

    generate = prepare._generate_all

    def edited_while_prepared(*args):
        made = generate(*args)
        edit_label_in_place(source)
        return made

    edit_label_in_place(source)  # another edit: prepared again, and edited once more meanwhile
    monkeypatch.setattr(prepare, "_generate_all", edited_while_prepared)
    with pytest.raises(DistqaError, match=r"train.jsonl changed while its features were being prepared: nothing"):
        resolve_features(cfg, str(source), tokenizer, training=True)
    assert (entry / FINGERPRINT_FILE).read_bytes() == stamp  # the entry as it was


def test_a_stamp_whose_input_record_lacks_its_change_time_is_hashed_not_a_traceback(tmp_path, minilm_dir):
    cfg = config(minilm_dir, f"task.cache_dir={tmp_path / 'cache'}")
    tokenizer = load_tokenizer(cfg.model, required=True)
    source = tmp_path / "train.jsonl"
    source.write_bytes(SAMPLE.read_bytes())
    entry = resolve_features(cfg, str(source), tokenizer, training=True)
    stamp = json.loads((entry / FINGERPRINT_FILE).read_text())
    del stamp["input_file"]["ctime_ns"]
    (entry / FINGERPRINT_FILE).write_text(json.dumps(stamp))
    assert resolve_features(cfg, str(source), tokenizer, training=True) == entry
    assert json.loads((entry / FINGERPRINT_FILE).read_text())["input_file"]["ctime_ns"] == source.stat().st_ctime_ns
