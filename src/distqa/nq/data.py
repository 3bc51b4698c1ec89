"""Where `distqa train` gets Natural Questions features, and how a batch of them is padded."""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from distqa.config import Config
from distqa.data_identity import arrow_fingerprint, fingerprint
from distqa.dist import print0, usable_cpus
from distqa.errors import DistqaError
from distqa.models import RANDOM_MODELS
from distqa.models import pad_collate as generic_pad_collate
from distqa.nq.dummy import DummyDataset
from distqa.nq.features import FeatureSettings

# Pad values of the padded columns; every other column is a scalar per feature.
PAD_COLUMNS = {"input_ids": None, "token_type_ids": 0, "attention_mask": 0, "token_map": -1}
TRAIN_COLUMNS = ["input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions", "answer_type"]


def feature_settings(cfg: Config, *, training: bool) -> FeatureSettings:
    d = cfg.task
    return FeatureSettings(
        max_seq_len=d.max_seq_len,
        doc_stride=d.doc_stride,
        max_query_len=d.max_query_len,
        keep_unknown=d.keep_unknown,
        seed=cfg.seed,
        training=training,
    )


def tokenizer_name(cfg: Config) -> str:
    name = cfg.model.tokenizer or cfg.model.name
    if name in RANDOM_MODELS:
        raise DistqaError("Natural Questions data needs a tokenizer: set model.tokenizer (e.g. bert-base-uncased)")
    return name


def default_cache_dir() -> Path:
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(hf_home) / "distqa" / "features"


def feature_cache_entry(cfg: Config, path: str | Path, tokenizer: Any, *, training: bool) -> Path:
    """Where `resolve_features` keeps the features of JSONL `path`: task.cache_dir (default
    HF_HOME/distqa/features) / a key of the file, the tokenizer's contents and the settings."""
    from distqa.nq.feature_stamp import fingerprint, fingerprint_key  # see resolve_features

    cache_root = Path(cfg.task.cache_dir) if cfg.task.cache_dir else default_cache_dir()
    return cache_root / fingerprint_key(fingerprint(Path(path), tokenizer, feature_settings(cfg, training=training)))


def resolve_features(cfg: Config, path: str, tokenizer: Any, *, training: bool) -> Path:
    """The prepared folder for `path`: itself if `distqa prepare` wrote it, else a cache entry,
    prepared now if missing. Call on one process per node first (see `dist.local_main_first`)."""
    # Imported here, not at the top: `prepare` pulls in `datasets` (pandas, pyarrow: about 0.5 s
    # per process), which runs on the DummyDataset never use.
    from distqa.nq.feature_folder import recorded_result
    from distqa.nq.feature_stamp import made_otherwise
    from distqa.nq.prepare import FINGERPRINT_FILE, load_features, local_main, prepare_features

    source = Path(path)
    if source.is_dir():
        if not (source / FINGERPRINT_FILE).is_file():
            raise DistqaError(f"{source} is a folder but not one `distqa prepare` wrote")
        # Used as it is: features of another tokenizer, length or mode would train while config.yaml
        # and the export said otherwise.
        if differ := made_otherwise(source, tokenizer, feature_settings(cfg, training=training)):
            mode = "train" if training else "eval"
            raise DistqaError(
                f"the features at {source} were prepared otherwise than this run reads them: {'; '.join(differ)}: "
                f"give the settings they were prepared with, or prepare them again (distqa prepare --mode {mode} "
                f"--output {source} ...)"
            )
        note = recorded_result(source).skipped_note()
        if note and not cfg.task.skip_bad_lines:  # as the run's own preparation would: it stops at the first
            raise DistqaError(
                f"the features at {source} lack the lines their input's preparation skipped ({note}): "
                "set task.skip_bad_lines=true to use them without those lines, or mend the lines and "
                "prepare them again"
            )
        # After the refusals the stamp alone decides: reading every value costs a second at full size.
        load_features(source, verify=local_main())  # damaged since `prepare` wrote it: one line
        if note:
            print0(f"the features at {source} lack the lines their input's preparation skipped: {note}")
        return source
    name = tokenizer_name(cfg)  # first: no tokenizer is one line, before the fingerprint needs one
    target = feature_cache_entry(cfg, source, tokenizer, training=training)
    result = prepare_features(
        source,
        target,
        tokenizer_name=name,
        settings=feature_settings(cfg, training=training),
        num_proc=usable_cpus(),
        skip_bad_lines=cfg.task.skip_bad_lines,
    )
    note = result.skipped_note()
    if not result.reused:
        print(
            f"prepared {result.docs} documents of {source} into {result.features} features at {target}"
            + (f"; {note}" if note else ""),
            flush=True,
        )
    elif note:  # said by every run that uses these features, not only the one that prepared them
        print0(f"reused the features of {source} at {target}; {note}")
    return target


def check_feature_ids(folder: Path, example_ids: Collection[str], source: str | Path) -> None:
    """Refuse features whose example ids are not those of the examples read from `source`.

    The cache entry is keyed on the file's path, size and modification time, and its stamp checks
    the change time (then the bytes, `feature_stamp.same_input`); a file system that keeps no
    change time leaves an edit in place that kept the others unseen, and a renamed example would
    get no window at all (an empty answer, silently). Evaluation features hold a window of every
    example, so the two sets of ids must be equal."""
    from distqa.nq.prepare import load_features  # see resolve_features

    cached, wanted = set(load_features(folder).unique("example_id")), set(example_ids)
    if cached == wanted:
        return
    missing, extra = sorted(wanted - cached), sorted(cached - wanted)
    differ = [f"{len(missing)} example(s) of the input have no features (first: {missing[0]})"] if missing else []
    differ += [f"{len(extra)} cached id(s) are not in the input (first: {extra[0]})"] if extra else []
    raise DistqaError(
        f"the features cached at {folder} do not match {source} ({', '.join(differ)}): the cache is stale (the "
        f"input changed but kept its size and modification time, on a file system that keeps no change time): "
        f"delete {folder} and run again to rebuild it"
    )


def warn_overlap(folder: Path, valid_ids: Collection[str], *, train: str, valid: str) -> None:
    """Say so (rank 0, once) when validation examples are also training examples: their eval_*
    scores measure what the model saw, not what it learned, and train.best_metric picks a step by
    them. Counted by the training features' ids: an example whose windows all fell to
    task.keep_unknown's sampling is not trained on. A warning, not a refusal: fitting a handful of
    examples and scoring them is a fair smoke test of the pipeline (scripts/demo_nq.sh does it); a
    leak nobody meant must not be silent."""
    from distqa.nq.prepare import load_features  # see resolve_features

    shared = set(load_features(folder).unique("example_id")) & set(valid_ids)
    if shared:
        print0(
            f"warning: data.train={train} trains on {len(shared)} of the {len(valid_ids)} examples of "
            f"data.valid={valid} (first: {min(shared)}): their eval_* scores measure examples the model trains "
            "on, not what it learned (and train.best_metric picks a step by them): hold them out "
            "(`distqa split` makes disjoint files)"
        )


class FeatureDataset(Dataset):
    """A memory-mapped prepared folder, restricted to the columns a step needs."""

    def __init__(self, folder: Path, columns: list[str]) -> None:
        from distqa.nq.prepare import FINGERPRINT_FILE, load_features  # see resolve_features

        self.columns = columns
        self.data = load_features(folder).select_columns(columns)
        # The documents the features came from, for the start line (a document gives one feature
        # per window): `distqa prepare` counts them in the folder's stamp.
        try:
            docs = json.loads((Path(folder) / FINGERPRINT_FILE).read_text()).get("docs")
        except (OSError, ValueError, AttributeError):
            docs = None
        self.num_examples = docs if isinstance(docs, int) and not isinstance(docs, bool) else None
        self.folder, self.files, self.changed = Path(folder), _identity(self.data), False

    # DataLoader workers get this dataset pickled, at every epoch, and would open the Arrow files
    # by their paths. A folder prepared again meanwhile holds other files there (or other names),
    # which the workers would read while this process, its length and its fingerprint kept the old
    # ones. So the folder is opened again through load_features (which makes files gone or cut
    # short one line) and its files compared with this process's.
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "data"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        from distqa.nq.prepare import load_features  # see resolve_features

        self.__dict__.update(state)
        try:
            self.data = load_features(self.folder).select_columns(self.columns)
            self.changed = _identity(self.data) != self.files
        except DistqaError:  # its files gone, or damaged
            self.changed = True

    def __len__(self) -> int:
        self._unchanged()
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, Any]:
        self._unchanged()
        return self.data[int(index)]

    def _unchanged(self) -> None:
        if self.changed:  # said here, not while unpickling: a worker's error then reaches the trainer
            raise DistqaError(
                f"the features at {self.folder} changed during the run (prepared again, or replaced): a run "
                "reads one set of features from start to end; restart it to use the new ones"
            )

    def fingerprint(self) -> str:
        """Every value of the columns a step reads, in order, straight from the memory-mapped
        Arrow files of this node (not the folder's name or stamp: a node whose copy differs must
        show it). Not `datasets`' own fingerprint either: that one hashes how the set was made
        (the generator and its arguments), so a reordered file at the same path keeps it."""
        return arrow_fingerprint(self.data)


def _identity(data: Any) -> list[tuple[str, int, int, int]]:
    """The Arrow files behind a memory-mapped dataset: path, inode, size and modification time."""
    return [(entry["filename"], *_stat(entry["filename"])) for entry in data.cache_files]


def _stat(path: str) -> tuple[int, int, int]:
    try:
        st = os.stat(path)
    except OSError:  # gone since it was opened
        return (-1, -1, -1)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def train_data_fingerprint(dataset: Dataset) -> str:
    """`NQTask.data_fingerprint`: the prepared features' Arrow content, the DummyDataset's
    settings, or (any other dataset) every item through the generic path."""
    if isinstance(dataset, (FeatureDataset, DummyDataset)):
        return dataset.fingerprint()
    return fingerprint(dataset)


def pad_collate(items: list[dict[str, Any]], pad_id: int, max_len: int, multiple: int = 8) -> dict[str, Any]:
    """Natural Questions' columns through the generic padding collate (`distqa.models`)."""
    pads = {key: pad_id if value is None else value for key, value in PAD_COLUMNS.items()}
    return generic_pad_collate(items, pads, max_len=max_len, multiple=multiple)
