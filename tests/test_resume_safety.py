"""Resume never crashes and never continues on the wrong thing: damaged checkpoints (any bytes in any
file), a folder whose checkpoints are all unusable, changed data, and every changed setting."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SMALL, load_weights, max_abs_diff
from distqa.checkpoint import REQUIRED_FILES, list_checkpoints, verify_checkpoint
from distqa.config_layers import describe_keys
from distqa.errors import ConfigError, DistqaError
from distqa.registry import load_config
from distqa.resume import resume_kind
from distqa.trainer import train

BASE = [
    *SMALL,
    "train.batch_size=2",
    "train.lr=1e-3",
    "train.lr_schedule=constant",
    "train.warmup_ratio=0",
    "train.checkpoint_every=2",
    "train.keep_checkpoints=0",
]


def run(out: Path, *extra: str) -> Path:
    base = BASE
    if any(arg.startswith("task.name=") for arg in extra):  # another task: the NQ task's keys do not apply
        base = [arg for arg in BASE if not arg.startswith("task.")]
    try:
        train(load_config(None, [*base, f"output_dir={out}", *extra]))
    finally:
        torch.use_deterministic_algorithms(False)  # train.deterministic sets it process-wide
    return out


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> Path:
    """A run of 4 steps with checkpoints at 2 and 4; tests copy it before damaging it."""
    return run(tmp_path_factory.mktemp("ref") / "run", "train.max_steps=4")


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory) -> Path:
    return run(tmp_path_factory.mktemp("ref6") / "run", "train.max_steps=6")


def copy_run(src: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(src, out)
    return out


# ---------------------------------------------------------------------------- damaged files
CHECKPOINT_FILES = ["manifest.json", *REQUIRED_FILES]


@pytest.fixture
def good_step4(four_steps) -> Path:
    """four_steps' step-4, verified whole once per test: hashing its 50 MB for every example took
    most of the hypothesis test's time, and each example's copy of it is byte for byte the same."""
    folder = four_steps / "checkpoints" / "step-4"
    assert verify_checkpoint(folder) is None
    return folder


@pytest.mark.safety  # about 3 s: make test-safety, for make test's 5 minutes
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(CHECKPOINT_FILES), data=st.binary(max_size=300))
def test_any_bytes_in_any_checkpoint_file_are_reported_never_raised(good_step4, tmp_path, name, data):
    folder = tmp_path / "step-4"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(good_step4, folder)
    (folder / name).write_bytes(data)
    problem = verify_checkpoint(folder)
    assert isinstance(problem, str) and problem and "\n" not in problem


@pytest.mark.parametrize(
    "manifest, expected",
    [
        (b"[]", "not a JSON object"),
        (b"{}", "does not list training_state.pt"),
        (b"null", "not a JSON object"),
        (b"\xff\xfe garbage", "not valid JSON"),
        (b"[" * 100_000, "not valid JSON"),  # nested past Python's recursion limit
        (None, "outside the checkpoint"),  # the real manifest plus an entry that climbs out
        (False, "malformed entry"),  # the real manifest with a size that is a bool
    ],
)
def test_manifest_shapes_that_once_crashed_or_passed(four_steps, tmp_path, manifest, expected):
    folder = copy_run(four_steps, tmp_path) / "checkpoints" / "step-4"
    real = json.loads((folder / "manifest.json").read_text())
    if manifest is None:
        real["../../metrics.jsonl"] = real["trainer_state.json"]
        manifest = json.dumps(real).encode()
    elif manifest is False:
        real["model.safetensors"]["bytes"] = True
        manifest = json.dumps(real).encode()
    (folder / "manifest.json").write_bytes(manifest)
    assert expected in verify_checkpoint(folder)


def test_garbage_manifest_falls_back_to_the_previous_checkpoint(four_steps, six_steps, tmp_path, capsys):
    """rel-manifest-garbage: random bytes in the newest checkpoint's manifest."""
    out = copy_run(four_steps, tmp_path)
    (out / "checkpoints" / "step-4" / "manifest.json").write_bytes(bytes(range(256)) * 3)
    capsys.readouterr()
    run(out, "train.max_steps=6")
    text = capsys.readouterr().out
    assert "skipping checkpoint" in text and "step-4" in text and "manifest.json is not valid JSON" in text
    assert "resumed from" in text and "step-2 at step 2" in text
    assert max_abs_diff(load_weights(out), load_weights(six_steps)) == 0.0


def test_no_usable_checkpoint_stops_and_never_moves_aside_an_earlier_run(four_steps, tmp_path):
    out = copy_run(four_steps, tmp_path)
    for step in (2, 4):
        (out / "checkpoints" / f"step-{step}" / "training_state.pt").write_bytes(b"\0" * 10)
    metrics_before = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(
        DistqaError, match=r"no usable checkpoint in .*step-4: training_state.pt has 10 bytes.*resume=never"
    ):
        run(out, "train.max_steps=6")
    assert (out / "metrics.jsonl").read_bytes() == metrics_before  # not emptied by a silent restart

    # train.resume=never is the explicit fresh start: the earlier run is moved aside, not deleted.
    run(out, "train.max_steps=2", "train.resume=never")
    (earlier,) = (out / "earlier-runs").iterdir()
    assert (earlier / "metrics.jsonl").read_bytes() == metrics_before
    assert {p.name for p in (earlier / "checkpoints").iterdir()} == {"step-2", "step-4"}
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step-2"]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


# ---------------------------------------------------------------------------- changed settings
# One other valid value for every key of the schema. The test fails when a key is added to the
# schema without a value here, so every new key is classified (silent, applied or refused).
ALTERNATIVES = {
    "output_dir": None,  # resumed through train.resume=PATH from another folder, below
    "seed": "7",
    "train.best_mode": "min",
    "train.best_metric": None,  # needs an evaluation: tests/test_best_checkpoint.py
    "task.name": "toy_task:ToyClassificationTask",
    "model.name": "bert-base-random",
    "model.tokenizer": "MINILM",
    "model.dropout": "0.2",
    "model.attn_implementation": "eager",
    "data.train": "NQ",
    "data.valid": "NQ",
    "task.max_seq_len": "32",
    "task.doc_stride": "64",
    "task.max_query_len": "32",
    "task.max_answer_len": "20",
    "task.keep_unknown": "0.5",
    "task.skip_bad_lines": "true",
    "task.cache_dir": "CACHE",
    "task.dummy_size": "200",
    "data.num_workers": "1",
    "data.timeout_s": "30",
    "train.max_steps": "5",
    "train.epochs": "2",
    "train.batch_size": "1",
    "train.grad_accum": "2",
    "train.global_batch": "2",  # the run's own global batch (1 process x train.batch_size=2), now derived
    "train.parallel": "fsdp",
    "train.activation_checkpointing": "true",
    "train.optimizer": "sgd",
    "train.lr": "2e-3",
    # SGD's only (refused with the base run's adamw); a momentum changed on resume is
    # test_reliability_promises.py's.
    "train.momentum": None,
    "train.lr_schedule": "cosine",
    "train.warmup_ratio": "0.5",
    "train.weight_decay": "0.1",
    "train.max_grad_norm": "0.5",
    "train.precision": "fp16",
    "train.compile": None,  # applied (test_resume_lines.py); compiling costs a minute on a CPU
    "train.static_graph": "false",
    "train.find_unused_parameters": "true",
    # Communication settings: one process here has no all-reduce to compress; their effect at two
    # processes is tests/test_comm_hooks.py's.
    "train.ddp_comm_hook": "fp16",
    "train.powersgd_rank": "2",
    "train.powersgd_start_step": "2",
    "train.bucket_cap_mb": "50",
    "train.deterministic": "true",
    "train.checkpoint_every": "1",
    "train.keep_checkpoints": "1",
    "train.term_grace_s": "5",
    "train.check_replicas": "false",
    "train.check_finite": "true",
    "train.log_every": "2",
    "train.eval_every": "1",
    "train.resume": None,  # what selects the checkpoint: exercised by every case
    "train.allow_data_change": "true",
}
# Changing these changes the data the task builds; with the tiny model (no tokenizer) a real NQ
# file is refused by the task itself, naming model.tokenizer.
NEEDS_TOKENIZER = {"data.train", "data.valid"}


# What docs/reliability.md ("Resuming: the rules") promises is refused: the checkpoint's state would mean
# something else.
PROMISED_REFUSED = {
    "seed",
    "task.name",
    "model.name",
    "model.tokenizer",
    "train.optimizer",
    "train.parallel",
    "task.max_seq_len",
    "task.doc_stride",
    "task.max_query_len",
    "task.max_answer_len",
    "task.keep_unknown",
    "task.dummy_size",
}


def test_every_key_is_classified():
    assert set(ALTERNATIVES) == {key for key, _, _ in describe_keys(load_config())}
    cfg = load_config()
    assert {k for k in ALTERNATIVES if resume_kind(cfg, k) == "refused"} == PROMISED_REFUSED


def alternative(key: str, tmp_path: Path, minilm_dir: Path) -> list[str]:
    """`key=<another value>`, plus what keeps the global batch when the key splits it."""
    from conftest import TESTS

    value = {
        "MINILM": str(minilm_dir),
        "NQ": str(TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"),
        "CACHE": str(tmp_path / "cache"),
    }.get(ALTERNATIVES[key], ALTERNATIVES[key])
    # The same global batch split differently is an applied change (another global batch is
    # refused: test_another_global_batch_is_refused_in_one_line).
    keep = {
        "train.batch_size": ["train.grad_accum=2"],
        "train.grad_accum": ["train.batch_size=1"],
        "train.parallel": ["train.check_replicas=false"],  # whole replicas only: refused with fsdp
    }
    return [f"{key}={value}", *keep.get(key, [])]


_DEFAULTS = load_config()  # once: this runs at collection, in every xdist worker
KIND = {key: resume_kind(_DEFAULTS, key) for key in ALTERNATIVES}  # the default task's keys included
REFUSED = [k for k, v in ALTERNATIVES.items() if v is not None and KIND[k] == "refused"]
APPLIED = sorted(
    k for k in ALTERNATIVES if KIND[k] == "applied" and k not in NEEDS_TOKENIZER and ALTERNATIVES[k] is not None
)


def test_another_global_batch_is_refused_in_one_line(four_steps, tmp_path):
    out = copy_run(four_steps, tmp_path)
    with pytest.raises(DistqaError, match="global batch") as caught:
        run(out, "train.max_steps=6", "train.batch_size=4")  # 4 x 1 rank instead of 2 x 1
    assert "\n" not in str(caught.value) and "train.batch_size" in str(caught.value), caught.value


@pytest.mark.parametrize("key", REFUSED)
def test_a_changed_setting_that_changes_the_state_is_refused_in_one_line(four_steps, tmp_path, key, minilm_dir):
    out = copy_run(four_steps, tmp_path)
    with pytest.raises(DistqaError) as caught:
        run(out, "train.max_steps=6", *alternative(key, tmp_path, minilm_dir))
    message = str(caught.value)
    assert "\n" not in message and key in message, message
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step-2", "step-4"]  # nothing written


@pytest.mark.safety  # about 27 s: make test-safety, for make test's 5 minutes
@pytest.mark.parametrize("key", APPLIED)
def test_a_changed_setting_that_applies_from_the_resume_step_names_itself(
    four_steps, tmp_path, key, minilm_dir, capsys
):
    out = copy_run(four_steps, tmp_path)
    capsys.readouterr()
    run(out, *(["train.max_steps=6"] if key != "train.max_steps" else []), *alternative(key, tmp_path, minilm_dir))
    printed = capsys.readouterr().out
    assert "resumed from" in printed and "applied from step 4 on" in printed and key in printed


def test_settings_that_change_nothing_computed_resume_silently_all_at_once(four_steps, tmp_path, minilm_dir, capsys):
    keys = [k for k in sorted(ALTERNATIVES) if KIND[k] == "silent" and ALTERNATIVES[k] is not None]
    keys = [k for k in keys if k not in NEEDS_TOKENIZER]
    out = copy_run(four_steps, tmp_path)
    args = [arg for key in keys for arg in alternative(key, tmp_path, minilm_dir)]
    capsys.readouterr()
    run(out, *(arg for arg in args if not arg.startswith("train.max_steps=")), "train.max_steps=5")
    # (train.eval_every's other value is said to do nothing here: this run has no data.valid.)
    printed = capsys.readouterr().out.replace("warning: train.eval_every=", "")
    # The one warning: the run made longer (4 -> 5 steps) takes the new length's schedule.
    warnings = [line for line in printed.splitlines() if "warning" in line]
    assert "resumed from" in printed and len(warnings) == 1, printed
    assert "with another length, applied from step 4 on: 4 -> 5 steps" in warnings[0]


@pytest.mark.parametrize("key", sorted(NEEDS_TOKENIZER))
def test_nq_data_without_a_tokenizer_is_one_line(four_steps, tmp_path, key, minilm_dir):
    out = copy_run(four_steps, tmp_path)
    with pytest.raises(DistqaError, match="model.tokenizer"):
        run(out, "train.max_steps=6", *alternative(key, tmp_path, minilm_dir))


def test_resume_from_a_folder_into_another_output_dir(four_steps, six_steps, tmp_path):
    out = run(tmp_path / "elsewhere", "train.max_steps=6", f"train.resume={four_steps / 'checkpoints' / 'step-4'}")
    assert max_abs_diff(load_weights(out), load_weights(six_steps)) == 0.0


def test_a_changed_rate_takes_effect_on_resume(four_steps, tmp_path):
    out = copy_run(four_steps, tmp_path)
    run(out, "train.max_steps=6", "train.lr=2e-3")
    lrs = [json.loads(x)["lr"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lrs == [1e-3] * 4 + [2e-3] * 2


def test_a_checkpoint_past_the_end_is_refused(four_steps, tmp_path):
    out = copy_run(four_steps, tmp_path)
    with pytest.raises(ConfigError, match=r"step-4 is at step 4, past this run's 3 steps: raise train.max_steps"):
        run(out, "train.max_steps=3")


def test_a_task_setting_renamed_added_or_dropped_since_the_checkpoint_is_a_change(four_steps, monkeypatch):
    """Only keys on both sides were compared: a fork's task.max_words renamed task.max_len (16 words
    cut to 2 from the resume step on), or a dict setting's entry left out (a class weight back to
    1.0), resumed without a word, exit 0. A core key an older distqa lacked is still no change."""
    import copy
    import dataclasses

    from distqa import resume
    from distqa.checkpoint_verify import read_trainer_state

    directory = four_steps / "checkpoints" / "step-4"
    state = read_trainer_state(directory)
    cfg = load_config(None, [*BASE, f"output_dir={four_steps}", "train.max_steps=4"])
    assert resume.changed_settings(state, cfg) == ({}, {})
    older = copy.deepcopy(state)
    del older["config"]["train"]["check_finite"]  # a core key the checkpoint's distqa did not have
    assert resume.changed_settings(older, cfg) == ({}, {})

    renamed = copy.deepcopy(state)
    renamed["config"]["task"]["max_words"] = renamed["config"]["task"].pop("max_seq_len")
    renamed["config"]["task"]["weights"] = {"positive": 2.0}
    assert resume.changed_settings(renamed, cfg) == (
        {"task.max_seq_len": resume.ABSENT, "task.max_words": 64, "task.weights.positive": 2.0},
        {"task.max_seq_len": 64, "task.max_words": resume.ABSENT, "task.weights.positive": resume.ABSENT},
    )
    monkeypatch.setattr(resume, "read_trainer_state", lambda _: renamed)
    with pytest.raises(
        ConfigError, match=r"changed task.max_seq_len \(absent -> 64\), task.max_words \(64 -> absent\)"
    ):
        resume.check_resumable(directory, cfg, global_batch=state["global_batch"])

    # A tuple default is the list trainer_state.json holds: no change (every resume of it was refused).
    @dataclasses.dataclass
    class Words:
        name: str = "nq"
        stop_words: tuple[str, ...] = ("the", "a")

    listed = copy.deepcopy(state)
    listed["config"]["task"] = {"name": "nq", "stop_words": ["the", "a"]}
    assert resume.changed_settings(listed, dataclasses.replace(cfg, task=Words())) == ({}, {})


def test_a_grad_accum_derived_from_the_global_batch_is_no_change_on_resume(four_steps):
    """1 process then 2 at train.global_batch=8: the warning said train.grad_accum (2 -> 1) changed,
    and config-history/ kept a copy, though the command line never set it."""
    import copy
    import dataclasses

    from distqa import resume
    from distqa.checkpoint_verify import read_trainer_state

    state = copy.deepcopy(read_trainer_state(four_steps / "checkpoints" / "step-4"))
    state["config"]["train"].update(global_batch=8, grad_accum=2)
    cfg = load_config(None, [*BASE, f"output_dir={four_steps}", "train.max_steps=4", "train.global_batch=8"])
    cfg.train.resolve_global_batch(4)  # 4 processes of train.batch_size=2: no accumulation
    assert cfg.train.grad_accum == 1 and resume.changed_settings(state, cfg) == ({}, {})
    # Without a global batch it is the user's own setting: a change.
    state["config"]["train"]["global_batch"] = 0
    plain = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch=0))
    assert resume.changed_settings(state, plain) == ({"train.grad_accum": 2}, {"train.grad_accum": 1})


def test_an_entry_of_a_dict_setting_is_judged_by_its_settings_resume_kind(four_steps):
    """A dict setting declared resume="applied" (or "silent") had each entry refused: its
    entries' keys (task.weights.pos) named no field, and a key without one is refused."""
    import dataclasses

    from distqa.config import setting
    from distqa.resume import resume_kind

    @dataclasses.dataclass
    class Weighted:
        name: str = "nq"
        weights: dict[str, float] = setting({"pos": 1.0}, "class weights", resume="applied")
        names: dict[str, str] = setting({}, "display names", resume="silent")
        frozen: dict[str, float] = setting({"a": 1.0}, "changes the model")

    cfg = dataclasses.replace(load_config(None, BASE), task=Weighted())
    assert resume_kind(cfg, "task.weights.pos") == resume_kind(cfg, "task.weights.neg") == "applied"
    assert resume_kind(cfg, "task.names.a") == "silent"
    assert resume_kind(cfg, "task.frozen.a") == "refused"
    assert resume_kind(cfg, "task.missing.a") == resume_kind(cfg, "train.lr.x") == "refused"
    assert resume_kind(cfg, "train.lr") == "applied"


def test_a_momentum_an_adamw_checkpoint_recorded_is_no_change(four_steps):
    """Recorded before train.momentum was refused without sgd (it did nothing): a resume without it
    was warned of a change, and a finished run's rerun refused."""
    import copy

    from distqa import resume
    from distqa.checkpoint_verify import read_trainer_state

    state = copy.deepcopy(read_trainer_state(four_steps / "checkpoints" / "step-4"))
    state["config"]["train"]["momentum"] = 0.9
    cfg = load_config(None, [*BASE, f"output_dir={four_steps}", "train.max_steps=4"])
    assert cfg.train.optimizer == "adamw" and resume.changed_settings(state, cfg) == ({}, {})
