#!/usr/bin/env bash
# The GPU acceptance suite (tests/test_gpu.py, test_gpu_dp.py, test_gpu_nq.py; marker gpu) on a machine that has a GPU, torch and
# pytest but not this repository's .venv, and no package index: a lent GPU machine. Run it from
# anywhere in the checkout:
#
#     bash scripts/gpu_check.sh [PYTEST_ARGS...]     (e.g. -k sigterm: one test again)
#
# The packages that machine lacks travel as wheels in WHEELS (default .whl/, ignored by git; how
# to fetch them: the comment at the end of this file) are installed into SITE, then
# PYTHONPATH=SITE:src, so distqa runs from the checkout with no install. Writes, under $OUT when
# set (else results/gpu/): gpu_tests.log (pytest's output) and gpu_figures.json (the versions, the
# GPU, each test's outcome and the figures the tests recorded: differences against their
# tolerances, compile time, peak memory). Exits with pytest's status (0 when every test passed or
# was skipped, e.g. without a GPU).
#
#   PYTHON       interpreter with torch (default: python3)
#   WHEELS       folder of wheels to install first (default: .whl; empty: install nothing)
#   SITE         where they go (default: /tmp/site)
#   GPU_WORKERS  pytest-xdist workers on a GPU: groups of launches side by side (default: 5)
#   TIMEOUT      seconds per test, where pytest-timeout is installed (default: 300)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS-.whl}
SITE=${SITE:-/tmp/site}
DEST=${OUT:-results/gpu}
mkdir -p "$DEST"
LOG=$DEST/gpu_tests.log
FIGURES=$DEST/gpu_figures.json
rm -f "$FIGURES" # an earlier run's counts must not stand for this one's, should this one be killed
RAW=$(mktemp -d)
trap 'rm -rf "$RAW"' EXIT

if [[ -n $WHEELS ]] && compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DISTQA_GPU_FIGURES=$RAW/figures.json

# What the suite runs on, first in the log: a failure further down often reads differently
# once the versions are known. Written to a file, not stdout: a library that prints on import
# (huggingface_hub's "Error importing ..." without httpx) made stdout no JSON, and the summary below
# then lost the figures (a review).
: > "$LOG"
"$PYTHON" - "$RAW/env.json" >> "$LOG" 2>&1 <<'EOF' || { cat "$LOG"; exit 1; }
import importlib, json, platform, sys
import torch
env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
for name in ("transformers", "tokenizers", "datasets", "omegaconf", "pyarrow", "numpy", "distqa"):
    try:
        module = importlib.import_module(name)
        env[name] = getattr(module, "__version__", "?") + f" ({module.__file__})"
    except Exception as err:  # a missing wheel shows here, before forty tracebacks below
        env[name] = f"cannot import: {type(err).__name__}: {err}"
with open(sys.argv[1], "w") as out:
    json.dump(env, out, indent=2)
EOF
tee -a "$LOG" < "$RAW/env.json"
echo >> "$LOG"
# The count is the last line: anything a library printed on import comes before it.
gpus=$("$PYTHON" -c 'import torch; print(); print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>> "$LOG" | tail -n 1)
[[ $gpus =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: torch gave no GPU count ('$gpus'; the log: $LOG)" >&2; exit 1; }
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG" || true
fi

args=(-m gpu -p no:cacheprovider -rA -v --junitxml="$RAW/junit.xml" tests/test_gpu.py tests/test_gpu_dp.py tests/test_gpu_nq.py "$@")
if "$PYTHON" -c 'import pytest_timeout' 2> /dev/null; then
  args+=(--timeout "${TIMEOUT:-300}")
fi
# Side by side only with a GPU: without one every test skips at once, and xdist's lines would
# leave out each skip's reason.
if [[ $gpus -gt 0 ]] && "$PYTHON" -c 'import xdist' 2> /dev/null; then
  args+=(-n "${GPU_WORKERS:-5}" --dist loadgroup)
fi
echo "+ $PYTHON -m pytest ${args[*]}" | tee -a "$LOG"
status=0
# tee ignores the SIGINT a time box sends the whole group: pytest stops on it and writes its summary
# and junit file, which a killed tee would cut off (and pytest's status with it: 1, not 2).
"$PYTHON" -m pytest "${args[@]}" 2>&1 | (trap '' INT TERM && exec tee -a "$LOG") || status=${PIPESTATUS[0]}

"$PYTHON" - "$RAW" "$FIGURES" "$status" "$LOG" <<'EOF'
import json, re, sys
import xml.etree.ElementTree as ET
from pathlib import Path
raw, figures, status, log = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])


def environment(path):
    """The versions, or why they are missing: the tests' outcomes and figures are written either way."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return {"unreadable": f"{path.name}: {type(err).__name__}: {err}"}


outcomes = {}
if (raw / "junit.xml").is_file():
    for case in ET.parse(raw / "junit.xml").iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        if not case.get("name"):  # an interrupted run's nameless case is none; a file that failed to collect is one
            if "error" in kinds:
                outcomes[f"collecting {case.get('classname') or 'a test file'}"] = {"outcome": "error", "seconds": 0.0}
            continue
        outcomes[case.get("name")] = {"outcome": kinds[0] if kinds else "passed", "seconds": float(case.get("time", 0))}
# How many tests the run selected, from pytest's own line: those without an outcome never ended.
text = log.read_text(errors="replace")
workers = re.search(r"\bworkers? \[(\d+) items?\]", text)
collected = re.search(r"collected (\d+) items?(?: / (\d+) deselected)?(?: / (\d+) selected)?", text)
if workers:
    expected = int(workers.group(1))
elif collected:
    expected = int(collected.group(3)) if collected.group(3) else int(collected.group(1)) - int(collected.group(2) or 0)
else:
    expected = None
# pytest's 2 is an interrupt (the box ran out) or a file that failed to collect (a missing wheel, say).
collecting = re.search(r"Interrupted: (\d+) errors? during collection", text)
result = {
    "pytest_exit_status": status,
    "expected": expected,
    "collection_errors": int(collecting.group(1)) if collecting else 0,
    "cut_short": not collecting and (status == 2 or (expected is not None and len(outcomes) < expected)),
    "environment": environment(raw / "env.json"),
    "tests": outcomes,
    "figures": json.loads((raw / "figures.json").read_text()) if (raw / "figures.json").is_file() else {},
}
figures.write_text(json.dumps(result, indent=2) + "\n")
print(f"figures: {figures}")
EOF
echo "log: $LOG; pytest exit status $status"
exit "$status"

# The wheels, fetched once where pip's index is reachable (Python 3.12, x86-64), for a machine
# that has torch, tokenizers, safetensors, pyarrow, numpy, pandas, fsspec, huggingface_hub and the
# test tools but not the rest of requirements.txt:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl transformers==5.23.0 datasets==5.2.0 omegaconf==2.4.0 dill==0.4.1 multiprocess==0.70.19 \
#     regex==2026.11.19 fsspec==2026.9.0
# (fsspec: datasets 5.2 wants <= 2026.9.0.) With these the suite ran on an H100 on 2026-11-27,
# beside that machine's torch 2.11.0, tokenizers 0.23.2, huggingface_hub 1.33.0 and pyarrow 25.0.1.
