"""`distqa bench`: process-count parsing, the FLOPs and peak tables, the step timer, and real
torchrun launches that write bench.json and bench.png."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import toy_task
from conftest import ROOT, bench_result, free_port, subprocess_env
from distqa.bench.launch import _reason, check_port, parse_nproc, print_table, rendezvous_args, worker_env
from distqa.bench.profile import PROFILED_STEPS
from distqa.bench.report import add_scaling, implausible, summarize
from distqa.cli import build_parser, main
from distqa.config import ModelConfig
from distqa.dist import cpus_per_local_rank, default_num_workers
from distqa.errors import ConfigError, DistqaError
from distqa.flops import ModelShape, model_shape, peak_tflops
from distqa.nq.model import BertJointQA
from distqa.steptimer import PHASES, StepTimer

# Not in `make test` (its 5-minute budget): `make test-launch` (in CI, part of `make test-suites`).
pytestmark = pytest.mark.launch

BENCH_SMALL = ["model.name=tiny", "task.max_seq_len=64", "task.dummy_size=256", "data.num_workers=0"]


def test_parse_nproc_sorts_and_rejects_bad_lists():
    assert parse_nproc("2,1,4") == [1, 2, 4]
    for bad, says in (("1,x", "comma-separated"), ("0,1", ">= 1"), ("2,2", "twice"), ("", "comma-separated")):
        with pytest.raises(ConfigError, match=says):
            parse_nproc(bad)


def test_bert_base_shape_matches_the_published_count():
    # bert-base-uncased: 110M parameters, of which the embeddings are 30522*768 + 512*768 + 2*768
    # (+ LayerNorm's 2*768, which is not an nn.Embedding): about 85.6M outside the embeddings.
    with torch.device("meta"):
        model = BertJointQA.build(ModelConfig(name="bert-base-random"))
    shape = model_shape(model)
    total = sum(p.numel() for p in model.parameters())
    embeddings = (30522 + 512 + 2) * 768
    assert shape == ModelShape(non_embedding_params=total - embeddings, layers=12, hidden_size=768)
    assert 85.0e6 < shape.non_embedding_params < 86.5e6
    # 6N + 12*L*T*d at T=512: the attention part is 56.6 MFLOPs per token.
    assert shape.flops_per_token(512) == 6 * shape.non_embedding_params + 12 * 12 * 512 * 768


def test_tied_weights_are_counted_once():
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.out = torch.nn.Linear(4, 10, bias=False)
            self.out.weight = self.embed.weight
            self.config = type("C", (), {"num_hidden_layers": 1, "hidden_size": 4})()

    assert model_shape(Tied()).non_embedding_params == 0


def test_model_without_config_is_a_clear_error():
    with pytest.raises(DistqaError, match="Task.model_shape"):
        model_shape(torch.nn.Linear(2, 2))


def test_peak_table_matches_device_names():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0  # the longer key wins
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp32") == 494.7  # TF32 matmuls
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp16") == 312.0
    assert peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on Volta
    assert peak_tflops("Some Future GPU", "bf16") is None


def test_step_timer_splits_wall_time_into_phases():
    timer = StepTimer(torch.device("cpu"), warmup=1)
    for step in range(4):
        timer.step_begin()
        time.sleep(0.002 if step else 0.05)  # the warm-up step is slow and must not count
        timer.mark("forward_backward")
        time.sleep(0.01)
        timer.mark("optimizer")
        time.sleep(0.004)
        timer.mark("other")
        timer.count(samples=8, tokens=100)
    timer.finish()
    summary = timer.summary()
    assert summary["steps"] == 3 and summary["samples"] == 24 and summary["tokens"] == 300
    ms = summary["phase_ms"]
    assert set(ms) == set(PHASES) and ms["allreduce_wait"] == 0.0
    # Lower bounds are the sleeps; the upper ones only exclude the 50 ms warm-up step.
    assert 10.0 <= ms["forward_backward"] < 45.0 and 4.0 <= ms["optimizer"] < 45.0 and 2.0 <= ms["data"] < 45.0
    # The phases tile the measured window: their sum is its wall time.
    assert sum(ms.values()) * 3 / 1000 == pytest.approx(summary["seconds"], rel=0.05)


def test_step_timer_without_measured_steps_says_so():
    timer = StepTimer(torch.device("cpu"), warmup=5)
    timer.step_begin()
    timer.finish()
    with pytest.raises(RuntimeError, match="no step was recorded"):
        timer.summary()
    off = StepTimer.off(torch.device("cpu"))
    off.step_begin()
    off.mark("data")
    assert not off.recording and off.steps_begun == 0


def test_default_workers_share_the_cpus(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cpus_per_local_rank() == 4 and default_num_workers() == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_num_workers() == 8  # capped
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert default_num_workers() == 0


def _run(key: str, seconds: float, **extra) -> dict:
    return bench_result(seconds, **extra)


def test_summary_scaling_and_mfu_arithmetic():
    one = summarize(1, [_run("t", 1.0), _run("t", 2.0), _run("t", 0.5)], [_run("b", 1.0)], None)
    two = summarize(2, [_run("t", 0.8)], [], peak=100.0)
    add_scaling([one, two])
    assert one["samples_per_s"] == 100.0  # the median of 100, 50 and 200
    assert one["trainer_over_baseline"] == 1.0
    # 1000 tokens in 100 samples: T = 10, so 6 * 1e8 + 12 * 10 layers * 10 * 1000 = 6.012e8 FLOPs per token.
    assert one["flops_per_token"] == 6 * 10**8 + 12 * 10 * 10 * 1000
    assert one["mfu"] == pytest.approx(6.012e8 * 1000 / 1e12 / 989.4)  # tokens/s x FLOPs/token over the peak
    assert two["mfu"] == pytest.approx(6.012e8 * 1250 / 2 / 1e12 / 100.0)  # --peak-tflops wins
    assert two["scaling_efficiency"] == pytest.approx(125.0 / 2 / 100.0)
    cpu = summarize(1, [_run("t", 1.0, device="cpu (x86_64)")], [], None)
    assert cpu["mfu"] is None and cpu["model_tflops_per_process"] > 0


def _row(nproc: int, seconds: list[float], samples: int = 100, baseline: tuple[float, ...] = ()) -> dict:
    """A world size's row from repeats that took SECONDS each (one per round)."""
    runs = [_run("t", s, samples=samples) for s in seconds]
    return summarize(nproc, runs, [_run("b", s, samples=samples) for s in baseline], None)


def test_rows_give_the_spread_of_their_repeats():
    one = _row(1, [1.0, 1.25, 0.8])  # 100, 80 and 125 samples/s
    two = _row(2, [1.0, 1.0, 1.0], samples=160)  # 80 per process in every round
    add_scaling([one, two])
    assert one["samples_per_s_spread"] == pytest.approx({"min": 80.0, "median": 100.0, "max": 125.0, "relative": 0.45})
    assert one["repeats"] == pytest.approx([100.0, 80.0, 125.0])  # the key other tools read, kept
    # Efficiency pairs the rounds: 80/100, 80/80, 80/125; the row's figure is that of the medians.
    assert two["scaling_efficiency"] == pytest.approx(0.8)
    assert two["scaling_efficiency_spread"] == pytest.approx({"min": 0.64, "max": 1.0})
    single = _row(1, [1.0], baseline=(1.0,))
    assert single["samples_per_s_spread"]["relative"] is None  # one repeat says nothing of the noise
    assert single["baseline_samples_per_s_spread"]["relative"] is None


def _result(rows: list[dict]) -> dict:
    add_scaling(rows)
    head = {"device": "cpu (x86_64)", "model": "tiny", "precision": "fp32", "seq_len": 64, "flops_note": None}
    return {**head, "runs": rows, "warnings": implausible(rows)}


def test_implausible_figures_are_warned_on_stderr(capsys):
    # Issue 14's figure: 2 processes at 270.6 % of the 1-process throughput per process.
    one = _row(1, [1.0, 1.0, 1.0], baseline=(1.0, 1.3, 1.0))  # the loop's 100, 76.9, 100: 23.1 %
    two = _row(2, [1.0, 1.0, 1.2], samples=541.2)  # 541.2, 541.2, 451.0: 16.7 %
    result = _result([one, two])
    print_table(result)
    out, err = capsys.readouterr()
    assert err.splitlines() == result["warnings"] and len(result["warnings"]) == 3
    assert all(line.startswith("distqa bench: warning: nproc ") for line in result["warnings"])
    assert "nproc 2: scaling efficiency 270.6 % is above 100 %" in err
    assert "nproc 2: samples/s spread 16.7 % over its repeats (451.0 to 541.2) is over 10 %" in err
    assert "nproc 1: hand-written loop samples/s spread 23.1 %" in err
    assert "nproc 1: samples/s" not in err and "nproc 1: scaling" not in err
    assert " 16.7%" in out and "451.0..541.2" in out  # the spread in the table too


def test_clean_rows_give_no_warning(capsys):
    one = _row(1, [1.0, 1.02, 0.98], baseline=(1.0, 1.03, 0.99))
    two = _row(2, [1.0, 0.97, 1.0], samples=180)  # 90 % efficiency, 3 % spread
    edge = _row(4, [1.0, 1.1, 1.0], samples=400)  # exactly 100 % and a 9.1 % spread: at the limits, not over
    result = _result([one, two, edge])
    print_table(result)
    out, err = capsys.readouterr()
    assert result["warnings"] == [] and err == ""
    assert "median of 3 run(s)" in out


def test_default_bench_runs_rounds_that_alternate_the_order(tmp_path, monkeypatch, capsys):
    launched = []

    def fake_launch(nproc: int, loop: str, repeat: int, args, out: Path) -> dict:
        launched.append((nproc, loop[0], repeat))
        # Other load on the machine during the first round's 1-process trainer run.
        seconds = 2.0 if (nproc, loop, repeat) == (1, "trainer", 0) else 1.0
        # train.global_batch=16 of batch 8: grad_accum 2 at one process, 1 at two
        extra = {"host": "h", "torch": "t", "compile": False, "seq_len": 64, "batch_size": 8, "grad_accum": 2 // nproc}
        return _run(loop, seconds, samples=100 * nproc, device="cpu (x86_64)", **extra)

    monkeypatch.setattr("distqa.bench.launch._launch", fake_launch)
    assert build_parser().parse_args(["bench", "--nproc", "1", "--output", "x"]).repeats == 3
    out = tmp_path / "b"
    assert main(["bench", "--nproc", "2,1", "--output", str(out), "--baseline", "model.name=tiny"]) == 0
    # Round by round, every process count in each; odd rounds reverse both orders.
    assert launched == [
        *[(1, "t", 0), (1, "b", 0), (2, "t", 0), (2, "b", 0)],
        *[(2, "b", 1), (2, "t", 1), (1, "b", 1), (1, "t", 1)],
        *[(1, "t", 2), (1, "b", 2), (2, "t", 2), (2, "b", 2)],
    ]
    result = json.loads((out / "bench.json").read_text())
    one, two = result["runs"]
    # Each row's own accumulation (the top level had the first row's for every row).
    assert (one["grad_accum"], two["grad_accum"], result["grad_accum"]) == (2, 1, None)
    assert one["nproc"] == 1 and one["samples_per_s"] == 100.0 and one["repeats"] == [50.0, 100.0, 100.0]
    assert one["samples_per_s_spread"]["relative"] == 0.5 and two["samples_per_s_spread"]["relative"] == 0.0
    assert two["scaling_efficiency_spread"] == {"min": 1.0, "max": 2.0}
    err = capsys.readouterr().err
    assert err.splitlines() == result["warnings"] and len(result["warnings"]) == 1
    assert "nproc 1: samples/s spread 50.0 %" in err
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cpu_processes_share_the_cores_unless_threads_are_set(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker_env(1, {})["OMP_NUM_THREADS"] == "16"
    assert worker_env(4, {"PATH": "/bin"}) == {"PATH": "/bin", "OMP_NUM_THREADS": "4"}
    assert worker_env(32, {})["OMP_NUM_THREADS"] == "1"
    assert worker_env(4, {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"  # the user's choice stays


def test_master_port_gives_a_rendezvous_hosted_here_at_that_port():
    """As scripts/run_local.sh: standalone (any free port) by default, the user's port when set."""
    assert rendezvous_args({}) == rendezvous_args({"MASTER_PORT": ""}) == ["--standalone"]
    assert rendezvous_args({"MASTER_PORT": "29612"}) == [
        "--nnodes=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:29612",
        "--rdzv-conf=is_host=1",
    ]
    assert "--rdzv-endpoint=127.0.0.1:29612" in rendezvous_args({"MASTER_PORT": "29612", "MASTER_ADDR": "127.0.0.1"})
    for bad in ("abc", "0", "65536", "١٢٣"):
        with pytest.raises(ConfigError, match=f"MASTER_PORT={bad} is not a port number"):
            rendezvous_args({"MASTER_PORT": bad})


def test_a_taken_master_port_is_one_line_before_the_launch():
    check_port({})  # no MASTER_PORT: torchrun picks a free one
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(DistqaError, match=f"port {port} is already in use on this host"):
            check_port({"MASTER_PORT": str(port)})
    check_port({"MASTER_PORT": str(port)})  # free again


def _bench(tmp_path: Path, *args: str, threads_unset: bool = False, **extra_env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "distqa", "bench", *args]
    env = subprocess_env(**extra_env)
    if threads_unset:  # as users run it: the bench gives each process its share of the cores
        del env["OMP_NUM_THREADS"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.slow
def test_bench_launches_trainer_and_baseline_and_writes_json_and_png(tmp_path):
    """One real 2-process launch of each loop. (Several process counts, their rounds, scaling and
    the plot of several rows: test_default_bench_runs_rounds_that_alternate_the_order, in this
    process; the 1-process launch: test_bench_runs_a_forked_task_without_a_flops_shape.)"""
    out = tmp_path / "bench"
    args = ["--nproc", "2", "--output", str(out), "--warmup", "2", "--steps", "4", "--baseline", "--repeats", "1"]
    args += ["--profile"]
    # At a port of our choosing (MASTER_PORT), as two users of one host would run it; the 1-process
    # launch of test_bench_runs_a_forked_task_without_a_flops_shape takes a free one (standalone).
    port = free_port()
    proc = _bench(tmp_path, *args, "--peak-tflops", "1", *BENCH_SMALL, threads_unset=True, MASTER_PORT=str(port))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"distqa bench: trainer, 2 process(es), run 1 of 1, rendezvous at localhost:{port}: log in" in proc.stdout
    result = json.loads((out / "bench.json").read_text())
    (row,) = result["runs"]
    assert row["nproc"] == 2 and row["scaling_efficiency"] == 1.0  # its own reference
    assert result["model"] == "tiny" and result["seq_len"] == 64 and result["measured_steps"] == 4
    assert row["samples_per_s"] > 0 and row["tokens_per_s"] > row["samples_per_s"]
    assert row["baseline_samples_per_s"] > 0 and row["trainer_over_baseline"] > 0
    assert row["mfu"] is not None and row["mfu"] > 0  # --peak-tflops gives a CPU an MFU
    assert row["threads_per_process"] == max(1, len(os.sched_getaffinity(0)) // 2)
    assert row["step_breakdown_ms"]["allreduce_wait"] > 0.0
    # 4 measured steps x 8 examples per process, summed over the processes.
    runs = json.loads((out / "runs" / "np2-trainer-0.json").read_text())
    assert runs["samples"] == 4 * 8 * 2 and runs["world_size"] == 2
    assert (out / "runs" / "np2-baseline-0.json").is_file()
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "vs loop" in proc.stdout and "bench.json" in proc.stdout
    # --profile: a launch of its own after the timed one (whose figures are above), each rank's
    # trace of the PROFILED_STEPS steps after the warm-up, and rank 0's table of operators.
    profiled = out / "profile-np2"
    for rank in (0, 1):
        trace = json.loads((profiled / f"trace-rank{rank}.json").read_text())
        steps = {e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")}
        assert steps == {f"ProfilerStep#{n}" for n in range(2, 2 + PROFILED_STEPS)}, steps  # after steps 1-2
    table = (profiled / "operators.txt").read_text()
    assert table.startswith(f"{PROFILED_STEPS} steps after 2 warm-up steps") and "aten::addmm" in table
    assert json.loads((out / "runs" / "np2-profile-0.json").read_text())["steps"] == PROFILED_STEPS
    assert f"distqa bench: profile of 2 process(es) in {profiled}" in proc.stdout


def test_bench_rejects_bad_input_before_launching(tmp_path, monkeypatch, capsys):
    # In this process (the command line's own exit path is that of every command): no launch may start.
    monkeypatch.setattr("distqa.bench.launch._launch", lambda *a: pytest.fail("launched despite a bad input"))
    out = str(tmp_path / "b")
    for args, says in (
        (["--nproc", "1", "train.batchsize=4"], "unknown config key 'train.batchsize'"),
        (["--nproc", "1,0"], "--nproc '1,0': every process count must be >= 1"),
        (["--nproc", "1", "--warmup", "1"], "--warmup=1 must be >= 2"),
        (["--nproc", "1", "--repeats", "0"], "--repeats=0 must be >= 1"),
        (["--nproc", "1", "--peak-tflops", "nan"], "--peak-tflops=nan must be a number > 0"),
        (["--nproc", "1", "--peak-tflops", "inf"], "--peak-tflops=inf must be a number > 0"),
        (["--nproc", "1", "--peak-tflops", "0"], "--peak-tflops=0.0 must be a number > 0"),
        # Each count's split of the global batch, as its trainer would (found by a review: refused
        # by the launch, after it started)
        (["--nproc", "1,2", "train.global_batch=8", "train.batch_size=8"], "cannot be split over 2 process(es)"),
        (
            [
                "--nproc",
                "1",
                "train.parallel=fsdp",
                "train.check_replicas=false",
                "train.ddp_comm_hook=bf16",
                "train.global_batch=16",
            ],
            "train.ddp_comm_hook=bf16 with train.parallel=fsdp and train.grad_accum=2",
        ),
    ):
        assert main(["bench", "--output", out, *args]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_a_failing_worker_is_reported_with_its_reason(tmp_path):
    out = tmp_path / "b"
    args = ["--nproc", "1", "--output", str(out), "--steps", "1", *BENCH_SMALL, "model.name=no-such-model"]
    proc = _bench(tmp_path, *args)
    assert proc.returncode != 0
    assert "the trainer run with 1 process(es) failed" in proc.stderr
    assert "cannot load" in proc.stderr and "'no-such-model'" in proc.stderr and "np1-trainer-0.log" in proc.stderr
    assert not (out / "bench.json").exists()


@pytest.mark.slow
def test_a_launch_past_its_timeout_is_stopped_with_its_workers(tmp_path):
    out = tmp_path / "timeout-bench"
    # Importing torch and transformers alone takes longer than 2 s in each worker.
    proc = _bench(tmp_path, "--nproc", "2", "--output", str(out), "--timeout", "2", *BENCH_SMALL)
    assert proc.returncode == 2 and "took longer than --timeout=2 s" in proc.stderr
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes of the stopped launch still run: {left}"


def test_failure_reason_prefers_the_ranks_own_error(tmp_path):
    log = tmp_path / "x.log"
    log.write_text(
        "[rank0]: Traceback (most recent call last):\n[rank0]: torch.OutOfMemoryError: CUDA out of memory.\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n====\nworker FAILED\n====\n"
    )
    assert _reason(log) == "[rank0]: torch.OutOfMemoryError: CUDA out of memory."
    log.write_text("distqa bench: error: out of GPU memory at train.batch_size=64\n[rank0]: ValueError: x\n")
    assert _reason(log) == "distqa bench: error: out of GPU memory at train.batch_size=64"
    log.write_text("terminate called without an active exception\n=======\n")
    assert _reason(log) == "terminate called without an active exception"


class _FakeEvent:
    """torch.cuda.Event's timing surface, on the host clock: exercises the GPU branch here."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "timing events must be created with enable_timing=True"
        self.t: float | None = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.t is not None and end.t is not None, "elapsed_time between unrecorded events"
        return (end.t - self.t) * 1000.0  # milliseconds, as CUDA's


def test_step_timer_on_cuda_uses_events_and_one_sync(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    timer = StepTimer(torch.device("cuda", 0), warmup=1)
    for _ in range(3):
        timer.step_begin()
        timer.mark("forward_backward")
        time.sleep(0.01)
        timer.mark("optimizer")
        timer.mark("other")
    timer.finish()
    summary = timer.summary()
    assert len(syncs) == 2  # where the measured window starts and where it ends, never per step
    assert all(isinstance(event, _FakeEvent) for _, event in timer._marks)
    assert 10.0 <= summary["phase_ms"]["forward_backward"] < 45.0
    assert sum(summary["phase_ms"].values()) * 2 / 1000 == pytest.approx(summary["seconds"], rel=0.2)


@pytest.mark.slow
def test_bench_runs_a_forked_task_without_a_flops_shape(tmp_path):
    # The toy task's model has no Hugging Face config: throughput and breakdown, FLOPs left out.
    # Its collate and loss sleep known times, which the breakdown must put in their phases.
    out = tmp_path / "toy"
    args = [
        "--nproc",
        "1",
        "--output",
        str(out),
        "--warmup",
        "2",
        "--steps",
        "3",
        "--repeats",
        "1",
        "task=toy_task:SleepyTask",
    ]
    proc = _bench(tmp_path, *args, "data.num_workers=0", "--peak-tflops", "1", threads_unset=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    (row,) = result["runs"]
    assert result["task"] == "toy_task:SleepyTask" and row["samples_per_s"] > 0
    assert row["threads_per_process"] == len(os.sched_getaffinity(0))  # one process: every core
    phases = row["step_breakdown_ms"]
    assert phases["allreduce_wait"] == 0.0  # one process: no DDP, nothing to wait for
    assert phases["data"] >= toy_task.SleepyTask.COLLATE_MS
    assert phases["forward_backward"] >= toy_task.SleepyTask.LOSS_MS
    assert row["flops_per_token"] is None and row["mfu"] is None and "Task.model_shape" in result["flops_note"]
    assert "no FLOPs or MFU" in proc.stdout


@pytest.mark.launch  # a launch started, then stopped: seconds
def test_a_sigterm_to_bench_stops_its_launch_too(tmp_path):
    """The launch runs in a session of its own (so that a timeout stops torchrun and its workers);
    a SIGTERM to the bench ended it alone, and the launch trained on, orphaned (a review)."""
    out = tmp_path / "bench"
    proc = subprocess.Popen(
        [sys.executable, "-m", "distqa", "bench", "--nproc", "2", "--steps", "3000", "--repeats", "1",
         "--output", str(out), "model.name=tiny", "task.max_seq_len=32", "train.batch_size=4"],
        env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    log = out / "runs" / "np2-trainer-0.log"
    deadline = time.monotonic() + 120
    while "step" not in (log.read_text() if log.is_file() else "") and time.monotonic() < deadline:
        time.sleep(0.5)  # the workers are training
    proc.terminate()
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == (
        f"distqa: error: bench stopped by SIGTERM, its launch with it: no bench.json written (logs in {out}/runs)"
    )
    left = subprocess.run(["pgrep", "-f", f"--output-dir={out}"], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes of the launch outlived the bench: {left}"
