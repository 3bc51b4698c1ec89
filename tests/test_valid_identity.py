"""The validation data is part of what a run is: every rank must evaluate on the same data (their
shares are scored as one set), and a resume onto other validation data says so and starts the best
record again (a record measured on other data would keep checkpoints/best on a step no longer
comparable)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SMALL, run_train
from distqa import outcome
from distqa.registry import load_config
from distqa.trainer import train

TOY = [arg for arg in SMALL if not arg.startswith("task.")] + ["task.name=toy_data_tasks:ValidFileTask"]


def valid_file(tmp_path: Path, name: str, **spec) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"seed": 1, "size": 11, "score": 1.0, **spec}))
    return path


def final_state(out: Path, step: int) -> dict:
    return json.loads((out / "checkpoints" / f"step-{step}" / "trainer_state.json").read_text())


@pytest.mark.safety  # about 6 s: make test-safety, for make test's 5 minutes
def test_a_resume_onto_other_validation_data_says_so_and_starts_the_best_record_again(tmp_path, capsys):
    a = valid_file(tmp_path, "a", score=100.0)
    b = valid_file(tmp_path, "b", seed=2, score=1.0)
    out = tmp_path / "run"
    args = [*TOY, f"output_dir={out}", "train.eval_every=2", "train.checkpoint_every=2"]
    args += ["train.best_metric=eval_score", "train.best_mode=max"]
    train(load_config(None, [*args, f"data.valid={a}", "train.max_steps=2"]))
    assert final_state(out, 2)["best"]["step"] == 2
    assert final_state(out, 2)["valid_data"]["examples"] == 11
    capsys.readouterr()

    train(load_config(None, [*args, f"data.valid={b}", "train.max_steps=4"]))
    said = capsys.readouterr().out
    assert f"warning: data.valid='{b}' (11 examples, fingerprint" in said
    assert "is not the validation data this run had until step 2" in said
    assert "train.best_metric's record (eval_score=100 at step 2) was measured on it and starts again" in said
    best = final_state(out, 4)["best"]
    assert (best["step"], best["value"]) == (4, 1.0)
    assert (out / "checkpoints" / "best").resolve().name == "step-4"

    # The same file again (a moved copy): nothing said, the record kept.
    moved = tmp_path / "moved.json"
    moved.write_bytes(b.read_bytes())
    train(load_config(None, [*args, f"data.valid={moved}", "train.max_steps=6"]))
    assert "is not the validation data" not in capsys.readouterr().out
    assert final_state(out, 6)["best"]["step"] == 4

    # Without a best metric the eval_* figures still change data set from here on: said all the same.
    no_best = [arg for arg in args if not arg.startswith("train.best_")]
    train(load_config(None, [*no_best, f"data.valid={a}", "train.max_steps=8"]))
    said = capsys.readouterr().out
    assert f"warning: data.valid='{a}' (11 examples, fingerprint" in said and "best_metric's record" not in said


@pytest.mark.safety
def test_ranks_that_evaluate_on_different_data_stop_at_start(tmp_path):
    skewed = valid_file(tmp_path, "skewed", skew=True)
    proc = run_train(
        [*TOY, f"data.valid={skewed}", "train.max_steps=4", f"output_dir={tmp_path / 'run'}"],
        nproc=2,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert "the ranks do not see the same validation data (rank 0: 11 examples" in proc.stderr
    assert "rank 1: 12 examples" in proc.stderr and f"data.valid='{skewed}' must be the same data" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.safety
@pytest.mark.parametrize("best", [[], ["train.best_metric=eval_score", "train.best_mode=max"]])
def test_a_node_without_validation_data_beside_one_with_stops_every_rank_in_one_line(tmp_path, monkeypatch, best):
    """data.valid may differ per node: one node's set beside another's none paired the first node's
    all-gather with the other's next collective ('DDP expects same model across all ranks'), exit 1
    and a traceback naming no setting (under NCCL, possibly a hang). With train.best_metric the node
    without one refused alone ('needs an evaluation') and the other said 'lost a peer'."""
    halved = valid_file(tmp_path, "halved", absent=True)
    said = tmp_path / "node.txt"
    monkeypatch.setenv("DISTQA_ERROR_FILE", str(said))
    args = [*TOY, f"data.valid={halved}", "train.eval_every=2", "train.max_steps=4", *best]
    proc = run_train([*args, f"output_dir={tmp_path / 'run'}"], nproc=2, timeout=120, check=False)
    line = "the ranks do not see the same validation data: a validation set on rank 0, none on rank 1"
    assert proc.returncode != 0 and line in proc.stderr, proc.stderr
    assert outcome.read(said).error_ranks == {0, 1}, said.read_text()  # every rank stopped on it
    assert "needs an evaluation" not in said.read_text() and "lost a peer" not in said.read_text()
    assert "DDP expects" not in proc.stderr  # (the traceback below it is torchrun's own report)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.safety
def test_a_refusal_of_rank_0_s_scoring_stops_every_rank_with_its_line(tmp_path, monkeypatch):
    """Rank 0 alone scores the gathered outputs. Its one-line error once stopped rank 0 alone, and
    the other ranks said "lost a peer ... torchrun starts the next round": a restart, and the same
    error again, each round (on another node, its last line named no reason at all)."""
    refusing = valid_file(tmp_path, "refusing", refuse="the cache at X is stale: delete X")
    said = tmp_path / "node.txt"
    monkeypatch.setenv("DISTQA_ERROR_FILE", str(said))
    args = [*TOY, f"data.valid={refusing}", "train.eval_every=2", "train.max_steps=6"]
    proc = run_train([*args, f"output_dir={tmp_path / 'run'}"], nproc=2, timeout=120, check=False)
    # printed once, by the rank that said it first; after the step's checkpoint (Trainer._after_step)
    line = "]: error: evaluation at step 2: the cache at X is stale: delete X; checkpoint "
    assert proc.returncode != 0 and proc.stderr.count(line) == 1, proc.stderr
    lines = said.read_text().splitlines()
    assert any(x.startswith("distqa [rank 1" + line) for x in lines), lines
    assert (tmp_path / "run" / "checkpoints" / "step-2").is_dir()
    assert outcome.read(said).error_ranks == {0, 1} and "lost a peer" not in said.read_text(), lines


@pytest.mark.safety  # about 5 s: make test-safety, for make test's 5 minutes
def test_nq_validation_data_is_identified_by_its_gold_answers_too(tmp_path, minilm_dir):
    """The identity hashed the validation windows alone: a data.valid whose answers alone changed
    kept it, and the best record measured on the old answers stayed (a step scoring 0.0 on the
    file in use exported as the best; found by a review)."""
    from distqa.nq.task import NQTask

    sample = Path(__file__).parent / "fixtures" / "nq" / "simplified-nq-sample.jsonl"
    lines = [json.loads(line) for line in sample.read_text().splitlines()[:3]]
    first = tmp_path / "a.jsonl"
    first.write_text("".join(json.dumps(line) + "\n" for line in lines))
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(first.read_bytes())
    regraded = tmp_path / "b.jsonl"
    lines[0]["annotations"][0]["long_answer"] = {"start_token": -1, "end_token": -1, "candidate_index": -1}
    lines[0]["annotations"][0]["short_answers"] = []
    regraded.write_text("".join(json.dumps(line) + "\n" for line in lines))

    def identity(valid: Path) -> str:
        cfg = load_config(None, [f"model.tokenizer={minilm_dir}", "task.max_seq_len=64", f"data.valid={valid}",
                                 f"task.cache_dir={tmp_path / 'cache'}", "model.name=tiny"])  # fmt: skip
        task = NQTask(cfg)
        task.build_model()  # (the DummyDataset's vocabulary size)
        task.build_train_dataset()
        dataset = task.build_eval_dataset()
        return task.data_fingerprint(dataset)

    assert identity(first) == identity(moved)  # the same answers elsewhere: the same data
    assert identity(regraded) != identity(first)
    # A checkpoint from before the gold counted recorded the windows alone: the same data still
    # (its record dropped and its best pruned as other data, found by a review); the gold is not seen.
    from distqa.data_agreement import same_identity

    windows, gold = identity(first).split("+")
    assert same_identity({"examples": 3, "fingerprint": windows}, {"examples": 3, "fingerprint": identity(first)})
    assert same_identity({"examples": 3, "fingerprint": windows}, {"examples": 3, "fingerprint": identity(regraded)})
    assert not same_identity(
        {"examples": 3, "fingerprint": identity(first)}, {"examples": 3, "fingerprint": identity(regraded)}
    )
    assert not same_identity({"examples": 3, "fingerprint": windows}, {"examples": 4, "fingerprint": identity(first)})
