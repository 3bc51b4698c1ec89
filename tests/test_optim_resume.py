"""A restored AdamW runs the implementation of the device it resumes on (distqa.optim.match_device).

No GPU is needed: which implementation a device gets is one function (`optim.fused_for`), patched
here to say what CUDA says, and fused AdamW runs on the CPU too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distqa import optim
from distqa.config import TrainConfig


def _trained(fused: bool) -> tuple[nn.Module, dict]:
    """A small model after two AdamW steps with `fused`, and its optimizer's state dict."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(optim.parameter_groups(model, 0.01), lr=1e-3, fused=fused)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt.state_dict()


def _resumed(saved: dict, model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """As CheckpointManager.restore does it: a fresh optimizer for this device, the saved state
    loaded into it, then apply_settings."""
    opt = optim.build_optimizer(model, cfg, torch.device("cpu"))
    opt.load_state_dict(saved)
    optim.apply_settings(opt, optim.build_scheduler(opt, cfg, 10), cfg)
    return opt


def test_cpu_checkpoint_resumed_where_adamw_is_fused_runs_fused(monkeypatch):
    model, saved = _trained(fused=False)
    assert not saved["param_groups"][0]["fused"]
    # load_state_dict leaves an unfused group's `step` as saved; a float64 one (an unfused step under
    # a float64 default dtype) shows whether match_device makes it what the fused kernel reads.
    for state in saved["state"].values():
        state["step"] = state["step"].double()
    monkeypatch.setattr(optim, "fused_for", lambda device: True)  # the device says fused, as CUDA does
    opt = _resumed(saved, model, TrainConfig(lr=1e-3))
    assert all(g["fused"] and g["foreach"] is None for g in opt.param_groups)
    for p, state in opt.state.items():
        assert state["step"].device == p.device and state["step"].dtype == torch.float32
    # A fused optimizer takes GradScaler's found_inf itself; with the saved groups' fused False the
    # unfused step refuses it ("Expected grad_scale and found_inf to be None"): the fp16 crash.
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert all(float(s["step"]) == 3.0 for s in opt.state.values())


def test_fused_checkpoint_resumed_on_the_cpu_runs_what_a_fresh_cpu_run_runs():
    model, saved = _trained(fused=True)
    assert saved["param_groups"][0]["fused"]
    opt = _resumed(saved, model, TrainConfig(lr=1e-3))
    fresh = optim.build_optimizer(model, TrainConfig(lr=1e-3), torch.device("cpu"))
    assert [(g["fused"], g["foreach"]) for g in opt.param_groups] == [
        (g["fused"], g["foreach"]) for g in fresh.param_groups
    ]
    assert not getattr(opt, "_step_supports_amp_scaling", False)
    assert all(s["step"].device.type == "cpu" for s in opt.state.values())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert all(float(s["step"]) == 3.0 for s in opt.state.values())


@pytest.mark.parametrize("fused", [False, True])
def test_same_device_resume_keeps_the_state_exact(fused, monkeypatch):
    """Switching nothing must change nothing: the moments and step counts come back as saved."""
    model, saved = _trained(fused=fused)
    monkeypatch.setattr(optim, "fused_for", lambda device: fused)
    opt = _resumed(saved, model, TrainConfig(lr=1e-3))
    again = opt.state_dict()
    for key, state in saved["state"].items():
        for name, value in state.items():
            assert torch.equal(again["state"][key][name], value), name
    assert all(g["fused"] == fused for g in opt.param_groups)


def test_sgd_is_left_alone():
    model = nn.Linear(4, 2)
    cfg = TrainConfig(optimizer="sgd", lr=0.1, momentum=0.9)
    opt = optim.build_optimizer(model, cfg, torch.device("cpu"))
    optim.apply_settings(opt, optim.build_scheduler(opt, cfg, 10), cfg)
    assert "fused" not in opt.param_groups[0] or not opt.param_groups[0]["fused"]
