"""fork-task-config: a task in a module of its own (outside the project) with its own settings, a
loss that must run in train mode with gradients and an `evaluate(model, info)` escape hatch that
must run in eval mode without them, through the unchanged trainer under torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import yaml

from conftest import ROOT, subprocess_env
from distqa.errors import DistqaError
from distqa.registry import load_config
from distqa.trainer import train

FORK = textwrap.dedent(
    """
    from dataclasses import dataclass
    from pathlib import Path

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import TensorDataset

    from distqa.config import setting
    from distqa.task import Task


    @dataclass
    class Settings:
        num_labels: int = setting(2, "classes")
        width: int = setting(8, "features per example")
        examples: int = setting(256, "examples")


    class ForkTask(Task):
        Config = Settings

        def build_model(self):
            return nn.Linear(self.cfg.task.width, self.cfg.task.num_labels)

        def build_train_dataset(self):
            g = torch.Generator().manual_seed(self.cfg.seed)
            x = torch.randn(self.cfg.task.examples, self.cfg.task.width, generator=g)
            return TensorDataset(x, (x.sum(dim=1) > 0).long() % self.cfg.task.num_labels)

        def collate(self, items):
            x, y = zip(*items)
            return {"x": torch.stack(x), "y": torch.stack(y)}

        def loss(self, model, batch):
            if not model.training or not torch.is_grad_enabled():
                raise RuntimeError("loss outside train mode or without gradients")
            return F.cross_entropy(model(batch["x"]), batch["y"])

        def evaluate(self, model, info):
            if model.training or torch.is_grad_enabled():
                raise RuntimeError("evaluate in train mode or with gradients")
            self.calls = getattr(self, "calls", 0) + 1
            return {"eval_calls": float(self.calls)} if info.is_main else {}

        def save_model(self, model, directory: Path):
            directory.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), directory / "model.pt")
    """
)


def distqa(tmp_path, *args: str, torchrun: bool = False) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd = [*(launcher if torchrun else [sys.executable]), "-m", "distqa", *args]
    env = subprocess_env(PYTHONPATH=f"{tmp_path / 'fork'}:{subprocess_env()['PYTHONPATH']}")
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.launch  # about 22 s: make test-launch, for make test's 5 minutes
@pytest.mark.slow
def test_a_fork_with_its_own_settings_trains_and_evaluates_through_the_trainer(tmp_path, monkeypatch):
    (tmp_path / "fork").mkdir()
    (tmp_path / "fork" / "my_fork.py").write_text(FORK)
    task = "task.name=my_fork:ForkTask"

    proc = distqa(tmp_path, "train", task, "--help")
    assert proc.returncode == 0 and "task.num_labels = 2" in proc.stdout
    proc = distqa(tmp_path, "train", task, "task.num_lables=3")
    assert proc.returncode != 0
    assert "task.num_lables" in proc.stderr.strip().splitlines()[-1] and "task.num_labels" in proc.stderr
    proc = distqa(tmp_path, "train", task, "task.width=wide")
    assert proc.returncode != 0 and "task.width" in proc.stderr.strip().splitlines()[-1]

    out = tmp_path / "run"
    run = [task, "task.num_labels=3", "task.width=12", "train.eval_every=4", "train.max_steps=8"]
    run += ["train.optimizer=sgd", "train.lr=0.1", "data.num_workers=0", f"output_dir={out}"]
    proc = distqa(tmp_path, "train", *run, torchrun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = [
        r["eval_calls"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_calls" in r
    ]
    assert calls == [1.0, 2.0]
    assert "eval at step 4: eval_calls=1" in proc.stdout
    saved = yaml.safe_load((out / "config.yaml").read_text())["task"]
    assert saved["num_labels"] == 3 and saved["width"] == 12 and saved["name"] == "my_fork:ForkTask"

    # A changed task setting that changes the checkpoint's meaning is refused on resume. In this
    # process, as one rank with 2 accumulation steps (the same global batch): a second launch would
    # only show again what the one above shows.
    monkeypatch.syspath_prepend(str(tmp_path / "fork"))
    changed = [a for a in run if a != "task.num_labels=3"] + ["task.num_labels=2", "train.max_steps=9"]
    with pytest.raises(DistqaError, match=r"task\.num_labels \(3 -> 2\)"):
        train(load_config(None, [*changed, "train.grad_accum=2"]))
