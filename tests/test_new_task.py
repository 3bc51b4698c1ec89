"""`distqa new-task NAME`: the task it writes works as written. Quick: a bad NAME and an existing
target are refused in one line with nothing written; the generated code is lint-clean, takes a
training step, evaluates and answers its own command in this process. Marked safety (it launches
torchrun): in a fork's layout, the generated test passes under pytest and `distqa train --config
configs/NAME.yaml` trains the task."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env
from distqa.cli import main
from distqa.errors import DistqaError

RUFF = Path(sys.executable).parent / "ruff"


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(capsys, *args: str) -> str:
    """The one error line of `distqa new-task ARGS`, which must fail."""
    capsys.readouterr()
    assert main(["new-task", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_bad_name_or_an_existing_target_is_refused_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").mkdir()
    for name in ("1st", "my-task", "class"):
        assert "is not a Python identifier" in refused(capsys, name)
    assert "--dir nowhere is not a folder" in refused(capsys, "fine", "--dir", "nowhere")
    # A name longer than a file name may be (test_NAME.py) was an OSError traceback.
    assert "NAME is 300 characters long: at most 100" in refused(capsys, "a" * 300)
    assert "module json already exists" in refused(capsys, "json")  # would shadow the standard library's
    assert tree(tmp_path) == {}

    assert main(["new-task", "mine"]) == 0
    written = tree(tmp_path)
    assert "src/mine/task.py" in written and "tests/test_mine.py" in written and "configs/mine.yaml" in written
    assert "src/mine exists: new-task never overwrites" in refused(capsys, "mine")
    # Any one target that exists stops it before the first file: no half-written task.
    (tmp_path / "configs" / "other.yaml").write_text("mine\n")
    assert "configs/other.yaml exists" in refused(capsys, "other")
    (tmp_path / "src" / "third.py").write_text("")  # a module NAME would shadow
    assert "src/third.py exists" in refused(capsys, "third")
    assert tree(tmp_path) == {**written, "configs/other.yaml": b"mine\n", "src/third.py": b""}


def test_the_generated_task_is_clean_trains_evaluates_and_predicts(tmp_path, monkeypatch, capsys):
    """In this process, one rank: the seam methods the trainer calls, and the task's own command on
    an export. (The 2-process training, resume and export are the generated test's, below.)"""
    import torch

    from distqa.dist import DistInfo
    from distqa.registry import load_config, load_task

    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").mkdir()
    shutil.copy(ROOT / "pyproject.toml", tmp_path)  # the project's ruff settings, as in a fork
    assert main(["new-task", "nt_probe"]) == 0
    if RUFF.exists():
        for check in (["check"], ["format", "--check"]):
            lint = subprocess.run([str(RUFF), *check, "src", "tests"], capture_output=True, text=True)
            assert lint.returncode == 0, lint.stdout + lint.stderr

    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    try:
        # A tokenizer the task would not use is refused (it was ignored without a word).
        with pytest.raises(DistqaError, match=r"model.tokenizer=bert-base-uncased: the nt_probe task encodes"):
            load_task(load_config("configs/nt_probe.yaml", ["model.tokenizer=bert-base-uncased"]))
        # Inputs past the model's 512 positions: one line when the model is built (it was an
        # index error at the first text that long, any step of the run).
        with pytest.raises(DistqaError, match=r"task.max_words=600 \(601 tokens with \[CLS\]\) exceeds the 512"):
            load_task(load_config("configs/nt_probe.yaml", ["task.max_words=600"])).build_model()
        load_task(load_config("configs/nt_probe.yaml", ["task.max_words=511"])).build_model()
        cfg = load_config("configs/nt_probe.yaml", ["train.max_steps=1", "task.max_words=3"])
        task = load_task(cfg)
        model = task.build_model()
        data = task.build_train_dataset()
        batch = task.collate([data[i] for i in range(4)])
        assert batch["input_ids"].shape[1] <= 4  # [CLS] and task.max_words words
        task.loss(model, batch).backward()
        model.eval()
        valid = task.build_eval_dataset()
        with torch.no_grad():
            outputs = task.eval_step(model, task.collate([valid[i] for i in range(len(valid))]))
        assert set(task.compute_metrics(outputs, step=1)) == {"eval_accuracy"}
        info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
        assert 0 <= task.evaluate(model, info, step=1)["eval_accuracy"] <= 1

        task.save_model(model, tmp_path / "model")
        task.save_settings(tmp_path / "model")
        capsys.readouterr()
        command = ["nt-probe-predict", "--config", "configs/nt_probe.yaml", "--model", "model", "--text", "a good book"]
        # The training config's task.max_words: 16 is not what this model was trained with (3, on
        # the command line): the file's value is refused, not used to cut texts otherwise.
        assert main(command) != 0
        said = capsys.readouterr().err
        assert "task.max_words=16 in configs/nt_probe.yaml is not the task.max_words=3 the model" in said, said
        command.append("task.max_words=3")
        assert main(command) == 0
        label, text = capsys.readouterr().out.strip().splitlines()[-1].split("\t")
        assert label in ("negative", "positive") and text == "a good book"
        # A task.* key the user gives wins over the trained one, with a line saying so (it was dropped).
        assert main([*command, "task.max_words=1"]) == 0
        said = capsys.readouterr().err
        assert "task.max_words=1 was given but the model in model was trained with task.max_words=3" in said
        assert main([*command, "task.max_words=600"]) != 0
        assert "task.max_words=600 (601 tokens with [CLS]) exceeds" in capsys.readouterr().err
        # A fork reorders its classes after training: the export's own names still say what the
        # model predicts (printing LABELS[index] renamed every prediction).
        task_module = sys.modules["nt_probe.task"]
        monkeypatch.setattr(task_module, "LABELS", tuple(reversed(task_module.LABELS)))
        assert main(command) == 0
        assert capsys.readouterr().out.strip().splitlines()[-1].split("\t")[0] == label

        # Damaged CSV rows are one line each, never an example: an unquoted comma, an unclosed quote.
        data_module = sys.modules["nt_probe.data"]
        for lines in (["text,label", "so bad, really,negative"], ["text,label", '"awful,negative', "ok,positive"]):
            (tmp_path / "bad.csv").write_text("\n".join(lines) + "\n")
            with pytest.raises(DistqaError, match=r"data.train='bad.csv'"):
                data_module.read_examples("bad.csv", "data.train")
    finally:
        for name in [m for m in sys.modules if m == "nt_probe" or m.startswith("nt_probe.")]:
            del sys.modules[name]


@pytest.mark.safety
def test_in_a_fork_the_generated_test_passes_and_the_config_trains(tmp_path):
    """A fork's layout (a copy of the project's src/ and pyproject.toml, its src/ on PYTHONPATH as
    `pip install -e .` puts it): `distqa new-task demo`, then the generated tests/test_demo.py under
    pytest, then `distqa train --config configs/demo.yaml`, all from the fork's root."""
    fork = tmp_path / "fork"
    shutil.copytree(ROOT / "src" / "distqa", fork / "src" / "distqa", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", fork)
    env = subprocess_env(PYTHONPATH=str(fork / "src"))

    def run(*args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, *args], cwd=fork, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc

    made = run("-m", "distqa", "new-task", "demo")
    assert "task.name=demo.task:DemoTask" in made.stdout and "warning" not in made.stderr  # importable
    passed = run("-m", "pytest", "tests/test_demo.py", "-q", "-p", "no:cacheprovider").stdout
    assert "1 passed" in passed, passed

    run("-m", "distqa", "train", "--config", "configs/demo.yaml")
    results = fork / "results" / "demo"
    assert (results / "model" / "model.safetensors").is_file()
    rows = [json.loads(line) for line in (results / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_accuracy" in row for row in rows)


def test_the_wheel_of_a_forked_task_carries_its_sample_data(tmp_path):
    """docs/fork.md: the wheel carries the task. A wheel built with a task from `distqa new-task` held
    its code but not the sample_*.csv its config trains on. Built here from the project's pyproject
    (setuptools, offline, no build isolation) with only the new task under src/."""
    import zipfile

    from distqa.newtask import write_task

    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "src").mkdir()
    write_task("my_task", tmp_path / "src", tmp_path)
    code = "from setuptools import build_meta; print(build_meta.build_wheel('dist'))"
    built = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = tmp_path / "dist" / built.stdout.split()[-1]
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"my_task/task.py", "my_task/sample_train.csv", "my_task/sample_valid.csv"} <= names, sorted(names)
