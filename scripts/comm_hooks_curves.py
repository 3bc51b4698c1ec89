"""The loss curves of one training run per `train.ddp_comm_hook`, at 2 processes, in one plot.

    .venv/bin/python scripts/comm_hooks_curves.py --output DIR [KEY=VALUE ...]

Each hook trains the same steps from the same seed (`distqa train` under torchrun, 2 processes);
DIR/curves.json holds every logged loss per hook and DIR/comm-hooks.png plots them. KEY=VALUE
settings go to every run (defaults: the tiny model on the DummyDataset, 200 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HOOKS = ("none", "fp16", "bf16", "powersgd")
DEFAULTS = [
    "model.name=tiny",
    "task.max_seq_len=64",
    "task.dummy_size=1024",
    "data.num_workers=0",
    "model.dropout=0.0",
    "train.batch_size=8",
    "train.max_steps=200",
    "train.lr=1e-3",
    "train.log_every=5",
    "train.checkpoint_every=1000",
    "train.resume=never",
]


def train(hook: str, out: Path, extra: list[str]) -> list[tuple[int, float]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "distqa"]
    cmd += ["train", *DEFAULTS, *extra, f"train.ddp_comm_hook={hook}", f"output_dir={out / hook}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two processes on two cores
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / hook / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(row["step"], row["loss"]) for row in rows if "loss" in row]


def plot(curves: dict[str, list[tuple[int, float]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for hook, points in curves.items():
        ax.plot([s for s, _ in points], [loss for _, loss in points], label=hook, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=9)
    ax.legend(title="train.ddp_comm_hook")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("settings", nargs="*", help="KEY=VALUE for every run")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    curves = {hook: train(hook, args.output, args.settings) for hook in HOOKS}
    (args.output / "curves.json").write_text(json.dumps(curves, indent=1) + "\n")
    plot(curves, args.output / "comm-hooks.png", "2 processes, " + " ".join([*DEFAULTS[:2], *args.settings]))
    for hook, points in curves.items():
        print(f"{hook:9s} final loss {points[-1][1]:.4f} at step {points[-1][0]}")


if __name__ == "__main__":
    main()
