"""train.ddp_comm_hook: the hooks' arithmetic and PowerSGD's state on a one-process gloo group (quick),
then at two processes (marker comm, `make test-comm`): fp16/bf16 end near none but not on it,
PowerSGD trains as well as none, and a SIGTERM-and-resume with PowerSGD ends bitwise on the
uninterrupted run's weights."""

from __future__ import annotations

import io
import signal

import pytest
import torch

from conftest import FAULT_RUN, SGD, Bucket, launch, load_weights, max_abs_diff, metrics_rows, run_train, wait_for_step
from distqa import comm_hooks
from distqa.config import TrainConfig
from distqa.errors import ConfigError
from distqa.powersgd import PowerSGD
from distqa.steptimer import StepTimer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.Linear(24, 40), torch.nn.Linear(40, 16))


def _step(powersgd: PowerSGD, buckets: list[list[int]], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """One step's hook calls over `buckets` (lists of parameter indices; the last reduced last):
    the reduced gradient of every parameter."""
    params, out = powersgd.params, {}
    for index, members in enumerate(buckets):
        bucket = Bucket(
            [grads[i] for i in members],
            index=index,
            params=[params[i] for i in members],
            last=index == len(buckets) - 1,
        )
        powersgd.reduce(bucket).wait()
        out.update(zip(members, (g.clone() for g in bucket.gradients())))
    return [out[i] for i in range(len(params))]


FIRST, REBUILT = [[0, 1], [2, 3, 4, 5]], [[4, 5, 0], [3, 1], [2]]  # DDP's first buckets; as rebuilt after step 1


def _resumed_at(step: int, total: int) -> tuple[PowerSGD, PowerSGD, list[list[torch.Tensor]]]:
    """PowerSGD (starting at step 2) run `step` steps, and another resumed from its state as a
    checkpoint holds it; with the gradients of all `total` steps."""
    train = TrainConfig(ddp_comm_hook="powersgd", powersgd_rank=2, powersgd_start_step=2)
    model = _model()
    torch.manual_seed(1)
    steps = [[torch.randn_like(p) for p in model.parameters()] for _ in range(total)]
    straight = PowerSGD(model, train)
    for grads in steps[:step]:
        _step(straight, FIRST if grads is steps[0] else REBUILT, grads)
    # Through a file as a checkpoint holds it (weights_only: plain types and tensors only).
    saved = io.BytesIO()
    torch.save(straight.state_dict(), saved)
    saved.seek(0)
    resumed = PowerSGD(model, train)
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    return straight, resumed, steps


def _steps_agree(straight: PowerSGD, resumed: PowerSGD, steps: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The remaining steps on both: the resume's first sees DDP's first buckets, the uninterrupted
    run its rebuilt ones, and every reduced gradient must be equal. The last step's, returned."""
    for grads in steps:
        want = _step(straight, REBUILT, grads)
        got = _step(resumed, FIRST if grads is steps[0] else REBUILT, grads)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    return want


def test_powersgd_state_follows_the_parameters_into_other_buckets(group):
    """The resume's first step sees DDP's first buckets, the uninterrupted run its rebuilt ones:
    the state saved per parameter must give the same reduced gradients in either."""
    straight, resumed, steps = _resumed_at(5, 7)
    assert resumed.state.iter == straight.state.iter == 5
    want = _steps_agree(straight, resumed, steps[5:])
    # The hook did compress: the reduced gradient is not the gradient (one rank: a mean is itself).
    assert not torch.equal(want[0], steps[6][0])


def test_a_resume_at_the_step_powersgd_begins_compresses_as_the_uninterrupted_run(group):
    """The checkpoint at train.powersgd_start_step holds no PowerSGD state yet: the resumed run's
    first compressed step sees DDP's first buckets, the uninterrupted run its rebuilt ones. Their
    first Qs, drawn one seed per bucket, differed (6.6e-3 apart at the end, exit 0)."""
    straight, resumed, steps = _resumed_at(2, 6)
    assert resumed.state.iter == 2 and not resumed.pieces  # no state yet
    want = _steps_agree(straight, resumed, steps[2:])
    assert not torch.equal(want[0], steps[5][0])  # compressed


def test_bf16_hook_rounds_to_bf16_on_gloo(group):
    values = torch.tensor([1.0, 1.0 + 2**-10, 3.0e-3, -7.25])
    bucket = Bucket([values], params=[torch.nn.Parameter(values)])
    reduced = comm_hooks.bf16_hook(None, bucket).wait()
    assert torch.equal(reduced, values.to(torch.bfloat16).float()) and not torch.equal(reduced, values)


def test_the_timer_wraps_the_chosen_hook():
    timer, calls = StepTimer(torch.device("cpu"), warmup=0), []
    timer.step_begin()
    timed = timer.wrap(lambda state, bucket: calls.append((state, bucket.is_last())))
    for last in (False, True):
        timed("state", Bucket([torch.zeros(1)], last=last))
    assert calls == [("state", False), ("state", True)]
    assert [phase for phase, _ in timer._marks] == ["data", "allreduce_wait"]


def test_fsdp_takes_the_16_bit_hooks_as_its_reduce_dtype():
    assert comm_hooks.reduce_dtype(TrainConfig(ddp_comm_hook="bf16"), None) is torch.bfloat16
    assert comm_hooks.reduce_dtype(TrainConfig(ddp_comm_hook="fp16"), torch.bfloat16) is torch.float16
    assert comm_hooks.reduce_dtype(TrainConfig(), torch.bfloat16) is torch.float32
    assert comm_hooks.reduce_dtype(TrainConfig(), None) is None  # FSDP's own default, as before


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"ddp_comm_hook": "int8"}, "train.ddp_comm_hook"),
        ({"ddp_comm_hook": "powersgd", "parallel": "fsdp"}, "train.ddp_comm_hook=powersgd"),
        ({"powersgd_rank": 0}, "train.powersgd_rank"),
        ({"powersgd_start_step": 1}, "train.powersgd_start_step"),
        (
            {"ddp_comm_hook": "powersgd", "precision": "fp16"},
            "train.ddp_comm_hook=powersgd cannot run with train.precision=fp16",
        ),
        ({"bucket_cap_mb": 0.0}, "train.bucket_cap_mb"),
    ],
)
def test_bad_settings_are_one_line_naming_the_key(settings, key):
    with pytest.raises(ConfigError) as err:
        TrainConfig(**settings)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_another_world_size_or_rank_restarts_the_state():
    why = comm_hooks._why_afresh
    saved = {"hook": "powersgd", "world_size": 2, "powersgd": {"rank": 4}}
    assert why(saved, 2, 4) is None
    assert "2 process(es), this run has 4" in why(saved, 4, 4)
    assert "powersgd_rank was 4" in why(saved, 2, 8)
    assert "no PowerSGD state" in why({"hook": "none", "world_size": 2, "powersgd": None}, 2, 4)
    assert "no PowerSGD state" in why(None, 2, 4)


# ----------------------------------------------------------------------------- two processes
# Small buckets: several in flight per step, as in a large model.
RUN = [
    *SGD,
    "train.lr=0.05",
    "train.batch_size=4",
    "train.max_steps=30",
    "train.log_every=1",
    "train.bucket_cap_mb=0.5",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 30 SGD steps at two processes under each hook."""
    root = tmp_path_factory.mktemp("hooks")
    for hook in comm_hooks.HOOKS:
        run_train([*RUN, f"train.ddp_comm_hook={hook}", f"output_dir={root / hook}"], nproc=2)
    return root


def _final_loss(out) -> float:
    return [row["loss"] for row in metrics_rows(out) if "loss" in row][-1]


@pytest.mark.comm
@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_16_bit_hooks_end_near_none_but_not_on_it(runs, hook):
    diff = max_abs_diff(load_weights(runs / hook), load_weights(runs / "none"))
    assert 0.0 < diff < 5e-3, diff


@pytest.mark.comm
def test_powersgd_trains_as_well_as_none(runs):
    none, powersgd = _final_loss(runs / "none"), _final_loss(runs / "powersgd")
    assert abs(powersgd - none) <= 0.1 * none, (powersgd, none)
    assert max_abs_diff(load_weights(runs / "powersgd"), load_weights(runs / "none")) > 0.0


POWERSGD_RUN = [*FAULT_RUN, "train.ddp_comm_hook=powersgd", "train.powersgd_start_step=2", "train.bucket_cap_mb=0.1"]


@pytest.mark.comm
def test_powersgd_resumes_exactly_after_sigterm(tmp_path):
    """DataLoader workers on, dropout, grad accumulation: SIGTERM mid-run, resume (with other
    buckets, too), and the weights equal the uninterrupted run's bit for bit; the hook ran once per
    step (its count is the step)."""
    straight = tmp_path / "straight"
    run_train([*POWERSGD_RUN, f"output_dir={straight}"], nproc=2)
    out = tmp_path / "preempted"
    proc = launch([*POWERSGD_RUN, f"output_dir={out}"])
    wait_for_step(proc, out, 10)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    step = int(
        next(x for x in stderr.splitlines() if x.startswith("distqa: preempted:")).split("at step ")[1].split()[0]
    )
    assert 10 <= step < 20
    saved = torch.load(out / "checkpoints" / f"step-{step}" / "comm-rank1.pt", weights_only=True)
    assert saved["powersgd"]["iter"] == step and saved["powersgd"]["pieces"]
    resumed = run_train([*POWERSGD_RUN, "train.bucket_cap_mb=0.3", f"output_dir={out}"], nproc=2)
    assert "starts its state afresh" not in resumed.stdout + resumed.stderr
    assert max_abs_diff(load_weights(out), load_weights(straight)) == 0.0


@pytest.mark.comm
def test_another_world_size_restarts_powersgd_with_one_warning(tmp_path):
    out = tmp_path / "run"
    common = [*POWERSGD_RUN, "train.grad_accum=1", "train.global_batch=8", "data.num_workers=0", f"output_dir={out}"]
    run_train([*common, "train.max_steps=8"], nproc=1)
    proc = run_train([*common, "train.max_steps=12"], nproc=2)
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if "starts its state afresh" in x]
    assert len(lines) == 1 and "1 process(es), this run has 2" in lines[0], lines


@pytest.mark.comm
def test_fsdp_reduces_gradients_in_the_hook_s_dtype(tmp_path):
    for hook in ("none", "bf16"):
        run_train(
            [
                *RUN,
                "train.check_replicas=false",
                "train.max_steps=8",
                "train.parallel=fsdp",
                f"train.ddp_comm_hook={hook}",
                f"output_dir={tmp_path / hook}",
            ],
            nproc=2,
        )
    diff = max_abs_diff(load_weights(tmp_path / "bf16"), load_weights(tmp_path / "none"))
    assert 0.0 < diff < 5e-3, diff
