"""Where the answer thresholds chosen on data.valid travel with the exported model.

A leaf module (no torch): the task writes the file (`NQTask.save_model`) and `distqa predict` reads it, and
neither imports the other.

The file, and the task state each checkpoint carries, is one JSON object: `{"long": 1.25, "short": null,
"step": 10, "precision": "bf16"}`. A threshold is a finite number, or null for +inf ("never answer");
`step` is the optimizer step whose weights the thresholds were chosen on, `precision` the
train.precision the validation scores were computed in, which `distqa predict` computes its scores in
too (both absent in files and checkpoints of an older distqa).
Thresholds belong to the weights they were chosen on: with another step's weights they are a plausible,
wrong setting (for example, "never answer" from step 10 emptied a submission of step 15's weights).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple

from distqa.errors import DistqaError
from distqa.task_settings import unique_keys

THRESHOLDS_FILE = "distqa_thresholds.json"
KINDS = ("long", "short")
STEP_KEY, PRECISION_KEY = "step", "precision"
PRECISIONS = ("fp32", "bf16", "fp16")  # train.precision's values


class Chosen(NamedTuple):
    """Thresholds, and what they were chosen with when recorded (None: an older distqa's file)."""

    thresholds: dict[str, float]
    step: int | None = None
    precision: str | None = None


def to_json_values(
    thresholds: dict[str, float], step: int | None = None, precision: str | None = None
) -> dict[str, float | int | str | None]:
    """The thresholds as JSON can hold them: +inf ("never answer") as null (JSON has no Infinity),
    and the step and the precision they were chosen at when they are known."""
    values: dict[str, float | int | str | None] = {
        kind: None if thresholds[kind] == math.inf else thresholds[kind] for kind in KINDS
    }
    if step is not None:
        values[STEP_KEY] = step
    if precision is not None:
        values[PRECISION_KEY] = precision
    return values


def _threshold(kind: str, value: Any) -> float:
    if value is None:
        return math.inf
    # bool is an int to Python: `true` would be read as 1.0.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{kind} is {json.dumps(value)}, not a number or null")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float's range
        number = math.nan
    # +inf: files before null meant "never" wrote it as `Infinity`, which Python's json reads.
    # NaN or -inf would silently empty (or fill) every answer of that kind.
    if not (math.isfinite(number) or number == math.inf):
        raise ValueError(f"{kind} is {value}, not a finite number or null")
    return number


def from_json_values(raw: Any) -> Chosen:
    """`to_json_values` undone, strictly. ValueError naming the problem for anything else: a
    misspelt or missing key would otherwise be ignored, and that kind answered always."""
    if not isinstance(raw, dict):
        raise ValueError(f"a JSON {type(raw).__name__}, not an object with keys {', '.join(KINDS)}")
    unknown = sorted(str(key) for key in raw if key not in (*KINDS, STEP_KEY, PRECISION_KEY))
    missing = [kind for kind in KINDS if kind not in raw]
    if unknown or missing:
        parts = ([f"unknown key(s) {', '.join(unknown)}"] if unknown else []) + (
            [f"no {' or '.join(missing)}"] if missing else []
        )
        raise ValueError(f"{'; '.join(parts)} (the keys are {', '.join(KINDS)}, {STEP_KEY} and {PRECISION_KEY})")
    step = raw.get(STEP_KEY)
    if STEP_KEY in raw and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"{STEP_KEY} is {json.dumps(step)}, not a step number")
    precision = raw.get(PRECISION_KEY)
    if PRECISION_KEY in raw and precision not in PRECISIONS:
        raise ValueError(f"{PRECISION_KEY} is {json.dumps(precision)}, not one of {', '.join(PRECISIONS)}")
    return Chosen({kind: _threshold(kind, raw[kind]) for kind in KINDS}, step, precision)


def thresholds_json(thresholds: dict[str, float], step: int | None = None, precision: str | None = None) -> str:
    """The text of distqa_thresholds.json. A threshold of +inf means "never answer" (no score is
    above it; the choice when answering lowers F1) and is written as null: JSON has no Infinity,
    and strict parsers (JavaScript's, jq, Go's) reject the `Infinity` Python writes by default.
    Thresholds are otherwise finite (between two finite scores), so allow_nan=False only guards
    against writing invalid JSON."""
    return json.dumps(to_json_values(thresholds, step, precision), indent=2, allow_nan=False) + "\n"


def read_chosen(path: Path) -> Chosen:
    """distqa_thresholds.json as `thresholds_json` writes it (null: never answer), or as exports
    before it did (`Infinity`, no step, no precision)."""
    try:
        return from_json_values(json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys))
    # Not JSON (JSONDecodeError, UnicodeDecodeError; RecursionError: nested too deep), or not thresholds;
    # OSError: not a file (a folder, a broken link).
    except (OSError, ValueError, RecursionError) as err:
        raise DistqaError(
            f"{path} is not a thresholds file ({str(err).splitlines()[0]}): export the model again, or remove "
            "it to give every example its best answer"
        ) from None
