#!/usr/bin/env python3
"""`make check-flow`: .neuro/live.yml checked offline, with neuro-flow's own parser, and every reference.

    python scripts/check_flow.py [WORKSPACE]      # default: this checkout; reads WORKSPACE/.neuro/live.yml

Prints one line per volume and per job (its preset, volumes with their modes, secrets, parameters),
then a summary; exits 1 with one line per problem on stderr. Two checks, because neither alone is
enough: neuro-flow parses and evaluates every job (schema, expression syntax, parameters) but does
not check that a referenced `volumes.X`, `images.X` or `params.X` exists; the reference check here
(PyYAML only) does.

neuro-flow 24.12.1 (module apolo_flow) cannot share the project's environment (through apolo-extras
it needs python-dateutil<3, the pinned requirements resolve to 4), so it lives in a folder of its
own, used only by a subprocess: $NEURO_FLOW_TARGET, default .venv/neuro-flow, installed there on
first use with `pip install --target` (about 40 s, needs pip's index once). tests/test_neuro_flow.py
uses the same folder and these functions.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
NEURO_FLOW = "neuro-flow==24.12.1"
EXPR = re.compile(r"\$\{\{(.*?)\}\}|\$\[\[(.*?)\]\]", re.S)
REF = re.compile(r"\b(volumes|images|params)\.([A-Za-z_][A-Za-z0-9_]*)")


class FlowError(Exception):
    """A problem to report in one line (no traceback)."""


def strings(node: object, path: str = "") -> Iterator[tuple[str, str]]:
    """Every string in the document with where it is: ("jobs.train.cmd", "...")."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from strings(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from strings(value, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


def _param_scopes(doc: dict, where: str) -> list[set[str]]:
    """The parameter sets a string at `where` is evaluated with: its job's, or, in a mixin, those of
    every job using it (a mixin's params.X must exist in each)."""
    parts = where.split(".")
    if parts[0] == "jobs":
        return [set(doc["jobs"][parts[1]].get("params") or {})]
    if parts[0] == "mixins":
        users = [j for j in (doc.get("jobs") or {}).values() if parts[1] in (j.get("mixins") or [])]
        return [set(j.get("params") or {}) for j in users] or [set()]
    return [set()]


def undefined_references(doc: dict) -> list[str]:
    """Every volumes.X, images.X, params.X and mixin a flow names without defining it."""
    volumes, images = set(doc.get("volumes") or {}), set(doc.get("images") or {})
    mixins = doc.get("mixins") or {}
    problems = []
    for section in ("jobs", "mixins"):
        for name, body in (doc.get(section) or {}).items():
            for mixin in body.get("mixins") or []:
                if mixin not in mixins:
                    problems.append(f"{section}.{name}: unknown mixin {mixin!r}")
    for where, text in strings(doc):
        scopes = _param_scopes(doc, where)
        for match in EXPR.finditer(text):
            for kind, ref in REF.findall(match.group(1) or match.group(2)):
                if kind == "volumes" and ref not in volumes:
                    problems.append(f"{where}: volumes.{ref} is not defined")
                elif kind == "images" and ref not in images:
                    problems.append(f"{where}: images.{ref} is not defined")
                elif kind == "params" and any(ref not in scope for scope in scopes):
                    problems.append(f"{where}: params.{ref} is not a parameter of the job")
    return problems


def neuro_flow_env(install: bool = True) -> dict[str, str]:
    """An environment whose Python imports apolo_flow: this one, or the --target folder (installed
    there on first use unless `install` is false or DISTQA_NO_NEURO_FLOW_INSTALL=1)."""
    env = dict(os.environ)
    probe = subprocess.run([sys.executable, "-c", "import apolo_flow"], capture_output=True)
    if probe.returncode == 0:
        return env
    target = Path(os.environ.get("NEURO_FLOW_TARGET", ROOT / ".venv" / "neuro-flow"))
    if not (target / "apolo_flow").is_dir():
        if not install or os.environ.get("DISTQA_NO_NEURO_FLOW_INSTALL") == "1":
            raise FlowError(f"apolo_flow is not importable and not in {target} (DISTQA_NO_NEURO_FLOW_INSTALL=1)")
        # Into a side folder first: an install stopped half-way must not look like a finished one.
        partial = target.with_name(target.name + ".partial")
        print(f"installing {NEURO_FLOW} into {target} (once; about 40 s)", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(partial), NEURO_FLOW]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            raise FlowError(f"installing {NEURO_FLOW} into {partial} took over 10 minutes") from None
        if proc.returncode != 0:
            tail = " ".join(proc.stderr.split())[-300:]
            raise FlowError(f"could not install {NEURO_FLOW} (no package index?): {tail}")
        partial.rename(target)
    env["PYTHONPATH"] = os.pathsep.join([str(target), *filter(None, [env.get("PYTHONPATH")])])
    return env


# Run in the neuro-flow environment: parse, then evaluate every job as `neuro-flow run` would (a
# multi-job with suffix s1), with the given parameters for multi-jobs (defaults elsewhere).
EVALUATE = r"""
import asyncio, dataclasses, json, sys
from pathlib import Path
from types import SimpleNamespace

from yarl import URL

from apolo_flow.config_loader import LiveLocalCL
from apolo_flow.context import RunningLiveFlow
from apolo_flow.parser import ConfigDir, parse_live

workspace, multi_params = Path(sys.argv[1]), json.loads(sys.argv[2])


class Parse:  # the client's URI parser, minus the platform: storage:/image: stay as written
    def str_to_uri(self, text, project_name=None, short=False):
        return URL(text)


# Evaluating the flow asks the client only for these; no login, no network.
client = SimpleNamespace(
    config=SimpleNamespace(project_name_or_raise="proj", username="alice", org_name=None), parse=Parse()
)


async def main():
    flow_ast = parse_live(workspace, workspace / ".neuro" / "live.yml")
    flow = await RunningLiveFlow.create(LiveLocalCL(ConfigDir(workspace, workspace / ".neuro"), client), "live")
    out = {"kind": flow_ast.kind.value, "images": {}, "volumes": {}, "jobs": {}}
    for name, image in flow.images.items():
        out["images"][name] = {"ref": image.ref, "context": str(image.context), "dockerfile": str(image.dockerfile)}
    for name, volume in flow.volumes.items():
        out["volumes"][name] = {"remote": str(volume.remote), "mount": str(volume.mount), "local": str(volume.local)}
    for job_id in flow.job_ids:
        meta = await flow.get_meta(job_id)
        if meta.multi:
            job = await flow.get_multi_job(job_id, "s1", None, multi_params)
        else:
            job = await flow.get_job(job_id, {})
        out["jobs"][job_id] = json.loads(json.dumps(dataclasses.asdict(job), default=str))
    print(json.dumps(out))


asyncio.run(main())
"""


def evaluate(env: dict[str, str], workspace: Path, params: dict[str, str]) -> subprocess.CompletedProcess:
    """neuro-flow's parse and evaluation of WORKSPACE/.neuro/live.yml; stdout is JSON on success."""
    return subprocess.run(
        [sys.executable, "-c", EVALUATE, str(workspace), json.dumps(params)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def describe(doc: dict, out: dict) -> list[str]:
    """One line per volume and per job of an evaluated flow."""
    lines = []
    for name, vol in out["volumes"].items():
        local = doc["volumes"][name].get("local")
        lines.append(f"volume {name}: {vol['remote']} at {vol['mount']}" + (f" (local {local}/)" if local else ""))
    by_remote = {vol["remote"]: name for name, vol in out["volumes"].items()}
    for name, job in out["jobs"].items():
        mounts = []
        for spec in job.get("volumes") or []:
            remote, _, mode = spec.rpartition(":")
            remote = remote.rpartition(":")[0]
            mounts.append(f"{by_remote.get(remote, remote)} {mode}")
        secrets = sorted(v.removeprefix("secret:") for v in (job.get("env") or {}).values() if v.startswith("secret:"))
        parts = [f"job {name}: preset {job.get('preset')}", "volumes " + (", ".join(mounts) or "none")]
        parts.append("secrets " + (", ".join(secrets) or "none"))
        params = doc["jobs"][name].get("params") or {}
        parts.append("params " + (", ".join(params) or "none"))
        lines.append("; ".join(parts))
    return lines


def _exception_text(stderr: str) -> str:
    """The exception at the end of a traceback, its lines (message, YAML locations) joined into one."""
    lines = stderr.strip().splitlines() or ["no output"]
    starts = [i for i, line in enumerate(lines) if re.match(r"[A-Za-z_][\w.]*(Error|Exception)\b", line)]
    return " ".join(" ".join(lines[starts[-1] if starts else -1 :]).split())


def check(workspace: Path, install: bool = True) -> list[str]:
    """The lines `make check-flow` prints; FlowError for the first kind of problem found."""
    live = workspace / ".neuro" / "live.yml"
    try:
        doc = yaml.safe_load(live.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise FlowError(f"cannot read {live}: {' '.join(str(err).split())}") from None
    problems = undefined_references(doc if isinstance(doc, dict) else {})
    if problems:
        raise FlowError("\n".join(f"{live}: {p}" for p in problems))
    proc = evaluate(neuro_flow_env(install), workspace, {})
    if proc.returncode != 0:
        raise FlowError(f"{live}: neuro-flow rejects it: {_exception_text(proc.stderr)}")
    out = json.loads(proc.stdout)
    lines = describe(doc, out)
    lines.append(f"{live}: {len(out['jobs'])} jobs, {len(out['volumes'])} volumes, every reference defined")
    return lines


def main(argv: list[str]) -> int:
    workspace = Path(argv[0]) if argv else ROOT
    try:
        lines = check(workspace.resolve())
    except FlowError as err:
        for line in str(err).splitlines():
            print(f"check-flow: error: {line}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
