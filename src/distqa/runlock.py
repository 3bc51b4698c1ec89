"""One live run per output_dir: a lock file that works across the nodes of a shared volume.

Two runs writing into one folder interleave their metrics and overwrite each other's checkpoints.
Rank 0 therefore holds `output_dir/run.lock` for the whole run. An OS file lock (flock) would be
released by the kernel at death, but it is not honoured by every shared filesystem a results
volume may be (FUSE, object-store mounts), so the lock is a plain file created with O_EXCL (atomic
on local disks and NFS alike) plus a heartbeat: the holder touches it every `HEARTBEAT_S`.

A lock whose holder is gone is recognised without anyone deleting files:
- on the same machine and in the same pid namespace, at once: its process (pid and start time,
  so a reused pid does not count) no longer exists;
- elsewhere, when its heartbeat is older than `LEASE_S`. Ages are measured against the clock of
  the filesystem that holds the folder (the mtime of a file written just now), so nodes whose
  clocks disagree still agree on the age. A lock younger than that is watched until its heartbeat
  moves (a live holder: refuse) or it stays still for the rest of the lease (a dead one: take it
  over). A lock dated in the future (a skewed clock, a copied folder) has no age to trust: it is
  watched for one lease, never longer.

The holder re-reads the lock at every heartbeat, and `verify()` re-reads it at once: the trainer
calls it before every write of a step, so a holder whose lock was taken over (it was wrongly judged
dead, or it was paused for longer than the lease) writes nothing more into the folder.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from distqa.errors import DistqaError

LOCK_NAME = "run.lock"
HEARTBEAT_S = 5.0
LEASE_S = 60.0
BREAK_STALE_S = 30.0  # breaking a lock takes milliseconds: a breaker file this old was left by a crash


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the process's name (the first: its state, R, S, Z, ...),
    or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()  # the name before ")" may hold spaces and parentheses


def process_start(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks since boot), or None if there is none."""
    fields = proc_stat(pid)
    return fields[19] if fields else None  # field 22 of the whole line


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def _parse(raw: str) -> dict[str, Any] | None:
    """The holder record in a lock file's text, or None when it is not one."""
    try:
        holder = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return holder if isinstance(holder, dict) else None


def _identity() -> dict[str, Any]:
    """What makes a process unique on a machine: pid, its start time, the pid namespace, the boot."""

    def read(path: str) -> str | None:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return None

    pidns = None
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pass
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "proc_start": process_start(os.getpid()),
        "pidns": pidns,
        "boot_id": read("/proc/sys/kernel/random/boot_id"),
    }


def describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "an unknown run (the lock file is unreadable)"
    since = f", since {holder['started']}" if holder.get("started") else ""
    return f"host {holder.get('host')!s}, pid {holder.get('pid')!s}{since}"


class RunLock:
    """Held by rank 0 from the start of a run to its end. `lost` becomes a message if another
    run took the lock over (seen by the heartbeat, or by `verify()` before each write of a step)."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.path = output_dir / LOCK_NAME
        self.token = uuid.uuid4().hex
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ taking the lock
    def acquire(self) -> None:
        """Take the lock or raise a DistqaError naming output_dir and the holder."""
        record = {
            **_identity(),
            "token": self.token,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": " ".join(sys.argv)[:500],
            # Where it was taken: a copy of a live run's folder holds this file too (`_held`).
            "output_dir": os.path.abspath(self.output_dir),
        }
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._break_if_stale()
                continue
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(record) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            except BaseException:
                # Ours (O_EXCL): an empty claim left behind (a full disk) would make the next run
                # wait a lease for "an unknown run".
                self.path.unlink(missing_ok=True)
                raise
            break
        self._thread = threading.Thread(target=self._heartbeat, name="distqa-run-lock", daemon=True)
        self._thread.start()

    def _holder(self) -> tuple[str, dict[str, Any] | None]:
        raw = _read(self.path)
        return raw, _parse(raw)

    def _fs_now(self) -> float:
        """The filesystem's idea of now: the mtime of a file written just now in output_dir."""
        probe = self.output_dir / f".clock-{self.token}"
        probe.write_bytes(b"")
        try:
            return probe.stat().st_mtime
        finally:
            probe.unlink(missing_ok=True)

    def _break_if_stale(self) -> None:
        """Return when the lock is gone or was stale (and is now removed); raise if it is held."""
        try:
            raw, holder = self._holder()
            first_mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            return  # released in the meantime: try again
        me = _identity()
        if (
            holder is not None
            and me["proc_start"] is not None  # a system without /proc: only the heartbeat can tell
            and all(holder.get(k) == me[k] for k in ("host", "pidns", "boot_id"))
            and type(holder.get("pid")) is int
            and holder["pid"] > 0
        ):
            # Alive only if its pid is still that process (its start time). Our own pid counts no
            # more: a container restarted after a SIGKILL keeps its host name and often its pid and
            # pid namespace, and its lock, refused as "in use by another run", stopped the restart.
            if process_start(holder["pid"]) == holder.get("proc_start"):
                raise self._held(holder)
            self._remove_stale(raw, holder, "its process no longer exists")
            return
        # Another machine (or namespace): judge by the heartbeat. It has been still for at least
        # the time we watched it (our own monotonic clock) and, when its mtime is in the past, for
        # its age on the filesystem's clock. A future mtime gives a negative age, which must not
        # lengthen the wait: then only the watching counts.
        announced = False
        watched_since = time.monotonic()
        while True:
            try:
                mtime = self.path.stat().st_mtime
                current = _read(self.path)
            except FileNotFoundError:
                return
            if current != raw:
                return  # replaced by another run: judge the new lock afresh
            if mtime != first_mtime:
                raise self._held(holder)  # the heartbeat moved: its holder is alive
            age = self._fs_now() - mtime
            still = max(age, time.monotonic() - watched_since)
            if still > LEASE_S:
                ahead = f" (its mtime is {-age:.0f} s in the future)" if age < 0 else ""
                self._remove_stale(raw, holder, f"its heartbeat stopped {still:.0f} s ago{ahead}")
                return
            if not announced:
                print(
                    f"distqa: {self.path} is held by {describe(holder)}; waiting up to {LEASE_S - still:.0f} s "
                    "for its heartbeat to tell whether that run is alive",
                    flush=True,
                )
                announced = True
            time.sleep(min(1.0, HEARTBEAT_S / 2))

    def _held(self, holder: dict[str, Any] | None) -> DistqaError:
        taken_in = holder.get("output_dir") if holder else None
        copied = ""
        if (
            isinstance(taken_in, str)
            and taken_in != os.path.abspath(self.output_dir)
            and not _same(taken_in, self.output_dir)
        ):
            # Never broken for it: another node may mount the very same folder at another path. (Where
            # that path is here and is the same folder, a symlink's, it is no copy: no hint to delete.)
            copied = (
                f" (it took the lock in {taken_in}: if this folder is a copy of that one, not the same folder "
                f"mounted at another path, delete {self.path})"
            )
        return DistqaError(
            f"output_dir {self.output_dir} is in use by another run ({describe(holder)}): wait for it "
            f"to end or stop it, or use another output_dir{copied}"
        )

    def _remove_stale(self, raw: str, holder: dict[str, Any] | None, why: str) -> None:
        """Delete the stale lock, if it is still the one judged stale.

        Only one run at a time may break a lock: it holds `run.lock.break` (created with O_EXCL),
        checks the lock still holds what was judged stale, and deletes it. Without that, a second
        breaker that judged the same stale lock could delete the fresh lock the first one had just
        made, and two runs would hold the folder. (Nobody but a breaker deletes a lock that is not
        its own, so the check and the delete cannot be separated by another run's lock.)
        """
        breaker = self.path.with_name(f"{LOCK_NAME}.break")
        try:
            fd = os.open(breaker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                if self._fs_now() - breaker.stat().st_mtime > BREAK_STALE_S:
                    breaker.unlink(missing_ok=True)  # left by a run that died while breaking
            except FileNotFoundError:
                pass
            time.sleep(0.05)
            return  # another run is breaking it: judge the lock afresh
        os.close(fd)
        try:
            try:
                if _read(self.path) != raw:
                    return  # broken and replaced by another run meanwhile: judge the new lock afresh
                self.path.unlink()
            except FileNotFoundError:
                return
        finally:
            breaker.unlink(missing_ok=True)
        print(f"distqa: taking over {self.output_dir} from a run that is gone ({describe(holder)}: {why})", flush=True)

    # ------------------------------------------------------------------ holding it
    def verify(self) -> str | None:
        """Whether this run still holds the lock, checked now (one small read): None, or the
        message of `lost`, which it also sets. Rank 0 calls it before each write of a step; the
        heartbeat thread alone would notice a takeover only at its next beat, and a holder paused
        across the takeover (a stopped container, a swapped-out host) resumes before that beat."""
        if self.lost is None:
            try:
                raw = _read(self.path)
            except FileNotFoundError:
                self.lost = f"the lock {self.path} was deleted while this run held it"
            except OSError:
                return None  # a passing storage hiccup: the heartbeat tells a lost lock from it
            else:
                if self.token not in raw:
                    self.lost = f"another run took over output_dir {self.output_dir} ({describe(_parse(raw))})"
        return self.lost

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if self.verify() is not None:
                return
            try:
                # Not through a link: claim refused a linked run.lock, and one planted later is not ours.
                os.utime(self.path, follow_symlinks=False)
            except OSError:
                continue  # a passing storage hiccup (or deleted just now: the next beat says so)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            if self.token in _read(self.path):
                self.path.unlink()
        except OSError:
            pass  # already gone, or the folder is unwritable now: a later run sees the lock as stale


def _same(one: str, other: str | Path) -> bool:
    """Whether two paths are the same folder on this host (False where either cannot be read)."""
    try:
        return os.path.samefile(one, other)
    except OSError:
        return False
