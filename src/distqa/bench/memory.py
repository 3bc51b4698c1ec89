"""What training an encoder needs per GPU, from its shape: the formulas behind the memory table of
docs/benchmarks.md, for models and GPUs this machine does not have.

    python -m distqa.bench.memory [--gpus 8] [--seq 512] [--batch 8] [--gib 80]

Per GPU = training state + activations + what FSDP gathers for the block it is computing.
- State (AdamW, fp32 weights whether or not compute is bf16): weights 4 + gradients 4 + two moments
  8 = 16 bytes per parameter. DDP holds all of it on every GPU; FSDP 1/N of it. `distqa bench`
  measures the same figure (`state_mib_per_rank`), which this formula matches on the CPU.
- Activations of one block, per sequence position per hidden unit (`Activations`), measured on an
  H100 (docs/benchmarks.md, 2026-11-27): DDP under bf16 autocast keeps 48 bytes (peak memory grew
  that much per sequence added, for BERT-base and BERT-large alike); Korthikanti et al. (2022,
  "Reducing Activation Recomputation in Large Transformer Models", eq. 2, without the attention
  matrix, which SDPA's fused kernels do not keep) count 34 for pure bf16. Under autocast the
  residual stream and the layer norms stay fp32, and backward's temporaries add to the peak. FSDP
  computes in bf16 itself (its policy casts the weights, no autocast): 36.
- With activation checkpointing, only each block's input stays (under autocast the fp32 output of
  a layer norm: 4 bytes), and the peak comes in the backward pass: one block's activations while it
  is recomputed, and what no block holds (the embeddings' output, the stream's gradient), 65
  together (measured: 110.5 bytes per position and hidden unit for BERT-base's 12 blocks, 156.1
  for BERT-large's 24). FSDP with checkpointing is not measured: its figures are the autocast
  ones scaled to bf16 (2 and 49).
- FSDP's gathered copies: the block being computed and the one prefetched, bf16 weights and fp32
  gradients before their reduce-scatter, and the root unit (embeddings and heads), which stays
  gathered from its forward to the end of its backward.
- Gradient accumulation (`accumulating`, train.grad_accum > 1) with FSDP: between micro-batches
  each rank keeps whole, unreduced fp32 gradients (4 bytes per parameter, as DDP does), because it
  reduces only on the last one. The tables are for train.grad_accum=1.
Left out: the CUDA context and allocator slack (`OVERHEAD_GIB` is set aside for them), the loss's
logits, and temporary buffers of individual kernels. DeBERTa's disentangled attention keeps
relative-position score matrices no fused kernel removes: its activation figures are lower bounds.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GIB = 2**30
# Set aside from each GPU: the CUDA context, NCCL's buffers, and the allocator's blocks reserved but
# not allocated. On an H100 (79.65 GiB, of which torch sees 79.18) the largest runs that fit peaked
# at 75.85 GiB allocated, and the out-of-memory errors at batches of 1,000 to 2,000 left 2.7 to
# 3.9 GiB reserved but unallocated (their failed requests were 2.8 to 6.3 GiB).
OVERHEAD_GIB = 4.0
STATE_BYTES_PER_PARAMETER = 16  # fp32 weights 4 + gradients 4 + AdamW's two moments 8


@dataclass(frozen=True)
class Activations:
    """Bytes per sequence position per hidden unit, by how a set-up computes."""

    block: float  # one block's, all kept for the backward pass
    block_input: float  # checkpointed: each block's input, the only thing it keeps
    recompute: float  # checkpointed: one block's while recomputed, and what is outside the blocks


# DDP, bf16 autocast, SDPA, dropout 0.1, seq 512, torch 2.11, one H100. Without checkpointing, peak
# memory rose 0.2140 GiB per sequence for BERT-base (batch 128 -> 256), 48.7 per s*h per block,
# and 0.5593 GiB for BERT-large (64 -> 128), 47.7. With it, (peak - state) / batch was 0.04048 GiB
# for BERT-base at batch 1460 and 0.07621 for BERT-large at 930: 110.5 and 156.1 per s*h, 4 per
# block (3.8 fitted) and 65 besides.
AUTOCAST = Activations(block=48, block_input=4, recompute=65)
# FSDP2, its MixedPrecisionPolicy in bf16: BERT-base rose 0.1589 GiB per sequence (batch 359 -> 394),
# 36.2 per s*h per block. Checkpointed, not measured: a block's input in bf16 (2 bytes, not 4), and
# AUTOCAST's recompute term scaled by 36/48.
BF16_COMPUTE = Activations(block=36, block_input=2, recompute=49)


@dataclass(frozen=True)
class Encoder:
    """A model's shape. Sources: each model's config.json and paper (parameters as published)."""

    name: str
    parameters: float
    layers: int
    hidden: int

    @property
    def block_parameters(self) -> float:
        return 12 * self.hidden**2  # attention 4h^2 + MLP 8h^2 (4x expansion), biases and norms left out

    @property
    def root_parameters(self) -> float:
        return max(0.0, self.parameters - self.layers * self.block_parameters)  # embeddings, heads


ENCODERS = (
    Encoder("BERT-base", 110e6, 12, 768),
    Encoder("BERT-large", 335e6, 24, 1024),
    Encoder("RoBERTa-large", 355e6, 24, 1024),
    Encoder("ModernBERT-large", 395e6, 28, 1024),
    Encoder("DeBERTa-v3-large", 435e6, 24, 1024),
    Encoder("XLM-R-large", 560e6, 24, 1024),
)


def state_bytes_per_rank(parameters: float, world: int, sharded: bool) -> float:
    """Weights, gradients and AdamW state one rank holds between steps."""
    return STATE_BYTES_PER_PARAMETER * parameters / (world if sharded else 1)


def activation_bytes(model: Encoder, seq: int, batch: int, *, sharded: bool, checkpointed: bool) -> float:
    """What one micro-batch keeps for its backward pass, at its peak. FSDP computes in bf16."""
    per = BF16_COMPUTE if sharded else AUTOCAST
    positions = seq * batch * model.hidden
    if checkpointed:
        return (model.layers * per.block_input + per.recompute) * positions
    return model.layers * per.block * positions


def gathered_bytes(model: Encoder) -> float:
    """FSDP: two blocks' bf16 weights and fp32 gradients, and the root unit's, gathered at once."""
    return (2 * model.block_parameters + model.root_parameters) * (2 + 4)


def per_gpu_bytes(
    model: Encoder, *, gpus: int, seq: int, batch: int, sharded: bool, checkpointed: bool, accumulating: bool = False
) -> float:
    total = state_bytes_per_rank(model.parameters, gpus, sharded) + activation_bytes(
        model, seq, batch, sharded=sharded, checkpointed=checkpointed
    )
    if sharded:
        total += gathered_bytes(model) + (4 * model.parameters if accumulating else 0.0)
    return total


SETUPS = (("DDP", False, False), ("DDP + AC", False, True), ("FSDP", True, False), ("FSDP + AC", True, True))


def largest_batch(model: Encoder, *, gpus: int, seq: int, gib: float, sharded: bool, checkpointed: bool) -> int:
    """The most sequences per GPU per micro-batch that fit in `gib` (0: not even one)."""
    fixed = per_gpu_bytes(model, gpus=gpus, seq=seq, batch=0, sharded=sharded, checkpointed=checkpointed)
    per_sequence = activation_bytes(model, seq, 1, sharded=sharded, checkpointed=checkpointed)
    return max(0, int(((gib - OVERHEAD_GIB) * GIB - fixed) // per_sequence))


def _markdown(head: str, label: Callable[[Encoder], str], cell: Callable[[Encoder, bool, bool], str]) -> str:
    """A markdown table: a row per encoder, a column per set-up."""
    lines = [f"| {head} | {' | '.join(name for name, _, _ in SETUPS)} |", "|---|" + "---:|" * len(SETUPS)]
    for model in ENCODERS:
        cells = [cell(model, sharded, ac) for _, sharded, ac in SETUPS]
        lines.append(f"| {label(model)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fit_table(gpus: int, seq: int, gib: float) -> str:
    """docs/benchmarks.md's other table: the largest batch per GPU in the four set-ups."""
    return _markdown(
        "model",
        lambda model: model.name,
        lambda model, sharded, ac: str(
            largest_batch(model, gpus=gpus, seq=seq, gib=gib, sharded=sharded, checkpointed=ac)
        ),
    )


def table(gpus: int, seq: int, batch: int) -> str:
    """docs/benchmarks.md's markdown table: GiB per GPU in the four set-ups."""
    return _markdown(
        "model (parameters)",
        lambda model: f"{model.name} ({model.parameters / 1e6:.0f} M)",
        lambda model, sharded, ac: (
            f"{per_gpu_bytes(model, gpus=gpus, seq=seq, batch=batch, sharded=sharded, checkpointed=ac) / GIB:.1f}"
        ),
    )


def _positive(kind: type) -> Any:
    """An argparse type: a number of `kind` above 0 (--batch -8 printed negative GiB, --gpus 0 a
    ZeroDivisionError traceback; found by a review)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"{text} must be a number above 0")
        return value

    return parse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=_positive(int), default=8)
    parser.add_argument("--seq", type=_positive(int), default=512)
    parser.add_argument("--batch", type=_positive(int), default=8, help="sequences per GPU per micro-batch")
    parser.add_argument("--gib", type=_positive(float), default=80.0, help="memory of one GPU, for the largest batch")
    args = parser.parse_args(argv)
    print(f"GiB per GPU, {args.gpus} GPUs, seq {args.seq}, batch {args.batch} per GPU, bf16 compute, AdamW")
    print(table(args.gpus, args.seq, args.batch))
    print(
        f"\nlargest batch per GPU in {args.gib:g} GiB ({OVERHEAD_GIB:g} GiB set aside), "
        f"{args.gpus} GPUs, seq {args.seq}"
    )
    print(fit_table(args.gpus, args.seq, args.gib))


if __name__ == "__main__":
    main()
