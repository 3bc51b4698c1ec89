"""Natural Questions examples to model features, BERT-joint style (Alberti et al., 2019).

A feature is `[CLS] question [SEP] window [SEP]`: the question cut to `max_query_len` sub-word
tokens, and one window of the document, windows starting every `doc_stride` sub-word tokens. Each
window position maps back to the index of the NQ whitespace token it came from (`token_map`, -1
for the question and special tokens), which is what predictions are written in.

HTML tags (`<P>`, `<Table>`, `<Tr>`, ...) are dropped before sub-word tokenisation: an uncased
WordPiece vocabulary spells `<Table>` as three meaningless pieces, and tags are about a fifth of
NQ's tokens, so keeping them would spend window space on markup. Answer spans that begin or end on
a tag (every long answer does) shrink to the text inside; the tags' indices are recovered at
prediction time from the long-answer candidates.

Targets: the first short answer (type short); YES/NO, the long answer's span (type yes/no); a long
answer alone (type long); else unknown. A window that does not hold the whole target span is
unknown and points at [CLS] (0, 0); such windows are kept with probability `keep_unknown` (a
seeded draw per example), because almost every window of a 10k-token article is one of them.

Sub-word ids come from a word-to-ids cache: documents repeat words, and one batched tokenizer call
for the words the cache lacks is far cheaper than one call per word (see docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from distqa.errors import DistqaError
from distqa.nq.reader import NQExample

UNKNOWN, YES, NO, SHORT, LONG = range(5)
_CACHE_LIMIT = 2_000_000  # words; bounds a worker's memory over the 17 GB file
# Segment ids: 0 for [CLS] question [SEP], 1 for the document and its [SEP] (BERT's pairs). The
# model must have that many token types (models.check_model_fits).
TOKEN_TYPES = 2


@dataclass(frozen=True)
class FeatureSettings:
    max_seq_len: int = 512
    doc_stride: int = 128
    max_query_len: int = 64
    keep_unknown: float = 0.02  # fraction of unknown windows kept for training
    seed: int = 42
    training: bool = True  # False: keep every window (evaluation, prediction)


def is_html_tag(token: str) -> bool:
    return len(token) > 2 and token[0] == "<" and token[-1] == ">"


def select_target(example: NQExample) -> tuple[int, int, int]:
    """(first NQ token, last NQ token inclusive, answer type) of the training target.

    Training files have one annotation; with several (the dev format) the first annotation with a
    short answer wins, then one with YES/NO, then one with a long answer.
    """

    def first(pred):  # noqa: ANN001, ANN202 - tiny local helper
        return next((a for a in example.annotations if pred(a)), None)

    def real_shorts(a):  # noqa: ANN001, ANN202 - a (-1, -1) short span is "no answer", not a span
        return [s for s in a.get("short_answers", []) if s["start_token"] >= 0]

    ann = first(real_shorts)
    if ann is not None:
        short = real_shorts(ann)[0]
        return short["start_token"], short["end_token"] - 1, SHORT
    ann = first(lambda a: a.get("yes_no_answer", "NONE") != "NONE" and a["long_answer"]["start_token"] >= 0)
    if ann is not None:
        long = ann["long_answer"]
        return long["start_token"], long["end_token"] - 1, YES if ann["yes_no_answer"] == "YES" else NO
    ann = first(lambda a: a["long_answer"]["start_token"] >= 0)
    if ann is not None:
        return ann["long_answer"]["start_token"], ann["long_answer"]["end_token"] - 1, LONG
    return -1, -1, UNKNOWN


# Words whose ids a tokenizer may give otherwise after a space than alone (`spells_after_space`).
_PROBES = ("the", "word", "New", "York", "1990", "a")


def spells_after_space(backend: Any) -> bool:
    """Whether a tokenizer spells a word otherwise after a space than alone, as byte-level BPE does
    without a prefix space (RoBERTa, ModernBERT: `Ġword` in running text, `word` alone). Such a
    tokenizer gets each document word as it reads in the text, after a space: alone, every word
    was spelt as a text's first, the words' boundaries were gone from the windows and a word had
    other ids in the document than in the question, exit 0 (found by a review). WordPiece and
    SentencePiece give the same ids either way, and are left as they were (their features too)."""
    return any(
        backend.encode(f" {word}", add_special_tokens=False).ids != backend.encode(word, add_special_tokens=False).ids
        for word in _PROBES
    )


def _stable_seed(seed: int, example_id: str) -> list[int]:
    digest = hashlib.blake2b(example_id.encode(), digest_size=8).digest()
    return [seed, int.from_bytes(digest, "little")]


def require_cls_and_sep(tokenizer: Any) -> None:
    """Every window is [CLS] question [SEP] passage [SEP]: a tokenizer that names no [CLS] or [SEP]
    (one trained with `tokenizers` and saved without its special tokens) gave None for their ids,
    prepared with exit 0, and training ended in a TypeError from the collate (a review)."""
    missing = [role for role in ("cls", "sep") if getattr(tokenizer, f"{role}_token_id", None) is None]
    if missing:
        names = " and ".join(f"{role}_token" for role in missing)
        raise DistqaError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no {names}: its windows are "
            f"[CLS] question [SEP] passage [SEP]; use a BERT-style tokenizer, or set {names} in its "
            "tokenizer_config.json to tokens of its vocabulary"
        )


class FeatureBuilder:
    """Turns NQExamples into feature dicts. One per worker process: it owns a word cache."""

    def __init__(self, tokenizer: Any, settings: FeatureSettings) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("FeatureBuilder needs a fast (Rust) tokenizer")
        require_cls_and_sep(tokenizer)
        self.tokenizer = tokenizer
        self.settings = settings
        self.cls_id, self.sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
        # Our own copy of the Rust tokenizer, set to treat "[SEP]" or "[CLS]" written in a question or
        # a Wikipedia page as text: only the builder places special tokens. The copy comes back with
        # the padding and truncation saved in tokenizer.json, which word pieces must not get.
        backend = copy.deepcopy(tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        backend.encode_special_tokens = True
        self._backend = backend
        self._space = " " if spells_after_space(backend) else ""
        self._cache: dict[str, list[int]] = {}

    def word_ids(self, words: list[str]) -> list[list[int]]:
        """Sub-word ids of each word, tokenising only the words not seen before, in one call."""
        cache = self._cache
        missing = list({w for w in words if w not in cache})
        if missing and len(cache) + len(missing) > _CACHE_LIMIT:
            cache.clear()  # then every word of this document is missing, not only the new ones
            missing = list(set(words))
        if missing:
            # The Rust tokenizer directly: transformers' __call__ wraps the same work in ~3x the time.
            spelt = [self._space + word for word in missing] if self._space else missing
            encoded = self._backend.encode_batch(spelt, add_special_tokens=False)
            cache.update(zip(missing, (e.ids for e in encoded)))
        return [cache[w] for w in words]

    def document_subwords(self, tokens: list[str]) -> tuple[list[int], np.ndarray]:
        """(sub-word ids, NQ token index of each) for the document, HTML tags dropped."""
        kept = [i for i, t in enumerate(tokens) if t and not (t[0] == "<" and t[-1] == ">" and len(t) > 2)]
        pieces = self.word_ids([tokens[i] for i in kept])
        ids = list(chain.from_iterable(pieces))
        origin = np.repeat(np.asarray(kept, dtype=np.int64), [len(p) for p in pieces])
        return ids, origin

    def __call__(self, example: NQExample) -> list[dict[str, Any]]:
        s = self.settings
        query = self._backend.encode(example.question, add_special_tokens=False).ids[: s.max_query_len]
        doc_ids, doc_origin = self.document_subwords(example.tokens)
        room = s.max_seq_len - len(query) - 3  # [CLS] query [SEP] window [SEP]
        if room < 1:
            raise ValueError(
                f"task.max_seq_len={s.max_seq_len} leaves no room for the document after a question of "
                f"{len(query)} tokens (example {example.example_id}): "
                "raise task.max_seq_len or lower task.max_query_len"
            )

        first_tok, last_tok, answer_type = select_target(example)
        origin = doc_origin
        # Sub-word span of the target: the first piece at or after its first token, the last piece
        # at or before its last token (tags at either end were dropped).
        sub_start = int(np.searchsorted(origin, first_tok, side="left"))
        sub_end = int(np.searchsorted(origin, last_tok, side="right")) - 1
        if answer_type == UNKNOWN or sub_start > sub_end:
            answer_type = UNKNOWN

        rng = np.random.default_rng(_stable_seed(s.seed, example.example_id))
        prefix = [self.cls_id, *query, self.sep_id]
        offset = len(prefix)
        features = []
        # A stride longer than the window would leave document text in no window at all.
        for begin in range(0, max(len(doc_ids), 1), min(s.doc_stride, room)):
            end = min(begin + room, len(doc_ids))
            inside = answer_type != UNKNOWN and begin <= sub_start and sub_end < end
            if inside:
                start, stop, kind = sub_start - begin + offset, sub_end - begin + offset, answer_type
            else:
                start, stop, kind = 0, 0, UNKNOWN
                if s.training and rng.random() >= s.keep_unknown:
                    if end >= len(doc_ids):
                        break
                    continue
            input_ids = prefix + doc_ids[begin:end] + [self.sep_id]
            features.append(
                {
                    "example_id": example.example_id,
                    "input_ids": input_ids,
                    "token_type_ids": [0] * offset + [1] * (end - begin + 1),
                    "attention_mask": [1] * len(input_ids),
                    "start_positions": start,
                    "end_positions": stop,
                    "answer_type": kind,
                    "token_map": [-1] * offset + doc_origin[begin:end].tolist() + [-1],
                }
            )
            if end >= len(doc_ids):
                break
        return features
