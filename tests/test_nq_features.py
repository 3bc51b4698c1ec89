"""Reader and feature builder on real Natural Questions lines (tests/fixtures/nq, CC BY-SA 3.0)."""

from __future__ import annotations

import copy
import gc
import json
import re

import pytest
from transformers import AutoTokenizer

from conftest import TESTS, only_this_process_finalizes
from distqa.errors import DistqaError
from distqa.nq.features import LONG, SHORT, UNKNOWN, FeatureBuilder, FeatureSettings, is_html_tag, select_target
from distqa.nq.prepare import load_features, prepare_features
from distqa.nq.reader import NQReader, byte_ranges

FIXTURES = TESTS / "fixtures" / "nq"
SAMPLE = FIXTURES / "simplified-nq-sample.jsonl"  # the first 10 lines of simplified-nq-train.jsonl


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    return AutoTokenizer.from_pretrained(minilm_dir)


def words(text: str) -> list[str]:
    """Lower-cased word pieces without spaces, for comparing decoded sub-words with NQ tokens."""
    return re.findall(r"\w+", text.lower())


def build(tokenizer, **kw):
    return FeatureBuilder(tokenizer, FeatureSettings(**{"max_seq_len": 256, "doc_stride": 64, **kw}))


def test_reader_streams_every_line_of_the_train_sample():
    examples = list(NQReader(SAMPLE))
    assert len(examples) == 10
    assert examples[0].example_id == "5655493461695504401"
    assert all(len(e.annotations) == 1 for e in examples)
    kinds = [select_target(e)[2] for e in examples]
    assert kinds.count(SHORT) == 4 and kinds.count(LONG) == 2 and kinds.count(UNKNOWN) == 4  # per SOURCES.md


def test_byte_ranges_partition_the_lines():
    for parts in (1, 2, 3, 7, 64):
        ids = [e.example_id for a, b in byte_ranges(SAMPLE, parts) for e in NQReader(SAMPLE, byte_range=(a, b))]
        assert ids == [e.example_id for e in NQReader(SAMPLE)]


def test_test_format_reads(tmp_path):
    raw = json.loads((FIXTURES / "ds-test-head1.json").read_text())  # pretty-printed: make it one line
    path = tmp_path / "test.jsonl"
    path.write_text(json.dumps(raw) + "\n")
    (example,) = NQReader(path)
    assert example.example_id == "-1220107454853145579" and example.annotations == []
    assert select_target(example) == (-1, -1, UNKNOWN)


def test_malformed_line_names_file_and_line(tmp_path):
    lines = SAMPLE.read_text().splitlines()
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([lines[0], lines[1][:500], lines[2], '{"example_id": 1}']) + "\n")
    with pytest.raises(DistqaError, match=r"bad\.jsonl, line 2: not valid JSON"):
        list(NQReader(path))
    reader = NQReader(path, skip_bad_lines=True)
    assert [e.example_id for e in reader] == [json.loads(lines[i])["example_id"].__str__() for i in (0, 2)]
    assert [n for n, _ in reader.bad_lines] == [2, 4]
    assert "missing field" in reader.bad_lines[1][1]
    # The column is the line's own, at its cut-off end (json counted it from after the newline: 1).
    cut = '{"example_id": 7, "question_text": "x"'
    path.write_text(lines[0] + "\n" + cut + "\n")
    said = rf"line 2: not valid JSON \(Expecting ',' delimiter at column {len(cut) + 1}\)"
    with pytest.raises(DistqaError, match=said):
        list(NQReader(path))


def test_span_outside_document_is_reported(tmp_path):
    raw = json.loads(SAMPLE.read_text().splitlines()[0])
    raw["annotations"][0]["short_answers"][0]["end_token"] = 10**6
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(raw) + "\n")
    with pytest.raises(DistqaError, match=r"line 1: annotations\[0\]\.short_answers\[0\].*outside"):
        list(NQReader(path))


def test_short_answer_targets_decode_to_the_annotated_words(tokenizer):
    builder = build(tokenizer, keep_unknown=0.0)
    checked = 0
    for example in NQReader(SAMPLE):
        first, last, kind = select_target(example)
        if kind != SHORT:
            continue
        positives = [f for f in builder(example) if f["answer_type"] == SHORT]
        assert positives, example.example_id
        for f in positives:
            span = f["input_ids"][f["start_positions"] : f["end_positions"] + 1]
            gold = " ".join(example.tokens[first : last + 1])
            assert words(tokenizer.decode(span)) == words(gold)
            # Every target position maps back inside the annotated NQ tokens.
            assert f["token_map"][f["start_positions"]] == first and f["token_map"][f["end_positions"]] == last
        checked += 1
    assert checked == 4


def test_long_only_example_targets_its_long_answer(tokenizer):
    example = next(e for e in NQReader(SAMPLE) if select_target(e)[2] == LONG)
    long = example.annotations[0]["long_answer"]
    text_tokens = [i for i in range(long["start_token"], long["end_token"]) if not is_html_tag(example.tokens[i])]
    feats = [f for f in build(tokenizer, max_seq_len=512, doc_stride=128)(example) if f["answer_type"] == LONG]
    assert feats, "the long answer fits one 512-token window"
    f = feats[0]
    assert f["token_map"][f["start_positions"]] == text_tokens[0]
    assert f["token_map"][f["end_positions"]] == text_tokens[-1]


def test_windows_layout_and_unknown_at_cls(tokenizer):
    example = next(iter(NQReader(FIXTURES / "train_sample.jsonl")))  # 17,964 tokens, no answer
    feats = build(tokenizer, keep_unknown=1.0)(example)
    assert len(feats) > 50
    question = tokenizer(example.question, add_special_tokens=False)["input_ids"][:64]
    previous_start = -1
    for f in feats:
        ids, tmap = f["input_ids"], f["token_map"]
        assert len(ids) == len(tmap) == len(f["token_type_ids"]) <= 256
        assert ids[: len(question) + 2] == [tokenizer.cls_token_id, *question, tokenizer.sep_token_id]
        assert ids[-1] == tokenizer.sep_token_id
        assert (f["start_positions"], f["end_positions"], f["answer_type"]) == (0, 0, UNKNOWN)
        window = [t for t in tmap if t >= 0]
        assert window == sorted(window) and all(not is_html_tag(example.tokens[t]) for t in window)
        assert window[0] > previous_start
        previous_start = window[0]
    # keep_unknown subsamples those windows, the same way on every run.
    kept = [len(build(tokenizer, keep_unknown=0.1)(example)) for _ in range(2)]
    assert kept[0] == kept[1] and 0 < kept[0] < len(feats) / 3


def test_prepare_caches_and_reuses(tmp_path, minilm_dir):
    settings = FeatureSettings(max_seq_len=256, doc_stride=128, keep_unknown=0.05)
    out = tmp_path / "features"
    first = prepare_features(SAMPLE, out, tokenizer_name=str(minilm_dir), settings=settings, num_proc=2)
    assert not first.reused and first.docs == 10 and first.features > 0
    ds = load_features(out)
    assert len(ds) == first.features
    assert {
        "example_id",
        "input_ids",
        "token_type_ids",
        "attention_mask",
        "start_positions",
        "end_positions",
        "answer_type",
        "token_map",
    } <= set(ds.column_names)
    again = prepare_features(SAMPLE, out, tokenizer_name=str(minilm_dir), settings=settings, num_proc=2)
    assert again.reused
    # The same features as one process makes: sharding changes nothing.
    single = prepare_features(SAMPLE, tmp_path / "one", tokenizer_name=str(minilm_dir), settings=settings)
    assert load_features(tmp_path / "one")["input_ids"] == ds["input_ids"]
    assert single.features == first.features
    # Another setting is another fingerprint: prepared anew.
    other = FeatureSettings(max_seq_len=256, doc_stride=64, keep_unknown=0.05)
    assert not prepare_features(SAMPLE, out, tokenizer_name=str(minilm_dir), settings=other).reused


def test_the_prepare_pool_s_workers_collect_none_of_what_they_inherited(tmp_path, minilm_dir, monkeypatch):
    """Garbage this process had not collected yet when the pool forked (here a cycle whose finalizer
    writes its pid; under pytest, an earlier in-process run's objects) is not finalized in the
    workers, even by a collection there (seen once: both workers of a test process died of a
    segfault during a collection)."""
    from distqa.nq import prepare

    real = prepare._generate

    def collecting_first(shards):
        gc.collect()  # what a worker's allocations may trigger at any time
        yield from real(shards)

    monkeypatch.setattr(prepare, "_generate", collecting_first)
    settings = FeatureSettings(max_seq_len=256, doc_stride=128, keep_unknown=0.05)
    with only_this_process_finalizes(tmp_path / "finalized-by"):
        result = prepare_features(SAMPLE, tmp_path / "f", tokenizer_name=str(minilm_dir), settings=settings, num_proc=2)
        assert result.features > 0


def test_dev_format_with_five_annotations_reads_and_targets(tmp_path, tokenizer):
    """The dev format: five annotations; the first with a short answer gives the training target."""
    raw = json.loads(SAMPLE.read_text().splitlines()[0])  # a short answer at tokens [1960, 1969)
    real = raw["annotations"][0]
    null = {
        "long_answer": {"start_token": -1, "end_token": -1, "candidate_index": -1},
        "short_answers": [],
        "yes_no_answer": "NONE",
    }
    long_only = {**real, "short_answers": []}
    raw["annotations"] = [null, long_only, real, null, {**real, "yes_no_answer": "NONE"}]
    path = tmp_path / "dev.jsonl"
    path.write_text(json.dumps(raw) + "\n")
    (example,) = NQReader(path)
    assert len(example.annotations) == 5
    assert select_target(example) == (1960, 1968, SHORT)
    positives = [f for f in build(tokenizer, keep_unknown=0.0)(example) if f["answer_type"] == SHORT]
    assert positives and positives[0]["token_map"][positives[0]["start_positions"]] == 1960


def _byte_level_bpe(texts):
    """A RoBERTa-style tokenizer, trained here: byte-level BPE without a prefix space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["[CLS]", "[SEP]", "[PAD]", "[UNK]"]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]"
    )


def test_document_words_are_spelt_as_in_running_text_by_any_tokenizer(tokenizer):
    """Each document word was encoded alone: a byte-level BPE tokenizer (RoBERTa, ModernBERT) spelt
    every one as a text's first word ('New' where the text reads 'ĠNew'), so the windows lost the
    words' boundaries and the document had other ids than the question for the same word; a
    ModernBERT trained on that with exit 0 (found by a review). BERT's ids, and the feature cache's
    key for it, are as before."""
    from distqa.nq.feature_stamp import made_with
    from distqa.nq.features import spells_after_space

    examples = list(NQReader(SAMPLE))
    bpe = _byte_level_bpe(" ".join(e.tokens) for e in examples)
    for tok, spaced in ((bpe, True), (tokenizer, False)):
        assert spells_after_space(tok.backend_tokenizer) is spaced
        builder, whole = build(tok), copy.deepcopy(tok.backend_tokenizer)
        whole.no_truncation()  # (MiniLM's tokenizer.json cuts at 512)
        for example in examples[:3]:
            kept = [t for t in example.tokens if t and not is_html_tag(t)]
            ids, _ = builder.document_subwords(example.tokens)
            text = " ".join(kept)
            assert ids == whole.encode(f" {text}" if spaced else text, add_special_tokens=False).ids
        assert ("words" in made_with(tok, FeatureSettings())["settings"]) is spaced
    question = bpe.backend_tokenizer.encode("what is the capital of new york", add_special_tokens=False).ids
    later = bpe.backend_tokenizer.encode(" york", add_special_tokens=False).ids
    assert question[-len(later) :] == later and build(bpe).word_ids(["york"]) == [later]
