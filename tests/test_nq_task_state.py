"""NQ's thresholds travel in each checkpoint (Task.state_dict): a resumed run, or `distqa export`
of an earlier checkpoint (the best one), exports the thresholds chosen with those weights."""

from __future__ import annotations

import json
import math

from distqa.nq.task import NQTask
from distqa.registry import load_config


def test_thresholds_survive_the_checkpoint_s_strict_json():
    task = NQTask(load_config(None, ["model.name=tiny"]))
    assert task.state_dict() == {}  # nothing evaluated yet: nothing to carry
    task.thresholds = {"long": math.inf, "short": -1.5}
    text = json.dumps(task.state_dict(), allow_nan=False)  # what trainer_state.json can hold
    resumed = NQTask(load_config(None, ["model.name=tiny"]))
    resumed.load_state_dict(json.loads(text))
    assert resumed.thresholds == {"long": math.inf, "short": -1.5}
    resumed.load_state_dict({})  # a checkpoint from before: the thresholds stay as they are
    assert resumed.thresholds == {"long": math.inf, "short": -1.5}
