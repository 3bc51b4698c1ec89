"""`python -m distqa.torchrun ARGS`: torchrun itself (the same function, in this process), without
its failure report once distqa has said why the run stopped. scripts/worker.sh and
scripts/run_local.sh start torchrun this way.

When a worker fails, torchrun ends with a traceback of its own and a "Failures:" box after the
workers' output, so the last thing a user reads is a report of exit codes, not distqa's one line
saying what to do. Here torchrun runs unchanged (its arguments, signal handling, rendezvous and
exit status are torchrun's), and only at its end is its exception judged by what the workers wrote
to the node's file (distqa.outcome, `DISTQA_ERROR_FILE`, made here when no launcher set one):

- every local rank finished: the run completed, and a SIGTERM that reached torchrun after that
  is no failure: exit 0, silently;
- every failed rank wrote its own error line, or the preempted line: distqa has said it; torchrun's
  report is left out (with its "failed (exitcode ...)" and "Sending process ... closing signal"
  log lines). The exit status is torchrun's (1) after an error; after a stop every rank
  checkpointed (the preempted line, no error), the stop's own as in scripts/worker.sh: 143, or
  128+N when signal N reached torchrun itself (130 for Ctrl-C), so that scripts/run_local.sh,
  which execs this, tells a preemption from a failure as worker.sh does;
- a signal that reached torchrun before any rank began to train (none wrote `distqa: training:`):
  nothing was lost; the signal's status, 128+N, and one line saying so;
- otherwise (a crash: a worker that wrote nothing): torchrun's report, as ever.

One more traceback of torchrun's is a race of its own (pytorch/pytorch#69520): after the workers of
every node finished, torchrun's agents meet in an exit barrier on the store that node 0's agent
hosts, and node 0 may exit the moment the barrier completes, before the last node's final request
is answered. That node then logs "Error waiting on exit barrier" with a connection traceback and
exits 0 all the same (seen once in `make test-nodes`). It is one line here.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from distqa import outcome
from distqa.parent_watch import AGENT_ENV

# torchrun's own log records that belong to its failure report.
_REPORT_RECORDS = ("failed (exitcode", "Sending process")


class _QuietOnceExplained(logging.Filter):
    """Drops torchrun's failure log lines while the node's file holds an error line, or the
    preempted line for a worker that ended with its status (143): they would come after distqa's
    own line and say only which exit codes the workers had. (The preempted case shows on a node
    whose workers stopped for another node's SIGTERM: its torchrun saw them fail, not a signal.)"""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(_REPORT_RECORDS):
            return True
        said = outcome.read(self.path)
        if said.error_ranks:
            return False
        if not said.preempted:
            return True
        # Another exit code beside the preemption is a crash of its own: its line stays.
        code = re.match(r"failed \(exitcode: (-?\d+)\)", record.getMessage())
        return code is not None and int(code.group(1)) != 143


class _ExitBarrierNote(logging.Filter):
    """Turns torchrun's "Error waiting on exit barrier" traceback into one line when the cause is a
    lost connection to the store. The agent enters that barrier only once every worker of its node
    has finished, so this node's outcome is whole; the store's host says in its own log how it
    ended. Another cause (a node that never came: a timeout) keeps torchrun's record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Error waiting on exit barrier"):
            return True
        from torch.distributed import DistNetworkError  # imported by torchrun long before

        if not (record.exc_info and isinstance(record.exc_info[1], DistNetworkError)):
            return True
        print(
            "distqa: the master node's store closed during torchrun's exit barrier (its wait for the "
            "other nodes at the end); every worker of this node had finished, and the master's own "
            "log says how it ended",
            file=sys.stderr,
            flush=True,
        )
        return False


def _failures(err: BaseException) -> dict[int, int] | None:
    """{global rank: exit code} of a ChildFailedError; None for another exception (a signal)."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict):
        return None
    return {int(rank): int(getattr(failure, "exitcode", 1)) for rank, failure in failures.items()}


def rendezvous_failure(err: BaseException) -> str:
    """One line for a rendezvous that never completed: a node missing (the master's store waits for
    clients that do not come), or two nodes with one NODE_RANK (each waits for the other's keys)."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return (
        f"the nodes did not all meet in torchrun's rendezvous ({first}): start every node, each with its "
        "own NODE_RANK from 0 to NNODES-1, within RDZV_TIMEOUT of each other and pointed at node 0's "
        "MASTER_ADDR:MASTER_PORT"
    )


def store_lost(err: BaseException) -> str:
    """One line for torchrun's store lost mid-run: node 0, whose agent hosts it, is gone."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return (
        f"the connection to torchrun's rendezvous store on node 0 (MASTER_ADDR) failed ({first}): node 0 is gone, "
        "and no new round can start without it, so this node stops too; start node 0 again, then the other nodes, "
        "to resume from the newest checkpoint"
    )


def _explained_status(err: BaseException, said: outcome.Outcome) -> int:
    """The exit status of a stop distqa explained: torchrun's 1 when a rank wrote an error; else
    every rank checkpointed on the signal, and the status is the signal's, as a shell gives it."""
    if said.error_ranks or not said.preempted:
        return 1
    return 128 + _signal_of(err)  # without a signal of torchrun's own, the ranks' own exit: 143


def _signal_of(err: BaseException) -> int:
    """The signal torchrun itself received (a SignalException's), else SIGTERM (the ranks')."""
    sigval = getattr(err, "sigval", None)
    return int(sigval) if sigval is not None else int(signal.SIGTERM)


def _stopped_before_training(err: BaseException, *, say: bool) -> int:
    """A signal reached torchrun before any rank wrote `distqa: training:`: every rank was still
    loading (its SIGTERM handler not yet installed), so the signal ended it and nothing was lost.
    torchrun's answer is its SignalException's traceback; here it is a stop's status, 128+N as a
    shell gives it, and one line, unless a launcher that reads the node's file (worker.sh) says it."""
    sigval = _signal_of(err)
    name = signal.Signals(sigval).name
    _end_workers_left()
    outcome.stopped_before_training(name)  # for worker.sh, which may not have sent it (a kill of torchrun)
    if say:
        print(f"distqa: stopped by {name} before training started: nothing to checkpoint", file=sys.stderr, flush=True)
    return 128 + sigval


def _end_workers_left(wait_s: float = 5.0) -> None:
    """Stop the workers torchrun started but did not stop. A signal that came while it was still
    starting them (its agent held no record of them yet) left them running; each then found its
    agent gone and said so after this process's last line, in about 1 of 4 stops of a test launch.
    This process started them (it runs torchrun's agent), each in a session of its own."""
    me = os.getpid()
    try:
        left = [int(pid) for task in os.listdir(f"/proc/{me}/task") for pid in _children(me, task)]
    except OSError:
        return
    for pid in left:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)  # still loading: nothing of theirs to checkpoint
    deadline = time.monotonic() + wait_s
    for pid in left:
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:  # reaped already (torchrun's own record of it)
                break
            time.sleep(0.02)


def _children(pid: int, task: str) -> list[str]:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/task/{task}/children").read_text().split()
    return []


def main(argv: list[str]) -> int:
    from torch.distributed import DistStoreError
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.run import main as torchrun_main

    sys.argv[0] = "torchrun"  # its usage and error messages name the command users know
    # Given back at the end: an in-process caller's later launches must not inherit this run's file
    # (a test's did: the next run_local.sh took it for a launcher's and printed no line of its own).
    saved = {name: os.environ.get(name) for name in ("DISTQA_ERROR_FILE", AGENT_ENV)}
    made = None
    if not os.environ.get("DISTQA_ERROR_FILE"):
        try:
            fd, made = tempfile.mkstemp(prefix="distqa-outcome.", suffix=".txt")
        except OSError:  # no writable temp folder: plain torchrun, report and all
            torchrun_main(argv)
            return 0
        os.close(fd)
        os.environ["DISTQA_ERROR_FILE"] = made  # the workers inherit it
    path = Path(os.environ["DISTQA_ERROR_FILE"])
    os.environ[AGENT_ENV] = str(os.getpid())  # the workers' watch of this process (distqa.parent_watch)
    quiet = (logging.getLogger("torch.distributed.elastic.multiprocessing.api"), _QuietOnceExplained(path))
    note = (logging.getLogger("torch.distributed.elastic.agent.server.api"), _ExitBarrierNote())
    for logger, log_filter in (quiet, note):
        logger.addFilter(log_filter)
    agent, start_workers = SimpleElasticAgent, SimpleElasticAgent._initialize_workers
    rounds = itertools.count()

    def marked(self: Any, worker_group: Any) -> None:
        outcome.new_round(next(rounds))  # the lines after it are this worker group's (outcome.this_round)
        start_workers(self, worker_group)

    agent._initialize_workers = marked  # type: ignore[method-assign]
    try:
        torchrun_main(argv)
        return 0
    except (DistStoreError, RendezvousTimeoutError) as err:
        # The nodes never all met: torchrun's answer is a traceback of its store's internals.
        print(f"distqa: error: {rendezvous_failure(err)}", file=sys.stderr, flush=True)
        return 1
    except RendezvousConnectionError as err:
        # Node 0's agent, which hosts the store, is gone (its node lost): this node's workers have
        # stopped, each saying so, and no round can start without the store. torchrun's answer is
        # 70 lines ending in a traceback; the ranks' own line spoke of a next round (found by a review).
        print(f"distqa: error: {store_lost(err)}", file=sys.stderr, flush=True)
        return 1
    except (ChildFailedError, SignalException) as err:
        said = outcome.read(path)
        if said.all_finished:
            return 0
        failures = _failures(err)
        if failures is None and not (said.error_ranks or said.preempted or said.training):
            return _stopped_before_training(err, say=made is not None)
        if failures is None and said.preempted or failures is not None and said.explains(failures):
            return _explained_status(err, said)
        raise
    finally:
        agent._initialize_workers = start_workers  # type: ignore[method-assign]
        for logger, log_filter in (quiet, note):
            logger.removeFilter(log_filter)
        if made is not None:
            with contextlib.suppress(OSError):
                os.unlink(made)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


if __name__ == "__main__":
    from distqa.console import outlive_closed_output

    outlive_closed_output()  # its workers go on when the tee or terminal showing them is gone
    code = main(sys.argv[1:])
    # torchrun has imported torch, and the interpreter's teardown walks every object of it: about
    # 2 s on a busy CPU, after the workers are gone. On a `docker stop` that is time out of the
    # platform's grace period (Docker's 10 s), so the final collections skip them (as distqa's own).
    gc.freeze()
    raise SystemExit(code)
