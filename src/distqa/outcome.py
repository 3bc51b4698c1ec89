"""How each process of a node ended, said once per node: one file per node that every rank appends
its last line to, under a lock.

Under torchrun every rank of a node meets the same mistake (a batch larger than the data, a
missing file) and would print the same line, once per process. Each rank appends its line to the
node's file instead, and prints it only when no rank of the node printed the same message before:
identical lines appear once per node, a different error on one rank still appears.

The file is the launcher's when it set `DISTQA_ERROR_FILE` (scripts/worker.sh, `python -m
distqa.torchrun`): the launcher reads it after torchrun ends, to leave out torchrun's own failure
report when distqa explained the failure, and to tell a finished run from a failed one when a
SIGTERM arrived after the last step (every rank appends `distqa: finished: ...` when `train`
returned). Without a launcher the file is one under the temp folder, named after this torchrun
(its run id, restart round and process), used for the deduplication only.

Lines, one per rank and event (and `# printed: ...` for what this node printed):
    distqa: round: K                     (the agent, `distqa.torchrun`: a worker group starts)
    distqa [rank R]: error: MESSAGE      (`distqa: error: ...` for a single process)
    distqa: preempted: MESSAGE
    distqa: finished: local rank L of N
    distqa: training: local rank L of N  (SIGTERM from here on means a checkpoint)
    distqa: stopped before training: SIGNAL  (`distqa.torchrun`: a signal before any rank trained)

A launcher's file outlives torchrun's restart rounds, so only the last round's lines say how the
run ended (`this_round`): an earlier round's preempted line (a node joining makes every rank
checkpoint) beside a later round's error made worker.sh report the failure as a preemption, 143.
The agent marks each round, a node's joining included (torch's TORCHELASTIC_RESTART_COUNT does
not count that one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from distqa.runlock import process_start

ERROR = re.compile(r"^distqa(?: \[rank (\d+)\])?: error: (.*)$")
PREEMPTED = "distqa: preempted: "
FINISHED = re.compile(r"^distqa: finished: local rank (\d+) of (\d+)$")
TRAINING = "distqa: training: "
# Written by `distqa.torchrun` when a signal reached it before any rank began to train (the
# signal's name follows): the launcher above it (worker.sh) says so, however the signal came.
STOPPED_EARLY = "distqa: stopped before training: "
ROUND = re.compile(r"^distqa: round: \d+$")
# Marks a message printed on this node (a rank that does not show its line, as a lost peer's other
# local ranks, still writes it, and must not keep local rank 0 from printing it). Readers skip it.
PRINTED = "# printed: "


def launcher_file() -> Path | None:
    """The file a launcher asked for (and reads after torchrun ends), if any."""
    path = os.environ.get("DISTQA_ERROR_FILE")
    return Path(path) if path else None


def _node_file() -> Path | None:
    """The launcher's file; else, under torchrun, one per torchrun process and restart round (the
    parent of every local rank is that torchrun); else none (a single process has no one to meet)."""
    path = launcher_file()
    if path is not None or "TORCHELASTIC_RUN_ID" not in os.environ:
        return path
    agent = os.getppid()
    started = process_start(agent) or ""  # a later process with a reused pid gets another file
    key = "|".join([os.environ["TORCHELASTIC_RUN_ID"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), str(agent)])
    digest = hashlib.sha256(f"{key}|{started}".encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir())
    _forget_old(folder)
    return folder / f"distqa-node-{os.getuid()}-{digest}.txt"


def _forget_old(folder: Path, age_s: float = 86400) -> None:
    """Nobody knows when the last rank of a torchrun is done with its file: files of this user's
    runs a day old go when a later run has something to say."""
    now = time.time()
    for old in folder.glob(f"distqa-node-{os.getuid()}-*.txt"):
        with contextlib.suppress(OSError):
            if now - old.lstat().st_mtime > age_s:
                old.unlink()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[IO[str]]:
    """`path` opened for reading and appending, held under an exclusive lock. Never through a
    symlink, and only a file of this user: the temp folder is shared."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "r+") as f:
        if os.fstat(fd).st_uid != os.getuid():
            raise OSError(f"{path} belongs to another user")
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the file is closed
        f.seek(0)
        yield f


def _message(line: str) -> str:
    """What two ranks' lines say, without the rank that said it."""
    found = ERROR.match(line)
    return f"error: {found.group(2)}" if found else line


def report(line: str, *, show: bool = True) -> None:
    """Append `line` to the node's file; print it (`show`) unless a rank of this node printed the
    same message already. Printed under the lock, in one write: ranks never interleave a line."""
    path, printed = _node_file(), False
    if path is not None:
        try:
            with _locked(path) as f:
                earlier_lines = this_round(f.read().splitlines())
                shown = {earlier[len(PRINTED) :] for earlier in earlier_lines if earlier.startswith(PRINTED)}
                if show and _message(line) in shown:
                    show = False  # a rank of this node printed it
                elif show:
                    _print(line)
                    printed = True
                    f.write(f"{PRINTED}{_message(line)}\n")
                f.write(line + "\n")
        except OSError:
            pass  # the file is a convenience; the message is not
    if show and not printed:
        _print(line)


_said: set[str] = set()


def this_round(lines: list[str]) -> list[str]:
    """The lines of the last restart round: after the agent's last `round` line (all of them in a
    file without one). The agent starts a round's workers only once the last round's have ended."""
    marks = [i for i, line in enumerate(lines) if ROUND.match(line)]
    return lines[marks[-1] + 1 :] if marks else lines


def new_round(number: int) -> None:
    """The agent starts a worker group: the first, a restart, or one for a node that joined."""
    _append(f"distqa: round: {number}")


def finished() -> None:
    """This rank's training is complete (its last barrier passed on every rank), whatever torchrun's
    status after a late SIGTERM (`train(..., whole_process=True)` says it). Only for a launcher
    that reads it; once per process."""
    _say_once("finished")


def training() -> None:
    """From here a SIGTERM makes this rank checkpoint (`StopSignal`); before it, one finds nothing to
    checkpoint, and a launcher that sees no such line reports a stop as one before training."""
    _say_once("training")


def stopped_before_training(signal_name: str) -> None:
    """`distqa.torchrun`: `signal_name` reached torchrun before any rank of this round trained."""
    _append(f"{STOPPED_EARLY}{signal_name}")


def _say_once(event: str) -> None:
    if launcher_file() is None or event in _said:
        return
    _said.add(event)
    local_rank, local_size = os.environ.get("LOCAL_RANK", "0"), os.environ.get("LOCAL_WORLD_SIZE", "1")
    _append(f"distqa: {event}: local rank {local_rank} of {local_size}")


def _append(line: str) -> None:
    """`line` into a launcher's file, if there is one (a convenience: never a failure of its own)."""
    path = launcher_file()
    if path is not None:
        with contextlib.suppress(OSError), _locked(path) as f:
            f.write(line + "\n")


def _print(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


@dataclasses.dataclass
class Outcome:
    """What the ranks of a node wrote to its file."""

    error_ranks: set[int]  # ranks with an error line (a single process's line counts as rank 0)
    preempted: bool
    finished: set[int]  # local ranks that finished
    local_size: int  # the local world size the finished lines name (0: none)
    training: bool  # a rank reached the point from which a SIGTERM means a checkpoint

    @property
    def all_finished(self) -> bool:
        return self.local_size > 0 and self.finished == set(range(self.local_size))

    def explains(self, failures: dict[int, int]) -> bool:
        """Every failed rank ({global rank: exit code}) said why: an error line of its own, or the
        preemption (exit 143) that every rank says alike. A rank that crashed wrote nothing."""
        return bool(failures) and all(
            rank in self.error_ranks or (code == 143 and self.preempted) for rank, code in failures.items()
        )


def read(path: Path) -> Outcome:
    """What the ranks of the last restart round wrote."""
    try:
        lines = this_round(path.read_text(errors="replace").splitlines())
    except OSError:
        lines = []
    errors, finished, local_size = set(), set(), 0
    for line in lines:
        if found := ERROR.match(line):
            errors.add(int(found.group(1) or 0))
        elif found := FINISHED.match(line):
            finished.add(int(found.group(1)))
            local_size = int(found.group(2))
    preempted = any(line.startswith(PREEMPTED) for line in lines)
    return Outcome(errors, preempted, finished, local_size, any(line.startswith(TRAINING) for line in lines))
