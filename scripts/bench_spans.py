"""Cost of the span search that evaluation and `distqa predict` run on every batch's logits.

`distqa.nq.postprocess.best_spans` (every top-k start and end pair of a batch as one tensor) against
the pair-by-pair search it replaced (`pair_by_pair` in tests/test_nq_pipeline.py, which checks that
both pick the same spans), in the same run, on random logits: a batch of windows whose first 20
positions are the question, top-k 20, task.max_answer_len 30. CPU, one thread by default (as a
rank's evaluation runs it after the forward pass). Usage:
  python scripts/bench_spans.py [--threads N] [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from distqa.nq.postprocess import best_spans  # noqa: E402
from test_nq_pipeline import pair_by_pair  # noqa: E402  (the reference lives beside its test)

SHAPES = [(8, 128), (32, 384), (32, 512)]  # (windows a batch, sub-words a window)


def per_call_ms(fn: Callable[[], object], repeat: int) -> float:
    """The median of `repeat` timed calls, after one untimed."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print("| windows x sub-words | pair by pair (ms a batch) | batched (ms a batch) | speed-up |")
    print("|---|---|---|---|")
    for batch, seq in SHAPES:
        start, end, types = torch.randn(batch, seq), torch.randn(batch, seq), torch.randn(batch, 5)
        token_map = torch.arange(seq).repeat(batch, 1)
        token_map[:, :20] = -1  # [CLS] and the question: not the document
        ids = [str(i) for i in range(batch)]
        logits = (start, end, types, token_map, ids)
        old = per_call_ms(lambda logits=logits: pair_by_pair(*logits, 30), args.repeat)
        new = per_call_ms(lambda logits=logits: best_spans(*logits, max_answer_len=30), args.repeat)
        print(f"| {batch} x {seq} | {old:.2f} | {new:.2f} | {old / new:.0f}x |")


if __name__ == "__main__":
    main()
