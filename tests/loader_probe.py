"""A loader worker_init_fn for tests/test_reliability_promises.py that sends torchrun's stop (SIGTERM
to the training process's group) from inside each worker as it starts. A module of its own:
DataLoader workers start from a fork server and import what they run by name."""

from __future__ import annotations

import os
import signal

from distqa.worker_signals import loader_worker_init

GROUP_ENV = "DISTQA_TEST_TRAINING_PGID"


def group_sigterm_init(worker_id: int) -> None:
    os.killpg(int(os.environ[GROUP_ENV]), signal.SIGTERM)  # torchrun's stop, while the loader starts
    loader_worker_init(worker_id)
