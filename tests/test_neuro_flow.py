""".neuro/live.yml: parsed and evaluated by neuro-flow itself, every reference defined, and the
documented Kaggle -> Neu.ro -> submission path (docs/containers.md#neuro) checked command by command.

The checks are scripts/check_flow.py's (`make check-flow`): neuro-flow 24.12.1 (module apolo_flow)
lives in a folder of its own, $NEURO_FLOW_TARGET (default .venv/neuro-flow), installed there on first
use with `pip install --target` (about 40 s; DISTQA_NO_NEURO_FLOW_INSTALL=1 skips that and these
tests): marked `download` (`make test-download`). The reference check and the docs' commands
against the YAML need only PyYAML and run in `make test`.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LIVE = ROOT / ".neuro" / "live.yml"
DOCS = ROOT / "docs" / "containers.md"
# The parameters scripts/run_distributed_on_platform.sh passes with --param.
PLATFORM_SCRIPT_PARAMS = {"name", "nnodes", "node_rank", "master_addr", "master_port", "train_args"}

_spec = importlib.util.spec_from_file_location("check_flow", ROOT / "scripts" / "check_flow.py")
check_flow = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(check_flow)  # type: ignore[union-attr]
undefined_references = check_flow.undefined_references


def load() -> dict:
    return yaml.safe_load(LIVE.read_text())


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
    # Credentials only as platform secrets, and only where used: download and jupyter.
    envs = [doc["jobs"]["download"]["env"], doc["jobs"]["jupyter"]["env"]]
    assert all(env["KAGGLE_KEY"].startswith("secret:") for env in envs)
    assert "KAGGLE_KEY" not in doc["mixins"]["node"]["env"]


# ---- neuro-flow itself, in its own folder ------------------------------------------------------


@pytest.fixture(scope="session")
def neuro_flow_env() -> dict[str, str]:
    """An environment whose Python imports apolo_flow: this one, or the --target folder."""
    try:
        return check_flow.neuro_flow_env()
    except check_flow.FlowError as err:
        pytest.skip(str(err))


evaluate = check_flow.evaluate  # neuro-flow's parse and evaluation, JSON on stdout


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
    assert "KAGGLE_KEY" not in dist["env"]  # training needs no credentials
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


# ---- the platform path: contract, docs, make check-flow ----------------------------------------

# Jobs that load a model or a tokenizer, so need HF_HOME on the persistent cache volume.
MODEL_JOBS = ("prepare", "train", "distributed_training", "predict", "jupyter")


def job_volumes(doc: dict, name: str) -> list[str]:
    job = doc["jobs"][name]
    mixed = [v for m in job.get("mixins") or [] for v in doc["mixins"][m].get("volumes") or []]
    return mixed + list(job.get("volumes") or [])


def job_env(doc: dict, name: str) -> dict[str, str]:
    job = doc["jobs"][name]
    env: dict[str, str] = {}
    for mixin in job.get("mixins") or []:
        env.update(doc["mixins"][mixin].get("env") or {})
    return {**env, **(job.get("env") or {})}


def test_download_prepare_and_the_cache_volume():
    doc = load()
    for name in doc["jobs"]:
        data = [v for v in job_volumes(doc, name) if "volumes.data." in v]
        expected = ["${{ volumes.data.ref_rw }}"] if name == "download" else ["${{ volumes.data.ref_ro }}"]
        assert data in ([], expected), name  # writable in download only
    download = doc["jobs"]["download"]
    assert "distqa download --output ${{ volumes.data.mount }}" in download["cmd"]
    assert job_env(doc, "download")["KAGGLE_USERNAME"] == "secret:kaggle_username"
    assert job_env(doc, "download")["KAGGLE_KEY"] == "secret:kaggle_key"
    assert "distqa prepare" in doc["jobs"]["prepare"]["cmd"]
    for name in MODEL_JOBS:
        assert job_env(doc, name)["HF_HOME"].startswith("${{ volumes.cache.mount }}/"), name
        assert "${{ volumes.cache.ref_rw }}" in job_volumes(doc, name), name


def test_the_default_training_names_natural_questions_data():
    """train's default arguments and the documented run_distributed_on_platform.sh example use
    configs/bert-base.yaml, which names the split that `download` writes and `prepare` prepares."""
    doc = load()
    for name in ("train", "distributed_training"):
        args = shlex.split(doc["jobs"][name]["params"]["train_args"]["default"])
        config = yaml.safe_load((ROOT / args[args.index("--config") + 1]).read_text())
        assert config["data"]["train"] == "data/split/train.jsonl", name
        assert config["data"]["valid"] == "data/split/valid.jsonl", name
        assert not any(a.startswith("data.train=") for a in args), name
    mount = doc["volumes"]["data"]["mount"]
    assert mount == "/app/data"  # the image's working directory is /app: data/split/... is on the volume
    split = doc["jobs"]["download"]["params"]["split_args"]["default"]
    assert split.endswith("--output ${{ volumes.data.mount }}/split")
    prepare = doc["jobs"]["prepare"]["cmd"]
    assert "--input data/split/train.jsonl --mode train" in prepare
    assert "--input data/split/valid.jsonl --mode eval" in prepare


def docs_steps() -> list[tuple[int, list[str]]]:
    """The numbered list of docs/containers.md's Neu.ro section: (number, its commands), a command
    being the first backticked text of the item, split on `&&`."""
    section = DOCS.read_text().split("## Neu.ro\n", 1)[1].split("\n## ", 1)[0]
    items = re.findall(r"^(\d+)\. (.*?)(?=^\d+\. |^\s*$)", section, re.M | re.S)
    steps = []
    for number, text in items:
        command = re.search(r"`([^`]+)`", text).group(1)  # type: ignore[union-attr]
        steps.append((int(number), [c.strip() for c in command.split("&&")]))
    return steps


def check_command(doc: dict, words: list[str], secrets: set[str]) -> None:
    """One documented command against the flow: its job, volume, image, parameter or secret exists."""
    tool, rest = words[0], words[1:]
    if tool == "neuro-flow" and rest[0] == "run":
        job = doc["jobs"][rest[1]]
        for i, word in enumerate(rest):
            if word == "--param":
                assert rest[i + 1] in (job.get("params") or {}), words
    elif tool == "neuro-flow" and rest[0] in ("upload", "download"):
        assert doc["volumes"][rest[1]].get("local"), words
    elif tool == "neuro-flow" and rest[0] == "build":
        assert rest[1] in doc["images"], words
    elif tool == "neuro" and rest[:2] == ["secret", "add"]:
        assert rest[2] in secrets, words
    elif tool == "mkdir":
        locals_ = {v.get("local") for v in doc["volumes"].values()}
        assert set(rest[1:]) <= locals_, words
    elif tool == "scripts/run_distributed_on_platform.sh":
        assert PLATFORM_SCRIPT_PARAMS == set(doc["jobs"]["distributed_training"]["params"])
        args = rest[rest.index("--") + 1 :]
        assert (ROOT / args[args.index("--config") + 1]).is_file(), words
    elif tool == "make":
        assert re.search(rf"^{rest[0]}:", (ROOT / "Makefile").read_text(), re.M), words
    else:  # the rest touch no part of the flow
        assert " ".join(words[:2]) in ("pip install", "neuro login", "neuro-flow mkvolumes", "kaggle competitions"), (
            words
        )


def test_every_command_of_the_documented_path_matches_the_flow():
    doc = load()
    steps = docs_steps()
    assert [n for n, _ in steps] == list(range(1, len(steps) + 1))
    secrets = {v.removeprefix("secret:") for _, v in check_flow.strings(doc) if v.startswith("secret:")}
    commands = [shlex.split(c) for _, cs in steps for c in cs]
    for words in commands:
        check_command(doc, words, secrets)
    flat = [" ".join(w[:3]) for w in commands]
    order = ["neuro-flow run download", "neuro-flow run prepare", "neuro-flow run train", "neuro-flow run predict"]
    assert [flat.index(c) for c in order] == sorted(flat.index(c) for c in order)
    assert {s for w in commands if w[:3] == ["neuro", "secret", "add"] for s in w[3:4]} == secrets
    # It ends in the upload of the file that `predict` writes into results, downloaded to results/.
    submit = commands[-1]
    assert submit[:4] == ["kaggle", "competitions", "submit", "tensorflow2-question-answering"]
    local = submit[submit.index("-f") + 1]
    predict = doc["jobs"]["predict"]
    run = predict["params"]["run"]["default"].replace("${{ volumes.results.mount }}", "results")
    assert local == f"{run}/submission.csv" and "--output ${{ params.run }}/submission.csv" in predict["cmd"]
    assert "--input ${{ volumes.data.mount }}/simplified-nq-test.jsonl" in predict["cmd"]
    assert ["neuro-flow", "download", "results"] in commands


def test_the_docs_check_finds_a_command_the_flow_lacks():
    doc = load()
    for bad in (["neuro-flow", "run", "preprocess"], ["neuro-flow", "run", "train", "--param", "args", "x"]):
        with pytest.raises((AssertionError, KeyError)):
            check_command(doc, bad, set())
    with pytest.raises(AssertionError):
        check_command(doc, ["neuro", "secret", "add", "kaggle_token", "X"], {"kaggle_key"})


def planted(tmp_path: Path, text: str) -> Path:
    (tmp_path / ".neuro").mkdir()
    (tmp_path / ".neuro" / "live.yml").write_text(text)
    return tmp_path


def run_check_flow(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "scripts" / "check_flow.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


def test_check_flow_fails_on_a_job_naming_an_undefined_volume(tmp_path):
    """Found before neuro-flow runs (it would not see it), one line per problem."""
    bad = LIVE.read_text().replace("- ${{ volumes.data.ref_rw }}", "- ${{ volumes.dataset.ref_rw }}")
    proc = run_check_flow(str(planted(tmp_path, bad)))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"check-flow: error: {tmp_path}/.neuro/live.yml: jobs.download.volumes[0]: volumes.dataset is not defined"
    ]


@pytest.mark.download
def test_make_check_flow_prints_every_job_and_volume(neuro_flow_env):
    proc = subprocess.run(["make", "-s", "check-flow"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    doc = load()
    assert sorted(line.split(":")[0] for line in lines if line.startswith("volume ")) == sorted(
        f"volume {v}" for v in doc["volumes"]
    )
    jobs = {line.split(":")[0].removeprefix("job "): line for line in lines if line.startswith("job ")}
    assert set(jobs) == set(doc["jobs"])
    assert "volumes data rw, code ro; secrets kaggle_key, kaggle_username" in jobs["download"]
    assert "data ro, cache rw" in jobs["train"] and "secrets none" in jobs["train"]
    assert lines[-1].endswith(f"{len(doc['jobs'])} jobs, {len(doc['volumes'])} volumes, every reference defined")


@pytest.mark.download
def test_check_flow_fails_on_what_neuro_flow_rejects(neuro_flow_env, tmp_path):
    broken = LIVE.read_text().replace("    http_port: 6006\n", "    http_port: 6006\n    gpus: 1\n")
    proc = run_check_flow(str(planted(tmp_path, broken)), env=neuro_flow_env)
    assert proc.returncode == 1 and "neuro-flow rejects it" in proc.stderr and "gpus" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.download
def test_the_evaluated_platform_path(neuro_flow_env):
    """As neuro-flow evaluates the jobs: download with the data volume writable and the secrets,
    prepare, HF_HOME on the cache volume wherever a model or tokenizer is loaded."""
    jobs = json.loads(evaluate(neuro_flow_env, ROOT, {}).stdout)["jobs"]
    download = jobs["download"]
    assert any(v.endswith("/data:/app/data:rw") for v in download["volumes"])
    assert download["env"]["KAGGLE_USERNAME"] == "secret:kaggle_username"
    assert download["env"]["KAGGLE_KEY"] == "secret:kaggle_key"
    script = shlex.split(download["cmd"])
    assert download["entrypoint"] == "bash" and script[0] == "-c"
    assert script[1].startswith("distqa download --output /app/data && distqa split --input ")
    assert "--valid 2000 --output /app/data/split" in script[1]
    assert "distqa prepare --config configs/bert-base.yaml" in jobs["prepare"]["cmd"]
    for name in MODEL_JOBS:
        assert jobs[name]["env"]["HF_HOME"] == "/cache/huggingface", name
        assert any(v.endswith("/cache:/cache:rw") for v in jobs[name]["volumes"]), name
    for name in set(jobs) - {"download"}:
        assert not any(":/app/data:rw" in v for v in jobs[name]["volumes"]), name
    assert shlex.split(jobs["train"]["cmd"])[:2] == ["--config", "configs/bert-base.yaml"]
    assert jobs["predict"]["cmd"].endswith("--output /app/results/bert-base/submission.csv")
