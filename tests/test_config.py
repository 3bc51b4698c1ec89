"""Config: defaults < YAML file < KEY=VALUE, and clear errors that name the key."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import ROOT, help_texts
from distqa import config_layers
from distqa.cli import main
from distqa.config import Config, setting, to_yaml
from distqa.config_layers import describe_keys
from distqa.errors import ConfigError
from distqa.registry import load_config

REQUIRED_KEYS = [
    "output_dir",
    "seed",
    "model.name",
    "model.tokenizer",
    "model.dropout",
    "data.train",
    "task.max_seq_len",
    "train.max_steps",
    "train.epochs",
    "train.batch_size",
    "train.grad_accum",
    "train.optimizer",
    "train.lr",
    "train.lr_schedule",
    "train.warmup_ratio",
    "train.weight_decay",
    "train.max_grad_norm",
    "train.precision",
    "train.checkpoint_every",
    "train.log_every",
    "train.resume",
]


def test_defaults_match_the_contract():
    cfg = load_config()
    assert cfg.data.train == "dummy"
    assert cfg.train.resume == "auto"
    assert cfg.model.tokenizer is None  # i.e. model.name
    assert {k for k, _, _ in describe_keys(cfg)} >= set(REQUIRED_KEYS)  # cfg: with the default task's keys


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 7\ntrain:\n  lr: 0.5\n  batch_size: 3\nmodel:\n  dropout: 0.2\n")
    cfg = load_config(str(path), ["train.lr=0.25", "train.optimizer=sgd"])
    assert cfg.seed == 7  # from the file
    assert cfg.train.batch_size == 3  # from the file
    assert cfg.train.lr == 0.25  # the command line wins over the file
    assert cfg.train.optimizer == "sgd"
    assert cfg.model.dropout == 0.2
    assert cfg.train.epochs == Config().train.epochs  # untouched default


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["train.lrr=0.1"], ["train.lrr", "did you mean train.lr"]),
        (["nosuch=1"], ["nosuch"]),
        (["train.batch_size=eight"], ["train.batch_size"]),
        (["train.max_steps=1.5"], ["train.max_steps"]),
        (["train.optimizer=adam"], ["train.optimizer", "adamw", "sgd"]),
        (["train.precision=fp8"], ["train.precision"]),
        (["train.batch_size=0"], ["train.batch_size"]),
        (["model.dropout=1.5"], ["model.dropout"]),
        (["train.lr"], ["KEY=VALUE"]),
    ],
)
def test_bad_overrides_name_the_key(overrides, names):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for name in names:
        assert name in str(info.value)


def test_unknown_key_in_file_names_key_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  batch_sise: 4\n")
    with pytest.raises(ConfigError, match=r"train\.batch_sise.*bad\.yaml"):
        load_config(str(path))


def test_wrong_type_in_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=r"train\.lr"):
        load_config(str(path))


def test_missing_data_path_is_an_error_not_dummy(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(None, [f"data.train={missing}"])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/run.yaml")


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_config(None, ["train.lr=0.125", "model.dropout=0.0"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert dataclasses.asdict(load_config(str(path))) == dataclasses.asdict(cfg)


def test_a_text_holding_an_interpolations_characters_round_trips_as_text(tmp_path):
    """A value given escaped (`\\${train.lr}`) is the text `${train.lr}`: config.yaml wrote it as is,
    so a run started again from it (or an export reading a checkpoint's settings) named another
    folder, runs/3e-05, exit 0. Backslashes before it stay too."""
    from distqa.export import checkpoint_config

    given = ["output_dir=runs/\\${train.lr}", "model.name=a\\\\\\${x}b", "model.tokenizer=c\\d"]
    cfg = load_config(None, given)
    assert (cfg.output_dir, cfg.model.name, cfg.model.tokenizer) == ("runs/${train.lr}", "a\\${x}b", "c\\d")
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert dataclasses.asdict(load_config(str(path))) == dataclasses.asdict(cfg)
    read = checkpoint_config(dataclasses.asdict(cfg), tmp_path)
    assert (read.output_dir, read.model.name, read.model.tokenizer) == (cfg.output_dir, cfg.model.name, "c\\d")


def test_help_lists_every_key_with_default_and_meaning(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    for key, default, help_text in describe_keys(load_config()):  # the default task's keys too
        shown = "null" if default is None else repr(default) if isinstance(default, str) else str(default)
        assert f"  {key} = {shown}" in lines, key
        assert " ".join(help_text.split()[:3]) in text, key
    assert "train.lr = 3e-05" in text


def test_cli_reports_a_config_error_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "distqa", "train", "train.batchsize=4"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("distqa: error: unknown config key 'train.batchsize'")
    assert "Traceback" not in proc.stderr


def test_a_config_mistake_is_reported_before_torch_is_imported():
    """ux-fast-errors: the key as typed, the closest full key, and no torch import on the way (which
    is what made a mistake take seconds)."""
    code = (
        "import sys; from distqa.cli import main; code = main(['train', 'trian.max_steps=3']); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported'; sys.exit(code)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    expected = "unknown config key 'trian.max_steps' in the command line (did you mean train.max_steps?)"
    assert last == f"distqa: error: {expected}"


SHIPPED_CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_and_set_only_known_keys(path: Path, tmp_path: Path, monkeypatch) -> None:
    """A config in configs/ that misspells a key or breaks a check fails here, not on a GPU node."""
    raw = yaml.safe_load(path.read_text())
    # A config may name its data relative to the working directory (bert-base.yaml: the split that
    # `distqa split` writes into data/split): stand-in files there, so that its checks run.
    for key in ("train", "valid"):
        value = (raw.get("data") or {}).get(key)
        if value not in (None, "dummy") and not Path(value).is_absolute():
            (tmp_path / value).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / value).touch()
    monkeypatch.chdir(tmp_path)
    cfg = load_config(str(path))
    for section, values in raw.items():
        if isinstance(values, dict):
            for key, value in values.items():
                assert getattr(getattr(cfg, section), key) == value, f"{path.name}: {section}.{key}"
        else:
            assert getattr(cfg, section) == values, f"{path.name}: {section}"


def test_there_are_shipped_configs() -> None:
    assert {p.name for p in SHIPPED_CONFIGS} >= {"bert-base.yaml", "quickstart.yaml", "bert-large-fsdp.yaml"}


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: p.name)
def test_a_shipped_config_that_fine_tunes_a_pretrained_model_names_real_data(path: Path) -> None:
    """bert-large-fsdp.yaml set no data.train: the README's BERT-large command fine-tuned on the
    DummyDataset's noise and exported the model, exit 0 (one warning line said so; found by a review).
    Only a config of a model built from scratch (tiny, *-random) may train on synthetic data."""
    raw = yaml.safe_load(path.read_text())
    name = (raw.get("model") or {}).get("name", "")
    if name == "tiny" or name.endswith("-random"):
        return
    assert (raw.get("data") or {}).get("train") not in (None, "dummy"), f"{path.name} fine-tunes {name} on dummy data"


def test_help_texts_say_what_distqa_is_and_give_each_command_its_own_example():
    """The help of distqa and of its commands, printed as users get it, without importing torch."""
    texts = help_texts([], ["train"], ["prepare"], ["predict"])
    top, train, prepare, predict = (" ".join(text.split()) for text in texts)
    assert top.startswith("usage: distqa [-h] COMMAND ... distqa fine-tunes a Hugging Face encoder")
    assert "Natural Questions" in top and "task.name=textcls" in top and "Thin on purpose" not in top
    assert "e.g. train.lr=1e-4 train.max_steps=500" in train
    assert "e.g. model.tokenizer=bert-base-uncased task.max_seq_len=384" in prepare and "train.lr" not in prepare
    assert "e.g. train.batch_size=64 task.cache_dir=features" in predict and "train.lr" not in predict


def test_the_example_in_the_top_level_help_parses():
    """Each command of the example is one distqa accepts (torchrun's from `-m distqa` on)."""
    from distqa.cli import EXAMPLES, build_parser

    lines = [shlex.split(line) for line in EXAMPLES.replace("\\\n", " ").splitlines() if line.startswith("  ")]
    parsed = [build_parser().parse_args(words[words.index("distqa") + 1 :]).command for words in lines]
    assert parsed == ["download", "split", "train", "predict"]


def test_the_example_in_the_top_level_help_trains_on_the_files_its_earlier_commands_write(tmp_path, monkeypatch):
    """It trained on the downloaded file with --config configs/bert-base.yaml, whose data.valid names
    a split it never made: 'data.valid=... does not exist (use data.train=dummy ...)'. Here the files
    download and split write stand in for them, and the train command's settings must load."""
    from distqa.cli import EXAMPLES, build_parser

    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "bert-base.yaml").write_bytes((ROOT / "configs" / "bert-base.yaml").read_bytes())
    monkeypatch.chdir(tmp_path)
    lines = [shlex.split(line) for line in EXAMPLES.replace("\\\n", " ").splitlines() if line.startswith("  ")]
    for words in lines:
        args = build_parser().parse_args(words[words.index("distqa") + 1 :])
        if args.command == "download":
            written = [Path(args.output) / "simplified-nq-train.jsonl", Path(args.output) / "simplified-nq-test.jsonl"]
        elif args.command == "split":
            written = [Path(args.output) / "train.jsonl", Path(args.output) / "valid.jsonl"]
        elif args.command == "train":
            cfg = load_config(args.config, args.overrides)
            assert cfg.data.valid is not None and Path(cfg.data.valid).is_file()
            return
        for path in written:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}\n")
    raise AssertionError("no train command in the example")


NQ_VALID_HINT = "set data.valid= (empty) to train without validation, or set examples aside with `distqa split "
TOY = "task.name=toy_task:ToyClassificationTask"


@pytest.mark.parametrize(
    "task,key,hint",
    [
        ([], "data.valid", NQ_VALID_HINT),
        (["task.name=textcls"], "data.train", "check the path: this task has no synthetic data)"),
        ([TOY], "data.valid", "set data.valid= (empty) to train without validation)"),
    ],
)
def test_a_missing_data_path_says_what_fits_its_key_and_task(tmp_path, task, key, hint):
    """It said 'use data.train=dummy' for data.valid too, and for tasks without synthetic data."""
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError) as caught:
        load_config(None, [*task, f"{key}={missing}"])
    assert str(caught.value).startswith(f"{key}={str(missing)!r} does not exist ({hint}"), caught.value
    assert "data.train=dummy" not in str(caught.value)


def test_a_config_that_is_a_folder_is_called_one(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load_config(str(tmp_path))
    assert str(caught.value).startswith(f"config file {tmp_path} is a folder: give --config a YAML file")


def test_a_config_that_is_a_pipe_is_called_one_not_missing(tmp_path):
    """`--config /dev/stdin` (or `<(...)`) was 'does not exist'; it exists, and cannot be read by each process."""
    fifo = tmp_path / "settings.fifo"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/null"):
        with pytest.raises(ConfigError, match=f"config file {re.escape(path)} is not a regular file: every process"):
            load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    # The command line's first look for the file's task (for --help's keys) read the pipe, and
    # waited for a writer for ever (a review).
    proc = subprocess.run(
        [sys.executable, "-m", "distqa", "train", "--config", str(fifo), "--check-config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and f"config file {fifo} is not a regular file" in proc.stderr, proc.stderr


def test_the_global_batch_derives_grad_accum_for_each_process_count():
    cfg = load_config(None, ["train.global_batch=8", "train.batch_size=2"])
    cfg.train.resolve_global_batch(2)
    assert cfg.train.grad_accum == 2
    one = load_config(None, ["train.global_batch=8", "train.batch_size=2"])
    one.train.resolve_global_batch(1)
    assert one.train.grad_accum == 4
    split = r"train.global_batch=8 cannot be split over 3 process\(es\) of train.batch_size=2"
    with pytest.raises(ConfigError, match=split):
        load_config(None, ["train.global_batch=8", "train.batch_size=2"]).train.resolve_global_batch(3)
    both = load_config(None, ["train.global_batch=8", "train.batch_size=2", "train.grad_accum=3"])
    with pytest.raises(ConfigError, match="train.grad_accum=3 contradicts train.global_batch=8"):
        both.train.resolve_global_batch(2)
    with pytest.raises(ConfigError, match="train.global_batch=6 is not a multiple of train.batch_size=4"):
        load_config(None, ["train.global_batch=6", "train.batch_size=4"])
    unset = load_config(None, ["train.grad_accum=3"])
    unset.train.resolve_global_batch(2)
    assert unset.train.grad_accum == 3


def test_a_renamed_key_is_refused_and_the_error_gives_its_new_name(tmp_path):
    """`data.max_seq_len` and the other keys that became the task's own (before any release) are
    unknown keys now, on the command line and in a YAML file; the error names the new key, which a
    task declares (`renamed_keys` on its settings class), so the core holds no task's names."""
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'data.max_seq_len' in the command line: "
        r"data.max_seq_len is now task.max_seq_len; give task.max_seq_len$",
    ):
        load_config(None, ["data.max_seq_len=64"])
    path = tmp_path / "old.yaml"
    path.write_text("data:\n  train: dummy\n  doc_stride: 64\n")
    with pytest.raises(ConfigError, match=f"'data.doc_stride' in {path}: data.doc_stride is now task.doc_stride"):
        load_config(str(path))
    # Only the selected task's renamings: textcls never had data.doc_stride.
    with pytest.raises(
        ConfigError, match=r"unknown config key 'data.doc_stride' in the command line \(did you mean data.train\?\)$"
    ):
        load_config(None, ["task=textcls", "data.doc_stride=64"])
    with pytest.raises(ConfigError, match="unknown config key 'data.foo'"):
        load_config(None, ["data.foo=1"])


# ---- numbers that are not numbers, seeds, sections (issue 24: no silent wrong result) ----------

FLOAT_KEYS = [
    "train.lr",
    "train.momentum",
    "train.weight_decay",
    "train.max_grad_norm",
    "train.term_grace_s",
    "train.warmup_ratio",
    "model.dropout",
    "task.keep_unknown",  # a task's own float: checked by the same walk over every float leaf
]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", ".nan", ".inf"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_setting_refuses_nan_and_inf_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=\S+ is not a finite number: give {re.escape(key)} a"):
        load_config(None, [f"{key}={value}"])


def test_a_non_finite_float_in_a_file_is_named_too(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  max_grad_norm: .nan\n")
    with pytest.raises(ConfigError, match=r"^train.max_grad_norm=nan is not a finite number"):
        load_config(str(path))


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_check_config_refuses_a_non_finite_learning_rate_in_one_line(value, capsys):
    assert main(["train", "--check-config", f"train.lr={value}"]) == 2
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err
        == f"distqa: error: train.lr={value} is not a finite number: give train.lr a finite value (default: 3e-05)\n"
    )


@pytest.mark.parametrize("value", ["0", "-1e-3"])
def test_the_learning_rate_must_be_positive(value):
    with pytest.raises(ConfigError, match=r"^train.lr=\S+ must be > 0"):
        load_config(None, [f"train.lr={value}"])


@dataclasses.dataclass
class FloatSettings:
    temperature: float = setting(1.0, "may be inf", finite=False)
    floor: float = setting(0.0, "must be finite")


def test_a_task_setting_declared_finite_false_may_be_inf_but_never_nan():
    def settings_of(name):
        return FloatSettings

    cfg = config_layers.load_config(None, ["task.name=x:T", "task.temperature=inf"], settings_of=settings_of)
    assert cfg.task.temperature == math.inf
    for bad in ("task.temperature=nan", "task.floor=inf", "task.floor=nan"):
        with pytest.raises(ConfigError, match=rf"^{bad.split('=')[0]}=\S+ is not a finite number"):
            config_layers.load_config(None, ["task.name=x:T", bad], settings_of=settings_of)


@pytest.mark.parametrize("value", ["-1", "4294967296", "100000000000000000000"])
def test_the_seed_is_a_32_bit_unsigned_integer(value, capsys):
    with pytest.raises(ConfigError, match=rf"^seed={value} must be an integer in \[0, 4294967295\]$"):
        load_config(None, [f"seed={value}"])
    assert main(["train", "--check-config", f"seed={value}"]) == 2
    assert capsys.readouterr().err.startswith(f"distqa: error: seed={value} must be")
    assert load_config(None, ["seed=4294967295"]).seed == 4294967295 and load_config(None, ["seed=0"]).seed == 0


@pytest.mark.parametrize("text", ["train: 5", "train: [1]", "model: tiny", "task: [nq]", "data:\n  - x"])
def test_a_section_that_is_not_a_mapping_is_named(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text + "\n")
    section = text.split(":")[0]
    with pytest.raises(ConfigError, match=rf"^'{section}' in {re.escape(str(path))} must be a mapping of settings"):
        load_config(str(path))


def test_a_section_given_a_value_on_the_command_line_is_named():
    with pytest.raises(ConfigError, match=r"^train is a section, not a setting: give its keys, e.g. train\.\w+=VALUE$"):
        load_config(None, ["train=5"])
    assert load_config(None, ["task=textcls"]).task.name == "textcls"  # the shorthand stays


# ---------------------------------------------------------------------------- text settings
@pytest.mark.parametrize("value", ["010", "1:30", "1.10", "1e5", "007", "true", "2024-01-01"])
def test_a_text_setting_on_the_command_line_is_the_text_as_typed(value):
    """YAML would read output_dir=010 as the octal 8, 1:30 as 90 and 1.10 as 1.1: a run wrote to
    another folder than the one named, with exit 0."""
    cfg = load_config(None, [f"output_dir={value}", f"model.name={value}", f"task.cache_dir={value}"])
    assert (cfg.output_dir, cfg.model.name, cfg.task.cache_dir) == (value, value, value)
    assert load_config(None, ["model.tokenizer=null"]).model.tokenizer is None  # null still means none
    assert load_config(None, ["train.lr=1e-3"]).train.lr == 1e-3  # numbers stay numbers where they belong


@pytest.mark.parametrize(
    "value, read",
    [("010", "the octal number 8: write 10 without the leading zero"), ("1:30", "a base-60 number")],
)
def test_a_number_yaml_reads_in_another_base_is_refused(tmp_path, value, read):
    """train.max_steps=010 trained 8 steps with exit 0 (YAML 1.1: a leading zero is octal, 1:30 is 90)."""
    with pytest.raises(ConfigError, match=f"train.max_steps={value} in the command line: YAML reads it as {read}"):
        load_config(None, [f"train.max_steps={value}"])
    path = tmp_path / "run.yaml"
    path.write_text(f"seed: 3\ntrain:\n  max_steps: {value}\n")
    with pytest.raises(ConfigError, match=f"train.max_steps={value} in config file {re.escape(str(path))}"):
        load_config(str(path))
    # What reads as the decimal it looks like stays allowed: 08 (no octal), 007, 0, 1_000.
    assert [load_config(None, [f"seed={v}"]).seed for v in ("08", "007", "0", "1_000")] == [8, 7, 0, 1000]


@pytest.mark.parametrize("value", ["2", "-1", "10"])
def test_a_switch_given_a_number_other_than_0_or_1_is_refused(tmp_path, value):
    """OmegaConf reads any whole number as a bool: train.compile=2 compiled, task.skip_bad_lines=-1
    skipped bad lines, with exit 0."""
    for key in ("train.compile", "task.skip_bad_lines", "train.deterministic"):
        with pytest.raises(
            ConfigError, match=f"{key}={value} in the command line: {key} is a switch: give true or false"
        ):
            load_config(None, [f"{key}={value}"])
    path = tmp_path / "run.yaml"
    path.write_text(f"train:\n  compile: {value}\n")
    with pytest.raises(
        ConfigError, match=f"train.compile={value} in config file {re.escape(str(path))}: train.compile"
    ):
        load_config(str(path))
    # What a switch is often written as stays allowed, and an interpolation resolves.
    assert [load_config(None, [f"train.compile={v}"]).train.compile for v in ("1", "0", "true", "no")] == [
        True, False, True, False]  # fmt: skip
    assert load_config(None, ["train.deterministic=true", "train.compile=${train.deterministic}"]).train.compile


def test_an_empty_output_dir_is_refused(tmp_path):
    """`output_dir: ""` in a file trained into the current folder with exit 0."""
    path = tmp_path / "run.yaml"
    path.write_text('output_dir: ""\n')
    with pytest.raises(ConfigError, match="output_dir is empty: name the folder for the run"):
        load_config(str(path))


def test_an_interpolation_in_a_text_setting_on_the_command_line_resolves():
    """It was refused ('Interpolation key model.name not found'), resolved against the one override."""
    assert load_config(None, ["output_dir=results/${model.name}", "model.name=tiny"]).output_dir == "results/tiny"


@pytest.mark.parametrize(
    "text", ["output_dir: 010", "output_dir: 1.10", "model:\n  name: yes", "model:\n  tokenizer: 7"]
)
def test_a_text_setting_that_yaml_read_as_a_number_is_refused_in_a_file(tmp_path, text):
    """In a file the text is already lost when the value is read: say so, and how to keep it."""
    path = tmp_path / "run.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=rf"in config file {re.escape(str(path))} is text, and YAML read its value"):
        load_config(str(path))
    quoted = re.sub(r": (.*)$", r": '\1'", text)
    path.write_text(quoted + "\n")
    assert load_config(str(path)) is not None


def test_none_for_an_optional_text_setting_is_refused_for_null(tmp_path):
    for source in (None, "file"):
        path = tmp_path / "run.yaml"
        path.write_text("task:\n  cache_dir: None\n")
        with pytest.raises(
            ConfigError, match=r"^task\.cache_dir=None in .* would be the text 'None': for no value give null$"
        ):
            load_config(str(path)) if source else load_config(None, ["task.cache_dir=None"])


@pytest.mark.parametrize(
    "text,expected",
    [
        ("train:\n  lr: 0.001\n  lr: 0.1\n", "found duplicate key lr at line 3, column 3"),
        ("train:\n\tlr: 0.1\n", "at line 2, column 1"),
        ("train:\n  lr: 0.1\n    x: 1\n", "mapping values are not allowed in this context at line 3, column 6"),
        ("train.lr: 0.5\n", "has the key 'train.lr': YAML nests keys by indenting, not by dots: write 'train:'"),
    ],
)
def test_a_yaml_mistake_names_its_place(tmp_path, text, expected):
    """The parser's first line ('while constructing a mapping') named neither the problem nor where."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))
    assert str(caught.value).startswith(f"config file {path} ") and expected in str(caught.value), caught.value


def test_a_second_config_file_is_refused_not_dropped(tmp_path, capsys):
    """The second --config replaced the first, whose settings vanished without a word."""
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("train:\n  lr: 0.5\n")
    second.write_text("train:\n  max_steps: 5\n")
    with pytest.raises(SystemExit) as exited:
        main(["train", "--check-config", "--config", str(first), "--config", str(second)])
    assert exited.value.code == 2
    assert f"error: --config given twice ({first} and {second})" in capsys.readouterr().err


def test_text_keys_read_a_task_s_annotations_even_where_one_cannot_be_resolved():
    """A fork's settings may annotate with a name only type checkers import: typing.get_type_hints
    then raises, and the text keys come from the annotations as written."""
    from distqa.config_yaml import text_keys

    namespace: dict = {}
    exec(  # a module with `from __future__ import annotations`, as the project's own
        "from __future__ import annotations\n"
        "import dataclasses\n"
        "@dataclasses.dataclass\n"
        "class Fork:\n"
        "    name: str = 'x'\n"
        "    path: str | None = None\n"
        "    other: Optional[str] = None\n"
        "    handle: OnlyForTypeCheckers = None\n"
        "    count: int = 1\n",
        namespace,
    )
    assert text_keys(namespace["Fork"](), "task.") == {"task.name": False, "task.path": True, "task.other": True}


def test_a_missing_relative_data_path_names_the_folder_it_was_looked_for_in(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["data.train=data/train.jsonl"])
    assert str(caught.value).startswith(f"data.train='data/train.jsonl' does not exist in {tmp_path} ("), caught.value


def test_a_switch_that_may_be_none_is_checked_too():
    """A fork's `maybe: bool | None = None` setting took task.maybe=2 as true."""
    import dataclasses
    from typing import Optional

    from distqa.config_yaml import bool_keys

    @dataclasses.dataclass
    class Inner:
        maybe: bool | None = None
        old_style: Optional[bool] = None  # noqa: UP045 (how older code spells it)
        count: int | None = None
        name: str = "x"

    @dataclasses.dataclass
    class Outer:
        inner: Inner = dataclasses.field(default_factory=Inner)
        flag: bool = False

    assert bool_keys(Outer()) == {"inner.maybe", "inner.old_style", "flag"}


def test_sgd_momentum_of_1_or_more_is_refused():
    """The velocity grows without bound: a short run finished, exit 0, on weights gone astray."""
    with pytest.raises(ConfigError, match=r"^train.momentum=1.5 must be in \[0, 1\)$"):
        load_config(None, ["train.optimizer=sgd", "train.momentum=1.5"])
    assert load_config(None, ["train.optimizer=sgd", "train.momentum=0.99"]).train.momentum == 0.99


# ---- text on the command line is taken as typed (a review of how settings reach the ranks) ------


@pytest.mark.parametrize(
    "value,expected",
    [
        ("runs/sweep #2", "runs/sweep #2"),  # was runs/sweep: YAML's comment, and a resume of sweep, exit 0
        ("#2", "#2"),
        ("  runs/a  ", "runs/a"),
        ("'runs/sweep #3'", "runs/sweep #3"),  # quoted: YAML's reading, less its quotes
        ("010", "010"),
        ("&x", "&x"),
        ("*x", "*x"),
        ("%x", "%x"),
        ("a: b", "a: b"),
    ],
)
def test_a_text_value_on_the_command_line_is_taken_as_typed(value, expected):
    assert load_config(None, [f"output_dir={value}"], data_paths=False).output_dir == expected


def test_no_value_for_an_optional_text_key_is_none_and_the_task_name_reads_like_any_text(monkeypatch):
    for value in ("", "null", "~"):
        assert load_config(None, [f"model.tokenizer={value}"]).model.tokenizer is None
    assert load_config(None, ["task.name='nq'"]).task.name == "nq"
    monkeypatch.setenv("DISTQA_TEST_TASK", "textcls")
    assert load_config(None, ["task=${oc.env:DISTQA_TEST_TASK}"], data_paths=False).task.name == "textcls"
    monkeypatch.delenv("DISTQA_TEST_TASK")
    unset = r"^task.name=\$\{oc.env:DISTQA_TEST_TASK\} on the command line: .*not found"
    with pytest.raises(ConfigError, match=unset):
        load_config(None, ["task=${oc.env:DISTQA_TEST_TASK}"])  # a traceback for a moment


def test_a_comment_after_an_interpolation_stays_and_a_half_quoted_value_is_refused():
    cfg = load_config(None, ["output_dir=runs/${model.name} #2"], data_paths=False)
    assert cfg.output_dir == "runs/tiny #2"  # was runs/tiny
    for value in ("'runs/x' #2", '"runs/x', "'"):  # the first was runs/x
        with pytest.raises(ConfigError, match="starts with a quote and does not end with it"):
            load_config(None, [f"output_dir={value}"], data_paths=False)


@pytest.mark.parametrize(
    "item,says",
    [
        (
            "model.name=[tiny",
            "model.name=[tiny on the command line is a YAML list or mapping, and model.name takes text",
        ),
        (
            "task.name=textcls task.labels=[neg,pos]",
            "task.labels=[neg,pos] on the command line is a YAML list or mapping",
        ),
        ('output_dir="/q"x', 'output_dir="/q"x on the command line starts with a quote and does not end'),
        ('train.lr="1e-4"x', 'train.lr="1e-4"x on the command line starts with a quote and does not end with it'),
        ("train.lr='1e-4'x'", "train.lr='1e-4'x' on the command line is not valid YAML ("),
        ("train.max_steps=[1", "train.max_steps=[1 on the command line is not valid YAML ("),
    ],
)
def test_a_value_yaml_cannot_read_or_a_list_for_text_is_one_line(item, says):
    with pytest.raises(ConfigError) as caught:  # a 40-line yaml traceback before
        load_config(None, item.split(" "), data_paths=False)
    assert str(caught.value).startswith(says), caught.value


@pytest.mark.parametrize("source", ["file", "env"])
@pytest.mark.parametrize("value", ["2", "-1", "010"])
def test_a_switch_given_a_number_as_text_or_through_an_interpolation_is_refused(tmp_path, monkeypatch, source, value):
    """OmegaConf reads the text "2" as a whole number, and any but 0 as true."""
    if source == "file":
        path = tmp_path / "run.yaml"
        path.write_text(f'train:\n  compile: "{value}"\n')
        args: tuple = (str(path), [])
    else:
        monkeypatch.setenv("DISTQA_TEST_SWITCH", value)
        args = (None, ["train.compile=${oc.env:DISTQA_TEST_SWITCH}"])
    with pytest.raises(ConfigError, match=r"train.compile is a switch: give true or false"):
        load_config(*args)
    monkeypatch.setenv("DISTQA_TEST_SWITCH", "true")
    assert load_config(None, ["train.compile=${oc.env:DISTQA_TEST_SWITCH}"]).train.compile is True


def test_a_momentum_the_optimizer_does_not_use_is_refused(tmp_path):
    """AdamW has no momentum setting (its moments are its betas): train.momentum with it would do nothing."""
    with pytest.raises(
        ConfigError, match=r"^train.momentum=0.9 applies to train.optimizer=sgd only \(this run's is adamw\)"
    ):
        load_config(None, ["train.momentum=0.9"])
    assert load_config(None, ["train.momentum=0"]).train.optimizer == "adamw"
    assert load_config(None, ["train.optimizer=sgd", "train.momentum=0.9"]).train.momentum == 0.9
    # A checkpoint whose settings were recorded before the refusal still exports: the momentum it
    # names did nothing.
    from distqa.export import checkpoint_config

    recorded = dataclasses.asdict(load_config())
    recorded["train"]["momentum"] = 0.9
    assert checkpoint_config(recorded, tmp_path).train.momentum == 0.0
    assert recorded["train"]["momentum"] == 0.9  # the checkpoint's record is left as it is


def test_an_empty_or_comments_only_config_file_is_refused(tmp_path):
    """An empty file in place of configs/bert-base.yaml (a failed template step, an empty mounted
    ConfigMap) trained the tiny model on the DummyDataset, exit 0."""
    for text in ("", "# only a comment\n", "\n\n"):
        path = tmp_path / "empty.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=rf"^config file {path} sets no settings \(it is empty, or holds only"):
            load_config(str(path))


@pytest.mark.parametrize(
    "text", ["task:\n  name: ${oc.env:DISTQA_TEST_UNSET}\n", "task: ${oc.env:DISTQA_TEST_UNSET}\n"]
)
def test_a_task_name_in_a_file_that_cannot_be_resolved_is_one_line(tmp_path, text, monkeypatch):
    monkeypatch.delenv("DISTQA_TEST_UNSET", raising=False)
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="DISTQA_TEST_UNSET' not found") as caught:
        load_config(str(path))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("train.max_steps=100 #1000", "holds ' #', where YAML's comments start: it would be train.max_steps=100"),
        ("train.compile=false #true", "it would be train.compile=false"),
        ("seed=7_", "YAML reads it as 7 (it drops underscores"),
        ("train.lr=0.001_", "YAML reads it as 0.001 (it drops underscores"),
        ("train.max_steps=1__000", "YAML reads it as 1000"),
        ("train.max_steps=0x10", "the number 16 in base 16: write 16"),
        ("train.max_steps=0b11", "the number 3 in base 2: write 3"),
        ("train.max_steps=!!int 010", "a tagged value"),
    ],
)
def test_a_number_yaml_reads_otherwise_than_it_looks_is_refused(given, said):
    """Each was accepted as the number on the right, exit 0: 100 steps for `100 #1000`, seed 7 for `7_`."""
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config(None, [given])


def test_a_hash_inside_quotes_of_a_list_value_is_no_comment():
    """['a #b'] is the text a #b to YAML: it was refused as a comment (found by a review)."""
    from distqa.config_yaml import check_no_comment

    check_no_comment("task.tags", "['a #b']")
    check_no_comment("task.tags", "{k: 'x #1'}")
    with pytest.raises(ConfigError, match=r"it would be task.tags=\[a\]"):
        check_no_comment("task.tags", "[a] #b")


def test_numbers_as_they_look_and_texts_with_a_hash_are_kept():
    cfg = load_config(None, ["train.lr=1e-3", "train.max_steps=100", "seed=7", "output_dir=runs/x #2"])
    assert (cfg.train.lr, cfg.train.max_steps, cfg.seed, cfg.output_dir) == (1e-3, 100, 7, "runs/x #2")


def test_a_number_in_a_file_with_underscores_or_another_base_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 0x10  # a comment in a file is YAML's own\n")
    with pytest.raises(ConfigError, match=rf"seed=0x10 in config file {path}: YAML reads it as the number 16"):
        load_config(str(path))
    path.write_text("seed: 16  # a comment in a file is YAML's own\n")
    assert load_config(str(path)).seed == 16


def test_a_setting_may_default_to_a_list_or_a_dict_each_instance_its_own():
    """setting(["the", "a"], ...) was a bare traceback (dataclasses refuse a mutable default)."""

    @dataclasses.dataclass
    class Words:
        stop_words: list[str] = setting(["the", "a"], "words dropped")
        weights: dict[str, float] = setting({"positive": 2.0}, "class weights")

    one, two = Words(), Words()
    one.stop_words.append("an")
    one.weights["negative"] = 1.0
    assert (two.stop_words, two.weights) == (["the", "a"], {"positive": 2.0})
    merged = OmegaConf.merge(OmegaConf.structured(Words), OmegaConf.from_dotlist(["stop_words=[x]"]))
    assert OmegaConf.to_object(merged).stop_words == ["x"]


# ---------------------------------------------------------------------------- list and mapping settings
@dataclasses.dataclass
class ListSettings:
    """A fork's settings of the kinds docs/fork.md allows: lists and mappings of numbers, text, switches."""

    weights: list[float] = setting([1.0, 1.0], "a loss weight per class")
    scales: list[float] = setting([1.0], "may hold inf", finite=False)
    sizes: list[int] = setting([1, 2], "sizes")
    stop_words: list[str] = setting(["the"], "words dropped")
    flags: list[bool] = setting([True], "switches")
    by_label: dict[str, float] = setting({"pos": 1.0}, "a weight per label")
    names: dict[str, str] = setting({"pos": "positive"}, "a name per label")
    nested: list[list[str]] = setting([["a"]], "groups of words")
    maybe: list[str | None] = setting(["a"], "words or none")
    by_group: dict[str, list[str]] = setting({"g": ["a"]}, "words per group")


ON_CLI_AS = "in the command line is text, and YAML read it as the"


def _list_config(args, tmp_path=None, text=None):
    path = None
    if text is not None:
        path = tmp_path / "fork.yaml"
        path.write_text("task:\n  name: x:T\n" + "".join(f"  {line}\n" for line in text.splitlines()))
    return config_layers.load_config(
        None if path is None else str(path), ["task.name=x:T", *args], settings_of=lambda name: ListSettings
    )


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ("task.weights=[nan,1]", r"task\.weights\[0\]=nan is not a finite number"),
        ("task.weights=[1,.inf]", r"task\.weights\[1\]=inf is not a finite number"),
        ("task.scales=[.nan]", r"task\.scales\[0\]=nan is not a finite number"),
        ("task.by_label={pos: .inf}", r"task\.by_label\.pos=inf is not a finite number"),
        ("task.by_label.pos=nan", r"task\.by_label\.pos=nan is not a finite number"),
        ("task.sizes=[010,1]", r"task\.sizes\[0\]=010 in the command line: YAML reads it as the octal number 8"),
        ("task.sizes=[1:30]", r"task\.sizes\[0\]=1:30 in the command line: YAML reads it as a base-60 number"),
        ("task.by_label={pos: 0x10}", r"task\.by_label\.pos=0x10 in the command line: YAML reads it as the number 16"),
        ("task.stop_words=[no,off]", rf"task\.stop_words\[0\] {ON_CLI_AS} bool"),
        ("task.stop_words=[a, 1.10]", rf"task\.stop_words\[1\] {ON_CLI_AS} float"),
        ("task.stop_words=[010]", rf"task\.stop_words\[0\] {ON_CLI_AS} int 8"),
        ("task.names={pos: yes}", rf"task\.names\.pos {ON_CLI_AS} bool True"),
        ("task.names.pos=1.10", rf"task\.names\.pos {ON_CLI_AS} float 1\.1"),
        ("task.flags=[true,2]", r"task\.flags\[1\]=2 in the command line: task\.flags\[1\] is a switch"),
        # An interpolation among the items left the others unchecked; one resolved is checked then.
        ('task.stop_words=[no, "${oc.env:HOME}"]', rf"task\.stop_words\[0\] {ON_CLI_AS} bool False"),
        ('task.flags=[true, "${oc.env:DISTQA_TEST_TWO}"]', r"task\.flags\[1\]=2 in the configuration: .* is a switch"),
        ("task.nested=[[a], [no]]", rf"task\.nested\[1\]\[0\] {ON_CLI_AS} bool False"),
        ("task.nested=[[010]]", rf"task\.nested\[0\]\[0\] {ON_CLI_AS} int 8"),
        ("task.maybe=[no]", rf"task\.maybe\[0\] {ON_CLI_AS} bool False"),
        ("task.by_group={g: [a, off]}", rf"task\.by_group\.g\[1\] {ON_CLI_AS} bool False"),
    ],
)
def test_the_items_of_a_list_or_mapping_setting_are_checked_as_single_settings_are(given, error, monkeypatch):
    """A fork's list[str] given [no, off] trained with ['False', 'False'], [010] was [8], [nan] a
    weight of nan, [2, -1] of list[bool] [True, True], each exit 0 (found by a review)."""
    monkeypatch.setenv("DISTQA_TEST_TWO", "2")
    with pytest.raises(ConfigError, match=f"^{error}"):
        _list_config([given])


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("weights: [.nan, 1]", r"task\.weights\[0\]=nan is not a finite number"),
        ("sizes: [010, 1]", r"task\.sizes\[0\]=010 in config file \S+: YAML reads it as the octal number 8"),
        ("sizes: [7_]", r"task\.sizes\[0\]=7_ in config file \S+: YAML reads it as 7 "),
        ("stop_words: [no, 1.10]", r"task\.stop_words\[0\] in config file \S+ is text, and YAML read it as the bool"),
        ("names:\n  pos: 010", r"task\.names\.pos in config file \S+ is text, and YAML read it as the int 8"),
        ("flags: [-1]", r"task\.flags\[0\]=-1 in config file \S+: task\.flags\[0\] is a switch"),
    ],
)
def test_the_items_of_a_list_or_mapping_setting_in_a_file_are_checked(tmp_path, text, error):
    with pytest.raises(ConfigError, match=f"^{error}"):
        _list_config([], tmp_path, text)


def test_good_list_and_mapping_settings_are_taken_as_written(tmp_path):
    cfg = _list_config(
        ["task.weights=[0.5, 2]", "task.scales=[.inf, 1]", "task.sizes=[1_000, 7]", "task.stop_words=['no', '010', a]",
         "task.flags=[true, 0, 1]", "task.by_label={pos: 2.5}", "task.names.pos='1.10'"]
    )  # fmt: skip
    task = cfg.task
    assert (task.weights, task.scales, task.sizes) == ([0.5, 2.0], [math.inf, 1.0], [1000, 7])
    assert task.stop_words == ["no", "010", "a"] and task.flags == [True, False, True]
    assert task.by_label == {"pos": 2.5} and task.names == {"pos": "1.10"}
    cfg = _list_config(
        ["task.nested=[['no'], [a]]", "task.maybe=[null, 'off']", "task.stop_words=[a, '${oc.env:HOME}']"]
    )
    assert cfg.task.nested == [["no"], ["a"]] and cfg.task.maybe == [None, "off"] and cfg.task.stop_words[0] == "a"
    cfg = _list_config([], tmp_path, "stop_words: ['no', \"1.10\"]\nsizes: [8, 1]\nnames: {pos: '010'}")
    assert cfg.task.stop_words == ["no", "1.10"] and cfg.task.sizes == [8, 1] and cfg.task.names == {"pos": "010"}


FSDP = ["train.parallel=fsdp", "train.check_replicas=false"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            ["train.ddp_comm_hook=bf16", "train.grad_accum=2"],
            "train.ddp_comm_hook=bf16 with train.parallel=fsdp and train.grad_accum=2: FSDP would sum",
        ),
        (["train.find_unused_parameters=true"], "train.find_unused_parameters=true is a DDP setting"),
    ],
)
def test_fsdp_refuses_what_it_cannot_do_in_one_line(settings, message, capsys):
    """Found by a review: FSDP summed the micro-batches' gradients in the hook's 16 bits (DDP sums
    in fp32), exit 0; find_unused_parameters was accepted, and a skipped part aborted gloo. Where a
    run starts: `distqa export` reads an older checkpoint's such settings (a review saw it refused)."""
    assert main(["train", "--check-config", "model.name=tiny", *FSDP, *settings]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"distqa: error: {message}") and len(err.splitlines()) == 1, err
    read = load_config(None, ["model.name=tiny", *FSDP, *settings])  # as export reads a checkpoint's
    with pytest.raises(ConfigError, match=re.escape(message)):
        read.train.resolve_global_batch(2)  # where each run starts
    # The same grad_accum derived from train.global_batch at 2 processes, once the world is known.
    cfg = load_config(None, ["model.name=tiny", *FSDP, "train.ddp_comm_hook=fp16", "train.global_batch=16"])
    with pytest.raises(ConfigError, match="train.ddp_comm_hook=fp16 with train.parallel=fsdp and train.grad_accum=2"):
        cfg.train.resolve_global_batch(1)  # batch_size 8 x 1 process: accumulates 2
    # Without accumulation the hook is FSDP's reduce-scatter dtype, as documented.
    assert load_config(None, ["model.name=tiny", *FSDP, "train.ddp_comm_hook=bf16"]).train.ddp_comm_hook == "bf16"


@pytest.mark.parametrize(
    "given",
    [
        ["train.lr=???"],
        ["output_dir='???'"],
        ["data.train=???"],
        ["task.name=???"],
        ["train.lr=0.5", "train.lr=???"],  # a later ??? kept the earlier value
    ],
)
def test_a_value_still_to_fill_in_is_refused_on_the_command_line(given):
    """OmegaConf's `???` merged as "keep what was there": the defaults trained, exit 0 (a review)."""
    key = given[-1].partition("=")[0]
    said = rf"^the command line leaves {re.escape(key)} as \?\?\? .*give {key} a value$"
    with pytest.raises(ConfigError, match=said):
        load_config(None, given)


@pytest.mark.parametrize("text", ["data:\n  train: ???\n", 'train:\n  lr: "???"\n', "task:\n  name: ???\n"])
def test_a_value_still_to_fill_in_is_refused_in_a_config_file(tmp_path, text):
    path = tmp_path / "template.yaml"
    path.write_text("output_dir: out\n" + text)
    with pytest.raises(ConfigError, match=rf"^config file {re.escape(str(path))} leaves \S+ as \?\?\?"):
        load_config(str(path), [])


def test_a_path_that_starts_with_the_home_folder_is_expanded(tmp_path, monkeypatch):
    """`output_dir: ~/runs/x` in a file (or under sh) went into a folder named `~` in the working
    directory, while every line printed read as the home folder (a review)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "run.yaml"
    path.write_text("output_dir: ~/runs/x\n")
    cfg = load_config(str(path), ["model.tokenizer=~/tok", "task.cache_dir=~/cache"])
    assert (cfg.output_dir, cfg.model.tokenizer, cfg.task.cache_dir) == (
        f"{tmp_path}/runs/x",
        f"{tmp_path}/tok",
        f"{tmp_path}/cache",
    )
    assert load_config(None, ["output_dir=runs/~x"]).output_dir == "runs/~x"  # only a leading ~/


@pytest.mark.parametrize("value", ["bogus", "SDPA", "spda"])
def test_an_attention_kernel_transformers_does_not_know_is_refused_at_load(value):
    """Any text passed --check-config; the run then ended in transformers' traceback (a review)."""
    with pytest.raises(ConfigError, match=rf"^model.attn_implementation='{value}' is not an attention kernel"):
        load_config(None, [f"model.attn_implementation={value}"])
    for known in ("sdpa", "eager", "flex_attention", "kernels-community/flash-attn"):
        assert load_config(None, [f"model.attn_implementation={known}"]).model.attn_implementation == known
