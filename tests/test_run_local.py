"""scripts/run_local.sh (what `make train` runs) checks the settings once before torchrun starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

RUN_LOCAL = ROOT / "scripts" / "run_local.sh"


def run_local(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """run_local.sh with a stand-in torchrun first on PATH that records that it was started."""
    fake = tmp_path / "bin" / "torchrun"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/torchrun-args.txt"\n')
    fake.chmod(0o755)
    env = {
        "PATH": os.pathsep.join([str(fake.parent), str(Path(sys.executable).parent), "/usr/bin", "/bin"]),
        "HOME": str(tmp_path),
        "NPROC_PER_NODE": "2",
        # The distqa under test (a checkout's src/ may come before the installed one).
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
    }
    return subprocess.run(
        ["bash", str(RUN_LOCAL), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_a_bad_key_is_one_line_and_torchrun_never_starts(tmp_path):
    proc = run_local(tmp_path, "--config", "configs/quickstart.yaml", "train.batchsize=4")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "distqa: error: unknown config key 'train.batchsize' in the command line (did you mean train.batch_size?)"
    ]
    assert not (tmp_path / "torchrun-args.txt").exists()


def test_good_settings_start_torchrun_with_them(tmp_path):
    proc = run_local(tmp_path, "--config", "configs/quickstart.yaml", "train.lr=1e-4")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "torchrun-args.txt").read_text().split() == [
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "distqa",
        "train",
        "--config",
        "configs/quickstart.yaml",
        "train.lr=1e-4",
    ]


def test_the_check_imports_no_torch():
    """The check runs before every launch: importing torch would cost seconds each time."""
    code = (
        "import sys\n"
        "from distqa.cli import main\n"
        "rc = main(['train', '--check-config', '--config', 'configs/quickstart.yaml', 'train.lr=1e-4'])\n"
        "print(rc, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0 []"
