"""What a run prints: plain lines instead of progress bars in a log, library reports once and
without colour codes, a plot titled after the run (`distqa.console`)."""

from __future__ import annotations

import json

import pytest
from PIL import Image
from transformers import AutoModelForQuestionAnswering
from transformers.utils import logging as hf_logging

from distqa import console
from distqa.config import ModelConfig
from distqa.console import TrainProgress, quiet_libraries, run_title
from distqa.metrics import plot_metrics
from distqa.models import build_hf_model
from distqa.registry import load_config


def record(step: int) -> dict:
    return {"step": step, "epoch": step / 10, "lr": 1e-4, "loss": 2.5, "samples_per_s": 8.0, "tokens_per_s": 512.0}


def test_a_log_gets_one_plain_line_per_record_and_a_terminal_a_bar(monkeypatch, capsys):
    monkeypatch.setattr(console, "on_terminal", lambda: False)
    progress = TrainProgress(6, 0, enabled=True)
    for step in range(1, 7):
        progress.advance()
        if step % 2 == 0:
            progress.report(record(step))
    progress.close()
    out, err = capsys.readouterr()
    assert "\r" not in out + err and err == ""
    assert out.splitlines()[0].startswith("step 2/6 (epoch 0.2): loss 2.5000, lr 0.0001, 8.0 samples/s, 512 tokens/s")
    assert [line.split("/")[0] for line in out.splitlines()] == ["step 2", "step 4", "step 6"]

    TrainProgress(6, 0, enabled=False).report(record(2))  # the other ranks print nothing
    assert capsys.readouterr() == ("", "")

    monkeypatch.setattr(console, "on_terminal", lambda: True)
    progress = TrainProgress(6, 3, enabled=True)
    progress.advance()
    progress.report(record(4))
    progress.close()
    out, err = capsys.readouterr()
    assert out == "" and "\r" in err and "4/6" in err and "loss=2.5000" in err  # the bar, on stderr


@pytest.fixture
def transformers_stderr(monkeypatch):
    """What transformers' own handler writes, with its verbosity and filters restored afterwards."""
    import io

    handler = hf_logging.get_logger().handlers[0]
    stream = io.StringIO()
    monkeypatch.setattr(handler, "stream", stream)
    level, filters = hf_logging.get_verbosity(), list(handler.filters)
    yield stream
    hf_logging.set_verbosity(level)
    handler.filters[:] = filters


def test_the_model_load_report_comes_from_rank_0_only_without_colour_codes(
    monkeypatch, transformers_stderr, minilm_dir
):
    monkeypatch.setattr(console, "on_terminal", lambda: False)
    load = ModelConfig(name=str(minilm_dir))
    quiet_libraries(is_main=True)
    build_hf_model(AutoModelForQuestionAnswering, load)  # a new span head: transformers reports it
    report = transformers_stderr.getvalue()
    assert report.count("LOAD REPORT") == 1 and "qa_outputs.weight" in report
    assert "\x1b" not in report
    quiet_libraries(is_main=False)
    build_hf_model(AutoModelForQuestionAnswering, load)
    assert transformers_stderr.getvalue() == report  # another rank adds nothing


def test_the_plot_is_titled_after_the_run(tmp_path):
    cfg = load_config(None, ["model.name=/models/x/bert-small", "train.lr=2e-4", f"output_dir={tmp_path}"])
    title = run_title(cfg, global_batch=64, uses=("model.name", "data.train"))
    assert title == f"task nq, model x/bert-small, data dummy\nlr 0.0002 (linear), global batch 64; output {tmp_path}"
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps(record(1)) + "\n")
    assert plot_metrics(metrics, tmp_path / "metrics.png", title=title)
    assert Image.open(tmp_path / "metrics.png").text["Title"] == title
    metrics.write_text("")
    assert not plot_metrics(metrics, tmp_path / "empty.png") and not (tmp_path / "empty.png").exists()


def test_the_title_names_only_the_settings_the_task_uses(tmp_path):
    """A fork that reads neither model.name nor data.train is not titled 'model tiny, data dummy';
    its own settings that differ from their defaults are named."""
    fork = ["task.name=toy_task:ToyClassificationTask", "task.size=64", f"output_dir={tmp_path}"]
    cfg = load_config(None, fork)
    assert run_title(cfg, 8, uses=()).splitlines()[0] == "task toy_task:ToyClassificationTask, size 64"
    # A task that does not say what it uses: the core settings changed from their defaults.
    assert run_title(cfg, 8).splitlines()[0] == "task toy_task:ToyClassificationTask, size 64"
    named = load_config(None, [*fork, "model.name=mine"])
    assert run_title(named, 8).splitlines()[0] == "task toy_task:ToyClassificationTask, model mine, size 64"


def test_each_evaluation_metric_gets_its_own_panel(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [record(1), {**record(2), "eval_f1": 0.6, "eval_loss": 3.0, "eval_answers": 4000}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert plot_metrics(metrics, tmp_path / "metrics.png")
    # Loss, lr, samples/s and three evaluation panels of 1.9 inches each, at 100 dpi.
    assert Image.open(tmp_path / "metrics.png").size[1] == round((1.1 + 1.9 * 6) * 100)


def test_the_start_line_says_examples_and_features_when_they_differ():
    class Features(list):
        num_examples = 3

    assert console.dataset_size([1, 2, 3]) == "3 examples"
    assert console.dataset_size(Features([1, 2, 3, 4, 5])) == "3 examples (5 features)"


def test_a_long_title_is_wrapped_inside_the_picture(tmp_path, monkeypatch):
    """The demo's title (task, model folder, data file, output folder) ran past both edges."""
    from distqa import metrics as metrics_module

    figures = []
    monkeypatch.setattr(metrics_module, "_save_png", lambda fig, path, title: figures.append(fig) or True)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps(record(1)) + "\n")
    title = "task nq, " + ", ".join(f"setting{i} value{i}" for i in range(20)) + "\nlr 0.0002 (linear), output /x"
    assert plot_metrics(metrics, tmp_path / "metrics.png", title=title)
    fig = figures[0]
    fig.canvas.draw()
    box = fig._suptitle.get_window_extent()
    assert 0 <= box.x0 and box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1
    assert fig._suptitle.get_text().splitlines()[-1] == "lr 0.0002 (linear), output /x"  # its own lines kept
