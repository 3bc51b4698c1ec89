"""The trainer's decisions that need no training: what follows a step, whether ranks agree on their
settings, whether weights are finite, and what a resume of a finished run may do."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from distqa.agreement import PER_NODE, compared_settings, differences, settings_hash
from distqa.control import after_step, diverged_hint
from distqa.dist import DistInfo
from distqa.errors import ConfigError, DistqaError
from distqa.parallel import all_finite
from distqa.registry import load_config
from distqa.resume import check_continuation
from distqa.stop_signal import StopSignal

ONE = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def test_after_step_plan():
    train = load_config(None, ["train.log_every=5", "train.checkpoint_every=4", "train.eval_every=3"]).train
    plans = {step: after_step(step, 10, train) for step in range(1, 11)}
    assert [s for s, p in plans.items() if p.log] == [3, 5, 6, 9, 10]  # every evaluation is logged
    assert [s for s, p in plans.items() if p.evaluate] == [3, 6, 9, 10]
    assert [s for s, p in plans.items() if p.save] == [4, 8, 10]
    # Every step that writes anything is checked first; the others are not (a pass over the weights).
    assert [s for s, p in plans.items() if p.check_weights] == [3, 4, 5, 6, 8, 9, 10]
    assert not after_step(10, 10, train, save_outputs=False).save  # speed runs write no final checkpoint
    # nor evaluate (a task's own validation set was timed as the last step), and still log the last step
    speed = {step: after_step(step, 10, train, save_outputs=False) for step in range(1, 11)}
    assert not any(p.evaluate for p in speed.values()) and [s for s, p in speed.items() if p.log] == [5, 10]
    every = load_config(None, ["train.check_finite=true", "train.log_every=5"]).train
    assert all(after_step(step, 10, every).check_weights for step in range(1, 11))


def test_a_sigterm_means_a_checkpoint_then_the_stop_except_at_the_last_step():
    train = load_config(None, ["train.log_every=5", "train.checkpoint_every=4", "train.check_replicas=true"]).train
    assert after_step(3, 10, train).on_stop_request(False) == after_step(3, 10, train)
    unplanned = after_step(3, 10, train).on_stop_request(True)
    # A save the plan did not foresee: the optimizer state was not part of the weights check.
    assert (unplanned.stop, unplanned.save, unplanned.check_optimizer) == (True, True, True)
    planned = after_step(4, 10, train).on_stop_request(True)
    assert (planned.stop, planned.save, planned.check_optimizer) == (True, True, False)
    last = after_step(10, 10, train, save_outputs=False).on_stop_request(True)
    assert not last.stop and not last.save  # the run ends here anyway, as planned
    assert all(after_step(step, 10, train).check_replicas for step in range(1, 11))


def test_diverged_hint_names_what_to_lower():
    hint = diverged_hint(
        load_config(None, ["train.lr=0.5", "train.max_grad_norm=0", "train.precision=fp16"]).train, None
    )
    assert "train.lr (now 0.5)" in hint and "set train.max_grad_norm" in hint and "bf16" in hint


def test_diverged_hint_points_at_a_checkpoint_only_when_there_is_one(tmp_path):
    """It said 'the newest checkpoint holds the last finite weights' before any was written."""
    train = load_config(None).train
    assert diverged_hint(train, None).endswith("; no checkpoint was written, so none holds the last finite weights")
    newest = tmp_path / "checkpoints" / "step-4"
    assert diverged_hint(train, newest).endswith(f"; the newest checkpoint, {newest}, holds the last finite weights")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_all_finite_sees_nan_and_inf_anywhere(bad):
    tensors = [torch.zeros(3), torch.ones(2, 2), torch.empty(0)]
    assert all_finite(tensors)
    tensors[1][1, 0] = bad
    assert not all_finite(tensors)


def test_all_finite_large_weights_are_finite():
    # A sum or a 2-norm of these overflows float32; they are finite all the same.
    assert all_finite([torch.full((1000,), 3e38)])
    assert all_finite([])


def test_stop_signal_refuses_non_finite_weights_and_a_lost_lock():
    class Lock:
        """Taken over now, which only a read of the lock (verify) finds: `lost` is set by it."""

        lost: str | None = None
        taken: str | None = None

        def verify(self) -> str | None:
            self.lost = self.taken
            return self.lost

    lock = Lock()
    stop = StopSignal(ONE, lock)  # type: ignore[arg-type]
    try:
        assert stop.should_stop(1, [torch.ones(2)]) is False
        with pytest.raises(DistqaError, match=r"NaN or inf after step 2: .*LOWER"):
            stop.should_stop(2, [torch.tensor([1.0, math.nan])], "LOWER")
        stop.should_stop(2, None)  # not asked to check: nothing checked
        lock.taken = "another run took over output_dir x"
        with pytest.raises(DistqaError, match="another run took over output_dir x: stopping"):
            stop.should_stop(3, [torch.ones(2)])
    finally:
        stop.close()


def test_settings_compared_across_ranks_leave_out_per_node_keys():
    a = load_config(None, ["data.num_workers=1"])
    b = load_config(None, ["data.num_workers=3", "output_dir=/elsewhere"])
    assert settings_hash(compared_settings(a)) == settings_hash(compared_settings(b))
    assert not PER_NODE & compared_settings(a).keys()
    c = load_config(None, ["train.lr=0.5", "train.max_steps=4"])
    assert settings_hash(compared_settings(a)) != settings_hash(compared_settings(c))
    line = differences([compared_settings(a), compared_settings(c)])
    assert line == "train.lr (rank 0: 3e-05, rank 1: 0.5); train.max_steps (rank 0: -1, rank 1: 4)"


def test_nodes_started_with_other_node_counts_differ(monkeypatch):
    """NNODES=2 on one node and 3 on another: a static rendezvous takes each node's own count, and
    the two could train as a group with exit 0 while a third waited in vain (or hang at the end)."""
    cfg = load_config(None, [])
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    two = compared_settings(cfg)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "3")
    three = compared_settings(cfg)
    assert settings_hash(two) != settings_hash(three)
    assert differences([two, three]) == "NNODES (torchrun --nnodes) (rank 0: '2', rank 1: '3')"


def _state(cfg, step: int) -> dict:
    return {"step": step, "config": dataclasses.asdict(cfg), "data": None}


def test_a_finished_run_trains_nothing_and_refuses_other_settings(tmp_path):
    done = load_config(None, ["train.max_steps=4", f"output_dir={tmp_path}"])
    assert check_continuation(tmp_path, _state(done, 4), done, total_steps=4, data={}) is True
    other = load_config(None, ["train.max_steps=4", "train.lr=1e-4", f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"finished at step 4 with other settings \(train.lr .*train.resume=never"):
        check_continuation(tmp_path, _state(done, 4), other, total_steps=4, data={})
    # Not finished: the new rate applies from the resume step on.
    assert check_continuation(tmp_path, _state(done, 2), other, total_steps=4, data={}) is False
    # Operational keys (silent) do not count as other settings.
    quiet = load_config(None, ["train.max_steps=4", "train.log_every=1", f"output_dir={tmp_path}"])
    assert check_continuation(tmp_path, _state(done, 4), quiet, total_steps=4, data={}) is True


def test_a_checkpoint_with_the_older_sampled_fingerprint_is_not_taken_for_other_data(tmp_path):
    cfg = load_config(None, ["train.max_steps=4", f"output_dir={tmp_path}"])
    state = {**_state(cfg, 2), "data": {"examples": 64, "fingerprint": "a" * 16}}
    now = {"examples": 64, "fingerprint": "b" * 32}
    with pytest.raises(ConfigError, match=r"older kind of fingerprint .*set train.allow_data_change=true once"):
        check_continuation(tmp_path, state, cfg, total_steps=4, data=now)
    allowed = load_config(None, ["train.max_steps=4", "train.allow_data_change=true", f"output_dir={tmp_path}"])
    assert check_continuation(tmp_path, state, allowed, total_steps=4, data=now) is False
    # Another length is other data, whatever the kind of fingerprint.
    with pytest.raises(ConfigError, match="is not the data checkpoint"):
        check_continuation(tmp_path, state, cfg, total_steps=4, data={"examples": 65, "fingerprint": "b" * 32})


def test_a_checkpoint_of_an_earlier_fingerprint_format_is_not_taken_for_other_data(tmp_path):
    """A checkpoint from before FINGERPRINT_FORMAT 2 hashed a dataclass item's repr: a fingerprint
    that differs from it may be the same data read another way, and the refusal says so."""
    from distqa.data_identity import FINGERPRINT_FORMAT

    cfg = load_config(None, ["train.max_steps=4", f"output_dir={tmp_path}"])
    state = {**_state(cfg, 2), "data": {"examples": 64, "fingerprint": "a" * 32}}  # no format: 1
    now = {"examples": 64, "fingerprint": "b" * 32, "format": FINGERPRINT_FORMAT}
    said = r"another fingerprint .*\(a{32}, format 1; now b{32}, format 2\): if its items hold only dicts.* the data "
    with pytest.raises(ConfigError, match=said + r"changed; .*set train.allow_data_change=true once"):
        check_continuation(tmp_path, state, cfg, total_steps=4, data=now)
    # The same format and another fingerprint is other data; the same fingerprint resumes.
    state["data"]["format"] = FINGERPRINT_FORMAT
    with pytest.raises(ConfigError, match="is not the data checkpoint"):
        check_continuation(tmp_path, state, cfg, total_steps=4, data=now)
    assert check_continuation(tmp_path, state, cfg, total_steps=4, data={**now, "fingerprint": "a" * 32}) is False


def test_train_in_process_gives_the_callers_sigterm_handling_back(tmp_path):
    """Only the CLI's process keeps ignoring SIGTERM once a run is done: an in-process caller that
    forks later (a datasets pool, a DataLoader) must get killable children (a pool's terminate
    otherwise waits forever for a worker that ignores its SIGTERM)."""
    import signal

    from distqa.trainer import train

    before = signal.getsignal(signal.SIGTERM)
    args = ["model.name=tiny", "task.max_seq_len=32", "task.dummy_size=16", "data.num_workers=0"]
    train(load_config(None, [*args, "train.max_steps=1", "train.batch_size=4", f"output_dir={tmp_path}"]))
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_finished_run_with_other_settings_is_refused_before_any_data_is_built(tmp_path, monkeypatch):
    """check_resumable runs before the data is built (NQ features take hours): when the run's length
    is known there (train.max_steps, or the checkpoint's own plan for train.epochs), a finished run
    with other settings is refused there."""
    from distqa import resume

    done = load_config(None, ["train.max_steps=4", f"output_dir={tmp_path}"])
    state = {**_state(done, 4), "global_batch": 8, "total_steps": 4}
    monkeypatch.setattr(resume, "read_trainer_state", lambda directory: state)
    other = load_config(None, ["train.max_steps=4", "train.lr=1e-4", f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"finished at step 4 with other settings \(train.lr"):
        resume.check_resumable(tmp_path, other, global_batch=8)
    by_epochs = load_config(None, ["train.lr=1e-4", f"output_dir={tmp_path}"])
    epochs_state = {**_state(load_config(None, [f"output_dir={tmp_path}"]), 4), "global_batch": 8, "total_steps": 4}
    monkeypatch.setattr(resume, "read_trainer_state", lambda directory: epochs_state)
    with pytest.raises(ConfigError, match="finished at step 4"):
        resume.check_resumable(tmp_path, by_epochs, global_batch=8)
    # Not finished: nothing refused here.
    monkeypatch.setattr(resume, "read_trainer_state", lambda directory: {**state, "step": 2})
    assert resume.check_resumable(tmp_path, other, global_batch=8)["step"] == 2


def test_all_finite_skips_integers_and_reads_rare_float_types():
    # Integer buffers (position ids) are finite by nature; float8 has no norm kernel of its own.
    assert all_finite([torch.arange(5), torch.ones(3).to(torch.float8_e4m3fn)])
    assert not all_finite([torch.arange(5), torch.tensor([1.0, math.nan]).to(torch.float8_e4m3fn)])
    assert not all_finite([torch.tensor([1 + 0j, complex(math.inf, 0)])])
