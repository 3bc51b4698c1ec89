"""train.resume=never or a checkpoint folder in a launch's later rounds (distqa.launch_start): the
rounds torchrun starts again with the same command continue what the first round started. The
real launches: test_fault_tolerance.py's worker SIGKILL (make test-safety) and test_multinode.py's
elastic run (make test-nodes)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import free_port
from distqa import launch_start, rounds
from distqa.dist import DistInfo
from distqa.launch_start import STORE_ENV, mode_of_this_round, note_started

ONE = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


@pytest.fixture
def no_store(monkeypatch):
    monkeypatch.setattr(rounds, "client", None)
    monkeypatch.setattr(launch_start, "_store", None)
    monkeypatch.delenv(STORE_ENV, raising=False)
    monkeypatch.setattr(launch_start, "_unreachable", None)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # as torchrun sets it for its workers


def test_the_agents_store_carries_the_first_rounds_start_to_later_rounds(tmp_path, monkeypatch, no_store, capsys):
    monkeypatch.setattr(rounds, "client", dist.HashStore())
    out, elsewhere = tmp_path / "run", str(tmp_path / "elsewhere" / "step-3")
    assert mode_of_this_round("never", out, ONE) == "never"  # the first round: as given
    note_started("never", ONE)
    assert mode_of_this_round("never", out, ONE) == "auto"
    assert "a later round of the launch (a restart, or a node that joined or left) continues" in capsys.readouterr().out
    assert mode_of_this_round("auto", out, ONE) == "auto"
    # A folder outside output_dir, and no checkpoint there yet: the folder again; then the newest.
    assert mode_of_this_round(elsewhere, out, ONE) == elsewhere
    (out / "checkpoints" / "step-4").mkdir(parents=True)
    assert mode_of_this_round(elsewhere, out, ONE) == "auto"


def test_without_a_store_every_start_is_a_launchs_first(tmp_path, no_store):
    note_started("never", ONE)
    assert mode_of_this_round("never", tmp_path, ONE) == "never"


def test_the_elastic_rendezvous_store_named_by_worker_sh_is_used(tmp_path, monkeypatch, no_store):
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setenv(STORE_ENV, f"127.0.0.1:{port}")
    assert mode_of_this_round("never", tmp_path, ONE) == "never"
    note_started("never", ONE)
    assert server.check(["distqa/launch/started"])
    monkeypatch.setattr(launch_start, "_store", None)  # a later round's process: a client of its own
    assert mode_of_this_round("never", tmp_path, ONE) == "auto"


def test_an_unreadable_store_keeps_the_setting_with_a_warning_once(tmp_path, monkeypatch, no_store, capsys):
    monkeypatch.setenv(STORE_ENV, f"127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setattr(launch_start, "_connect_timeout", timedelta(seconds=1))
    assert mode_of_this_round("never", tmp_path, ONE) == "never"
    assert "warning: cannot read the launch's store (127.0.0.1:" in capsys.readouterr().out
    start = time.monotonic()
    note_started("never", ONE)  # the failure is remembered, not waited for again
    assert time.monotonic() - start < 0.5
    assert "warning: cannot write to the launch's store" in capsys.readouterr().out


def test_a_store_named_outside_torchrun_is_not_waited_for(tmp_path, monkeypatch, no_store, capsys):
    """DISTQA_LAUNCH_STORE left exported in a shell: a plain `python -m distqa train` waited for it
    minutes, and warned of later rounds it has none of (found by a review)."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv(STORE_ENV, f"127.0.0.1:{free_port()}")
    start = time.monotonic()
    assert mode_of_this_round("never", tmp_path, ONE) == "never"
    note_started("never", ONE)
    assert time.monotonic() - start < 0.5 and capsys.readouterr().out == ""


def test_one_process_under_torchrun_reaches_the_agents_store(tmp_path, monkeypatch, no_store):
    """One process in all: distqa.dist keeps no client of the agent's store, so a restarted
    single-process launch took train.resume=never again (found by a review)."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    note_started("never", ONE)
    assert server.check(["distqa/launch/started"])
    monkeypatch.setattr(launch_start, "_store", None)
    assert mode_of_this_round("never", tmp_path, ONE) == "auto"
