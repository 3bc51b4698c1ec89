"""The one exception type that means "the user asked for something we cannot do".

Everything raised as a `DistqaError` is reported by the CLI as a single line naming the problem
and what to do about it, with a non-zero exit and no traceback (set `DISTQA_DEBUG=1` to see one).
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class DistqaError(Exception):
    """A problem with the user's input or environment, reported as one clear line."""

    exit_code = 2


class Preempted(DistqaError):
    """The run was asked to stop (SIGTERM) and saved a checkpoint: not a failure of the run.

    Exit status 143 (128 + SIGTERM), the conventional "terminated" status, so that platforms
    retry or reschedule the job rather than mark it as succeeded."""

    exit_code = 143


class PeerLost(DistqaError):
    """Another process of the run is gone (killed, or its node lost): the expected end of a restart
    round, which torchrun restarts while `--max-restarts` allows (distqa.rounds)."""

    exit_code = 1


class ConfigError(DistqaError):
    """An unknown configuration key, a value of the wrong type, or a value out of range."""


class EvaluationFailed(DistqaError):
    """The task's evaluation raised (on any rank): every rank stops with this line, after the
    step's checkpoint is written, so no trained step is lost to a bug in the metric code."""
