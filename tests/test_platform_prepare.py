"""The Neu.ro flow's `prepare` job, run as written in .neuro/live.yml (its bash command, the volume
mounts and parameters filled in), writes the features that `distqa train` then reuses: the cache
entry for the data configs/bert-base.yaml names, under HF_HOME on the cache volume. Without this, every
training node would tokenize the 17 GB file again, and the nodes of a multi-node run would build the
same entry at once on shared storage."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import subprocess_env
from distqa.models import load_tokenizer
from distqa.nq.data import resolve_features
from distqa.registry import load_config

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "nq" / "simplified-nq-sample.jsonl"


def flow_command(job: str, values: dict[str, str]) -> list[str]:
    """The job's entrypoint and arguments, its ${{ ... }} expressions replaced by `values`."""
    doc = yaml.safe_load((ROOT / ".neuro" / "live.yml").read_text())
    cmd = doc["jobs"][job]["cmd"]
    for expr, value in values.items():
        cmd = cmd.replace("${{ " + expr + " }}", value)
    assert "${{" not in cmd, cmd
    return [doc["jobs"][job]["entrypoint"], *shlex.split(cmd)]


@pytest.mark.launch  # about 14 s: make test-launch, for make test's 5 minutes
def test_the_prepare_job_writes_what_training_reads(tmp_path, monkeypatch, capsys, minilm_dir):
    # The image's layout: the working directory holds data/ (the data volume) and configs/; HF_HOME
    # is on the cache volume. bert-base.yaml's data, with a small local model for the test.
    lines = FIXTURE.read_text().splitlines(keepends=True)
    (tmp_path / "data" / "split").mkdir(parents=True)
    (tmp_path / "data" / "split" / "train.jsonl").write_text("".join(lines[:3]))
    (tmp_path / "data" / "split" / "valid.jsonl").write_text("".join(lines[3:5]))
    config = yaml.safe_load((ROOT / "configs" / "bert-base.yaml").read_text())
    config["model"]["name"] = str(minilm_dir)
    config["task"]["max_seq_len"] = 128
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "test.yaml").write_text(yaml.safe_dump(config))
    hf_home = tmp_path / "cache" / "huggingface"

    # `distqa` as the image has it: on PATH.
    env = subprocess_env(HF_HOME=str(hf_home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    command = flow_command("prepare", {"params.config": "configs/test.yaml", "params.num_proc": "1"})
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("wrote ") == 2, proc.stdout

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    cfg = load_config("configs/test.yaml")
    tokenizer = load_tokenizer(cfg.model)
    capsys.readouterr()
    folders = [
        resolve_features(cfg, cfg.data.train, tokenizer, training=True),
        resolve_features(cfg, cfg.data.valid, tokenizer, training=False),
    ]
    assert "prepared" not in capsys.readouterr().out  # both found, none rebuilt
    assert all(f.parent == hf_home / "distqa" / "features" for f in folders)
    assert sorted(p.name for p in (hf_home / "distqa" / "features").iterdir()) == sorted(f.name for f in folders)
