"""What a run writes in output_dir is its own, and what it reads back is what it claims: no write
through a planted symbolic link, config.yaml kept in config-history/ before it is rewritten, no
checkpoint renamed into a folder another run took over, no checkpoint with NaN/inf weights chosen
for resume, and a tampered checkpoint file is one line naming it. Checkpoints here are written by
`save_checkpoint` itself around a tiny model, in this process: milliseconds each."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from distqa import checkpoint, runlock
from distqa.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
from distqa.checkpoint_verify import sha256
from distqa.dist import DistInfo
from distqa.errors import DistqaError
from distqa.metrics import MetricsWriter
from distqa.outdir import RUN_PATHS, archive_config, claim, write_text
from distqa.resume import choose_checkpoint
from distqa.runlock import LOCK_NAME, RunLock

MAIN = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def outside_file(tmp_path: Path) -> tuple[Path, bytes]:
    target = tmp_path / "outside" / "precious.txt"
    target.parent.mkdir(exist_ok=True)
    data = b"the user's own file\n"
    target.write_bytes(data)
    return target, data


# ---------------------------------------------------------------------- links in output_dir
@pytest.mark.parametrize("name", RUN_PATHS)
def test_a_run_file_that_is_a_link_is_refused_before_the_lock_is_taken(tmp_path, name):
    out = tmp_path / "run"
    out.mkdir()
    target, data = outside_file(tmp_path)
    (out / name).symlink_to(target.parent if name in ("checkpoints", "model", "tb", "config-history") else target)
    with pytest.raises(DistqaError) as refused:
        claim(out, MAIN)
    message = str(refused.value)
    assert f"{out / name} is a symbolic link" in message and "\n" not in message
    assert target.read_bytes() == data and sorted(p.name for p in target.parent.iterdir()) == ["precious.txt"]
    assert (out / LOCK_NAME).is_symlink() if name == LOCK_NAME else not (out / LOCK_NAME).exists()


def test_an_output_dir_that_is_a_file_or_holds_a_folder_named_run_lock_is_said_so(tmp_path):
    """'cannot be written: File exists' and '... Is a directory' named neither what nor where."""
    (tmp_path / "file").write_text("notes\n")
    with pytest.raises(DistqaError, match=r"output_dir='.*/file' is a file, not a folder: name another output_dir"):
        claim(tmp_path / "file", MAIN)
    assert (tmp_path / "file").read_text() == "notes\n"
    (tmp_path / "run" / LOCK_NAME).mkdir(parents=True)
    with pytest.raises(DistqaError, match=rf"cannot be written: Is a directory \({tmp_path / 'run' / LOCK_NAME}\)"):
        claim(tmp_path / "run", MAIN)


def test_a_run_into_a_folder_whose_config_yaml_is_a_link_stops_and_leaves_its_target_alone(tmp_path):
    from conftest import SMALL
    from distqa.registry import load_config
    from distqa.trainer import train

    out = tmp_path / "run"
    out.mkdir()
    target, data = outside_file(tmp_path)
    (out / "config.yaml").symlink_to(target)
    with pytest.raises(DistqaError, match=rf"{out / 'config.yaml'} is a symbolic link"):
        train(load_config(None, [*SMALL, "train.max_steps=1", f"output_dir={out}"]))
    assert target.read_bytes() == data and sorted(p.name for p in out.iterdir()) == ["config.yaml"]


def test_writes_replace_a_link_planted_after_the_claim_never_write_through_it(tmp_path):
    out = tmp_path / "run"
    lock = claim(out, MAIN)
    assert lock is not None
    try:
        target, data = outside_file(tmp_path)
        (out / "config.yaml").symlink_to(target)
        write_text(out / "config.yaml", "seed: 1\n", MAIN)
        assert not (out / "config.yaml").is_symlink() and (out / "config.yaml").read_text() == "seed: 1\n"
        assert target.read_bytes() == data
        assert sorted(p.name for p in out.iterdir()) == ["config.yaml", LOCK_NAME]  # no temporary file left

        metrics = MetricsWriter(out, MAIN)
        (out / "metrics.jsonl").symlink_to(target)
        with pytest.raises(DistqaError, match=rf"cannot append to {out / 'metrics.jsonl'} \(it is a symbolic link\)"):
            metrics.log({"step": 1, "loss": 0.5})
        metrics.close()
        assert target.read_bytes() == data
    finally:
        lock.release()


# ---------------------------------------------------------------------- config history
def test_archive_config_keeps_every_earlier_config_and_overwrites_none(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    assert archive_config(out, 4, MAIN) is None and not (out / "config-history").exists()  # nothing to keep
    (out / "config.yaml").write_text("train:\n  lr: 0.1\n")
    assert archive_config(out, 4, MAIN) == out / "config-history" / "4.yaml"
    (out / "config.yaml").write_text("train:\n  lr: 0.2\n")
    assert archive_config(out, 4, MAIN) == out / "config-history" / "4-2.yaml"  # same step again: a new name
    assert (out / "config-history" / "4.yaml").read_text() == "train:\n  lr: 0.1\n"
    assert (out / "config-history" / "4-2.yaml").read_text() == "train:\n  lr: 0.2\n"
    assert sorted(p.name for p in (out / "config-history").iterdir()) == ["4-2.yaml", "4.yaml"]

    target, data = outside_file(tmp_path)
    (out / "config.yaml").unlink()
    (out / "config.yaml").symlink_to(target)
    with pytest.raises(DistqaError, match=r"cannot keep the earlier .*config.yaml as .*config-history/9.yaml") as e:
        archive_config(out, 9, MAIN)
    assert "\n" not in str(e.value) and not (out / "config-history" / "9.yaml").exists()


# ---------------------------------------------------------------------- checkpoints
def tiny_parts(fill: float | None = None) -> dict:
    model = nn.Linear(4, 3)
    if fill is not None:
        with torch.no_grad():
            model.weight[1, 2] = fill
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # momentum buffers: an optimizer state with tensors in it
    if fill is not None:
        with torch.no_grad():
            model.weight[1, 2] = fill
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "scaler": torch.amp.GradScaler("cpu", enabled=False),
    }


def save(root: Path, step: int, *, sharded: bool = False, fill: float | None = None, **extra) -> Path:
    state = {"step": step, "epoch": 0, "step_in_epoch": step, "global_batch": 2, "world_size": 1, "config": {}}
    return save_checkpoint(root, **tiny_parts(fill), trainer_state=state, info=MAIN, sharded=sharded, **extra)


def rehash(checkpoint: Path, name: str) -> None:
    """Fix the manifest's entry for `name`, so that only what else is wrong with it shows."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    path = checkpoint / name
    manifest[name] = {"bytes": path.stat().st_size, "sha256": sha256(path)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("key", ["log_window", "grad_norm_window"])
@pytest.mark.parametrize("value", ["abc", [1.0], [1.0, "2"], [1.0, float("nan")], [True, 1.0], {"a": 1}, 5])
def test_a_trainer_state_with_a_bad_log_window_is_damaged_not_a_traceback(tmp_path, capsys, key, value):
    """A crafted trainer_state.json whose manifest matches: skipped like any damaged checkpoint."""
    root = tmp_path / "checkpoints"
    first, second = save(root, 1), save(root, 2)
    state = json.loads((second / "trainer_state.json").read_text())
    assert key not in state  # absent (a checkpoint of before they were kept): fine
    (second / "trainer_state.json").write_text(json.dumps({**state, key: [3.5, 2]}))
    rehash(second, "trainer_state.json")
    assert verify_checkpoint(second) is None
    (second / "trainer_state.json").write_text(json.dumps({**state, key: value}))
    rehash(second, "trainer_state.json")
    assert verify_checkpoint(second) == f"trainer_state.json has no valid {key!r} (two finite numbers)"
    assert choose_checkpoint(tmp_path, "auto", MAIN) == first
    assert f"skipping checkpoint {second}: trainer_state.json has no valid {key!r}" in capsys.readouterr().out


GOOD_BEST = {"metric": "eval_f1", "mode": "max", "value": 0.5, "step": 2}


@pytest.mark.parametrize(
    "best",
    [{**GOOD_BEST, "value": float("nan")}, {**GOOD_BEST, "value": "abc"}, {**GOOD_BEST, "value": True},
     {**GOOD_BEST, "step": 3}, {**GOOD_BEST, "step": "2"}, {**GOOD_BEST, "mode": "auto"}, [1, 2], "best"],
)  # fmt: skip
def test_a_trainer_state_with_a_bad_best_record_is_damaged_not_a_frozen_best(tmp_path, capsys, best):
    """A NaN value was beaten by no evaluation (checkpoints/best stuck on an earlier step, exit 0);
    a text one stopped every evaluation with a traceback (found by a review)."""
    root = tmp_path / "checkpoints"
    first, second = save(root, 1), save(root, 2)
    state = json.loads((second / "trainer_state.json").read_text())
    (second / "trainer_state.json").write_text(json.dumps({**state, "best": GOOD_BEST}))
    rehash(second, "trainer_state.json")
    assert verify_checkpoint(second) is None
    (second / "trainer_state.json").write_text(json.dumps({**state, "best": best}))
    rehash(second, "trainer_state.json")
    assert (
        verify_checkpoint(second)
        == "trainer_state.json has no valid 'best' (metric, mode, a finite value, a step up to its own)"
    )
    assert choose_checkpoint(tmp_path, "auto", MAIN) == first
    assert f"skipping checkpoint {second}: trainer_state.json has no valid 'best'" in capsys.readouterr().out


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp"])
def test_a_checkpoint_is_not_renamed_into_a_folder_another_run_took_over(tmp_path, sharded, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 3600.0)  # only verify() can see the takeover
    out.mkdir()
    lock = RunLock(out)
    lock.acquire()
    try:
        root = out / "checkpoints"
        first = save(root, 1, sharded=sharded, keep=1, still_holding=lock.verify)
        answers = iter([None])  # held when the save starts; taken over while it writes

        def still_holding() -> str | None:
            if next(answers, "taken") is None:
                return None
            (out / LOCK_NAME).write_text(json.dumps({"host": "node-7", "pid": 4242, "token": "t"}))
            return lock.verify()

        with pytest.raises(DistqaError) as lost:
            save(root, 2, sharded=sharded, keep=1, still_holding=still_holding)
        message = str(lost.value)
        assert message.startswith(f"another run took over output_dir {out} (host node-7, pid 4242)")
        assert "checkpoint step-2 was not written" in message and "\n" not in message
        assert sorted(p.name for p in root.iterdir()) == ["step-1"]  # no step-2, no .tmp-step-2, step-1 not pruned
        assert verify_checkpoint(first) is None

        # Seen before the write starts: nothing is created, and a temporary folder there (the
        # new holder's) is left alone.
        (root / ".tmp-step-3").mkdir()
        with pytest.raises(DistqaError, match="checkpoint step-3 was not written"):
            save(root, 3, sharded=sharded, still_holding=lock.verify)
        assert sorted(p.name for p in root.iterdir()) == [".tmp-step-3", "step-1"]
    finally:
        lock.release()


def test_a_checkpoint_whose_weights_hold_nan_is_unusable_and_resume_takes_the_one_before(tmp_path, capsys):
    out = tmp_path / "run"
    root = out / "checkpoints"
    save(root, 1)
    bad = save(root, 2)
    assert verify_checkpoint(bad) is None
    weights = load_file(str(bad / "model.safetensors"))
    weights["bias"][0] = float("nan")
    save_file(weights, str(bad / "model.safetensors"))
    rehash(bad, "model.safetensors")  # the hash matches: only the values are wrong
    assert verify_checkpoint(bad) == "the model's weights hold NaN/inf (first: 'bias')"
    assert choose_checkpoint(out, "auto", MAIN) == root / "step-1"
    assert f"skipping checkpoint {bad}: the model's weights hold NaN/inf" in capsys.readouterr().out

    weights["bias"][0] = float("-inf")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(bad / "model.safetensors"))
    rehash(bad, "model.safetensors")
    assert verify_checkpoint(bad) == "the model's weights hold NaN/inf (first: 'bias')"


def test_a_sharded_checkpoint_whose_weights_hold_inf_is_unusable(tmp_path):
    root = tmp_path / "checkpoints"
    assert verify_checkpoint(save(root, 1, sharded=True)) is None
    bad = save(root, 2, sharded=True, fill=float("inf"))
    assert verify_checkpoint(bad) == "the model's weights hold NaN/inf (first: 'weight')"


class _Evil:
    marker: Path

    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))


def torch_saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "name, data",
    [
        ("rng-rank0.pt", b"\x00not a torch file at all"),
        ("rng-rank0.pt", torch_saved([1, 2, 3])),  # valid, of the wrong structure
        ("rng-rank0.pt", torch_saved({"python": (3, (1, 2), None), "numpy": 7, "torch": 1, "cuda": None})),
        ("rng-rank0.pt", "evil"),
        ("training_state.pt", "evil"),
        ("training_state.pt", torch_saved({"scheduler": [], "scaler": {}, "optimizer": {"state": 5}})),
    ],
)
def test_a_tampered_checkpoint_file_is_one_line_naming_it(tmp_path, name, data):
    _Evil.marker = tmp_path / "ran"
    checkpoint = save(tmp_path / "checkpoints", 1)
    (checkpoint / name).write_bytes(pickle.dumps(_Evil()) if data == "evil" else data)
    rehash(checkpoint, name)  # tampered by someone who also fixed the manifest
    assert verify_checkpoint(checkpoint) is None
    with pytest.raises(DistqaError) as refused:
        load_checkpoint(checkpoint, **tiny_parts(), info=MAIN)
    message = str(refused.value)
    assert message.startswith(f"cannot load checkpoint file {checkpoint / name}: ") and "\n" not in message
    assert "weights_only" not in message and "trust" not in message and "\x1b" not in message
    assert not _Evil.marker.exists()


TWO_RANK_SAVE = """
import os, sys
from pathlib import Path
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_output_safety import save
from distqa.dist import DistInfo
from distqa.errors import DistqaError
import test_output_safety

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
test_output_safety.MAIN = DistInfo(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"))
answers = iter([None, "another run took over output_dir X"])  # rank 0's lock: lost during the write
try:
    save(Path({root!r}), 2, sharded={sharded}, still_holding=lambda: next(answers))
except DistqaError as err:
    print("raised:", err, flush=True)
# A whole save, then rank 0 verifies it (reading the shards alone) while rank 1 waits for the verdict.
from distqa.checkpoint import verify_checkpoint
from distqa.dist import broadcast_object
written = save(Path({root!r}), 3, sharded={sharded})
print("verified:", broadcast_object(verify_checkpoint(written) if rank == 0 else None), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.safety
@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp"])
def test_every_rank_stops_when_rank_0_lost_the_lock_during_a_save(tmp_path, sharded):
    import subprocess
    import sys

    from conftest import TESTS, free_port, subprocess_env

    root = tmp_path / "checkpoints"
    code = TWO_RANK_SAVE.format(tests=str(TESTS), root=str(root), sharded=sharded)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-W", "ignore", "-c", code],
            env=subprocess_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-2000:]
        assert out.splitlines() == [
            "raised: another run took over output_dir X: checkpoint step-2 was not written, and this run stops",
            "verified: None",
        ]
    assert sorted(p.name for p in root.iterdir()) == ["step-3"]


def test_a_step_saved_again_is_whole_whenever_the_save_is_killed(tmp_path, monkeypatch):
    """step-N saved a second time (a resume that evaluates it, a finished run restarted) removed the
    old folder in place before the rename: a kill during that removal left step-N half deleted."""
    root = tmp_path / "checkpoints"
    save(root, 1)
    real = shutil.rmtree

    def killed_midway(path, *args, **kwargs):  # removes one file, then the process is gone
        files = sorted(p for p in Path(path).iterdir() if p.is_file()) if Path(path).is_dir() else []
        if files:
            files[0].unlink()
            raise SystemExit("killed")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_midway)
    with pytest.raises(SystemExit):
        save(root, 1, fill=2.0)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real)
    assert verify_checkpoint(root / "step-1") is None
    assert choose_checkpoint(tmp_path, "auto", MAIN) == root / "step-1"
    save(root, 1, fill=3.0)  # and the next save of it clears what the kill left
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]


def test_an_output_dir_outside_the_launchs_kept_folder_is_refused(tmp_path, monkeypatch):
    """run_docker_nodes.sh mounts RESULTS_DIR alone: output_dir=runs/a was written inside each
    container and removed with it, the script saying 'finished; results in ...', exit 0 (found by
    a review). A launch names its kept folder in DISTQA_OUTPUT_ROOT."""
    import torch

    from distqa.dist import DistInfo
    from distqa.outdir import claim

    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    kept = tmp_path / "results"
    kept.mkdir()
    monkeypatch.setenv("DISTQA_OUTPUT_ROOT", str(kept))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DistqaError, match=rf"output_dir='runs/a' \({tmp_path}/runs/a\) is not under {kept}, the only"):
        claim(Path("runs/a"), info)
    assert not (tmp_path / "runs").exists()
    (kept / "elsewhere").symlink_to(tmp_path / "outside", target_is_directory=True)
    with pytest.raises(DistqaError, match="is not under"):  # a link out of it is out of it
        claim(Path("results/elsewhere/run"), info)
    lock = claim(Path("results/a"), info)
    assert lock is not None and (kept / "a" / "run.lock").exists()
    lock.release()


def test_check_config_refuses_an_output_dir_outside_the_launchs_kept_folder(tmp_path, monkeypatch, capsys):
    """worker.sh runs `distqa train --check-config` before torchrun: it passed such an output_dir,
    and every rank then refused it, after torchrun had started them (found by a review)."""
    from distqa.cli import main

    monkeypatch.setenv("DISTQA_OUTPUT_ROOT", str(tmp_path / "results"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--check-config", "output_dir=runs/a"]) == 2
    assert capsys.readouterr().err.startswith(f"distqa: error: output_dir='runs/a' ({tmp_path}/runs/a) is not under")
    assert main(["train", "--check-config", "output_dir=results/a"]) == 0


def test_check_config_refuses_an_output_dir_that_is_a_file_or_lies_under_one(tmp_path, capsys):
    """--check-config passed both, and the run stopped only after torchrun had started every rank."""
    from distqa.cli import main

    (tmp_path / "notes").write_text("mine\n")
    assert main(["train", "--check-config", f"output_dir={tmp_path / 'notes'}"]) == 2
    said = capsys.readouterr().err
    assert said == f"distqa: error: output_dir='{tmp_path}/notes' is a file, not a folder: name another output_dir\n"
    assert main(["train", "--check-config", f"output_dir={tmp_path / 'notes' / 'run' / 'a'}"]) == 2
    assert f"lies under {tmp_path}/notes, which is a file" in capsys.readouterr().err
    assert main(["train", "--check-config", f"output_dir={tmp_path / 'new' / 'run'}"]) == 0
    assert (tmp_path / "notes").read_text() == "mine\n" and not (tmp_path / "new").exists()


# /proc/self/mountinfo as a container shows it: the root is the container's overlay layer, the
# results folder a bind mount of the host's, the data a mount whose name holds a space (escaped).
CONTAINER_MOUNTS = """\
601 540 0:52 / / rw,relatime master:310 - overlay overlay rw,lowerdir=/var/lib/docker/overlay2/l/A,upperdir=/x
602 601 0:55 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
610 601 254:0 /srv/results /app/results rw,relatime - ext4 /dev/vda rw
611 601 254:0 /srv/d /app/my\\040data rw,relatime - ext4 /dev/vda rw
612 610 0:60 / /app/results/tmp rw,relatime - overlay overlay rw
"""
HOST_MOUNTS = "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"


@pytest.mark.parametrize(
    ("path", "in_layer"),
    [
        ("/app/results/quickstart", False),  # the mounted folder
        ("/app/results", False),
        ("/app/runs/a", True),  # beside it: in the container's own layer
        ("/app/resultsX/a", True),  # a name that only starts like the mount
        ("/app/my data/run", False),  # the escaped mount point
        ("/app/results/tmp/a", False),  # an overlay mounted on a folder is not the container's root
    ],
)
def test_a_path_in_the_containers_own_layer_is_told_from_a_mounted_one(path, in_layer):
    from distqa.outdir import in_container_layer

    assert in_container_layer(Path(path), CONTAINER_MOUNTS) is in_layer
    assert in_container_layer(Path(path), HOST_MOUNTS) is False  # a host's root is no container layer


def test_a_run_into_the_containers_own_layer_is_warned_at_start_and_at_the_end(tmp_path, monkeypatch, capsys):
    """A plain `docker run --rm distqa` without -v trained into the container's layer and said
    'model written to results/quickstart/model', exit 0; the container's removal took it all."""
    from distqa import outdir
    from distqa.finish import summary

    mountinfo = tmp_path / "mountinfo"
    monkeypatch.setattr(outdir, "MOUNTINFO", mountinfo)
    mountinfo.write_text(HOST_MOUNTS)
    claim(tmp_path / "kept", MAIN).release()
    summary(tmp_path / "kept", plotted=False)
    assert "warning" not in capsys.readouterr().err
    mountinfo.write_text(CONTAINER_MOUNTS.replace("/app/results", str(tmp_path / "mounted")))
    claim(tmp_path / "mounted" / "run", MAIN).release()
    assert capsys.readouterr().err == ""
    claim(tmp_path / "run", MAIN).release()
    start = capsys.readouterr().err.splitlines()
    summary(tmp_path / "run", plotted=False)
    end = capsys.readouterr().err.splitlines()
    warning = (
        f"distqa: warning: output_dir='{tmp_path}/run' ({tmp_path}/run) is in this container's own file "
        "system, not a mounted folder: its checkpoints and model are removed with the container; mount a "
        'folder there to keep them (docker run -v "$PWD/results:/app/results" ...)'
    )
    assert start == [warning] and end == [warning]


def test_only_safetensors_that_only_their_owner_reads_are_opened(tmp_path):
    """safetensors writes 0600 (a host user of another uid read all but the weights); a fork's own
    files keep their modes (a first version set every file to 0644: a script lost its exec bit)."""
    from distqa.durable import as_umask_allows, umask

    modes = {"model.safetensors": 0o600, "adapter.safetensors": 0o700, "serve.sh": 0o755, "secret.token": 0o600}
    for name, mode in modes.items():
        (tmp_path / name).write_bytes(b"x")
        (tmp_path / name).chmod(mode)
    as_umask_allows(tmp_path.rglob("*"))
    got = {name: stat.S_IMODE((tmp_path / name).stat().st_mode) for name in modes}
    mask = umask()
    assert got == {
        "model.safetensors": 0o666 & ~mask | 0o600,
        "adapter.safetensors": 0o777 & ~mask | 0o700,
        "serve.sh": 0o755,
        "secret.token": 0o600,
    }, {name: oct(mode) for name, mode in got.items()}


def test_a_refused_write_names_the_folder_s_owner_and_this_uid(tmp_path, monkeypatch):
    """`docker run -v` of a folder the engine made (root's), the container running as uid 1000:
    "Permission denied" alone (a review)."""
    from distqa.outdir import _owner_note

    target = tmp_path / "results" / "q"
    denied = PermissionError(13, "Permission denied", str(target))
    owner = tmp_path.stat().st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1000)
    note = _owner_note(denied, str(target))
    assert note.startswith(f": {tmp_path} belongs to uid {owner} and this process runs as uid {owner + 1000}")
    assert "docker run --user" in note
    monkeypatch.setattr(os, "getuid", lambda: owner)
    assert _owner_note(denied, str(target)) == ""  # its own folder: something else refused it
    assert _owner_note(OSError(28, "No space left on device", str(target)), str(target)) == ""
