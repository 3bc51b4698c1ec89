"""One measurement of `distqa bench`, run by torchrun in every process of one world size.

    python -m distqa.bench.worker --loop trainer --result R.json --warmup 5 --steps 20 KEY=VALUE ...

`--loop trainer` runs distqa's own `Trainer` with a `StepTimer`; `--loop baseline` runs the
minimal hand-written DDP loop of `distqa.bench.baseline` on the same task, model and data;
`--dp-gpus N` (one process) runs the trainer with train.parallel=dp over the N visible GPUs, each
step `train.batch_size` x N examples, so that every GPU sees the batch a DDP process would. Rank 0
writes one JSON object: the summed samples and tokens, the slowest rank's seconds, each phase's
mean over ranks, and what MFU needs (FLOPs per token, the device's name).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from distqa.bench.baseline import run_baseline
from distqa.bench.profile import ProfilingTimer
from distqa.config import Config
from distqa.console import quiet_libraries
from distqa.dist import DistInfo, barrier, cleanup, gather_to_main, init_distributed, local_main_first, print0
from distqa.errors import DistqaError
from distqa.flops import device_name
from distqa.parallel import state_bytes
from distqa.parent_watch import watch_parent
from distqa.registry import load_config, load_task
from distqa.steptimer import PHASES, StepTimer
from distqa.task import Task
from distqa.trainer import Trainer


def _bench_config(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config, args.overrides)
    if args.dp_gpus:
        _check_gpus(args.dp_gpus)
        # Through load_config again, so that dp's settings are checked as `distqa train` checks them.
        per_step = ["train.parallel=dp", f"train.batch_size={cfg.train.batch_size * args.dp_gpus}"]
        cfg = load_config(args.config, [*args.overrides, *per_step])
    cfg.output_dir = args.output_dir
    # Only the steps are measured: no validation (it would run inside the last step), no resume
    # from an earlier measurement, no checkpoint along the way.
    cfg.data.valid = None
    cfg.train.max_steps = args.warmup + args.steps
    cfg.train.resume = "never"
    cfg.train.checkpoint_every = cfg.train.max_steps + 1
    if cfg.train.ddp_comm_hook == "powersgd" and cfg.train.powersgd_start_step > max(2, args.warmup):
        # Its first powersgd_start_step steps all-reduce uncompressed: timed, they would mix the two.
        cfg.train.powersgd_start_step = max(2, args.warmup)
        print0(f"distqa bench: PowerSGD starts after the {args.warmup} warm-up steps (train.powersgd_start_step="
               f"{cfg.train.powersgd_start_step}), so that every timed step is compressed")  # fmt: skip
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.train.resolve_global_batch(world_size)  # as the trainer does; the baseline loop reads grad_accum too
    grow = getattr(cfg.task, "ensure_dummy_examples", None)  # a task with a synthetic dataset
    if cfg.data.train == "dummy" and grow is not None:
        # Keep the whole run inside one epoch: a new epoch starts new DataLoader workers, whose
        # start-up would land in the measured steps of large world sizes only.
        grow(cfg.train.max_steps * cfg.train.batch_size * cfg.train.grad_accum * world_size)
    return cfg


def _check_gpus(gpus: int) -> None:
    """The launcher set CUDA_VISIBLE_DEVICES to `gpus` devices: DataParallel takes every visible one."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible != gpus or int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise DistqaError(
            f"--dp-gpus={gpus} needs one process with {gpus} visible GPU(s); it has {visible} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}) and "
            f"WORLD_SIZE={os.environ.get('WORLD_SIZE', '1')}: run it through `distqa bench --dp`"
        )


def _measure(
    cfg: Config, task: Task, info: DistInfo, loop: str, warmup: int, profile_dir: str | None = None
) -> tuple[dict, torch.nn.Module]:
    if loop == "trainer":
        timer = StepTimer(info.device, warmup=warmup)
        profiling = contextlib.nullcontext()
        if profile_dir:
            timer = ProfilingTimer(info.device, warmup, Path(profile_dir), info.rank)
            profiling = timer.profiling()
        trainer = Trainer(cfg, task, info, timer=timer, save_outputs=False)
        with profiling:
            trainer.fit()
        summary = timer.summary()
        summary["state_bytes"] = state_bytes(trainer.raw_model, trainer.optimizer)
        return summary, trainer.raw_model
    return run_baseline(cfg, task, info, warmup=warmup)


def _total(state: dict[str, int]) -> int:
    return sum(state.values())


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--loop", choices=("trainer", "baseline"), required=True)
    parser.add_argument("--dp-gpus", type=int, default=0, help="train.parallel=dp over this many GPUs (one process)")
    parser.add_argument("--result", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--output-dir", required=True, help="the run's output_dir")
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--profile-dir", help="profile the timed steps into this folder (`distqa bench --profile`)")
    parser.add_argument("--config")
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args(argv)


def _record(args: argparse.Namespace, cfg: Config, info: DistInfo, parts: list[dict], shape: dict) -> dict[str, Any]:
    """Rank 0's JSON object from every rank's summary: sums, the slowest rank, per-phase means."""
    return {
        "loop": args.loop,
        "world_size": info.world_size,
        "device": device_name(info.device),
        "torch": torch.__version__,
        "host": platform.node(),
        "threads_per_process": torch.get_num_threads(),
        "precision": cfg.train.precision,
        "fp32_matmul": torch.get_float32_matmul_precision(),  # "highest": no TF32, and another peak for MFU
        "parallel": cfg.train.parallel,
        "dp_gpus": args.dp_gpus or None,  # train.parallel=dp: the GPUs of its one process
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "compile": cfg.train.compile,
        "seq_len": getattr(cfg.task, "max_seq_len", None),  # a text task's; None for others
        "batch_size": cfg.train.batch_size,
        "grad_accum": cfg.train.grad_accum,
        "steps": parts[0]["steps"],
        "seconds": max(p["seconds"] for p in parts),
        "samples": sum(p["samples"] for p in parts),
        "tokens": sum(p["tokens"] for p in parts),
        "phase_ms": {k: sum(p["phase_ms"][k] for p in parts) / len(parts) for k in PHASES},
        "peak_memory_gib": max((p.get("peak_memory_gib", 0.0) for p in parts), default=0.0) or None,
        # The largest rank's (with FSDP, shards of uneven tensors differ by a few bytes).
        "state_bytes": max((p["state_bytes"] for p in parts if "state_bytes" in p), key=_total, default=None),
        **shape,
    }


def _shape(task: Task, model: torch.nn.Module) -> dict[str, Any]:
    try:
        return dataclasses.asdict(task.model_shape(model))
    except DistqaError as err:  # a model without a HF config: throughput without FLOPs
        return {"non_embedding_params": None, "layers": None, "hidden_size": None, "flops_note": str(err)}


def _measure_on_device(
    cfg: Config, task: Task, info: DistInfo, args: argparse.Namespace
) -> tuple[dict, torch.nn.Module]:
    """`_measure`, with the peak GPU memory and a one-line out-of-memory error."""
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)
    try:
        summary, model = _measure(cfg, task, info, args.loop, args.warmup, args.profile_dir)
    except torch.OutOfMemoryError as err:  # scripts/bench_gpu.sh looks for the largest batch this way
        raise DistqaError(
            f"out of GPU memory at train.batch_size={cfg.train.batch_size}"
            + (f", task.max_seq_len={cfg.task.max_seq_len}" if hasattr(cfg.task, "max_seq_len") else "")
            + f": {str(err).splitlines()[0]}"
        ) from err
    if info.device.type == "cuda":
        summary["peak_memory_gib"] = torch.cuda.max_memory_allocated(info.device) / 2**30
    return summary, model


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    cfg = _bench_config(args)
    watch_parent()  # a bench launch killed with its torchrun leaves no worker behind either
    info = init_distributed()
    quiet_libraries(is_main=info.is_main)  # logs as the trainer's: no library progress bars off a terminal
    try:
        with local_main_first(info):
            task = load_task(cfg)
        summary, model = _measure_on_device(cfg, task, info, args)
        parts = gather_to_main(summary, info)
        if info.is_main:
            path = Path(args.result)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(_record(args, cfg, info, parts, _shape(task, model)), indent=2) + "\n")
        # Free DDP's reducer and its gloo work before the process group goes, and leave together:
        # a rank that tears gloo down while a peer still talks to it, or whose gloo threads still
        # hold tensors when the interpreter exits, can abort ("terminate called without an
        # active exception", seen here once in 24 runs).
        del model
        gc.collect()
        barrier()
    finally:
        cleanup()


if __name__ == "__main__":
    try:
        main()
    except DistqaError as err:  # one line, as `distqa train` says it; the launcher shows it
        print(f"distqa bench: error: {err}", file=sys.stderr, flush=True)
        sys.exit(err.exit_code)
