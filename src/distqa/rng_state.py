"""Every random number generator of a process, as a checkpoint's `rng-rank{R}.pt` holds it.

A resume restores them all, so dropout masks, data augmentation and anything else drawn at random
continue as in an uninterrupted run (bitwise on the CPU and with deterministic kernels on GPUs).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def capture_rng_state(device: torch.device, replicas: Sequence[int] = ()) -> dict[str, Any]:
    """Every RNG of this process: Python, NumPy, torch's CPU generator, `device`'s CUDA generator,
    and those of the GPUs in `replicas` (train.parallel=dp: each GPU's copy of the model draws its
    dropout masks from its own GPU's generator)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = device.type == "cuda"
    return {
        "python": random.getstate(),
        # NumPy's key array as a plain list: weights_only loading refuses ndarrays.
        "numpy": (name, keys.tolist(), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if cuda else None,
        "cuda_replicas": {i: torch.cuda.get_rng_state(i) for i in replicas} if cuda else {},
    }


def restore_rng_state(state: dict[str, Any], device: torch.device, replicas: Sequence[int] = ()) -> bool:
    """Restore every RNG the state holds; False when `device` is a GPU and the state lacks its CUDA
    generator or one of `replicas`' (written on the CPU, or with fewer GPUs): the caller seeds
    those afresh per rank and per GPU."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device.type != "cuda":
        return True
    saved = state.get("cuda_replicas") or {}  # (none in checkpoints written before it was saved)
    if state["cuda"] is None or any(i not in saved for i in replicas):
        return False
    torch.cuda.set_rng_state(state["cuda"], device)
    for i in replicas:
        torch.cuda.set_rng_state(saved[i], i)
    return True
