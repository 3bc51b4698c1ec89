"""A model that always predicts the training targets (an oracle) through the real evaluation path:
windows, token maps, best spans, candidates, answer types, thresholds and the competition metric.

Every piece is tested on its own elsewhere; this checks that they agree with each other, where an
off-by-one (an end token inclusive on one side and exclusive on the other, a token map shifted by
the question) scores a trained model lower than it is, with exit 0. The oracle reads its answers
from the training features the same settings make, keyed by a window's ids."""

from __future__ import annotations

import json

import torch
from torch import nn

from conftest import SMALL, TESTS
from distqa.dist import DistInfo
from distqa.evaluation import run_evaluation
from distqa.models import load_tokenizer
from distqa.nq.evaluate import GoldIndex, final_answers
from distqa.nq.features import LONG, SHORT, UNKNOWN, YES, FeatureBuilder, FeatureSettings, select_target
from distqa.nq.metric import read_gold, score
from distqa.nq.postprocess import group_by_example
from distqa.nq.reader import NQReader, parse_example
from distqa.registry import load_config

SAMPLE = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"
ONE = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
LEN, STRIDE, QUERY = 384, 128, 64


class Oracle(nn.Module):
    """Logits that peak at the training target of each window it is given ([CLS] for none)."""

    def __init__(self, targets: dict[tuple[int, ...], tuple[int, int, int]]) -> None:
        super().__init__()
        self.targets = targets
        self.dummy = nn.Parameter(torch.zeros(1))  # a device and a dtype to be moved to

    def forward(self, input_ids, attention_mask, token_type_ids):  # noqa: ARG002 - the model's signature
        n, length = input_ids.shape
        start, end, kind = torch.zeros(n, length), torch.zeros(n, length), torch.zeros(n, 5)
        for row in range(n):
            ids = tuple(input_ids[row][attention_mask[row].bool()].tolist())
            s, e, t = self.targets[ids]
            start[row, s], end[row, e], kind[row, t] = 10.0, 10.0, 10.0
        return {"start_logits": start, "end_logits": end, "answer_type_logits": kind}


def oracle(tokenizer, source) -> Oracle:
    settings = FeatureSettings(max_seq_len=LEN, doc_stride=STRIDE, max_query_len=QUERY, keep_unknown=1.0)
    builder = FeatureBuilder(tokenizer, settings)
    targets = {}
    for example in NQReader(source):
        for f in builder(example):
            targets[tuple(f["input_ids"])] = (f["start_positions"], f["end_positions"], f["answer_type"])
    return Oracle(targets)


def with_yes_answer(path):
    """The sample, its last long-only example answered YES (the sample has no YES/NO answer)."""
    lines = SAMPLE.read_text().splitlines()
    last = max(i for i, line in enumerate(lines) if select_target(parse_example(line))[2] == LONG)
    obj = json.loads(lines[last])
    obj["annotations"][0]["yes_no_answer"] = "YES"
    lines[last] = json.dumps(obj)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_the_oracle_scores_every_answer_its_windows_can_hold(tmp_path, minilm_dir):
    from distqa.nq.task import NQTask

    source = with_yes_answer(tmp_path / "valid.jsonl")
    args = [*SMALL, f"model.tokenizer={minilm_dir}", f"task.cache_dir={tmp_path / 'cache'}", f"data.valid={source}"]
    args += [f"task.max_seq_len={LEN}", f"task.doc_stride={STRIDE}", f"task.max_query_len={QUERY}"]
    task = NQTask(load_config(None, args))
    task.build_model()
    task.build_train_dataset()  # prepares the validation windows
    model = oracle(load_tokenizer(task.cfg.model), source)
    windows: list = []
    scored = task.compute_metrics
    task.compute_metrics = lambda outputs, step: (windows.extend(outputs), scored(outputs, step))[1]
    metrics = run_evaluation(task, model, ONE, step=1, autocast_dtype=None)

    kinds = [select_target(example)[2] for example in NQReader(source)]
    assert {SHORT, LONG, YES, UNKNOWN} <= set(kinds), kinds  # the sample holds each kind the check is about
    # The same answers as `distqa predict` writes them, through the competition's own scoring.
    gold = GoldIndex(source)
    answers = final_answers(group_by_example(windows), gold.examples, task.thresholds)
    rows = {f"{eid}_long": long for eid, (long, _) in answers.items()}
    rows |= {f"{eid}_short": short for eid, (_, short) in answers.items()}
    wrong = {eid: (answers[eid], gold.gold[eid]) for eid in answers if not right(answers[eid], gold.gold[eid])}
    assert not wrong, wrong
    assert metrics["eval_long_f1"] == metrics["eval_short_f1"] == metrics["eval_micro_f1"] == 1.0, metrics
    assert "YES" in rows.values()
    assert score(read_gold(source), rows)["micro_f1"] == 1.0


def right(predicted: tuple[str, str], gold: tuple[set[str], set[str]]) -> bool:
    """Each row empty where its gold is, else one of the gold answers."""
    return all((p in g) if g else p == "" for p, g in zip(predicted, gold))
