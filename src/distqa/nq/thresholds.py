"""Where the answer thresholds chosen on data.valid travel with the exported model.

A leaf module (no torch): the task writes the file (`NQTask.save_model`) and `distqa predict` reads it, and
neither imports the other.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from distqa.errors import DistqaError

THRESHOLDS_FILE = "distqa_thresholds.json"


def to_json_values(thresholds: dict[str, float]) -> dict[str, float | None]:
    """The thresholds as JSON can hold them: +inf ("never answer") as null (JSON has no Infinity)."""
    return {kind: None if value == math.inf else value for kind, value in thresholds.items()}


def from_json_values(raw: dict[str, float | None]) -> dict[str, float]:
    """`to_json_values` undone: null is +inf again."""
    return {str(kind): math.inf if value is None else float(value) for kind, value in raw.items()}


def thresholds_json(thresholds: dict[str, float]) -> str:
    """The text of distqa_thresholds.json. A threshold of +inf means "never answer" (no score is
    above it; the choice when answering lowers F1) and is written as null: JSON has no Infinity,
    and strict parsers (JavaScript's, jq, Go's) reject the `Infinity` Python writes by default.
    Thresholds are otherwise finite (halfway between two finite scores), so allow_nan=False only
    guards against writing invalid JSON."""
    return json.dumps(to_json_values(thresholds), indent=2, allow_nan=False) + "\n"


def read_thresholds(path: Path) -> dict[str, float]:
    """distqa_thresholds.json as `thresholds_json` writes it (null: never answer), or as exports
    before it did (`Infinity`, which Python's json still reads)."""
    try:
        return from_json_values(json.loads(path.read_text()))
    except (ValueError, TypeError, AttributeError) as err:  # not JSON, not an object, not numbers
        raise DistqaError(
            f"{path} is not a thresholds file ({err}): export the model again, or remove it to give "
            "every example its best answer"
        ) from None
