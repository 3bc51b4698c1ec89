"""`distqa prepare --output` that cannot be written is one line naming the path; a writable output
folder is enough even where its parent is not; a half-written folder is never taken as complete."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, TESTS, subprocess_env, unavailable
from distqa import cli
from distqa.errors import DistqaError
from distqa.nq import feature_folder, prepare
from distqa.nq.feature_folder import LOCK_FILE, STAGING_DIR, read_stamp
from distqa.nq.features import FeatureSettings
from distqa.nq.prepare import FINGERPRINT_FILE, load_features, prepare_features

SAMPLE = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"
SETTINGS = FeatureSettings(max_seq_len=128, doc_stride=64)


def assert_one_line_error(rc: int, stderr: str, path: Path) -> None:
    assert rc != 0
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("distqa: error:") and str(path) in last, last


def cli_prepare(capsys, output: Path, minilm_dir: Path) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli.main(["prepare", "--input", str(SAMPLE), "--output", str(output), f"model.tokenizer={minilm_dir}"])
    return rc, capsys.readouterr().err


def test_output_that_is_a_file_is_one_line_and_the_file_is_kept(tmp_path, capsys, minilm_dir):
    existing = tmp_path / "file.txt"
    existing.write_bytes(b"notes\n")
    for output in (existing, existing / "sub"):
        rc, err = cli_prepare(capsys, output, minilm_dir)
        assert_one_line_error(rc, err, output)
        assert "is a file, not a folder" in err
    assert existing.read_bytes() == b"notes\n"


def test_more_processes_than_cpus_are_said_and_capped(tmp_path, capsys, minilm_dir):
    """--num-proc 50 on the 10-line sample started 50 processes, and 10**11 filled the memory (its
    list of byte ranges) before anything was read."""
    from distqa.dist import usable_cpus

    capsys.readouterr()
    args = ["prepare", "--input", str(SAMPLE), "--output", str(tmp_path / "out"), f"model.tokenizer={minilm_dir}"]
    assert cli.main([*args, "--num-proc", "50"]) == 0
    out = capsys.readouterr().out
    cpus = usable_cpus()
    assert f"--num-proc 50 is more than the {cpus} CPU(s) this process may use: {cpus} process(es)" in out, out
    assert f"with {cpus} process(es)" in out


def test_an_input_no_line_of_which_can_be_read_is_one_line_and_leaves_no_output_folder(tmp_path, capsys, minilm_dir):
    """A .gz or BOM input was 'holds no examples: it is blank' (the worker's own refusal, wrapped by
    `datasets`, was lost), and --output was left holding only its lock file."""
    import gzip

    packed = tmp_path / "in.jsonl.gz"
    packed.write_bytes(gzip.compress(SAMPLE.read_bytes()))
    marked = tmp_path / "bom.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + SAMPLE.read_bytes())
    blank = tmp_path / "blank.jsonl"
    blank.write_bytes(b"\n  \n")
    cases = [(packed, "is gzip-compressed"), (marked, "starts with a UTF-8 byte-order mark")]
    for source, expected in [*cases, (blank, "holds no examples: it is blank")]:
        output = tmp_path / f"out-{source.name}"
        capsys.readouterr()
        rc = cli.main(["prepare", "--input", str(source), "--output", str(output), f"model.tokenizer={minilm_dir}"])
        err = capsys.readouterr().err
        assert_one_line_error(rc, err, source)
        assert f"{source} {expected}" in err.strip().splitlines()[-1], err
        assert not output.exists(), sorted(p.name for p in output.iterdir())


def test_prepare_and_predict_with_a_config_need_only_their_input(tmp_path, capsys, monkeypatch, minilm_dir):
    """docs/nq.md's `distqa prepare --config configs/bert-base.yaml --input ...` was refused until
    data/split/train.jsonl and valid.jsonl existed, though --input is the only file it reads."""
    monkeypatch.chdir(tmp_path)  # no data/split here
    config = str(ROOT / "configs" / "bert-base.yaml")
    keys = [f"model.tokenizer={minilm_dir}", "task.max_seq_len=128", "task.doc_stride=64"]
    out = tmp_path / "features"
    rc = cli.main(["prepare", "--config", config, "--input", str(SAMPLE), "--output", str(out), *keys])
    assert rc == 0, capsys.readouterr().err
    assert len(load_features(out)) > 0
    missing = tmp_path / "no-model"
    rc = cli.main(
        ["predict", "--config", config, "--input", str(SAMPLE), "--checkpoint", str(missing), "--output", "s.csv"]
    )
    err = capsys.readouterr().err
    assert rc != 0 and f"--checkpoint {missing}: no model there" in err and "data." not in err, err


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A folder another user can enter (pytest's tmp_path is private to its owner)."""
    path = Path(tempfile.mkdtemp(prefix="distqa-prepare-"))
    path.chmod(0o755)
    yield path
    for folder, _, _ in os.walk(path):
        os.chmod(folder, 0o755)  # a non-root owner needs write access back to remove it
    shutil.rmtree(path)


def unprivileged(env: dict[str, str]) -> list[str]:
    """The prefix that runs a command where folder permissions apply: root ignores them."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        unavailable("running as root, which ignores folder permissions, and setpriv is missing to drop them")
    prefix = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    probe = subprocess.run([*prefix, sys.executable, "-c", "import distqa"], env=env, capture_output=True, cwd=ROOT)
    if probe.returncode != 0:
        unavailable(f"user 65534 cannot run this Python and distqa: {probe.stderr.decode()[-200:]}")
    return prefix


# `distqa ARGS...` for each ARGS in one interpreter, as `python -m distqa` runs it (its exit status,
# stdout and stderr, at the file descriptors: what a terminal would show), one after the other. One
# start of torch, transformers and datasets instead of one per command: seconds each.
DRIVER = """
import json, os, sys, traceback
from distqa.cli import main
folder, results = sys.argv[1], []
for index, argv in enumerate(json.loads(sys.argv[2])):
    streams = [open(os.path.join(folder, f"{index}.{name}"), "w+") for name in ("out", "err")]
    saved = [os.dup(1), os.dup(2)]
    os.dup2(streams[0].fileno(), 1), os.dup2(streams[1].fileno(), 2)
    try:
        code = main(argv)
    except SystemExit as exit:
        code = exit.code
    except BaseException:
        traceback.print_exc()  # what the interpreter prints for an uncaught exception
        code = 1
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(saved[0], 1), os.dup2(saved[1], 2)
    streams[0].seek(0), streams[1].seek(0)
    results.append([code, streams[0].read(), streams[1].read()])
print(json.dumps(results))
"""


def commands_in_one_process(
    prefix: list[str], env: dict[str, str], scratch: Path, commands: list[list[str]]
) -> list[tuple[int, str, str]]:
    """[(exit status, stdout, stderr)] of each `distqa` command, run in one process (see DRIVER);
    `scratch`: a folder the process may write its captured streams in."""
    folder = Path(tempfile.mkdtemp(dir=scratch))
    folder.chmod(0o777)
    cmd = [*prefix, sys.executable, "-c", DRIVER, str(folder), json.dumps(commands)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [tuple(result) for result in json.loads(proc.stdout.strip().splitlines()[-1])]


@pytest.mark.safety  # about 7 s: make test-safety, for make test's 5 minutes
def test_unwritable_output_is_one_line_and_a_writable_folder_is_enough(shared_tmp, minilm_dir):
    hf_home = shared_tmp / "hf"
    hf_home.mkdir(mode=0o777)
    hf_home.chmod(0o777)
    env = subprocess_env(HF_HOME=str(hf_home))
    locked = shared_tmp / "locked"
    stale = locked / "features"
    # Features of other settings, made earlier: stale, to be replaced in place.
    prepare_features(SAMPLE, stale, tokenizer_name=str(minilm_dir), settings=FeatureSettings(max_seq_len=256))
    for path in (stale, *stale.iterdir()):
        path.chmod(0o777 if path.is_dir() else 0o666)
    readonly = locked / "readonly"
    shutil.copytree(stale, readonly)
    readonly.chmod(0o555)
    kept = {p.name: p.read_bytes() for p in readonly.iterdir()}
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    prefix = unprivileged(env)

    keys = [f"model.tokenizer={minilm_dir}", "task.max_seq_len=128", "task.doc_stride=64"]
    missing = locked / "new"
    commands = [["prepare", "--input", str(SAMPLE), "--output", str(p), *keys] for p in (missing, readonly, stale)]
    results = commands_in_one_process(prefix, env, hf_home, commands)

    rc, _, err = results[0]
    assert_one_line_error(rc, err, missing)
    assert "Permission denied" in err and not missing.exists()

    rc, _, err = results[1]
    assert_one_line_error(rc, err, readonly)
    assert {p.name: p.read_bytes() for p in readonly.iterdir()} == kept  # the old features stay

    rc, out, err = results[2]
    assert rc == 0, err
    assert f"to {stale}" in out
    assert sorted(p.name for p in stale.iterdir()) == sorted(
        ["data-00000-of-00001.arrow", "dataset_info.json", "state.json", FINGERPRINT_FILE, LOCK_FILE]
    )
    record = json.loads((stale / FINGERPRINT_FILE).read_text())
    assert record["fingerprint"]["settings"]["max_seq_len"] == 128
    assert len(load_features(stale)) == record["features"] > 0


def test_a_run_killed_mid_build_leaves_a_folder_that_is_rebuilt_not_used(tmp_path, minilm_dir):
    out = tmp_path / "features"
    # What SIGKILL during the build leaves: the staging folder, no fingerprint.
    (out / STAGING_DIR / "dataset").mkdir(parents=True)
    (out / STAGING_DIR / "dataset" / "state.json").write_bytes(b"\x00\xff{")
    with pytest.raises(DistqaError, match="not a folder written by `distqa prepare`"):
        load_features(out)
    result = prepare_features(SAMPLE, out, tokenizer_name=str(minilm_dir), settings=SETTINGS)
    assert not result.reused and len(load_features(out)) == result.features
    assert not (out / STAGING_DIR).exists()


@pytest.mark.safety  # about 3 s: make test-safety, for make test's 5 minutes
@pytest.mark.parametrize("when", ["removing the old files", "before the new stamp"])
def test_a_crash_while_swapping_in_is_never_taken_as_complete(tmp_path, monkeypatch, minilm_dir, when):
    out = tmp_path / "features"
    old = prepare_features(SAMPLE, out, tokenizer_name=str(minilm_dir), settings=FeatureSettings(max_seq_len=256))
    real_fsync, real_unlink, real_iterdir = feature_folder.fsync_path, Path.unlink, Path.iterdir
    removed = []

    def crash_before_the_stamp(path: Path) -> None:
        if path.name == FINGERPRINT_FILE:
            raise KeyboardInterrupt  # as a Ctrl-C between moving the data in and writing the stamp
        real_fsync(path)

    def crash_half_way_through_removal(path: Path, missing_ok: bool = False) -> None:
        if path.parent == out and path.name != FINGERPRINT_FILE:
            # Whatever order the folder lists its files in, the stamp goes before any of them.
            assert not (out / FINGERPRINT_FILE).exists(), f"{path.name} removed while the folder looked complete"
            removed.append(path.name)
            if len(removed) == 2:
                raise KeyboardInterrupt  # one old data file gone, the others still there
        real_unlink(path, missing_ok=missing_ok)

    def stamp_listed_last(path: Path) -> Iterator[Path]:
        return iter(sorted(real_iterdir(path), key=lambda p: p.name == FINGERPRINT_FILE))

    if when == "before the new stamp":
        monkeypatch.setattr(feature_folder, "fsync_path", crash_before_the_stamp)
    else:
        monkeypatch.setattr(Path, "unlink", crash_half_way_through_removal)
        monkeypatch.setattr(Path, "iterdir", stamp_listed_last)  # the order most at risk
    with pytest.raises(KeyboardInterrupt):
        prepare_features(SAMPLE, out, tokenizer_name=str(minilm_dir), settings=SETTINGS)
    monkeypatch.undo()
    with pytest.raises(DistqaError, match="not a folder written by `distqa prepare`"):
        load_features(out)  # a mix of old and new files, or some missing: without a stamp, not complete
    assert (out / STAGING_DIR).is_dir()  # the marker that this stamp-less folder is ours
    # Neither the old fingerprint nor the new one is trusted: built again.
    again = prepare_features(SAMPLE, out, tokenizer_name=str(minilm_dir), settings=FeatureSettings(max_seq_len=256))
    assert not again.reused and again.features == old.features == len(load_features(out))


def test_a_full_disk_while_writing_is_one_line(tmp_path, monkeypatch, minilm_dir):
    def no_space(self, path, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prepare.datasets.Dataset, "save_to_disk", no_space)
    out = tmp_path / "features"
    with pytest.raises(DistqaError, match=rf"cannot write features to {out}: No space left on device"):
        prepare_features(SAMPLE, out, tokenizer_name=str(minilm_dir), settings=SETTINGS)
    # The staging folder is gone; a folder holding only the lock file is fine to reuse.
    assert [p.name for p in out.iterdir()] == [LOCK_FILE]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_a_damaged_fingerprint_file_is_never_trusted_nor_a_crash(data):
    with tempfile.TemporaryDirectory() as folder:
        stamp = Path(folder) / FINGERPRINT_FILE
        stamp.write_bytes(data)
        record = read_stamp(stamp)
        assert record is None or isinstance(record, dict)


def test_a_damaged_fingerprint_file_means_rebuild(tmp_path, minilm_dir):
    out = tmp_path / "features"
    prepare_features(SAMPLE, out, tokenizer_name=str(minilm_dir), settings=SETTINGS)
    for damage in (b"\xff\xfe[", b"[]", b'{"fingerprint": 5}'):
        (out / FINGERPRINT_FILE).write_bytes(damage)
        assert not prepare_features(SAMPLE, out, tokenizer_name=str(minilm_dir), settings=SETTINGS).reused
        assert prepare_features(SAMPLE, out, tokenizer_name=str(minilm_dir), settings=SETTINGS).reused


@pytest.mark.safety  # about 11 s: make test-safety, for make test's 5 minutes
def test_a_second_prepare_into_the_same_folder_waits_for_the_first_and_reuses_its_features(tmp_path, minilm_dir):
    """Two writers of one folder (two runs sharing a feature cache, `prepare` beside a training run)
    used to delete each other's staging folder: both failed, one with a false "no features". The
    lock of the folder is held here while a real `distqa prepare` starts into it: it must say that
    it waits, write nothing meanwhile, then build the folder once the lock is free. A second
    command started after it then reuses the folder instead of rebuilding it."""
    import fcntl

    out = tmp_path / "features"
    out.mkdir()
    command = [sys.executable, "-m", "distqa", "prepare", "--input", str(SAMPLE), "--output", str(out)]
    command += [f"model.tokenizer={minilm_dir}", "task.max_seq_len=128", "task.doc_stride=64"]
    lock_fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # as another writer holds it
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        line = first.stdout.readline()  # the first line it prints: it must wait before writing
        assert line.startswith(f"waiting for another process that is preparing features in {out}"), line
        assert [p.name for p in out.iterdir()] == [LOCK_FILE]  # no staging folder while it waits
    finally:
        os.close(lock_fd)  # the other writer is done
    rest, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert "wrote" in rest and len(load_features(out)) > 0
    second = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert second.returncode == 0, second.stderr
    assert "reused" in second.stdout and "waiting" not in second.stdout, second.stdout


def test_a_preparation_process_that_dies_is_said_not_taken_for_a_blank_file(tmp_path, monkeypatch, minilm_dir):
    """A worker that crashed (seen: a segfault in a forked worker) wrote no counts, and the file was
    called blank ("holds no examples: it is blank")."""
    real = prepare._generate

    def dying(shards):
        if any(shard["range"][0] > 0 for shard in shards):  # the second half's process
            os.kill(os.getpid(), signal.SIGKILL)
        yield from real(shards)

    monkeypatch.setattr(prepare, "_generate", dying)
    out = tmp_path / "out"
    with pytest.raises(DistqaError, match=r"a process preparing \S+ ended before finishing .*run again"):
        prepare_features(SAMPLE, out, tokenizer_name=str(minilm_dir), settings=SETTINGS, num_proc=2)
    assert not (out / FINGERPRINT_FILE).exists()


def test_unreadable_inputs_of_score_and_predict_are_one_line(shared_tmp):
    """A submission, a gold file or a model folder the user may not read: PermissionError
    tracebacks (score opened the submission outside its checks, read_gold caught no OSError,
    predict's first look into the folder raised), found by a review."""
    env = subprocess_env(HF_HOME=str(shared_tmp / "hf"))
    prefix = unprivileged(env)
    submission, gold, model = shared_tmp / "submission.csv", shared_tmp / "gold.jsonl", shared_tmp / "model"
    settings = shared_tmp / "settings.yaml"  # ("is not valid YAML: Permission denied")
    settings.write_text("train:\n  lr: 0.001\n")
    submission.write_text("example_id,PredictionString\n")
    shutil.copy(SAMPLE, gold)
    model.mkdir()
    (shared_tmp / "w").mkdir(mode=0o777)
    (shared_tmp / "w").chmod(0o777)
    for path in (submission, gold, model, settings):
        path.chmod(0)
    readable = TESTS / "fixtures" / "nq" / "submission.csv"
    commands = [
        ["score", "--pred", str(submission), "--gold", str(SAMPLE)],
        ["score", "--pred", str(readable), "--gold", str(gold)],
        ["predict", "--input", str(SAMPLE), "--checkpoint", str(model), "--output", str(shared_tmp / "w" / "out.csv")],
        ["train", "--config", str(settings), "--check-config"],
    ]
    results = commands_in_one_process(prefix, env, shared_tmp, commands)
    for (rc, _, err), path in zip(results, (submission, gold, model, settings), strict=True):
        assert_one_line_error(rc, err, path)
        assert "cannot be read (Permission denied)" in err.strip().splitlines()[-1], err
