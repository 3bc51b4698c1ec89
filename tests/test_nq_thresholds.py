"""NQ's answer thresholds: the pair chosen maximises the competition's one micro F1 (pooled over long
and short rows), a thresholds file is read strictly, and thresholds are exported only with the weights
of the step they were chosen at (`distqa export` of another checkpoint, a resume without data.valid)."""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace as NS

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from conftest import SMALL
from distqa.errors import DistqaError
from distqa.export import export_checkpoint
from distqa.nq.evaluate import best_pair, score_predictions
from distqa.nq.postprocess import WindowBest, f1, kind_f1
from distqa.nq.task import NQTask
from distqa.nq.thresholds import THRESHOLDS_FILE, read_chosen, thresholds_json
from distqa.registry import load_config
from distqa.trainer import train

# ------------------------------------------------------------------------------------ the pair


def pooled_f1(long_rows, short_rows, thresholds) -> float:
    """The competition's micro F1: TP, FP and FN summed over both kinds (`kind_f1`'s counting)."""
    counts = zip(kind_f1(long_rows, thresholds["long"]), kind_f1(short_rows, thresholds["short"]), strict=True)
    return f1(*(a + b for a, b in counts))


def every_cut(rows) -> list[float]:
    """+inf ("never") and, for each score, the cut just below it: every distinct way to threshold."""
    return [math.inf, *(math.nextafter(score, -math.inf) for score, _, _ in rows)]


rows_strategy = st.lists(
    st.tuples(
        st.one_of(st.sampled_from([-2.0, -0.5, 0.0, 0.5, 1.0, 3.0]), st.floats(-1e6, 1e6)),
        st.sampled_from(["", "a", "b", "c", "b", "b"]),  # wrong answers above the right ones: the hard cases
        st.sets(st.sampled_from(["a", "b", "c"]), max_size=2),
    ),
    max_size=12,
)
# A pair that two rounds of Dinkelbach's method do not reach (found by a search): the method must
# run until the F1 stops rising.
NO, GOLD = set(), {"a"}
THIRD_ROUND = (
    [(9.0, "a", GOLD), (0.0, "b", NO), (5.0, "b", NO), (0.0, "a", GOLD), (4.0, "b", NO), (8.0, "b", NO)],
    [(8.0, "b", NO), (2.0, "b", NO), (3.0, "a", GOLD), (8.0, "b", NO), (7.0, "b", NO), (3.0, "a", NO)]
    + [(9.0, "b", NO), (6.0, "b", NO), (7.0, "b", NO)],
)


@given(rows_strategy, rows_strategy)
@example(*THIRD_ROUND)
def test_best_pair_is_the_best_of_all_pairs(long_rows, short_rows):
    chosen = best_pair(long_rows, short_rows)
    value = pooled_f1(long_rows, short_rows, chosen)
    pairs = itertools.product(every_cut(long_rows), every_cut(short_rows))
    best = max(pooled_f1(long_rows, short_rows, {"long": lt, "short": st_}) for lt, st_ in pairs)
    assert value == best  # exact: the same counts give the same float
    assert all(math.isfinite(t) or t == math.inf for t in chosen.values())  # what the file can hold


def test_the_pair_is_chosen_for_the_pooled_f1_not_each_kind_s_own():
    """A case found by hand: each kind's own best gives long 4.5, short 4.5 (pooled 0.706); answering no
    short answer at all (its gold one scores lowest) gives 0.957."""
    examples = {str(i): NS(candidates=[{"start_token": 0, "end_token": 10, "top_level": True}]) for i in range(11)}
    gold = {str(i): ({"0:10"}, {"2:4"} if i == 0 else set()) for i in range(11)}
    grouped = {str(i): [WindowBest(str(i), 5.0 + i, 2, 4, 3)] for i in range(11)}
    metrics, thresholds = score_predictions(grouped, NS(examples=examples, gold=gold))
    assert thresholds == {"long": 4.5, "short": math.inf}
    assert metrics["eval_micro_f1"] == pytest.approx(22 / 23)
    from distqa.nq.settings import NQSettings

    assert tuple(metrics) == tuple(NQSettings.metric_names)  # what train.best_metric is checked against


def test_never_is_chosen_when_no_answer_can_be_right():
    rows = [(1.0, "a", set()), (2.0, "b", {"c"})]
    assert best_pair(rows, rows) == {"long": math.inf, "short": math.inf}
    assert best_pair([], []) == {"long": math.inf, "short": math.inf}


# ------------------------------------------------------------------------------------ the file


def test_files_old_and_new_read(tmp_path):
    path = tmp_path / THRESHOLDS_FILE
    path.write_text(thresholds_json({"long": math.inf, "short": -1.5}, step=10))
    assert json.loads(path.read_text()) == {"long": None, "short": -1.5, "step": 10}
    assert read_chosen(path) == ({"long": math.inf, "short": -1.5}, 10, None)
    path.write_text(thresholds_json({"long": 1.0, "short": 2.0}, step=3, precision="bf16"))
    assert json.loads(path.read_text())["precision"] == "bf16"
    assert read_chosen(path) == ({"long": 1.0, "short": 2.0}, 3, "bf16")
    path.write_text('{"long": Infinity, "short": 2}')  # before null, and before the step and the precision
    assert read_chosen(path) == ({"long": math.inf, "short": 2.0}, None, None)
    assert read_chosen(path)[0] == {"long": math.inf, "short": 2.0}


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"long": NaN, "short": NaN}', "long is nan, not a finite number or null"),
        ('{"long": -Infinity, "short": 1}', "long is -inf, not a finite number or null"),
        ('{"Long": 5, "shrt": 5}', "unknown key(s) Long, shrt; no long or short"),
        ("{}", "no long or short"),
        ('{"long": 1, "short": 2, "extra": 3}', "unknown key(s) extra"),
        ('{"long": true, "short": 1}', "long is true, not a number or null"),
        ('{"long": "1.5", "short": 1}', 'long is "1.5", not a number or null'),
        ('{"long": 1, "short": 2, "step": 1.5}', "step is 1.5, not a step number"),
        ('{"long": 1, "short": 2, "step": -1}', "step is -1, not a step number"),
        ('{"long": 1, "short": 2, "precision": "fp8"}', 'precision is "fp8", not one of fp32, bf16, fp16'),
        ("[1, 2]", "a JSON list, not an object"),
        ("not json", "Expecting value"),
        ("[" * 100_000 + "]" * 100_000, "maximum recursion depth"),  # was a RecursionError traceback
    ],
)
def test_a_damaged_file_is_one_line_naming_it(tmp_path, text, problem):
    path = tmp_path / THRESHOLDS_FILE
    path.write_text(text)
    with pytest.raises(DistqaError) as caught:
        read_chosen(path)[0]
    message = str(caught.value)
    assert message.startswith(f"{path} is not a thresholds file (") and problem in message, message
    assert "\n" not in message


# ----------------------------------------------------------------- thresholds and their weights


def nq_task() -> NQTask:
    return NQTask(load_config(None, ["model.name=tiny"]))


def evaluate_at(task: NQTask, step: int) -> None:
    """`compute_metrics` on a one-example validation set whose long answer scores `step`: the long
    threshold chosen (step - 0.5) tells which evaluation it came from."""
    candidate = {"start_token": 0, "end_token": 10, "top_level": True}
    task._gold = NS(examples={"e": NS(candidates=[candidate])}, gold={"e": ({"0:10"}, set())})
    task.compute_metrics([WindowBest("e", float(step), 2, 4, 3)], step)


def test_the_step_travels_in_the_checkpoint_s_strict_json():
    task = nq_task()
    assert task.state_dict() == {}  # nothing evaluated yet: nothing to carry
    evaluate_at(task, 10)
    assert task.thresholds == {"long": 9.5, "short": math.inf} and task.thresholds_step == 10
    text = json.dumps(task.state_dict(), allow_nan=False)  # what trainer_state.json can hold
    resumed = nq_task()
    resumed.load_state_dict(json.loads(text))
    assert (resumed.thresholds, resumed.thresholds_step) == ({"long": 9.5, "short": math.inf}, 10)
    assert resumed.thresholds_precision == "fp32"  # the run's train.precision, with which they were chosen
    resumed.load_state_dict({})  # a checkpoint written before any evaluation: they stay as they are
    assert resumed.thresholds_step == 10
    resumed.load_state_dict({"thresholds": {"long": 1.0, "short": None}})  # an older distqa's: no step
    assert (resumed.thresholds, resumed.thresholds_step) == ({"long": 1.0, "short": math.inf}, None)
    with pytest.raises(DistqaError, match=r"task state holds thresholds distqa cannot read \(no short"):
        resumed.load_state_dict({"thresholds": {"long": 1.0}})


def test_thresholds_are_written_only_with_the_weights_they_were_chosen_on(tmp_path, capsys):
    task = nq_task()
    model = task.build_model()
    evaluate_at(task, 10)
    task.weights_step = 10
    task.save_model(model, tmp_path / "same")
    assert read_chosen(tmp_path / "same" / THRESHOLDS_FILE) == ({"long": 9.5, "short": math.inf}, 10, "fp32")
    capsys.readouterr()
    task.weights_step = 15
    task.save_model(model, tmp_path / "later")
    assert not (tmp_path / "later" / THRESHOLDS_FILE).exists()
    line = capsys.readouterr().out.strip()
    assert "thresholds were chosen at step 10, these weights are step 15" in line and "\n" not in line
    task.load_state_dict({"thresholds": {"long": 1.0, "short": 2.0}})  # an older checkpoint: no step
    task.save_model(model, tmp_path / "older")  # written as before, with one line
    assert read_chosen(tmp_path / "older" / THRESHOLDS_FILE) == ({"long": 1.0, "short": 2.0}, None, None)
    assert "records no step" in capsys.readouterr().out


# ------------------------------------------------------------ end to end: train, export, resume


def evaluate_stand_in(self, model, info, step=0):
    """data.valid's evaluation takes minutes on CPUs: the real `compute_metrics` on a stand-in set."""
    evaluate_at(self, step)
    return {"eval_micro_f1": 0.5}


RUN = [*SMALL, "train.batch_size=2", "train.eval_every=2", "train.checkpoint_every=1"]


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    """4 steps, evaluated at steps 2 and 4, a checkpoint at each step (step-2 to step-4 kept)."""
    out = tmp_path_factory.mktemp("thresholds") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NQTask, "evaluate", evaluate_stand_in)
        train(load_config(None, [*RUN, "train.max_steps=4", f"output_dir={out}"]))
    return out


def test_export_writes_thresholds_only_for_an_evaluated_step(evaluated_run, tmp_path, capsys):
    assert read_chosen(evaluated_run / "model" / THRESHOLDS_FILE) == ({"long": 3.5, "short": math.inf}, 4, "fp32")
    two = export_checkpoint(str(evaluated_run / "checkpoints" / "step-2"), str(tmp_path / "two"))
    assert read_chosen(two / THRESHOLDS_FILE) == ({"long": 1.5, "short": math.inf}, 2, "fp32")
    capsys.readouterr()
    # step-3 carries step 2's thresholds (the latest evaluation): not step 3's weights' own.
    three = export_checkpoint(str(evaluated_run / "checkpoints" / "step-3"), str(tmp_path / "three"))
    assert (three / "model.safetensors").is_file() and not (three / THRESHOLDS_FILE).exists()
    assert "thresholds were chosen at step 2, these weights are step 3" in capsys.readouterr().out


def test_a_resume_without_data_valid_exports_no_thresholds_of_an_earlier_step(evaluated_run, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(evaluated_run, out)
    (out / "model" / THRESHOLDS_FILE).unlink()  # what the resumed run's export writes is in question
    capsys.readouterr()
    train(load_config(None, [*RUN, "train.max_steps=5", f"output_dir={out}"]))  # no evaluation: no data.valid
    assert not (out / "model" / THRESHOLDS_FILE).exists()
    assert "thresholds were chosen at step 4, these weights are step 5" in capsys.readouterr().out


def test_predict_refuses_thresholds_copied_beside_other_weights(evaluated_run, tmp_path, capsys, minilm_dir):
    import shutil

    from conftest import TESTS
    from distqa.cli import main

    two = export_checkpoint(str(evaluated_run / "checkpoints" / "step-2"), str(tmp_path / "two"))
    shutil.copy(evaluated_run / "model" / THRESHOLDS_FILE, two / THRESHOLDS_FILE)  # step 4's, beside step 2's weights
    source = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"
    output = tmp_path / "sub.csv"
    capsys.readouterr()
    status = main(
        ["predict", "--input", str(source), "--checkpoint", str(two), "--output", str(output)]
        + [f"model.tokenizer={minilm_dir}", f"task.cache_dir={tmp_path / 'cache'}"]
    )
    assert status == 2 and not output.exists()
    assert (
        f"{two / THRESHOLDS_FILE} was chosen at step 4, but the weights in {two} are step 2" in capsys.readouterr().err
    )


@pytest.mark.launch  # about 7 s: make test-launch, for make test's 5 minutes
def test_predict_says_never_for_a_kind_that_is_never_answered(evaluated_run, tmp_path, capsys, minilm_dir):
    """The file says null ("never") for the short threshold here; the console said `inf`."""
    from conftest import TESTS
    from distqa.cli import main

    source = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"
    capsys.readouterr()
    status = main(
        ["predict", "--input", str(source), "--checkpoint", str(evaluated_run), "--output", str(tmp_path / "s.csv")]
        + [f"model.tokenizer={minilm_dir}", f"task.cache_dir={tmp_path / 'cache'}"]
    )
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("thresholds from")]
    assert status == 0 and said == [
        f"thresholds from {evaluated_run / 'model' / THRESHOLDS_FILE}: long 3.5, short never"
    ]
