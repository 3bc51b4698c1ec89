"""`download` without a network: a stub KaggleApi that fails the way the real one does, and the real
kaggle package with no credentials (the network is switched off, so a stray request fails the test)."""

from __future__ import annotations

import os
import re
import socket
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from conftest import ROOT, help_texts
from distqa.errors import DistqaError
from distqa.nq.download import COMPETITION, RULES_URL, STAGING, download

FILES = ["sample_submission.csv", "simplified-nq-test.jsonl", "simplified-nq-train.jsonl"]


def http_error(status: int, reason: str) -> requests.HTTPError:
    """What kagglesdk's `raise_for_status()` raises for a refused request."""
    response = requests.Response()
    response.status_code = status
    response.url = "https://api.kaggle.com/v1/competitions.CompetitionApiService/DownloadDataFile"
    return requests.HTTPError(f"{status} Client Error: {reason} for url: {response.url}", response=response)


# requests' own text for an unreachable host, several lines long once urllib3 has wrapped it.
OFFLINE = requests.ConnectionError(
    "HTTPSConnectionPool(host='api.kaggle.com', port=443): Max retries exceeded with url: /v1/competitions\n"
    '(Caused by NameResolutionError("<urllib3.connection.HTTPSConnection object>: Failed to resolve '
    "'api.kaggle.com' ([Errno -3] Temporary failure in name resolution)\"))"
)


class StubApi:
    """The KaggleApi methods `download` calls; sends a file zipped (as Kaggle does for large files)
    unless it is named in `plain`."""

    def __init__(self, files=FILES, *, fail: dict[str, BaseException] | None = None, extra_members=(), plain=()):
        self.files, self.fail, self.extra_members, self.plain = list(files), fail or {}, extra_members, plain
        self.downloaded: list[str] = []

    def authenticate(self) -> None:
        if "authenticate" in self.fail:
            print("Authentication required to call the Kaggle API.")  # the real one prints a page of help
            raise self.fail["authenticate"]

    def competition_list_files(self, competition, page_token=None, page_size=20):
        assert competition == COMPETITION
        if "list" in self.fail:
            raise self.fail["list"]
        # Two pages, to exercise next_page_token.
        pages = {None: (self.files[:1], "page2"), "page2": (self.files[1:], "")}
        names, token = pages[page_token]
        return SimpleNamespace(files=[SimpleNamespace(name=n, ref=n) for n in names], next_page_token=token)

    def competition_download_file(self, competition, file_name, path=None, force=False, quiet=False):
        if file_name in self.fail:
            raise self.fail[file_name]
        self.downloaded.append(file_name)
        if file_name in self.plain:
            (Path(path) / file_name).write_text(f"new {file_name}\n")
            return
        with zipfile.ZipFile(Path(path) / f"{file_name}.zip", "w") as archive:
            archive.writestr(file_name, f"new {file_name}\n")
            for member in self.extra_members:
                archive.writestr(member, f"new {member}\n")


def one_line_error(output_dir: Path, api) -> str:
    with pytest.raises(DistqaError) as info:
        download(output_dir, api=api)
    message = str(info.value)
    assert "\n" not in message and len(message) < 600
    return message


def test_downloads_extracts_and_cleans_up(tmp_path, capsys):
    api = StubApi(plain=["sample_submission.csv"])
    assert download(tmp_path / "data", api=api) == 0
    assert api.downloaded == FILES
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == FILES  # no zip, staging or partial left
    for name in FILES:
        assert (tmp_path / "data" / name).read_text() == f"new {name}\n"
    assert "3 file(s) written, 0 kept" in capsys.readouterr().out


def test_existing_files_are_kept_and_not_downloaded(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "simplified-nq-test.jsonl").write_text("mine")
    (data / "notes.txt").write_text("mine too")
    # The train archive also holds notes.txt: extracting it must not replace the user's file.
    api = StubApi(extra_members=["notes.txt"])
    assert download(data, api=api) == 0
    assert api.downloaded == ["sample_submission.csv", "simplified-nq-train.jsonl"]
    assert (data / "simplified-nq-test.jsonl").read_text() == "mine"
    assert (data / "notes.txt").read_text() == "mine too"
    assert (data / "simplified-nq-train.jsonl").read_text() == "new simplified-nq-train.jsonl\n"
    out = capsys.readouterr().out
    assert f"kept {data / 'simplified-nq-test.jsonl'} (already there, not downloaded)" in out
    assert f"kept {data / 'notes.txt'}" in out


def test_no_credentials(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KAGGLE_CONFIG_DIR", str(tmp_path / "config"))
    message = one_line_error(tmp_path / "data", StubApi(fail={"authenticate": SystemExit(1)}))
    assert message.startswith("no Kaggle credentials found: create an API token at https://www.kaggle.com/settings/api")
    assert f"save the file as {tmp_path / 'config' / 'kaggle.json'} (KAGGLE_CONFIG_DIR's folder)" in message
    assert "Authentication required" not in capsys.readouterr().out  # kaggle's page of help is replaced


def test_rules_not_accepted(tmp_path):
    api = StubApi(fail={"simplified-nq-test.jsonl": http_error(403, "Forbidden")})
    message = one_line_error(tmp_path / "data", api)
    assert "HTTP 403" in message and "while downloading simplified-nq-test.jsonl" in message
    assert f"accept the competition rules at {RULES_URL}" in message
    # What came before the failure stays; the next run fetches only what is missing.
    assert (tmp_path / "data" / "sample_submission.csv").exists()
    again = StubApi()
    assert download(tmp_path / "data", api=again) == 0
    assert again.downloaded == ["simplified-nq-test.jsonl", "simplified-nq-train.jsonl"]
    assert not (tmp_path / "data" / STAGING).exists()


def test_bad_key(tmp_path):
    message = one_line_error(tmp_path / "data", StubApi(fail={"list": http_error(401, "Unauthorized")}))
    assert message.startswith("Kaggle rejected the credentials (HTTP 401) while listing the files")


@pytest.mark.parametrize("error", [OFFLINE, requests.Timeout("read timed out"), socket.gaierror(-3, "no DNS")])
def test_no_network(tmp_path, error):
    message = one_line_error(tmp_path / "data", StubApi(fail={"list": error}))
    assert message.startswith(f"cannot reach Kaggle while listing the files of {COMPETITION}")
    assert "check the network connection" in message and f"into {tmp_path / 'data'}" in message


@pytest.fixture
def kaggle_home(tmp_path, monkeypatch) -> Path:
    """No KAGGLE_* variables, an empty kaggle config folder and home; any network use fails the test."""
    for name in list(os.environ):
        if name.startswith("KAGGLE_"):
            monkeypatch.delenv(name)
    config = tmp_path / "config"
    config.mkdir()
    monkeypatch.setenv("KAGGLE_CONFIG_DIR", str(config))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home" / ".config"))

    def refuse(*args, **kwargs):
        raise AssertionError(f"network used: {args!r}")  # not an OSError: download cannot explain it away

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return config


def real_download_error(output_dir: Path) -> str:
    """The one-line error of `download` with the real kaggle package.

    kaggle is a requirement (with `six`, which kaggle 2.2.4 imports without declaring it): if it
    cannot be imported the install is broken, and these tests fail rather than skip.
    """
    message = one_line_error(output_dir, None)
    assert not message.startswith("cannot import the kaggle package"), message
    return message


def test_missing_kaggle_module_is_named(tmp_path, monkeypatch):
    """Where kaggle cannot be imported, the message names the missing module and the fix."""
    import builtins

    real_import = builtins.__import__

    def no_six(name, *args, **kwargs):
        if name == "six" or name.startswith("kaggle"):
            raise ModuleNotFoundError("No module named 'six'", name="six")
        return real_import(name, *args, **kwargs)

    for module in [m for m in sys.modules if m == "kaggle" or m.startswith("kaggle.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setattr(builtins, "__import__", no_six)
    message = one_line_error(tmp_path / "data", None)
    assert re.search(r"^cannot import the kaggle package \(.*six.*\): pip install six$", message), message


def test_real_kaggle_without_credentials(tmp_path, kaggle_home, capsys):
    message = real_download_error(tmp_path / "data")
    assert message == (
        "no Kaggle credentials found: create an API token at https://www.kaggle.com/settings/api, then set "
        "KAGGLE_API_TOKEN to it or save it as ~/.kaggle/access_token; or, with a kaggle.json key, set "
        f"KAGGLE_USERNAME and KAGGLE_KEY or save the file as {kaggle_home / 'kaggle.json'} (KAGGLE_CONFIG_DIR's "
        "folder); then run again"
    )
    assert capsys.readouterr().out == ""  # kaggle's page of help, printed on import and on failure, is hidden
    assert not (tmp_path / "data").exists()  # a failed sign-in leaves no empty folder behind


@pytest.mark.parametrize("home", [True, False], ids=["home", "KAGGLE_CONFIG_DIR"])
@pytest.mark.parametrize(
    "saved", [b"[]", b"\xff\xfe", b'{"username": 5}', None], ids=["list", "bytes", "no-key", "folder"]
)
def test_real_kaggle_with_a_credentials_file_it_cannot_read_is_one_line(
    tmp_path, kaggle_home, monkeypatch, saved, home
):
    """kagglesdk's TypeError, UnicodeDecodeError or IsADirectoryError was a traceback; a file of no
    key was "no Kaggle credentials found: ... save the file as" the file that was there."""
    key_file = kaggle_home / "kaggle.json"
    if home:
        monkeypatch.delenv("KAGGLE_CONFIG_DIR")
        key_file = tmp_path / "home" / ".kaggle" / "kaggle.json"
        key_file.parent.mkdir(parents=True)
    if saved is None:
        key_file.mkdir()
    else:
        key_file.write_bytes(saved)
    message = real_download_error(tmp_path / "data")
    assert message.startswith("kaggle could not read the credentials ("), message
    shown = "~/.kaggle/kaggle.json" if home else str(key_file)
    assert f"{shown} must be the JSON object" in message and not (tmp_path / "data").exists()


def test_an_output_that_is_a_file_is_one_line(tmp_path, kaggle_home):
    (tmp_path / "data").write_text("not a folder")
    assert real_download_error(tmp_path / "data") == (
        f"--output {tmp_path / 'data'} is a file, not a folder: name the folder the files go into"
    )
    message = real_download_error(tmp_path / "data" / "nq")  # under a file: ENOTDIR, also one line
    assert message.startswith(f"cannot write into {tmp_path / 'data' / 'nq'} while preparing"), message


# What the message says without KAGGLE_CONFIG_DIR (the README repeats it).
DEFAULT_PLACES = (
    "no Kaggle credentials found: create an API token at https://www.kaggle.com/settings/api, then set "
    "KAGGLE_API_TOKEN to it or save it as ~/.kaggle/access_token; or, with a kaggle.json key, set KAGGLE_USERNAME "
    "and KAGGLE_KEY or save the file as ~/.kaggle/kaggle.json (or ~/.config/kaggle/kaggle.json while ~/.kaggle "
    "does not exist; KAGGLE_CONFIG_DIR names another folder); then run again"
)


@pytest.mark.parametrize("saved_in", [None, ".kaggle", ".config/kaggle", "access_token"])
def test_real_kaggle_reads_the_places_the_message_names(tmp_path, kaggle_home, monkeypatch, saved_in):
    """The message names where the pinned kaggle package really looks: a key saved in each place is
    found (the run then fails on the network, which is off), and none at all gives the message."""
    monkeypatch.delenv("KAGGLE_CONFIG_DIR")
    home = tmp_path / "home"
    if saved_in == "access_token":
        (home / ".kaggle").mkdir(parents=True)
        (home / ".kaggle" / "access_token").write_text("KGAT_0123456789abcdef")
    elif saved_in is not None:
        (home / saved_in).mkdir(parents=True)
        (home / saved_in / "kaggle.json").write_text('{"username": "someone", "key": "0123456789abcdef"}')

    def no_dns(*args, **kwargs):
        raise socket.gaierror(-3, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    message = real_download_error(tmp_path / "data")
    if saved_in is None:
        assert message == DEFAULT_PLACES
    else:  # (kaggle checks a token online while signing in; a key only when it lists the files)
        assert message.startswith("cannot reach Kaggle while "), message


def test_real_kaggle_offline(tmp_path, kaggle_home, monkeypatch):
    monkeypatch.setenv("KAGGLE_USERNAME", "someone")
    monkeypatch.setenv("KAGGLE_KEY", "0123456789abcdef")

    def no_dns(*args, **kwargs):
        raise socket.gaierror(-3, "Temporary failure in name resolution")  # what an offline machine answers

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    message = real_download_error(tmp_path / "data")
    assert message.startswith(f"cannot reach Kaggle while listing the files of {COMPETITION} (ConnectionError: ")
    assert "Failed to resolve 'api.kaggle.com'" in message


def test_real_kaggle_rules_not_accepted(tmp_path, kaggle_home, monkeypatch):
    monkeypatch.setenv("KAGGLE_USERNAME", "someone")
    monkeypatch.setenv("KAGGLE_KEY", "0123456789abcdef")

    def forbidden(session, request, **kwargs):
        # Kaggle's answer for an account that has not accepted the competition rules.
        response = requests.Response()
        response.status_code, response.url, response.request = 403, request.url, request
        response.headers["Content-Type"] = "application/json"
        response._content = b'{"code": 403, "message": "You must accept this competition\'s rules first."}'
        return response

    monkeypatch.setattr(requests.Session, "send", forbidden)
    message = real_download_error(tmp_path / "data")
    assert message.startswith(
        f"Kaggle refused the competition files (HTTP 403) while listing the files of {COMPETITION}"
    )
    assert message.endswith(f"accept the competition rules at {RULES_URL}, then run again")


def test_kaggle_not_installed(tmp_path, monkeypatch):
    # None in sys.modules makes an import raise ModuleNotFoundError, even if an earlier test imported kaggle.
    for name in ["kaggle", "kaggle.api", "kaggle.api.kaggle_api_extended"]:
        monkeypatch.setitem(sys.modules, name, None)
    message = one_line_error(tmp_path / "data", None)
    assert message.startswith("cannot import the kaggle package") and message.endswith("pip install kaggle")


def test_download_help_names_every_credential_source_the_error_and_readme_name():
    """`distqa download --help` named only KAGGLE_USERNAME/KAGGLE_KEY and ~/.kaggle/kaggle.json."""
    text = " ".join(help_texts(["download"])[0].split())
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    sources = ["KAGGLE_API_TOKEN", "~/.kaggle/access_token", "KAGGLE_USERNAME", "KAGGLE_KEY", "kaggle.json"]
    sources += ["KAGGLE_CONFIG_DIR", "~/.config/kaggle"]
    assert [s for s in sources if s not in text] == [], text
    assert [s for s in sources if s not in readme] == []


def test_a_copy_a_killed_download_left_is_removed_and_a_live_ones_kept(tmp_path, capsys):
    """Each interrupted unpacking (SIGKILL, a preemption) left a hidden copy of up to 17 GB in the
    data folder that no later download removed; and the files came out 0600 (mkstemp's)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    data = tmp_path / "data"
    data.mkdir()
    target = data / "simplified-nq-train.jsonl"
    # A real download process killed mid-copy: its source never ends, so it is writing when killed.
    writer = (
        "import sys; from pathlib import Path; from distqa.nq.download import _move_into_place\n"
        "_move_into_place(sys.stdin.buffer, Path(sys.argv[1]))\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", writer, str(target)], stdin=subprocess.PIPE) for _ in range(2)]
    chunk = 1 << 24  # what the copy reads at a time: one chunk written, the next read waits
    for proc in procs:
        proc.stdin.write(b"x" * chunk)
        proc.stdin.flush()
    deadline = time.monotonic() + 60
    while len(list(data.glob(".*.partial"))) < 2 or any(p.stat().st_size < chunk for p in data.glob(".*.partial")):
        assert time.monotonic() < deadline, list(data.iterdir())
        time.sleep(0.1)
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].wait()
    old = time.time() - 3600
    for path in data.glob(".*.partial"):
        os.utime(path, (old, old))  # both older than the moment a writer takes its lock
    try:
        assert download(data, api=StubApi(plain=["sample_submission.csv"])) == 0
        left = list(data.glob(".*.partial"))
        assert len(left) == 1 and left[0].stat().st_size == chunk  # the live writer's, kept
        assert "removed 1 partial copy(ies) of simplified-nq-train.jsonl left by an interrupted download" in (
            capsys.readouterr().out
        )
    finally:
        procs[1].kill()
        procs[1].wait()
    umask = os.umask(0)
    os.umask(umask)
    assert all((p.stat().st_mode & 0o777) == 0o666 & ~umask for p in data.iterdir() if not p.name.startswith("."))
