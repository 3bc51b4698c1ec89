"""scripts/gpu_day.sh and its report builder (scripts/gpu_day_report.py), without a GPU.

The script runs for real with stand-ins first on PATH: `nvidia-smi` (FAKE_GPUS GPUs), `distqa`
(writes a bench.json like `distqa bench`; a largest-batch probe runs out of memory above
FAKE_MAX_BATCH; it sleeps when compiling if FAKE_COMPILE_SLEEP is set) and the GPU suite
(GPU_CHECK). Each appends its call to FAKE_LOG, so the order of the steps is checked; tiny boxes
prove that a step past its box is stopped, reported timed-out, and the day goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from distqa.bench.memory import ENCODERS, largest_batch

SCRIPT = ROOT / "scripts" / "gpu_day.sh"
# scripts/ is not a package: the report builder runs as a script, its sibling gpu_day_markdown beside it.
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_day_report  # noqa: E402

NVIDIA_SMI = """#!/usr/bin/env bash
((${FAKE_GPUS:-0} > 0)) || { echo "NVIDIA-SMI has failed because it couldn't communicate with the driver."; exit 9; }
for ((i = 0; i < FAKE_GPUS; i++)); do
  if [[ $1 == -L ]]; then echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"
  else echo "NVIDIA H100 80GB HBM3, ${FAKE_MEMORY:-81559 MiB}, 550.54"; fi
done
"""

DISTQA = r"""#!/usr/bin/env bash
echo "distqa $*" >> "$FAKE_LOG"
if [[ " $* " == *" --help "* ]]; then [[ -z ${FAKE_DP:-} ]] || echo "  --dp  DataParallel rows"; exit 0; fi
args=("$@") batch=32 speed=100 modes=ddp
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    --output) out=${args[i + 1]} ;;
    --nproc) nproc=${args[i + 1]} ;;
    --dp) modes="ddp dp" ;;
    train.batch_size=*) batch=${args[i]#*=} ;;
    train.compile=true) speed=125
      [[ -z ${FAKE_COMPILE_SLEEP:-} ]] || { echo "$$" >> "$FAKE_LOG.sleeping"; sleep "$FAKE_COMPILE_SLEEP"; } ;;
  esac
done
if [[ $out == */batches/* ]] && ((batch > ${FAKE_MAX_BATCH:-512})); then
  echo "distqa: error: the trainer run with 1 process(es) failed (exit 1): CUDA out of memory." >&2
  exit 1
fi
rows=()
for mode in $modes; do
  for n in ${nproc//,/ }; do
    rows+=("{\"parallel\": \"$mode\", \"nproc\": $n, \"samples_per_s\": $((speed * n)),
      \"tokens_per_s\": $((speed * n * 400)), \"mfu\": 0.2, \"scaling_efficiency\": 1.0,
      \"samples_per_s_spread\": {\"min\": $((speed * n - 1)), \"max\": $((speed * n + 1))},
      \"step_ms\": 40.0, \"step_breakdown_ms\": {\"forward_backward\": 38.0, \"optimizer\": 1.5},
      \"peak_memory_gib\": $((batch / 4))}")
  done
done
mkdir -p "$out"
(IFS=,; echo "{\"device\": \"cuda\", \"batch_size\": $batch, \"runs\": [${rows[*]}]}") > "$out/bench.json"
"""

GPU_CHECK = """#!/usr/bin/env bash
echo "gpu-check $PYTHON" >> "$FAKE_LOG"
mkdir -p "$OUT"
echo "tests/test_gpu.py::test_bf16 PASSED" > "$OUT/gpu_tests.log"
cat > "$OUT/gpu_figures.json" <<'EOF'
{"pytest_exit_status": 0, "environment": {"python": "3.12.3", "torch": "2.13.0+cu126", "cuda": "12.6"},
 "tests": {"test_bf16": {"outcome": "passed"}, "test_two_gpus": {"outcome": "skipped"}},
 "figures": {"compile": {"compile_time_s": 16.2}}}
EOF
exit "${FAKE_CHECK_STATUS:-0}"
"""


def _fakes(tmp_path: Path) -> dict[str, str]:
    """The stand-ins written into tmp_path/bin, and the environment that puts them first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("nvidia-smi", NVIDIA_SMI), ("distqa", DISTQA), ("gpu_check.sh", GPU_CHECK)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_LOG": str(tmp_path / "calls.log"),
        "GPU_CHECK": str(bin_dir / "gpu_check.sh"),
        "PYTHON": sys.executable,  # the suite's own (make test-torch-floor runs another venv)
        "GPU_DAY_GRACE_S": "1",
        "GPU_DAY_MIN_BOX_S": "1",
    }


def _run(env: dict[str, str], out: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {**env, **extra}
    if env.get("FAKE_GPUS", "0") != "0":  # the count torch would give; none: torch's own (0 here)
        env["GPU_DAY_GPUS"] = env["FAKE_GPUS"]
    return subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=60)


def test_without_a_gpu_it_exits_2_with_one_line_and_writes_nothing(tmp_path):
    fakes = _fakes(tmp_path)
    proc = _run(fakes, tmp_path / "day", FAKE_GPUS="0")
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1
    assert "no GPU visible (torch.cuda.device_count() is 0 for" in proc.stderr
    assert not (tmp_path / "day").exists()
    # A Python that cannot import torch: the same line (its failed count ended the script, silent).
    proc = _run(fakes, tmp_path / "day", PYTHON="false")
    assert proc.returncode == 2 and "no GPU visible (torch.cuda.device_count() is 0 for false)" in proc.stderr


def _formula(model: str, parallel: str, ac: bool, gpus: int = 1) -> int:
    """distqa.bench.memory's largest batch per GPU on the fake card (81559 MiB), seq 512."""
    encoder = next(e for e in ENCODERS if e.name == model)
    return largest_batch(encoder, gpus=gpus, seq=512, gib=81559 / 1024, sharded=parallel == "fsdp", checkpointed=ac)


def _probes(calls: list[str], setup: str) -> list[int]:
    return [int(c.split(" train.batch_size=")[1].split()[0]) for c in calls if f"/batches/{setup}/" in c]


def test_one_gpu_day_runs_the_steps_in_order_and_a_step_past_its_box_times_out(tmp_path):
    """Steps in order of value: the suite, bench, compile (timed out here), then the largest batch
    searched from the formula's: down while out of memory (10 %, then 25 % steps), up while it fits."""
    out = tmp_path / "day"
    base, large = _formula("BERT-base", "ddp", False), _formula("BERT-large", "fsdp", True)
    limit = base - base // 20  # the fake runs out of memory above it: the formula's batch fails, 10 % less fits
    began = time.monotonic()
    proc = _run(
        _fakes(tmp_path), out, FAKE_GPUS="1", FAKE_MAX_BATCH=str(limit), FAKE_COMPILE_SLEEP="30",
        GPU_DAY_BOX_COMPILE="1", GPU_DAY_SETUPS="bert-base-random-ddp-ac-false bert-large-random-fsdp-ac-true",
    )  # fmt: skip
    assert time.monotonic() - began < 20  # the 30 s compile was stopped at its 1 s box (+1 s grace)
    assert proc.returncode == 1, proc.stderr  # a step timed out
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert calls[0].startswith("gpu-check ")
    assert calls[1].startswith(f"distqa bench --nproc 1 --output {out}/bench ") and "--dp" not in calls[1]
    assert calls[2].startswith(f"distqa bench --nproc 1 --output {out}/compile ") and "train.compile=true" in calls[2]
    assert calls[3].startswith(f"distqa bench --nproc 1 --output {out}/profile --profile ")
    assert all("/batches/" in c for c in calls[4:])
    assert _probes(calls, "bert-base-random-ddp-ac-false") == [base, base - base // 10]
    # From far above: down in steps of at most 25 %, until one fits (the last) below one that did not.
    down = _probes(calls, "bert-large-random-fsdp-ac-true")
    assert down[0] == large > limit >= down[-1] and all(limit < b for b in down[:-1])
    assert all(0.75 * a <= b < a for a, b in zip(down, down[1:]))
    assert "train.parallel=fsdp train.activation_checkpointing=true" in calls[-1]
    assert "1 GPU: DP/DDP scaling rows skipped" in proc.stdout
    report = json.loads((out / "gpu_day.json").read_text())
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert status["gpu-tests"] == status["bench"] == status["largest-batch/bert-large-random-fsdp-ac-true"] == "ok"
    assert status["compile"] == "timed-out" and status["profile"] == "ok" and len(status) == 6
    assert report["gpu"] == {"count": 1, "name": "NVIDIA H100 80GB HBM3", "memory": "81559 MiB", "driver": "550.54"}
    found = {b["setup"]: b for b in report["largest_batches"]}
    assert found["bert-base-random-ddp-ac-false"]["largest_batch"] == base - base // 10
    assert found["bert-base-random-ddp-ac-false"]["formula_largest_batch"] == base
    assert found["bert-base-random-ddp-ac-false"]["stopped_by"] == f"batch {base}: CUDA out of memory"
    assert found["bert-large-random-fsdp-ac-true"]["largest_batch"] == down[-1]
    assert f"| 1 | {base - base // 10} | {base} |" in (out / "gpu_day.md").read_text()
    assert report["tests"]["passed"] == 1 and report["tests"]["skipped"] == 1
    assert (
        "| eager, batch 32 | 100.0 (99.0..101.0) | 40,000 | 20.0 % | 40.0 (38.0 / 1.5) | 8.0 |  |"
        in (out / "gpu_day.md").read_text()
    )


def test_where_every_batch_fits_the_search_goes_up_and_reports_the_largest_tried(tmp_path):
    out = tmp_path / "day"
    proc = _run(
        _fakes(tmp_path), out, FAKE_GPUS="1", FAKE_MAX_BATCH="100000", GPU_DAY_STEPS="batches",
        GPU_DAY_SETUPS="bert-base-random-ddp-ac-true",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    up = _probes((tmp_path / "calls.log").read_text().splitlines(), "bert-base-random-ddp-ac-true")
    assert up[0] == _formula("BERT-base", "ddp", True) and len(up) == 8  # its limit of runs
    assert all(a < b <= 1.25 * a for a, b in zip(up, up[1:]))
    (entry,) = json.loads((out / "gpu_day.json").read_text())["largest_batches"]
    assert (entry["largest_batch"], entry["stopped_by"], entry["lower_bound"]) == (up[-1], None, True)
    assert f"| ≥ {up[-1]} | {up[0]} |" in (out / "gpu_day.md").read_text()
    assert "the largest size tried |" in (out / "gpu_day.md").read_text()
    # The same OUTPUT_DIR again, where nothing fits now: this day's search alone is reported.
    (tmp_path / "again").mkdir()
    proc = _run(
        _fakes(tmp_path / "again"), out, FAKE_GPUS="1", FAKE_MAX_BATCH="0", GPU_DAY_STEPS="batches",
        GPU_DAY_SETUPS="bert-base-random-ddp-ac-true",
    )  # fmt: skip
    assert proc.returncode == 1
    (entry,) = json.loads((out / "gpu_day.json").read_text())["largest_batches"]
    assert entry["largest_batch"] == 0 and entry["stopped_by"].endswith("CUDA out of memory")
    assert "| < " in (out / "gpu_day.md").read_text()


def test_without_the_card_s_memory_the_search_starts_at_16_and_says_why(tmp_path):
    out = tmp_path / "day"
    proc = _run(
        _fakes(tmp_path), out, FAKE_GPUS="1", FAKE_MEMORY="[N/A]", FAKE_MAX_BATCH="20", GPU_DAY_STEPS="batches",
        GPU_DAY_SETUPS="bert-base-random-ddp-ac-false",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert _probes((tmp_path / "calls.log").read_text().splitlines(), "bert-base-random-ddp-ac-false") == [16, 17, 21]
    report = json.loads((out / "gpu_day.json").read_text())
    assert any("no figure of distqa.bench.memory (nvidia-smi gave no memory size" in n for n in report["not_done"])
    (entry,) = report["largest_batches"]
    assert (entry["largest_batch"], entry["formula_largest_batch"]) == (17, None)


def test_two_gpus_add_dp_rows_and_a_failed_suite_does_not_stop_the_day(tmp_path):
    out = tmp_path / "day"
    proc = _run(_fakes(tmp_path), out, FAKE_GPUS="2", FAKE_DP="1", FAKE_MAX_BATCH="0", FAKE_CHECK_STATUS="1")
    assert proc.returncode == 1
    calls = (tmp_path / "calls.log").read_text().splitlines()
    bench = next(c for c in calls if f"--output {out}/bench " in c)
    assert "--nproc 1,2 " in bench and bench.endswith(" --dp")
    report = json.loads((out / "gpu_day.json").read_text())
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert status["gpu-tests"] == "failed" and status["bench"] == "ok" and status["compile"] == "ok"
    # Nothing fits (out of memory down to a sixth of the formula's batch): the set-up failed, with the reason.
    assert status["largest-batch/bert-base-random-ddp-ac-false"] == "failed"
    assert "out of memory" in report["steps"][4]["reason"]
    probes = _probes(calls, "bert-base-random-ddp-ac-false")
    assert probes[0] == _formula("BERT-base", "ddp", False, gpus=2) and len(probes) == 8
    assert [(r["mode"], r["nproc"]) for r in report["bench"]["rows"]] == [("ddp", 1), ("ddp", 2), ("dp", 1), ("dp", 2)]
    assert report["compile"]["speedup"] == 1.25 and report["compile"]["compile_time_s"] == 16.2
    assert "| DP, 2 GPUs, eager, batch 32 per GPU | 200.0 (199.0..201.0) |" in (out / "gpu_day.md").read_text()


def _bench_json(folder: Path, rows: list[dict], batch: int = 32) -> None:
    folder.mkdir(parents=True)
    (folder / "bench.json").write_text(json.dumps({"device": "cuda", "batch_size": batch, "runs": rows}))


def _row(nproc: int, samples: float, **extra: object) -> dict:
    phases = {"forward_backward": 39.9, "optimizer": 1.3}
    return {"nproc": nproc, "samples_per_s": samples, "samples_per_s_spread": {"min": samples, "max": samples},
            "tokens_per_s": samples * 400, "mfu": 0.25, "scaling_efficiency": 0.9, "step_ms": 42.7,
            "step_breakdown_ms": phases, "peak_memory_gib": 8.3, **extra}  # fmt: skip


def test_report_from_ok_failed_timed_out_and_skipped_steps(tmp_path):
    out = tmp_path / "day"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "gpu-tests.log").write_text("collecting\nE   RuntimeError: CUDA error: no kernel image\nbye\n")
    (out / "tests").mkdir()
    # The suite was cut short: no gpu_figures.json, its counts come from pytest's lines in the log.
    (out / "tests" / "gpu_tests.log").write_text(
        "[gw0] [ 10%] PASSED tests/test_gpu.py::test_bf16[tiny]\n"
        "tests/test_gpu.py::test_fsdp_ws1 FAILED\nSKIPPED tests/test_gpu.py::test_two_gpus\n"
        "FAILED tests/test_gpu_nq.py::test_nq_trains\n"  # every file of the suite, not test_gpu.py alone
    )
    _bench_json(out / "bench", [_row(1, 750.0), _row(2, 1350.0), _row(2, 900.0, parallel="dp", dp_over_ddp=0.6667)])
    _bench_json(out / "compile", [_row(1, 960.0)])
    for batch in (16, 32, 64):  # 16 and 32 fit, 64 is out of memory; the large model's box ran out at 32
        (out / "batches" / "bert-base-random-fsdp-ac-true").mkdir(parents=True, exist_ok=True)
        (out / "batches" / "bert-base-random-fsdp-ac-true" / f"batch-{batch}.log").write_text(
            "distqa: error: the trainer run failed: torch.OutOfMemoryError: CUDA out of memory. Tried"
            if batch == 64
            else ""
        )
        if batch < 64:
            _bench_json(
                out / "batches" / "bert-base-random-fsdp-ac-true" / f"batch-{batch}", [_row(1, 10.0 * batch)], batch
            )
    (out / "batches" / "bert-base-random-fsdp-ac-true" / "formula.json").write_text('{"formula_largest_batch": 40}')
    (out / "batches" / "bert-large-random-ddp-ac-false").mkdir()
    (out / "batches" / "bert-large-random-ddp-ac-false" / "batch-16.log").write_text("")
    (out / "batches" / "bert-large-random-ddp-ac-false" / "batch-32.log").write_text("Traceback\nKeyboardInterrupt\n")
    _bench_json(out / "batches" / "bert-large-random-ddp-ac-false" / "batch-16", [_row(1, 50.0)], 16)
    # A search going down whose box ran out: 400 out of memory, 360 stopped in flight.
    (out / "batches" / "bert-large-random-fsdp-ac-false").mkdir()
    (out / "batches" / "bert-large-random-fsdp-ac-false" / "batch-400.log").write_text(
        "distqa bench: error: out of GPU memory at train.batch_size=400, task.max_seq_len=512\n"  # the search's match
    )
    (out / "batches" / "bert-large-random-fsdp-ac-false" / "batch-360.log").write_text("Traceback\nKeyboardInterrupt\n")
    steps = [
        gpu_day_report.step_entry("gpu-tests", 1, 61.0, 480, out / "logs" / "gpu-tests.log"),
        gpu_day_report.step_entry("bench", 0, 120.0, 540, out / "logs" / "bench.log"),
        gpu_day_report.step_entry(
            "largest-batch/bert-large-random-ddp-ac-false", 124, 105.0, 105, out / "logs" / "x.log"
        ),
        gpu_day_report.step_entry(
            "largest-batch/bert-large-random-fsdp-ac-false", 124, 105.0, 105, out / "logs" / "x.log"
        ),
        {"name": "compile", "status": "skipped", "reason": "only 20 s left of the 2400 s budget", "seconds": 0},
        {"note": "1 GPU: DP/DDP scaling rows skipped"},
    ]
    (out / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    report = gpu_day_report.write(out, 2, 2400)
    assert json.loads((out / "gpu_day.json").read_text()) == json.loads(json.dumps(report))
    assert [s["status"] for s in report["steps"]] == ["failed", "ok", "timed-out", "timed-out", "skipped"]
    assert report["steps"][0]["reason"] == "E   RuntimeError: CUDA error: no kernel image"
    assert report["tests"]["passed"] == report["tests"]["skipped"] == 1 and report["tests"]["failed"] == 2
    assert report["tests"]["not_passed"] == ["test_fsdp_ws1", "test_nq_trains"]
    assert report["tests"]["cut_short"] and report["tests"]["not_run"] is None
    assert [(r["mode"], r["nproc"], r["samples_per_s"]) for r in report["bench"]["rows"]] == [
        ("ddp", 1, 750.0), ("ddp", 2, 1350.0), ("dp", 2, 900.0)]  # fmt: skip
    assert report["compile"]["speedup"] == 960.0 / 750.0 and report["compile"]["compile_time_s"] is None
    base, large, down = report["largest_batches"]
    assert down["largest_batch"] == 0 and not down["lower_bound"]
    assert down["stopped_by"] == "batch 400: CUDA out of memory"
    assert (base["largest_batch"], base["stopped_by"], base["lower_bound"]) == (
        32,
        "batch 64: CUDA out of memory",
        False,
    )
    # Its box ran out in the probe of 32: no failure, a lower bound.
    assert (large["largest_batch"], large["stopped_by"], large["lower_bound"]) == (16, None, True)
    assert report["not_done"][0] == "1 GPU: DP/DDP scaling rows skipped" and len(report["not_done"]) == 5
    md = (out / "gpu_day.md").read_text()
    assert (
        "GPU acceptance suite (`make test-gpu`): 1 passed, 2 failed, 1 skipped (not passed: test_fsdp_ws1, "
        "test_nq_trains). Cut short (its box ran out, or it was stopped): the rest never ran." in md
    )
    assert "| eager, batch 32 | 750.0 | 300,000 | 25.0 % | 42.7 (39.9 / 1.3) | 8.3 |  |" in md
    assert "| DDP, 2 GPUs, eager, batch 32 per GPU | 1,350.0 | 540,000 | 25.0 % |" in md
    assert "| 8.3 | scaling efficiency 90.0 %; 0.67× DDP at as many GPUs |" in md
    assert "| `train.compile=true`, batch 32 | 960.0 |" in md and "1.28× eager" in md
    assert (
        "| bert-base-random, fsdp, activation checkpointing on | 1 | 32 | 40 | 320.0 | 8.3 "
        "| batch 64: CUDA out of memory |" in md
    )
    assert "| bert-large-random, ddp, activation checkpointing off | 1 | ≥ 16 |  | 50.0 | 8.3 | the time box |" in md
    assert "- compile: skipped: only 20 s left of the 2400 s budget" in md
    down_row = (
        "| bert-large-random, fsdp, activation checkpointing off |  | < 400 |  |  |  | batch 400: CUDA out of memory |"
    )
    assert down_row in md


def test_some_steps_at_a_time_gather_into_one_report(tmp_path):
    """GPU_DAY_STEPS: a day in several commands (each under a 10-minute limit) into one OUTPUT_DIR."""
    env, out = {**_fakes(tmp_path), "FAKE_GPUS": "1"}, tmp_path / "day"
    assert _run(env, out, GPU_DAY_STEPS="tests", FAKE_CHECK_STATUS="1").returncode == 1
    proc = _run(env, out, GPU_DAY_STEPS="bench compile", GPU_DAY_REPEATS="1")  # a short call: one repeat each
    assert proc.returncode == 0, proc.stderr  # this call's steps passed
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert [c.split(" --output ")[1].split()[0] for c in calls[1:]] == [f"{out}/bench", f"{out}/compile"]
    assert all(" --repeats 1 " in c for c in calls[1:]), calls
    report = json.loads((out / "gpu_day.json").read_text())
    assert [(s["name"], s["status"]) for s in report["steps"]] == [
        ("gpu-tests", "failed"), ("bench", "ok"), ("compile", "ok")]  # fmt: skip
    assert report["compile"]["speedup"] == 1.25
    assert _run(env, out, GPU_DAY_STEPS="tests").returncode == 0  # run again, it passes: its outcome replaced
    report = json.loads((out / "gpu_day.json").read_text())
    assert [(s["name"], s["status"]) for s in report["steps"]] == [
        ("gpu-tests", "ok"),
        ("bench", "ok"),
        ("compile", "ok"),
    ]
    bad = _run(env, out, GPU_DAY_STEPS="tests batch")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "'batch'" in bad.stderr
    for setups, said in (
        ("bert-base-random-ddp-ac-false bert-base-ddp-ac-false", "names 'bert-base-ddp-ac-false': the set-ups are"),
        (" ", "names no set-up"),
        ("bert-base-random-ddp-ac-false\nbert-base-random-ddp-ac-false", "names 'bert-base-random-ddp-ac-false' twice"),
    ):
        bad = _run(env, out, GPU_DAY_SETUPS=setups)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and said in bad.stderr, bad.stderr
    for repeats in ("0", "two", "-1"):
        bad = _run(env, out, GPU_DAY_REPEATS=repeats)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and f"GPU_DAY_REPEATS='{repeats}'" in bad.stderr


def test_without_the_suite_s_record_the_report_names_torch_s_build_and_cuda(tmp_path, monkeypatch):
    """A day of `GPU_DAY_STEPS=profile` alone: the versions come from torch/version.py, not from the
    package's metadata, which has neither the build ("+cu130") nor CUDA (the H100 day's heading
    said "torch 2.11.0 (CUDA ?)")."""
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("raise ImportError('read, not imported')\n")
    (site / "torch" / "version.py").write_text(
        "from typing import Optional\n__version__ = '2.11.0+cu130'\ndebug = False\ncuda: Optional[str] = '13.0'\n"
    )
    assert gpu_day_report.torch_build(site) == {"torch": "2.11.0+cu130", "cuda": "13.0"}
    real = gpu_day_report.torch_build
    monkeypatch.setattr(gpu_day_report, "torch_build", lambda: real(site))  # torch is imported in this process
    found = gpu_day_report.versions(tmp_path / "day")
    assert (found["torch"], found["cuda"]) == ("2.11.0+cu130", "13.0")
    (site / "torch" / "version.py").write_text("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n")
    assert real(site) == {"torch": "2.13.0+cpu"}  # a CPU build: no CUDA to name


SLEEPY = """import time

import pytest


@pytest.mark.gpu
def test_first_quick():
    pass


@pytest.mark.gpu
def test_then_slow():
    time.sleep(120)


@pytest.mark.gpu
def test_never_reached():
    pass
"""


@pytest.mark.launch  # the suite's collection imports torch and transformers: seconds
def test_a_suite_its_box_stops_is_reported_cut_short_with_the_tests_that_never_ran(tmp_path):
    """The box's SIGINT reached tee too: the log stopped mid-test, pytest's status read 1, the
    junit file's nameless case counted as passed, and the report said "1 passed" of a suite
    whose only selected test was cut off (found by a review)."""
    extra = tmp_path / "test_sleepy.py"
    extra.write_text(SLEEPY)
    out = tmp_path / "tests"
    env = {**os.environ, "OUT": str(out), "WHEELS": "", "PYTHON": sys.executable}
    script = str(ROOT / "scripts" / "gpu_check.sh")
    proc = subprocess.Popen(["timeout", "-s", "INT", "-k", "20", "30", "bash", script, str(extra)], env=env)
    log = out / "gpu_tests.log"
    deadline = time.monotonic() + 120
    while "test_then_slow" not in (log.read_text() if log.is_file() else "") and time.monotonic() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)  # as timeout sends it, to the script (and tee, in its group)
    assert proc.wait(timeout=60) == 2
    figures = json.loads((out / "gpu_figures.json").read_text())
    assert figures["pytest_exit_status"] == 2 and figures["cut_short"]
    tests = figures["tests"]
    assert None not in tests and "null" not in tests and tests["test_first_quick"]["outcome"] == "passed"
    assert "test_never_reached" not in tests and "test_then_slow" not in tests
    assert figures["expected"] >= len(tests) + 2  # the GPU files' tests too (each skips here)
    assert "KeyboardInterrupt" in log.read_text() and " in " in log.read_text().splitlines()[-1]  # the summary
    day = tmp_path
    counts = gpu_day_report.test_counts(day)
    assert counts["passed"] == 1 and counts["cut_short"] and counts["not_run"] == figures["expected"] - len(tests)
    gpu_day_report.write(day, 1, 600)
    assert "Cut short (its box ran out, or it was stopped): " in (day / "gpu_day.md").read_text()


@pytest.mark.launch  # the suite's collection imports torch and transformers: seconds
def test_a_library_that_prints_on_import_loses_neither_the_versions_nor_the_figures(tmp_path):
    """huggingface_hub without httpx prints "Error importing ..." on stdout at import: the versions'
    JSON, read from stdout, was then no JSON, the summary failed and gpu_figures.json was never
    written; and the GPU count read the same noise and stopped the script under `set -u` before
    pytest (found by a review)."""
    import torch

    noisy = tmp_path / "noisy"
    noisy.mkdir()
    (noisy / "sitecustomize.py").write_text("print('Error importing something: a library talking on stdout')\n")
    extra = tmp_path / "test_quick.py"
    extra.write_text(SLEEPY)
    out = tmp_path / "tests"
    env = {**os.environ, "OUT": str(out), "WHEELS": "", "PYTHON": sys.executable, "PYTHONPATH": str(noisy)}
    script = str(ROOT / "scripts" / "gpu_check.sh")
    proc = subprocess.run(["bash", script, str(extra), "-k", "first_quick"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figures = json.loads((out / "gpu_figures.json").read_text())
    assert figures["environment"]["torch"] == torch.__version__ and figures["environment"]["gpus"] == []
    assert figures["tests"]["test_first_quick"]["outcome"] == "passed" and not figures["cut_short"]


def test_a_box_set_below_the_smallest_is_skipped_saying_so(tmp_path):
    """It said "only 180 s left of the 200 s budget", as if the day's time had run out."""
    env, out = {**_fakes(tmp_path), "FAKE_GPUS": "1"}, tmp_path / "day"
    proc = _run(env, out, GPU_DAY_STEPS="compile", GPU_DAY_MIN_BOX_S="60", GPU_DAY_BOX_COMPILE="40")
    assert proc.returncode == 0, proc.stderr
    steps = json.loads((out / "gpu_day.json").read_text())["steps"]
    assert [(s["name"], s["status"], s["reason"]) for s in steps] == [
        ("compile", "skipped", "its box of 40 s is below GPU_DAY_MIN_BOX_S=60")
    ]


def test_one_call_gathers_its_files_flat_into_out(tmp_path):
    """A lent machine's call returns only $OUT's files, at most 8 and 2 folders down: the day's
    report, the suite's record and log, and one archive of the rest."""
    env = {**_fakes(tmp_path), "GPU_DAY_GPUS": "1", "GPU_DAY_DIR": str(tmp_path / "day"), "OUT": str(tmp_path / "out")}
    call = ["bash", str(ROOT / "scripts" / "gpu_day_call.sh"), "tests bench", "300"]
    proc = subprocess.run(call, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    back = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert back == ["day.tar.gz", "gpu_day.json", "gpu_day.md", "gpu_figures.json", "gpu_tests.log"]
    report = json.loads((tmp_path / "out" / "gpu_day.json").read_text())
    assert [(s["name"], s["status"]) for s in report["steps"]] == [("gpu-tests", "ok"), ("bench", "ok")]
    listed = subprocess.run(["tar", "-tzf", str(tmp_path / "out" / "day.tar.gz")], capture_output=True, text=True)
    assert "day/bench/bench.json" in listed.stdout.split() and "day/logs/bench.log" in listed.stdout.split()
    without = {k: v for k, v in env.items() if k != "OUT"}
    proc = subprocess.run(call, env=without, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "$OUT is the folder whose files come back" in proc.stderr


def _kill_sleeping_stand_ins(log):
    """The call's steps run under timeout, which leads a process group of its own: killing the
    call's group left the sleeping stand-in behind for its whole sleep."""
    pids = log.with_name(log.name + ".sleeping")
    for pid in pids.read_text().split() if pids.exists() else []:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(int(pid)), signal.SIGKILL)


def test_a_call_cut_off_at_its_limit_still_returns_the_steps_that_ended(tmp_path):
    """The machine's limit kills the whole call: gathered only at its end, $OUT came back empty,
    the finished steps' figures with it (found by a review)."""
    out = tmp_path / "out"
    env = {**_fakes(tmp_path), "GPU_DAY_GPUS": "1", "GPU_DAY_DIR": str(tmp_path / "day"), "OUT": str(out)}
    env["FAKE_COMPILE_SLEEP"] = "120"
    call = ["bash", str(ROOT / "scripts" / "gpu_day_call.sh"), "bench compile", "300"]
    proc = subprocess.Popen(call, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        log, deadline = tmp_path / "calls.log", time.monotonic() + 60
        while "train.compile=true" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, "the compile step never started"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _kill_sleeping_stand_ins(log)
    assert sorted(p.name for p in out.iterdir()) == ["day.tar.gz", "gpu_day.json", "gpu_day.md"]
    report = json.loads((out / "gpu_day.json").read_text())
    assert [(s["name"], s["status"]) for s in report["steps"]] == [("bench", "ok")]
    listed = subprocess.run(["tar", "-tzf", str(out / "day.tar.gz")], capture_output=True, text=True).stdout.split()
    assert "day/bench/bench.json" in listed and "day/logs/bench.log" in listed


def test_a_suite_that_could_not_collect_is_not_reported_cut_short(tmp_path):
    """pytest's status 2 is also a file that failed to import (a missing wheel): it read as "cut
    short (its box ran out)" (found by a review)."""
    (tmp_path / "tests").mkdir()
    figures = {
        "pytest_exit_status": 2,
        "expected": 21,
        "collection_errors": 1,
        "cut_short": False,
        "tests": {"collecting tests/test_gpu.py": {"outcome": "error"}},
        "environment": {},
        "figures": {},
    }
    (tmp_path / "tests" / "gpu_figures.json").write_text(json.dumps(figures))
    counts = gpu_day_report.test_counts(tmp_path)
    assert counts["error"] == 1 and not counts["cut_short"] and counts["collection_errors"] == 1
    gpu_day_report.write(tmp_path, 1, 600)
    md = (tmp_path / "gpu_day.md").read_text()
    assert "1 test file(s) could not be collected (the log says why): nothing ran." in md and "Cut short" not in md
