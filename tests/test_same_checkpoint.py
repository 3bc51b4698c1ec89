"""Every rank resumes from the checkpoint rank 0 chose and verified, or none starts.

Nodes that do not share output_dir each read their own copy: a review resumed a two-node run whose
node 1 held another run's step-10 at the same path, and both nodes trained on (and averaged the
gradients of) two different sets of weights with exit 0. Here two processes stand for two nodes,
each with its own folder: the same copy, another run's, none, a damaged one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distqa.registry import load_config
from distqa.trainer import train

TOY = [
    "task.name=toy_task:ToyClassificationTask",
    "task.size=64",
    "data.num_workers=0",
    "train.batch_size=8",
    "train.max_steps=3",
    "train.checkpoint_every=3",
]

CASES = ("same", "shared", "other", "missing", "damaged")

TWO_NODES = """
import os, sys, torch, torch.distributed as dist
from pathlib import Path
from distqa import checkpoint_verify
from distqa.dist import DistInfo
from distqa.errors import DistqaError
from distqa.resume import choose_checkpoint

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
info = DistInfo(rank=rank, local_rank=0, world_size=2, device=torch.device("cpu"))  # a node each
verify = checkpoint_verify.verify_checkpoint
verified = []
checkpoint_verify.verify_checkpoint = lambda folder: verified.append(folder) or verify(folder)
for case in sys.argv[2:]:
    node = 0 if case == "shared" else rank  # shared: both nodes see node 0's folder
    output_dir = Path(sys.argv[1]) / case / f"node{node}" / "run"  # each node's own path to its copy
    verified.clear()
    try:
        print(case, "resumes from", choose_checkpoint(output_dir, "auto", info), len(verified), flush=True)
    except DistqaError as err:
        print(case, "refused:", err, flush=True)
dist.destroy_process_group()
"""


def node_views(tmp_path: Path) -> None:
    """Node 0 holds run A in every case; node 1 a copy of A, run B (another seed), nothing, or A
    with one byte of its weights changed."""
    runs = {}
    for name, seed in (("A", 1), ("B", 2)):
        runs[name] = tmp_path / name
        train(load_config(None, [*TOY, f"seed={seed}", f"output_dir={runs[name]}"]))
    for case in CASES:
        shutil.copytree(runs["A"], tmp_path / case / "node0" / "run")
        if case == "shared":
            continue
        node1 = tmp_path / case / "node1" / "run"
        if case == "missing":
            node1.mkdir(parents=True)
            continue
        shutil.copytree(runs["B" if case == "other" else "A"], node1)
        if case == "damaged":
            weights = node1 / "checkpoints" / "step-3" / "model.safetensors"
            data = bytearray(weights.read_bytes())
            data[-1] ^= 0xFF
            weights.write_bytes(bytes(data))


@pytest.mark.safety
def test_every_node_resumes_from_its_own_copy_of_rank_0s_checkpoint_or_none_starts(tmp_path):
    from conftest import free_port, subprocess_env

    node_views(tmp_path)
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        subprocess.Popen(
            [sys.executable, "-W", "ignore", "-c", TWO_NODES, str(tmp_path), *CASES],
            env=subprocess_env(RANK=str(rank), **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        outputs.append(dict(line.split(" ", 1) for line in out.splitlines()))
    for rank, lines in enumerate(outputs):
        # Each node's own path (a node may mount the volume elsewhere), not rank 0's.
        # (The count: the checkpoint verified again here, on node 1's own copy only.)
        step = tmp_path / "same" / f"node{rank}" / "run" / "checkpoints" / "step-3"
        assert lines["same"] == f"resumes from {step} {rank}"
        assert lines["shared"] == f"resumes from {tmp_path / 'shared' / 'node0' / 'run' / 'checkpoints' / 'step-3'} 0"
        assert lines["other"].startswith("refused: the processes of this run do not all see the checkpoint")
        assert "rank 1: another checkpoint (its manifest.json differs from rank 0's)" in lines["other"]
        assert "rank 1: cannot read its manifest.json (No such file or directory)" in lines["missing"]
        assert "rank 1: damaged (" in lines["damaged"] and "model.safetensors" in lines["damaged"]
        for case in ("other", "missing", "damaged"):
            assert "rank 0:" not in lines[case], lines[case]  # rank 0's view is the reference
            assert str(tmp_path / case / "node0" / "run" / "checkpoints" / "step-3") in lines[case]
            assert lines[case] == outputs[0][case]  # the same line on every rank
