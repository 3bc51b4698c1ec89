"""`distqa download`: fetch the Kaggle "TensorFlow 2.0 Question Answering" files into data/.

The competition lists three files (simplified-nq-train.jsonl, about 17 GB unpacked; the test
file; sample_submission.csv). Each is fetched on its own with the `kaggle` package, so a file that
is already in the output folder is never downloaded again and never overwritten: a hand-copied or
half-used file stays exactly as it was. Kaggle usually sends a file zipped; it is downloaded into
`<output>/.kaggle-download/<name>/` (where kaggle resumes an interrupted transfer on the next run),
extracted under a temporary name and renamed into place, so a crash never leaves a truncated file
under the real name.

Credentials are the kaggle package's; 2.2.4 tries, in this order: an API token in KAGGLE_API_TOKEN
or ~/.kaggle/access_token; KAGGLE_USERNAME and KAGGLE_KEY, or kaggle.json in KAGGLE_CONFIG_DIR
(default ~/.kaggle, or on Linux ~/.config/kaggle while ~/.kaggle does not exist); the
~/.kaggle/credentials.json of `kaggle auth login`. Every failure the user can fix (no credentials,
a rejected key, competition rules not accepted, no network, a full disk) is a DistqaError with one
line saying what to do.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import io
import os
import shutil
import socket
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from distqa.durable import abandoned, lock_while_writing, umask
from distqa.errors import DistqaError

COMPETITION = "tensorflow2-question-answering"
RULES_URL = f"https://www.kaggle.com/c/{COMPETITION}/rules"
DATA_URL = f"https://www.kaggle.com/c/{COMPETITION}/data"
TOKEN_URL = "https://www.kaggle.com/settings/api"
STAGING = ".kaggle-download"
PARTIAL_MARKER = ".kaggle-partial"  # kaggle's sidecar file that records a resumable download


class KaggleApiLike(Protocol):
    """The part of `kaggle.api.kaggle_api_extended.KaggleApi` used here (tests pass a stub)."""

    def authenticate(self) -> None: ...

    def competition_list_files(self, competition: str, page_token: str | None = None, page_size: int = 20) -> Any: ...

    def competition_download_file(
        self, competition: str, file_name: str, path: str | None = None, force: bool = False, quiet: bool = False
    ) -> None: ...


def kaggle_config_dir() -> Path:
    """Where kaggle looks for kaggle.json: KAGGLE_CONFIG_DIR, else ~/.kaggle (or ~/.config/kaggle)."""
    if os.environ.get("KAGGLE_CONFIG_DIR"):
        return Path(os.environ["KAGGLE_CONFIG_DIR"])
    home = Path.home() / ".kaggle"
    # kaggle >= 1.7 falls back to the XDG folder on Linux when ~/.kaggle does not exist.
    if sys.platform.startswith("linux") and not home.exists():
        return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "kaggle"
    return home


def _shown(path: Path) -> str:
    """`path` as a person writes it: ~/... under the home folder."""
    try:
        return f"~/{path.relative_to(Path.home())}"
    except ValueError:
        return str(path)


def _no_credentials_message() -> str:
    # Every place kaggle reads, so that the message and the README name the same ones. (Importing
    # kaggle creates ~/.config/kaggle when ~/.kaggle is missing, which is why both are named.)
    if os.environ.get("KAGGLE_CONFIG_DIR"):
        key_file = f"{_shown(Path(os.environ['KAGGLE_CONFIG_DIR']) / 'kaggle.json')} (KAGGLE_CONFIG_DIR's folder)"
    else:
        key_file = "~/.kaggle/kaggle.json"
        if sys.platform.startswith("linux"):
            xdg = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "kaggle" / "kaggle.json"
            key_file += f" (or {_shown(xdg)} while ~/.kaggle does not exist; KAGGLE_CONFIG_DIR names another folder)"
    return (
        f"no Kaggle credentials found: create an API token at {TOKEN_URL}, then set KAGGLE_API_TOKEN to it "
        "or save it as ~/.kaggle/access_token; or, with a kaggle.json key, set KAGGLE_USERNAME and KAGGLE_KEY "
        f"or save the file as {key_file}; then run again"
    )


def _real_api() -> KaggleApiLike:
    """A KaggleApi, imported only now: importing kaggle tries to authenticate and prints help."""
    before = set(sys.modules)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from kaggle.api.kaggle_api_extended import KaggleApi
    except ImportError as err:
        # A failed import leaves half-initialised kaggle submodules behind, and a second attempt in
        # this process would then report a misleading circular import instead of the real cause.
        for name in set(sys.modules) - before:
            if name == "kaggle" or name.startswith("kaggle."):
                del sys.modules[name]
        # kaggle 2.2.4 imports `six` without declaring it as a dependency.
        missing = (err.name or "kaggle").split(".")[0] if isinstance(err, ModuleNotFoundError) else "kaggle"
        raise DistqaError(f"cannot import the kaggle package ({err}): pip install {missing}") from None
    api = KaggleApi()
    # KaggleApi reads KAGGLE_CONFIG_DIR once, when kaggle is first imported (a class attribute);
    # read it again so that the folder in force now is the one searched and named in messages.
    config_dir = kaggle_config_dir()
    api.config_dir = str(config_dir)
    api.config = str(config_dir / "kaggle.json")
    return api


def _authenticate(api: KaggleApiLike) -> None:
    try:
        # Without credentials kaggle prints a page of help to stdout and calls exit(1).
        with contextlib.redirect_stdout(io.StringIO()):
            api.authenticate()
    except SystemExit:
        key_file = kaggle_config_dir() / "kaggle.json"
        if key_file.exists():  # there, but kaggle found no username and key in it
            raise DistqaError(_unreadable_key_file("it holds no username and key")) from None
        raise DistqaError(_no_credentials_message()) from None
    # A credentials file kaggle cannot read: `[]`, other bytes than UTF-8, a folder by that name.
    except (ValueError, TypeError, KeyError, AttributeError, IsADirectoryError, PermissionError) as err:
        raise DistqaError(_unreadable_key_file(f"{type(err).__name__}: {_one_line(err)}")) from None


def _unreadable_key_file(why: str) -> str:
    return (
        f"kaggle could not read the credentials ({why}): {_shown(kaggle_config_dir() / 'kaggle.json')} must be "
        'the JSON object {"username": ..., "key": ...} that kaggle.com gives; or set KAGGLE_API_TOKEN, or '
        "KAGGLE_USERNAME and KAGGLE_KEY"
    )


def _one_line(err: BaseException, limit: int = 200) -> str:
    # requests wraps urllib3's MaxRetryError, whose `reason` ("Failed to resolve 'api.kaggle.com'")
    # is the useful part of a paragraph of connection-pool text.
    reason = getattr(err.args[0], "reason", None) if err.args else None
    text = " ".join(str(reason or err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# A full disk or quota, no permission, a read-only file system, a file where a folder must be.
_CANNOT_WRITE = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EPERM, errno.EEXIST, errno.ENOTDIR)


@contextlib.contextmanager
def _explained(output_dir: Path, step: list[str]) -> Iterator[None]:
    """Turn the errors of the kaggle package (requests underneath) into one-line DistqaErrors."""
    try:
        yield
    except DistqaError:
        raise
    except zipfile.BadZipFile as err:
        raise DistqaError(
            f"a downloaded archive is damaged ({err}) while {step[0]}: delete {output_dir / STAGING} and run again"
        ) from None
    except OSError as err:  # requests' exceptions are OSErrors too
        try:
            import requests

            request_error: tuple[type[BaseException], ...] = (requests.RequestException,)
        except ImportError:
            request_error = ()
        status = getattr(getattr(err, "response", None), "status_code", None)
        by_hand = f"or download the files by hand from {DATA_URL} into {output_dir}"
        if status == 401:
            raise DistqaError(
                f"Kaggle rejected the credentials (HTTP 401) while {step[0]}: check KAGGLE_USERNAME/KAGGLE_KEY "
                f"or {kaggle_config_dir() / 'kaggle.json'}, or the API token; {TOKEN_URL} gives a new one"
            ) from None
        if status == 403:
            raise DistqaError(
                f"Kaggle refused the competition files (HTTP 403) while {step[0]}: sign in to kaggle.com as the "
                f"account of these credentials, accept the competition rules at {RULES_URL}, then run again"
            ) from None
        if status is not None:
            raise DistqaError(
                f"Kaggle answered HTTP {status} while {step[0]} ({_one_line(err)}): try again later, {by_hand}"
            ) from None
        if isinstance(err, request_error + (ConnectionError, TimeoutError, socket.gaierror)):
            raise DistqaError(
                f"cannot reach Kaggle while {step[0]} ({type(err).__name__}: {_one_line(err)}): check the network "
                f"connection and any proxy (HTTPS_PROXY), {by_hand}"
            ) from None
        if err.errno in _CANNOT_WRITE:
            raise DistqaError(f"cannot write into {output_dir} while {step[0]}: {_one_line(err)}") from None
        raise


def _list_files(api: KaggleApiLike) -> list[str]:
    names: list[str] = []
    page_token: str | None = None
    while True:
        response = api.competition_list_files(COMPETITION, page_token=page_token)
        for item in response.files or []:
            name = item.name
            # The name becomes a path under output_dir: refuse anything that could leave it.
            if not name or name != Path(name).name or name in (".", ".."):
                raise DistqaError(f"Kaggle listed an unexpected file name {name!r} for {COMPETITION}")
            names.append(name)
        page_token = response.next_page_token or None
        if page_token is None:
            return names


def _move_into_place(source: io.BufferedIOBase | Path, target: Path) -> bool:
    """Copy or rename `source` to `target` unless `target` exists; True if it was written."""
    if target.exists():
        return False
    if isinstance(source, Path):
        os.rename(source, target)  # same folder tree, so a rename, not a copy
        return True
    # A name of its own: two downloads into one folder each write their own copy, then the first
    # renamed in is kept. Locked while written, so that a later download removes the copy a
    # killed one left (up to 17 GB each time) and never one being written.
    _remove_abandoned_copies(target)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    partial = Path(name)
    try:
        lock_while_writing(fd)
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp's 0600 kept other users (the image's uid) out
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(source, out, length=1 << 24)
    except BaseException:  # a full disk, an interrupt: no copy of its own left behind
        partial.unlink(missing_ok=True)
        raise
    # Checked again: another process (or the user) may have put the file there meanwhile.
    if target.exists():
        partial.unlink()
        return False
    os.rename(partial, target)
    return True


def _remove_abandoned_copies(target: Path) -> None:
    """The partial copies of `target` that killed downloads left (SIGKILL, a preemption)."""
    left = [p for p in target.parent.glob(f".{glob.escape(target.name)}.*.partial") if abandoned(p)]
    size = 0
    for path in left:
        with contextlib.suppress(OSError):
            size += path.stat().st_size
            path.unlink()
    if left:
        gone = f"{size / 1e9:.1f} GB"
        print(f"removed {len(left)} partial copy(ies) of {target.name} left by an interrupted download ({gone})")


def _install(staging: Path, output_dir: Path) -> tuple[list[str], list[str]]:
    """Extract (or move) what Kaggle sent into output_dir; (names written, names kept)."""
    written: list[str] = []
    kept: list[str] = []
    received = [p for p in sorted(staging.iterdir()) if p.is_file() and not p.name.endswith(PARTIAL_MARKER)]
    if not received:
        raise DistqaError(f"Kaggle sent nothing into {staging}: delete that folder and run again")
    for path in received:
        if not zipfile.is_zipfile(path):
            (written if _move_into_place(path, output_dir / path.name) else kept).append(path.name)
            continue
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                name = Path(member.filename).name  # flat: a member path never leaves output_dir
                if member.is_dir() or not name:
                    continue
                with archive.open(member) as source:
                    (written if _move_into_place(source, output_dir / name) else kept).append(name)
        path.unlink()  # extracted: the archive (5 GB for train) is no longer needed
    return written, kept


def download(output_dir: str | os.PathLike = Path("data"), api: KaggleApiLike | None = None) -> int:
    """Download and unpack the competition files into `output_dir`; return the exit code (0).

    Files already in `output_dir` are kept and not downloaded. `api` replaces the real KaggleApi
    (tests); by default kaggle is imported here, not at module import, because importing it
    tries to authenticate and prints a page of help when there are no credentials.
    """
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise DistqaError(f"--output {output_dir} is a file, not a folder: name the folder the files go into")
    step = ["preparing"]  # what is being done, for the error message (a list: _explained reads it late)
    kept: list[str] = []
    written: list[str] = []
    created = not output_dir.exists()
    try:
        with _explained(output_dir, step):
            _download_into(output_dir, api, step, kept, written)
    except DistqaError:
        # A failure before anything arrived (no credentials, no network) leaves no empty folder.
        if created:
            for folder in (output_dir / STAGING, output_dir):  # only when empty: a partial download is kept
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise
    print(f"{COMPETITION}: {len(written)} file(s) written, {len(kept)} kept in {output_dir}", flush=True)
    return 0


def _download_into(
    output_dir: Path, api: KaggleApiLike | None, step: list[str], kept: list[str], written: list[str]
) -> None:
    """The body of `download`, run inside its error translation."""
    output_dir.mkdir(parents=True, exist_ok=True)
    step[0] = "signing in to Kaggle"
    if api is None:
        api = _real_api()
    _authenticate(api)
    step[0] = f"listing the files of {COMPETITION}"
    names = _list_files(api)
    if not names:
        raise DistqaError(f"Kaggle lists no files for {COMPETITION}")
    for name in names:
        if (output_dir / name).exists():
            print(f"kept {output_dir / name} (already there, not downloaded)", flush=True)
            kept.append(name)
            continue
        step[0] = f"downloading {name}"
        staging = output_dir / STAGING / name
        staging.mkdir(parents=True, exist_ok=True)
        api.competition_download_file(COMPETITION, name, path=str(staging), quiet=False)
        step[0] = f"unpacking {name}"
        new, existing = _install(staging, output_dir)
        for item in new:
            print(f"wrote {output_dir / item}", flush=True)
        for item in existing:
            print(f"kept {output_dir / item} (already there; the downloaded copy was not used)", flush=True)
        written += new
        kept += existing
        shutil.rmtree(staging)
    with contextlib.suppress(OSError):
        (output_dir / STAGING).rmdir()  # only when empty
