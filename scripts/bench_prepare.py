"""Feature-building throughput on real Natural Questions documents, one process, in one run:

  word-by-word   one `tokenizer.encode(word)` call per document word, as the original Neu.ro
                 recipe did (its `_drop_tags_and_encode`), inside the same feature builder;
  rust word-by-word  the same, calling the Rust tokenizer directly (a stronger baseline);
  distqa (cold)  distqa's builder with an empty word cache for every pass: its worst case;
  distqa (warm)  the same builder kept across passes: the steady state of a long file, where most
                 words are already cached.

All produce identical features (checked). Usage:
  python scripts/bench_prepare.py --input tests/fixtures/nq/simplified-nq-sample.jsonl \
      --input tests/fixtures/nq/train_sample.jsonl --tokenizer PATH_OR_ID [--repeat 5]
Run with TOKENIZERS_PARALLELISM=false RAYON_NUM_THREADS=1 for a strict one-core figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from transformers import AutoTokenizer

from distqa.nq.features import FeatureBuilder, FeatureSettings
from distqa.nq.reader import NQReader


class WordByWordBuilder(FeatureBuilder):
    """The baseline: everything as distqa, except one tokenizer call per word and no cache."""

    def word_ids(self, words: list[str]) -> list[list[int]]:
        return [self.tokenizer.encode(w, add_special_tokens=False) for w in words]


class RustWordByWordBuilder(FeatureBuilder):
    """A stronger baseline: one call per word, but straight to the Rust tokenizer."""

    def word_ids(self, words: list[str]) -> list[list[int]]:
        return [self._backend.encode(w, add_special_tokens=False).ids for w in words]


def docs_per_second(make_builder, examples, repeat: int) -> tuple[float, list]:
    rates, output = [], None
    for _ in range(repeat):
        builder = make_builder()
        started = time.perf_counter()
        output = [builder(e) for e in examples]
        rates.append(len(examples) / (time.perf_counter() - started))
    return statistics.median(rates), output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", action="append", required=True, help="NQ JSONL file (repeatable)")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    settings = FeatureSettings(max_seq_len=512, doc_stride=128, keep_unknown=0.02)
    examples = [e for path in args.input for e in NQReader(path)]
    n_tokens = sum(len(e.tokens) for e in examples)

    warm = FeatureBuilder(tokenizer, settings)
    warm(examples[0])  # anything, so the first timed pass is not the one that fills the cache
    for e in examples:
        warm(e)
    base, base_out = docs_per_second(lambda: WordByWordBuilder(tokenizer, settings), examples, args.repeat)
    rust, rust_out = docs_per_second(lambda: RustWordByWordBuilder(tokenizer, settings), examples, args.repeat)
    cold, cold_out = docs_per_second(lambda: FeatureBuilder(tokenizer, settings), examples, args.repeat)
    hot, hot_out = docs_per_second(lambda: warm, examples, args.repeat)
    assert base_out == rust_out == cold_out == hot_out, "every builder must produce identical features"

    result = {
        "documents": len(examples),
        "mean_tokens_per_document": round(n_tokens / len(examples)),
        "word_by_word_docs_per_s": round(base, 2),
        "rust_word_by_word_docs_per_s": round(rust, 2),
        "distqa_cold_docs_per_s": round(cold, 2),
        "distqa_warm_docs_per_s": round(hot, 2),
        "speedup_cold": round(cold / base, 1),
        "speedup_warm": round(hot / base, 1),
        "speedup_cold_vs_rust_word_by_word": round(cold / rust, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
