"""Checkpoints that hold everything needed to continue exactly where a run stopped.

Layout of `output_dir/checkpoints/step-N/`:
  model.safetensors     the unwrapped model's weights
  training_state.pt     optimizer, LR scheduler and gradient-scaler state (tensors and numbers only)
  rng-rank{R}.pt        every RNG of rank R: Python, NumPy, torch CPU and CUDA
  trainer_state.json    step, epoch, position in the epoch, global batch, and the resolved config

Every rank takes part (the RNG states are gathered to rank 0); rank 0 alone writes. A checkpoint is
written to a hidden `.tmp-step-N` folder and renamed when complete, so a `step-N` folder is always
whole: a run killed mid-save leaves only a `.tmp-` folder, which resume ignores. Files are read back
with `weights_only=True` and safetensors, so loading a checkpoint never unpickles arbitrary objects.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model
from torch import nn

from distqa.dist import DistInfo, barrier, gather_to_main

_STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        # NumPy's key array as a plain list: weights_only loading refuses ndarrays.
        "numpy": (name, keys.tolist(), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(
    root: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: torch.amp.GradScaler,
    trainer_state: dict[str, Any],
    info: DistInfo,
) -> Path:
    """Write `root/step-N` (N = trainer_state["step"]). Every rank must call it."""
    step = int(trainer_state["step"])
    final = root / f"step-{step}"
    rng_states = gather_to_main(capture_rng_state(info.device), info)
    if info.is_main:
        tmp = root / f".tmp-step-{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_model(model, str(tmp / "model.safetensors"))
        training_state = {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
        }
        torch.save(training_state, tmp / "training_state.pt")
        for rank, rng in enumerate(rng_states):
            torch.save(rng, tmp / f"rng-rank{rank}.pt")
        # Written last: its presence inside a step-N folder marks the folder as complete.
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2) + "\n")
        if final.exists():  # saving the same step again (e.g. a finished run restarted)
            shutil.rmtree(final)
        tmp.rename(final)
    barrier()  # nobody may read or prune checkpoints before rank 0 has finished this one
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def read_trainer_state(directory: Path) -> dict[str, Any]:
    return json.loads((directory / STATE_FILE).read_text())


def load_checkpoint(
    directory: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: torch.amp.GradScaler,
    info: DistInfo,
) -> dict[str, Any]:
    """Restore everything `save_checkpoint` wrote, on this rank. Returns the trainer state."""
    load_model(model, str(directory / "model.safetensors"), device=str(info.device))
    training_state = torch.load(directory / "training_state.pt", map_location=info.device, weights_only=True)
    optimizer.load_state_dict(training_state["optimizer"])
    scheduler.load_state_dict(training_state["scheduler"])
    scaler.load_state_dict(training_state["scaler"])
    state = read_trainer_state(directory)
    rng_path = directory / f"rng-rank{info.rank}.pt"
    # A run resumed on more processes (same global batch) has ranks the checkpoint never saw;
    # the caller seeds those afresh, and says so.
    state["rng_restored"] = rng_path.is_file()
    if state["rng_restored"]:
        restore_rng_state(torch.load(rng_path, weights_only=True), info.device)
    return state
