"""Model FLOPs per token and the peak throughput of known accelerators, for MFU.

Model-FLOPs utilisation (MFU) = the FLOPs the model needs per second at the measured throughput,
over the hardware's peak (PaLM, Chowdhery et al. 2022, appendix B). A transformer needs, per
token of training (forward + backward = 3 x forward):

    6 * N            the matrix multiplications with the weights, N = non-embedding parameters
  + 12 * L * T * d   the attention scores and their weighted sum, L layers, T tokens of context,
                     d the hidden size

Embedding lookups are gathers, not matmuls, so their parameters are left out of N. Nothing here
is specific to BERT: L and d come from any Hugging Face config found in the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from distqa.errors import DistqaError


@dataclass(frozen=True)
class ModelShape:
    non_embedding_params: int
    layers: int
    hidden_size: int

    def flops_per_token(self, seq_len: int) -> int:
        return 6 * self.non_embedding_params + 12 * self.layers * seq_len * self.hidden_size


def _hf_config(model: nn.Module) -> object | None:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "num_hidden_layers") and hasattr(config, "hidden_size"):
            return config
    return None


def model_shape(model: nn.Module) -> ModelShape:
    """The numbers of the FLOPs formula, read off the model. Raises when it has no HF config."""
    config = _hf_config(model)
    if config is None:
        raise DistqaError(
            f"{type(model).__name__} has no Hugging Face config (num_hidden_layers, hidden_size): "
            "override Task.model_shape to give its shape for the FLOPs estimate"
        )
    seen: set[int] = set()  # tied weights (word embeddings = output projection) count once
    total = embedding = 0
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            total += param.numel()
            if isinstance(module, nn.Embedding):
                embedding += param.numel()
    return ModelShape(
        non_embedding_params=total - embedding,
        layers=int(config.num_hidden_layers),  # type: ignore[attr-defined]
        hidden_size=int(config.hidden_size),  # type: ignore[attr-defined]
    )


# Dense (no sparsity) tensor-core peaks in TFLOP/s, from NVIDIA's product datasheets. The key is
# matched against torch.cuda.get_device_name(); longer keys first, so "H100 PCIe" wins over "H100".
# "tf32" is what fp32 matmuls run at with TF32 enabled (the trainer enables it for fp32 on CUDA,
# unless train.deterministic).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5},
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7},  # SXM
    "GH200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0},
    "L40": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def _table_precision(precision: str) -> str:
    return "tf32" if precision == "fp32" else precision


def peak_tflops(device_name: str, precision: str, *, tf32: bool = True) -> float | None:
    """The datasheet peak of `device_name` at `train.precision`, or None when unknown. `tf32=False`:
    fp32 matmuls ran in full fp32 (train.deterministic leaves TF32 off), about a seventh of the TF32
    peak on an H100; the table has that peak for V100 only, and None elsewhere leaves MFU out."""
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in device_name:
            table = PEAK_TFLOPS[key]
            if precision == "fp32" and not tf32:
                return table.get("fp32")
            return table.get(_table_precision(precision), table.get(precision))
    return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"
