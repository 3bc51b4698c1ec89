""".neuro/live.yml: parsed and evaluated by neuro-flow itself, and every reference defined.

neuro-flow 24.12.1 (module apolo_flow) cannot share the project's environment: through
apolo-extras it needs python-dateutil<3 (aiobotocore/botocore), while the pinned requirements
resolve to python-dateutil 4. So it lives in a folder of its own, used only by a subprocess:
$NEURO_FLOW_TARGET, default .venv/neuro-flow, installed there on first use with
`pip install --target` (about 40 s; DISTQA_NO_NEURO_FLOW_INSTALL=1 skips that and these tests).
Those tests are marked `download`: `make test-download` runs them, `make test` leaves them out.

The reference check (volumes.X / images.X / params.X / mixins) needs only PyYAML and runs in `make test`:
neuro-flow's parser checks the syntax and the schema but not that a referenced name exists.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LIVE = ROOT / ".neuro" / "live.yml"
NEURO_FLOW = "neuro-flow==24.12.1"
EXPR = re.compile(r"\$\{\{(.*?)\}\}|\$\[\[(.*?)\]\]", re.S)
REF = re.compile(r"\b(volumes|images|params)\.([A-Za-z_][A-Za-z0-9_]*)")
# The parameters scripts/run_distributed_on_platform.sh passes with --param.
PLATFORM_SCRIPT_PARAMS = {"name", "nnodes", "node_rank", "master_addr", "master_port", "train_args"}


def load() -> dict:
    return yaml.safe_load(LIVE.read_text())


def strings(node: object, path: str = ""):
    """Every string in the document with where it is: ("jobs.train.cmd", "...")."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from strings(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from strings(value, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


def undefined_references(doc: dict) -> list[str]:
    volumes, images = set(doc.get("volumes") or {}), set(doc.get("images") or {})
    mixins = doc.get("mixins") or {}
    problems = []
    for section in ("jobs", "mixins"):
        for name, body in (doc.get(section) or {}).items():
            for mixin in body.get("mixins") or []:
                if mixin not in mixins:
                    problems.append(f"{section}.{name}: unknown mixin {mixin!r}")
    for where, text in strings(doc):
        # params.X is scoped to its job; a mixin's params.X must exist in every job that uses it.
        parts = where.split(".")
        if parts[0] == "jobs":
            scopes = [set(doc["jobs"][parts[1]].get("params") or {})]
        elif parts[0] == "mixins":
            users = [j for j in doc["jobs"].values() if parts[1] in (j.get("mixins") or [])]
            scopes = [set(j.get("params") or {}) for j in users] or [set()]
        else:
            scopes = [set()]
        for match in EXPR.finditer(text):
            for kind, ref in REF.findall(match.group(1) or match.group(2)):
                if kind == "volumes" and ref not in volumes:
                    problems.append(f"{where}: volumes.{ref} is not defined")
                elif kind == "images" and ref not in images:
                    problems.append(f"{where}: images.{ref} is not defined")
                elif kind == "params" and any(ref not in scope for scope in scopes):
                    problems.append(f"{where}: params.{ref} is not a parameter of the job")
    return problems


def test_every_reference_is_defined():
    assert undefined_references(load()) == []


def test_the_reference_check_finds_what_neuro_flow_does_not():
    """The recipe this file started from referred to an undefined volumes.notebooks."""
    doc = load()
    doc["jobs"]["jupyter"]["volumes"].append("${{ volumes.notebooks.ref_rw }}")
    doc["jobs"]["tensorboard"]["image"] = "$[[ images.tb_image.ref ]]"
    doc["jobs"]["train"]["cmd"] = "${{ params.nnodes }}"
    doc["mixins"]["node"]["env"]["X"] = "${{ params.node_rank }}"  # train, using the mixin, has none
    doc["jobs"]["tensorboard"]["mixins"] = ["gpu"]
    problems = "\n".join(undefined_references(doc))
    for expected in (
        "volumes.notebooks is not defined",
        "images.tb_image is not defined",
        "jobs.train.cmd: params.nnodes",
        "mixins.node.env.X: params.node_rank",
        "unknown mixin 'gpu'",
    ):
        assert expected in problems


def test_layout_and_contract():
    doc = load()
    assert doc["kind"] == "live"
    image = doc["images"]["train_image"]
    assert image["dockerfile"].endswith("/Dockerfile") and (ROOT / "Dockerfile").is_file()
    assert {"train", "distributed_training", "tensorboard", "jupyter"} <= set(doc["jobs"])
    for volume in ("data", "code", "config", "results"):
        assert (ROOT / doc["volumes"][volume]["local"]).is_dir(), volume
    dist = doc["jobs"]["distributed_training"]
    assert PLATFORM_SCRIPT_PARAMS == set(dist["params"])
    assert dist["multi"] is True and dist["detach"] is True
    # Credentials only as platform secrets.
    envs = [doc["mixins"]["node"]["env"], doc["jobs"]["jupyter"]["env"]]
    assert all(env["KAGGLE_KEY"].startswith("secret:") for env in envs)


# ---- neuro-flow itself, in its own folder ------------------------------------------------------

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
    out = {"kind": flow_ast.kind.value, "images": {}, "jobs": {}}
    for name, image in flow.images.items():
        out["images"][name] = {"ref": image.ref, "context": str(image.context), "dockerfile": str(image.dockerfile)}
    for job_id in flow.job_ids:
        if (await flow.get_meta(job_id)).multi:
            job = await flow.get_multi_job(job_id, "s1", None, multi_params)
        else:
            job = await flow.get_job(job_id, {})
        out["jobs"][job_id] = json.loads(json.dumps(dataclasses.asdict(job), default=str))
    print(json.dumps(out))


asyncio.run(main())
"""


@pytest.fixture(scope="session")
def neuro_flow_env() -> dict[str, str]:
    """An environment whose Python imports apolo_flow: this one, or a --target folder."""
    env = dict(os.environ)
    probe = subprocess.run([sys.executable, "-c", "import apolo_flow"], capture_output=True)
    if probe.returncode == 0:
        return env
    target = Path(os.environ.get("NEURO_FLOW_TARGET", ROOT / ".venv" / "neuro-flow"))
    if not (target / "apolo_flow").is_dir():
        if os.environ.get("DISTQA_NO_NEURO_FLOW_INSTALL") == "1":
            pytest.skip(f"apolo_flow not importable and not in {target} (DISTQA_NO_NEURO_FLOW_INSTALL=1)")
        partial = target.with_name(target.name + ".partial")
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(partial), NEURO_FLOW]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip(f"installing {NEURO_FLOW} into {partial} took over 10 minutes")
        if proc.returncode != 0:
            pytest.skip(f"could not install {NEURO_FLOW} (no package index?): {proc.stderr.strip()[-300:]}")
        partial.rename(target)
    env["PYTHONPATH"] = os.pathsep.join([str(target), *filter(None, [env.get("PYTHONPATH")])])
    return env


def evaluate(env: dict[str, str], workspace: Path, params: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", EVALUATE, str(workspace), json.dumps(params)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.download
def test_neuro_flow_parses_and_evaluates_every_job(neuro_flow_env):
    params = {
        "name": "ddp7-n1",
        "nnodes": "3",
        "node_rank": "1",
        "master_addr": "job-0.platform-jobs",
        "master_port": "29500",
        "train_args": "model.name=tiny 'output_dir=/app/results/a b'",
    }
    assert set(params) == PLATFORM_SCRIPT_PARAMS
    proc = evaluate(neuro_flow_env, ROOT, params)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["kind"] == "live"
    image = out["images"]["train_image"]
    assert Path(image["dockerfile"]) == ROOT / "Dockerfile" and Path(image["context"]) == ROOT

    jobs = out["jobs"]
    dist = jobs["distributed_training"]
    assert dist["multi"] and dist["detach"] and dist["name"] == "ddp7-n1"
    assert dist["entrypoint"] == "/app/scripts/worker.sh"
    assert shlex.split(dist["cmd"]) == ["model.name=tiny", "output_dir=/app/results/a b"]
    assert {k: dist["env"][k] for k in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")} == {
        "NNODES": "3",
        "NODE_RANK": "1",
        "MASTER_ADDR": "job-0.platform-jobs",
        "MASTER_PORT": "29500",
    }
    assert dist["env"]["KAGGLE_KEY"] == "secret:kaggle_key"
    assert any(v.endswith("/results:/app/results:rw") for v in dist["volumes"])
    assert any(v.endswith("/data:/app/data:ro") for v in dist["volumes"])

    train = jobs["train"]
    assert train["entrypoint"] == "/app/scripts/worker.sh" and not train["multi"]
    assert "NNODES" not in train["env"]  # one node: worker.sh's defaults
    assert shlex.split(train["cmd"])[-1] == "output_dir=/app/results/bert-base"
    assert jobs["tensorboard"]["http_port"] == 6006 and "--logdir /app/results" in jobs["tensorboard"]["cmd"]
    assert jobs["jupyter"]["http_port"] == 8888 and jobs["jupyter"]["http_auth"] is True


@pytest.mark.download
def test_distributed_training_defaults_and_unknown_params(neuro_flow_env):
    out = json.loads(evaluate(neuro_flow_env, ROOT, {}).stdout)
    dist = out["jobs"]["distributed_training"]
    assert (dist["env"]["NNODES"], dist["env"]["NODE_RANK"], dist["env"]["MASTER_ADDR"]) == ("2", "0", "self")
    assert dist["name"] in ("", None)  # neuro-flow then names the job itself
    assert dist["cmd"].endswith("output_dir=/app/results/bert-base-ddp")
    proc = evaluate(neuro_flow_env, ROOT, {"node_rnak": "1"})
    assert proc.returncode != 0 and "Unsupported arg(s): node_rnak" in proc.stderr


@pytest.mark.download
def test_neuro_flow_rejects_a_broken_file(neuro_flow_env, tmp_path):
    """The same evaluation fails on a schema error, so the tests above can fail."""
    (tmp_path / ".neuro").mkdir()
    broken = LIVE.read_text().replace("    http_port: 6006\n", "    http_port: 6006\n    gpus: 1\n")
    (tmp_path / ".neuro" / "live.yml").write_text(broken)
    proc = evaluate(neuro_flow_env, tmp_path, {})
    assert proc.returncode != 0 and "gpus" in proc.stderr
