"""What the replica check costs beside a training step (docs/benchmarks.md, "The replica check's cost").

    python scripts/bench_replica_check.py

Times the checksum `distqa.replicas` takes of every parameter of a BERT-base-shaped model (random
weights, built from its config: no download) against one AdamW step of batch 8 x 128 tokens, in the
same process, on this machine's device. The all-reduces of one number per tensor are left out.
"""

from __future__ import annotations

import time

import torch
from transformers import BertConfig, BertForQuestionAnswering

from distqa.replicas import checksums


def seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = BertForQuestionAnswering(BertConfig()).to(device)
    params = list(model.parameters())
    ids = torch.randint(0, 30522, (8, 128), device=device)
    zeros = torch.zeros(8, dtype=torch.long, device=device)
    optimizer = torch.optim.AdamW(params, lr=1e-5)

    def step() -> None:
        model(input_ids=ids, start_positions=zeros, end_positions=zeros).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    check = seconds(lambda: checksums(model), 5)
    train = seconds(step, 3)
    print(
        f"{device}: {sum(p.numel() for p in params) / 1e6:.1f}M parameters; checksum {check * 1000:.1f} ms; "
        f"AdamW step (batch 8 x 128 tokens) {train * 1000:.0f} ms; {check / train:.2%} of a step, "
        f"{check / train / 10:.2%} of training at train.log_every=10"
    )


if __name__ == "__main__":
    main()
