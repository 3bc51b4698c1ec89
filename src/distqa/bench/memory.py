"""What training an encoder needs per GPU, from its shape: the formulas behind the memory table of
docs/benchmarks.md, for models and GPUs this machine does not have.

    python -m distqa.bench.memory [--gpus 8] [--seq 512] [--batch 8] [--gib 80]

Per GPU = training state + activations + what FSDP gathers for the block it is computing.
- State (AdamW, fp32 weights whether or not compute is bf16): weights 4 + gradients 4 + two moments
  8 = 16 bytes per parameter. DDP holds all of it on every GPU; FSDP 1/N of it. `distqa bench`
  measures the same figure (`state_mib_per_rank`), which this formula matches on the CPU.
- Activations of one block: 48 * s * b * h bytes (`ACTIVATION_BYTES`), measured: peak memory
  on an H100 (docs/benchmarks.md, 2026-11-27) grew by that much per sequence added, for BERT-base
  and BERT-large alike. Korthikanti et al. (2022, "Reducing Activation Recomputation in Large
  Transformer Models", eq. 2, without the attention matrix, which SDPA's fused kernels do not
  keep) count 34 for pure bf16; under autocast the residual stream and the layer norms stay
  fp32, and backward's temporaries add to the peak. With activation checkpointing, only each
  block's input stays (fp32 under autocast: 4 * s * b * h), plus one block's activations while
  it is recomputed (not yet measured on a GPU).
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
from collections.abc import Callable
from dataclasses import dataclass

GIB = 2**30
OVERHEAD_GIB = 2.0  # CUDA context, NCCL buffers, allocator fragmentation: set aside from each GPU
STATE_BYTES_PER_PARAMETER = 16  # fp32 weights 4 + gradients 4 + AdamW's two moments 8
# Bytes per sequence position per hidden unit per block. Measured on one H100 (torch 2.11, bf16
# autocast, SDPA, dropout 0.1, seq 512): peak memory rose 0.2140 GiB per sequence for BERT-base
# (batch 128 -> 256), 48.7 per s*h per block, and 0.5593 GiB for BERT-large (64 -> 128), 47.7.
ACTIVATION_BYTES = 48
CHECKPOINTED_INPUT_BYTES = 4  # a block's input under autocast: the fp32 output of a layer norm


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


def activation_bytes(model: Encoder, seq: int, batch: int, checkpointed: bool) -> float:
    per_block = ACTIVATION_BYTES * seq * batch * model.hidden
    if checkpointed:
        return model.layers * CHECKPOINTED_INPUT_BYTES * seq * batch * model.hidden + per_block
    return model.layers * per_block


def gathered_bytes(model: Encoder) -> float:
    """FSDP: two blocks' bf16 weights and fp32 gradients, and the root unit's, gathered at once."""
    return (2 * model.block_parameters + model.root_parameters) * (2 + 4)


def per_gpu_bytes(
    model: Encoder, *, gpus: int, seq: int, batch: int, sharded: bool, checkpointed: bool, accumulating: bool = False
) -> float:
    total = state_bytes_per_rank(model.parameters, gpus, sharded) + activation_bytes(model, seq, batch, checkpointed)
    if sharded:
        total += gathered_bytes(model) + (4 * model.parameters if accumulating else 0.0)
    return total


SETUPS = (("DDP", False, False), ("DDP + AC", False, True), ("FSDP", True, False), ("FSDP + AC", True, True))


def largest_batch(model: Encoder, *, gpus: int, seq: int, gib: float, sharded: bool, checkpointed: bool) -> int:
    """The most sequences per GPU per micro-batch that fit in `gib` (0: not even one)."""
    fixed = per_gpu_bytes(model, gpus=gpus, seq=seq, batch=0, sharded=sharded, checkpointed=checkpointed)
    per_sequence = activation_bytes(model, seq, 1, checkpointed)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="sequences per GPU per micro-batch")
    parser.add_argument("--gib", type=float, default=80.0, help="memory of one GPU, for the largest batch")
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
