"""DummyDataset: synthetic question-answering features, so everything runs without the 17 GB data.

Each item has the exact layout of a real feature, `[CLS] question [SEP] document [SEP] [PAD]...`
with `token_type_ids` 0 for the question part and 1 for the document part, and targets that are
valid for it: an answer type drawn uniformly from the five, a span inside the document for types
1-4, and (0, 0) at [CLS] for "unknown" (the BERT-joint convention).

The targets are random but *learnable*, so a falling loss shows that gradients reach every head:
the answer span repeats the question's first tokens, and the question's first token encodes the
answer type. Item i is a pure function of (seed, i): any worker, rank or resumed run that asks for
it gets the same tensors, with no state to save.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from distqa.data_identity import digest_of

MAX_QUESTION_TOKENS = 64
MAX_ANSWER_TOKENS = 8
# Ids below 1000 in BERT vocabularies are special and [unusedN] tokens: keep ordinary text above.
TYPE_MARKER_BASE = 1000
FIRST_TEXT_ID = 1010


class DummyDataset(Dataset):
    def __init__(
        self,
        size: int,
        max_seq_len: int,
        *,
        vocab_size: int,
        seed: int,
        cls_id: int = 101,
        sep_id: int = 102,
        pad_id: int = 0,
    ) -> None:
        if vocab_size <= FIRST_TEXT_ID:
            raise ValueError(f"vocab_size={vocab_size} leaves no ids for text (need > {FIRST_TEXT_ID})")
        self.size = size
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.cls_id, self.sep_id, self.pad_id = cls_id, sep_id, pad_id

    def __len__(self) -> int:
        return self.size

    def fingerprint(self) -> str:
        """The identity of every item at the cost of one: items are a pure function of these
        settings, and item 0's content is added so that a change of the generator itself counts."""
        settings = (self.size, self.max_seq_len, self.vocab_size, self.seed, self.cls_id, self.sep_id, self.pad_id)
        return digest_of(type(self).__qualname__, *settings, self[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(f"DummyDataset index {index} out of range 0..{self.size - 1}")
        rng = np.random.default_rng([self.seed, index])
        length = self.max_seq_len
        q_len = int(rng.integers(2, min(MAX_QUESTION_TOKENS, length // 4) + 1))
        doc_room = length - q_len - 3  # [CLS], [SEP], [SEP]
        doc_len = int(rng.integers(max(1, doc_room // 2), doc_room + 1))  # the rest is padding
        answer_type = int(rng.integers(0, 5))

        question = rng.integers(FIRST_TEXT_ID, self.vocab_size, size=q_len)
        question[0] = TYPE_MARKER_BASE + answer_type
        document = rng.integers(FIRST_TEXT_ID, self.vocab_size, size=doc_len)

        doc_begin = q_len + 2  # position of the first document token in the sequence
        if answer_type == 0:
            start = end = 0
        else:
            span = int(rng.integers(1, min(MAX_ANSWER_TOKENS, q_len, doc_len) + 1))
            offset = int(rng.integers(0, doc_len - span + 1))
            document[offset : offset + span] = question[:span]
            start, end = doc_begin + offset, doc_begin + offset + span - 1

        used = doc_begin + doc_len + 1
        input_ids = np.full(length, self.pad_id, dtype=np.int64)
        input_ids[0] = self.cls_id
        input_ids[1 : q_len + 1] = question
        input_ids[q_len + 1] = self.sep_id
        input_ids[doc_begin : doc_begin + doc_len] = document
        input_ids[used - 1] = self.sep_id
        token_type_ids = np.zeros(length, dtype=np.int64)
        token_type_ids[doc_begin:used] = 1
        attention_mask = np.zeros(length, dtype=np.int64)
        attention_mask[:used] = 1
        return {
            "input_ids": torch.from_numpy(input_ids),
            "token_type_ids": torch.from_numpy(token_type_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "start_positions": torch.tensor(start),
            "end_positions": torch.tensor(end),
            "answer_type": torch.tensor(answer_type),
        }
