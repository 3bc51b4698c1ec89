"""`distqa bench --nproc 1,2 --output DIR [KEY=VALUE ...]`: one torchrun launch per world size.

Each launch runs the real training loop (`distqa.bench.worker`) for warm-up plus measured steps
and writes its figures to DIR/runs/; this process then writes DIR/bench.json and DIR/bench.png.
`--repeats` rounds (default 3) each launch every world size once, so that all rows see the same
machine load; with `--baseline` each also runs the hand-written DDP loop beside the trainer, and
with `--dp` (GPUs only) one process with `train.parallel=dp` over as many GPUs as the DDP row has
processes. Each row reports the median and the spread of its repeats, and implausible figures are
warned about.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from distqa import rdzv_check
from distqa.bench.profile import PROFILED_STEPS
from distqa.bench.report import add_scaling, implausible, plot, summarize
from distqa.config import Config
from distqa.dist import usable_cpus
from distqa.errors import ConfigError, DistqaError
from distqa.registry import load_config

LOOPS = ("trainer", "baseline")
DP = "dp"  # the third kind of launch: the trainer with train.parallel=dp, in one process


def parse_nproc(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; a clear error for anything else."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--nproc {text!r} is not a comma-separated list of process counts, e.g. 1,2") from None
    if any(n < 1 for n in values):
        raise ConfigError(f"--nproc {text!r}: every process count must be >= 1")
    if len(set(values)) != len(values):
        raise ConfigError(f"--nproc {text!r} names a process count twice")
    return sorted(values)


def _check_devices(nprocs: list[int]) -> None:
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if max(nprocs) > gpus:
            raise ConfigError(f"--nproc {max(nprocs)} needs {max(nprocs)} GPUs; {gpus} visible")
        return
    cpus = usable_cpus()
    if max(nprocs) > cpus:
        print(
            f"distqa bench: warning: {max(nprocs)} CPU processes on {cpus} CPUs share cores: "
            "their throughput measures the oversubscription, not DDP",
            file=sys.stderr,
        )


def _reason(log: Path) -> str:
    """The most telling line of a failed launch: distqa's own error line, else the last Python
    exception line of a rank, else the log's last line (torchrun's summary is framed by '=')."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for wanted in (
        lambda line: line.startswith("distqa") and "error:" in line,
        lambda line: (
            re.search(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception)\b.*:", line) is not None
            and "ChildFailedError" not in line
        ),  # torchrun's own report says only that a child failed
    ):
        found = [line for line in lines if wanted(line)]
        if found:
            return found[-1]
    content = [line for line in lines if not set(line) <= set("=-")]
    return content[-1] if content else "no output"


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the launch's whole process group, SIGKILL after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def worker_env(nproc: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The launch's environment: on CPUs, each process gets its share of the cores unless the user
    set OMP_NUM_THREADS (torchrun would give 1 thread to each of several processes but all cores to
    a single one, which flatters 1 against N)."""
    env = dict(environ)
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in environ:
        cpus = usable_cpus()
        env["OMP_NUM_THREADS"] = str(max(1, cpus // nproc))
    return env


def dp_env(gpus: int, environ: Mapping[str, str]) -> dict[str, str]:
    """A `--dp` launch's environment: CUDA_VISIBLE_DEVICES limited to the first `gpus` of those
    visible (the user's own list, or all), so that DataParallel spreads over exactly that many."""
    env = dict(environ)
    visible = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:
        visible = [str(i) for i in range(torch.cuda.device_count())]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[:gpus])
    return env


def rendezvous_args(environ: Mapping[str, str]) -> list[str]:
    """torchrun's rendezvous options: standalone (any free port) unless MASTER_PORT is set, so that
    two users of one host can each pick a port; then a c10d rendezvous hosted here on
    MASTER_ADDR (default localhost):MASTER_PORT, as scripts/run_local.sh does."""
    text = environ.get("MASTER_PORT", "")
    if not text:
        return ["--standalone"]
    if not (text.isascii() and text.isdigit() and len(text) <= 5 and 1 <= int(text) <= 65535):
        raise ConfigError(
            f"MASTER_PORT={text} is not a port number (1-65535): set a free port, or unset it for any free one"
        )
    # is_host=1: a port taken after the check fails the launch instead of joining another run's store.
    endpoint = f"{environ.get('MASTER_ADDR') or 'localhost'}:{int(text)}"
    return ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-conf=is_host=1"]


def check_port(environ: Mapping[str, str]) -> None:
    """With MASTER_PORT, one line before a launch if the port is taken or MASTER_ADDR is not this host."""
    if environ.get("MASTER_PORT"):
        try:
            rdzv_check.check(environ.get("MASTER_ADDR") or "localhost", int(environ["MASTER_PORT"]), "MASTER_ADDR", 5.0)
        except rdzv_check.CheckFailed as err:
            raise DistqaError(str(err)) from None


def _launch(nproc: int, loop: str, repeat: int, args: Any, out: Path, profile: Path | None = None) -> dict[str, Any]:
    """One torchrun launch of `loop` (trainer, baseline, or dp: the trainer in one process over
    `nproc` GPUs) and its result file; one line on failure or past --timeout. With `profile`, the
    trainer's steps after the warm-up are profiled into that folder (`distqa.bench.profile`)."""
    name = f"np{nproc}-{'profile' if profile else loop}-{repeat}"
    result, log = out / "runs" / f"{name}.json", out / "runs" / f"{name}.log"
    result.unlink(missing_ok=True)
    check_port(os.environ)  # before each launch: the port is this host's, and others may take it meanwhile
    dp = loop == DP
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rendezvous_args(os.environ),
        f"--nproc-per-node={1 if dp else nproc}",
        "-m",
        "distqa.bench.worker",
        f"--loop={'trainer' if dp else loop}",
        *([f"--dp-gpus={nproc}"] if dp else []),
        f"--result={result}",
        f"--output-dir={out / 'runs' / name}",
        f"--warmup={args.warmup}",
        f"--steps={PROFILED_STEPS if profile else args.steps}",
        *([f"--profile-dir={profile}"] if profile else []),
        *([f"--config={args.config}"] if args.config else []),
        *args.overrides,
    ]
    env = dp_env(nproc, os.environ) if dp else worker_env(nproc, os.environ)
    where = next((a.split("=", 1)[1] for a in command if a.startswith("--rdzv-endpoint=")), None)
    at = f", rendezvous at {where}" if where else ""  # the user's MASTER_PORT; torchrun's free port otherwise
    what = f"dp, {nproc} GPU(s) in 1 process" if dp else f"{loop}, {nproc} process(es)"
    print(f"distqa bench: {what}, run {repeat + 1} of {args.repeats}{at}: log in {log}", flush=True)
    with log.open("w") as sink:
        # A session of its own, so that a timeout or Ctrl-C stops torchrun *and* its workers
        # (killing torchrun alone would leave the workers waiting in a collective).
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=args.timeout)
        except BaseException as err:
            _stop(proc)
            if not isinstance(err, subprocess.TimeoutExpired):
                raise
            raise DistqaError(
                f"the {loop} run with {nproc} process(es) took longer than --timeout={args.timeout:g} s "
                f"(a hung collective?) and was stopped; see {log}"
            ) from None
    if code != 0 or not result.is_file():
        raise DistqaError(f"the {loop} run with {nproc} process(es) failed (exit {code}): {_reason(log)}; see {log}")
    return json.loads(result.read_text())


def _checked(args: Any) -> tuple[list[int], Config]:
    """The process counts and the settings, every option checked before anything is launched."""
    nprocs = parse_nproc(args.nproc)
    # Two warm-up steps at least: DDP's first step all-reduces at the end of backward (static
    # graph) and its second re-orders the gradient buckets; neither is the steady state.
    for option, low in (("warmup", 2), ("steps", 1), ("repeats", 1), ("timeout", 1)):
        if getattr(args, option) < low:
            raise ConfigError(f"--{option}={getattr(args, option)} must be >= {low}")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        raise ConfigError(f"--peak-tflops={args.peak_tflops} must be a number > 0")  # nan gave MFU nan, bad JSON
    cfg = load_config(args.config, args.overrides)  # a bad key fails here, before any launch
    rendezvous_args(os.environ)  # and a bad MASTER_PORT
    if args.baseline and cfg.train.parallel != "ddp":
        raise ConfigError(
            f"--baseline is a hand-written DDP loop: it has no train.parallel={cfg.train.parallel} "
            "counterpart; leave --baseline out"
        )
    _check_dp(args, cfg)
    _check_devices(nprocs)
    for nproc in nprocs:  # as each launch's trainer will: the global batch's split, and FSDP's
        dataclasses.replace(cfg.train).resolve_global_batch(nproc)
    return nprocs, cfg


def _check_dp(args: Any, cfg: Config) -> None:
    """`--dp` where its launches can run: on GPUs, beside DDP rows, with settings dp accepts. (A
    bench of train.parallel=dp itself would start N processes of it: that is what --dp is for.)"""
    if cfg.train.parallel == "dp":
        raise ConfigError(
            "train.parallel=dp runs one process, and bench launches N per row: use --dp "
            "(a DataParallel row beside each DDP row) and leave train.parallel at ddp"
        )
    if not getattr(args, "dp", False):
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            "--dp needs GPUs: train.parallel=dp (torch.nn.DataParallel) splits each batch over CUDA "
            "devices, and none is visible here; leave --dp out"
        )
    if cfg.train.parallel != "ddp":
        raise ConfigError(
            f"--dp compares DataParallel with DDP, and this bench has train.parallel={cfg.train.parallel}: "
            "leave --dp out, or train.parallel at ddp"
        )
    load_config(args.config, [*args.overrides, "train.parallel=dp"])  # what dp refuses, before any launch


def _rounds(nprocs: list[int], args: Any, out: Path) -> dict[tuple[int, str], list[dict[str, Any]]]:
    """Every launch's result by (process count, loop), from `--repeats` rounds."""
    chosen = ["trainer", *(["baseline"] if args.baseline else []), *([DP] if getattr(args, "dp", False) else [])]
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {(n, loop): [] for n in nprocs for loop in (*LOOPS, DP)}
    for repeat in range(args.repeats):
        # Round by round, every process count once per round, so that a change of the machine's
        # load lands on all of them rather than on one row (a 1-process run slowed by other load
        # once gave 2 processes a 270 % scaling efficiency). Odd rounds reverse the order of process
        # counts and of the loops: on a shared machine the second of two back-to-back runs is
        # not always as fast as the first, and that must favour no row and no loop.
        order = nprocs if repeat % 2 == 0 else nprocs[::-1]
        loops = chosen if repeat % 2 == 0 else chosen[::-1]
        for nproc in order:
            for loop in loops:
                runs[nproc, loop].append(_launch(nproc, loop, repeat, args, out))
    return runs


def _result(args: Any, cfg: Config, nprocs: list[int], runs: dict[tuple[int, str], list[dict]]) -> dict[str, Any]:
    """bench.json's content: the setting of the first run, then one summarized row per process
    count, and (`--dp`) one `"parallel": "dp"` row per GPU count after them."""
    first = runs[nprocs[0], "trainer"][0]
    rows = [summarize(n, runs[n, "trainer"], runs[n, "baseline"], args.peak_tflops) for n in nprocs]
    rows += [summarize(n, runs[n, DP], [], args.peak_tflops) for n in nprocs if runs[n, DP]]
    result: dict[str, Any] = {
        "command": "distqa bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": first["host"],
        "device": first["device"],
        "torch": first["torch"],
        "task": cfg.task.name,
        "model": cfg.model.name,
        "precision": first["precision"],
        "parallel": first.get("parallel", "ddp"),
        "activation_checkpointing": first.get("activation_checkpointing", False),
        "compile": first["compile"],
        "seq_len": first["seq_len"],
        "batch_size": first["batch_size"],
        # The rows' common value; None where train.global_batch gave each process count its own (in its row).
        "grad_accum": first["grad_accum"] if len({row.get("grad_accum") for row in rows}) == 1 else None,
        "warmup_steps": args.warmup,
        "measured_steps": args.steps,
        "non_embedding_params": first["non_embedding_params"],
        "layers": first["layers"],
        "hidden_size": first["hidden_size"],
        "flops_note": first.get("flops_note"),
        "runs": rows,
    }
    add_scaling(result["runs"])
    result["warnings"] = implausible(result["runs"])
    return result


class _Signalled(BaseException):
    """A SIGTERM or SIGHUP to distqa bench, raised where it waits: the launch, in a session of its
    own, is stopped on the way out (`_launch`). Without it the bench ended alone and its launch
    trained on, orphaned (a review: a BERT-base launch grew to 23 GB until the kernel killed it)."""


@contextlib.contextmanager
def _launches_stopped_on_signals(out: Path, written: list[Path]) -> Any:
    def handler(signum: int, _frame: Any) -> None:
        raise _Signalled(signum)

    if threading.current_thread() is not threading.main_thread():  # (signal handlers are the main thread's)
        yield
        return
    # (One ignored stays ignored: under nohup a hang-up must not stop the bench.)
    ignored = [sig for sig in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(sig) is signal.SIG_IGN]
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP) if sig not in ignored}
    try:
        yield
    except _Signalled as stopped:
        name = signal.Signals(stopped.args[0]).name
        # (--profile's launches come after bench.json: then it is there, whole.)
        wrote = f"{written[0]} written" if written else "no bench.json written"
        err = DistqaError(f"bench stopped by {name}, its launch with it: {wrote} (logs in {out}/runs)")
        err.exit_code = 128 + stopped.args[0]
        raise err from None
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


def run_bench(args: Any) -> dict[str, Any]:
    written: list[Path] = []
    with _launches_stopped_on_signals(Path(args.output), written):
        return _run_bench(args, written)


def _run_bench(args: Any, written: list[Path]) -> dict[str, Any]:
    nprocs, cfg = _checked(args)
    out = Path(args.output)
    try:
        (out / "runs").mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DistqaError(f"--output {out} cannot be created: {err.strerror or err}") from err
    result = _result(args, cfg, nprocs, _rounds(nprocs, args, out))
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "bench.png")
    written.append(out / "bench.json")
    for nproc in nprocs if getattr(args, "profile", False) else []:
        _launch(nproc, "trainer", 0, args, out, profile=out / f"profile-np{nproc}")
        print(f"distqa bench: profile of {nproc} process(es) in {out / f'profile-np{nproc}'}", flush=True)
    return result


def print_table(result: dict[str, Any]) -> None:
    """The rows on stdout (`--dp`'s after DDP's, `mode` dp), then each implausible figure's warning on stderr."""
    dp = any(r.get("parallel") == DP for r in result["runs"])
    modes = f"{result.get('parallel', 'ddp')}{' and dp' if dp else ''}"
    print(f"{result['device']}, {result['model']}, {modes}, {result['precision']}, seq {result['seq_len']}")
    if result["flops_note"]:
        print(f"no FLOPs or MFU: {result['flops_note']}")
    print(
        f"{'nproc':>5} {'mode':>4} {'samples/s':>10} {'min..max':>15} {'spread':>7} {'tokens/s':>10} {'scaling':>8} "
        f"{'data%':>6} {'MFU':>6} {'vs loop':>8} {'state MiB/rank':>15}" + (f" {'vs ddp':>7}" if dp else "")
    )
    for r in result["runs"]:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        ratio = f"{r['trainer_over_baseline']:.3f}" if "trainer_over_baseline" in r else "-"
        s = r["samples_per_s_spread"]
        span = f"{s['min']:.1f}..{s['max']:.1f}"
        relative = f"{100 * s['relative']:.1f}%" if s["relative"] is not None else "-"  # one repeat: unknown
        state = f"{r['state_mib_per_rank']:.1f}" if r.get("state_mib_per_rank") is not None else "-"
        versus = (f" {r['dp_over_ddp']:>7.3f}" if "dp_over_ddp" in r else f" {'-':>7}") if dp else ""
        print(
            f"{r['nproc']:>5} {r.get('parallel', 'ddp'):>4} {r['samples_per_s']:>10.1f} {span:>15} {relative:>7} "
            f"{r['tokens_per_s']:>10.0f} {100 * r['scaling_efficiency']:>7.1f}% "
            f"{r['step_breakdown_pct']['data']:>5.1f}% {mfu:>6} {ratio:>8} {state:>15}{versus}"
        )
    repeats = len(result["runs"][0]["repeats"])
    print(f"samples/s: median of {repeats} run(s) per process count; spread = (max - min) / median")
    if dp:
        print(
            "dp rows: one process, torch.nn.DataParallel over nproc GPUs, train.batch_size x nproc per step "
            "(the same per GPU as DDP's); scaling against dp's own smallest row; vs ddp: samples/s over DDP's"
        )
    for line in result["warnings"]:
        print(line, file=sys.stderr)
