"""Every rank runs the same code and builds the same model and tokenizer, or none starts.

A review ran two nodes whose settings agreed but whose files did not: node 1's copy of the model
folder had another `layer_norm_eps`, its tokenizer two vocabulary entries swapped, its distqa a
changed loss. Each trained to exit 0 on a mix of two computations. Two processes stand for the
two nodes here, each building what its own files say."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

from distqa.build_identity import config_identity, module_differences, tokenizer_hash, weight_summary, weights_differ
from distqa.models import build_hf_model

CASES = ("same", "config", "weights", "tokenizer")
REFUSAL = "the processes of this run did not build the same thing"

TWO_NODES = """
import os, sys, torch, torch.distributed as dist
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast
from distqa.build_identity import check_same_build
from distqa.dist import DistInfo
from distqa.errors import DistqaError
from distqa.task import Task
from distqa.config import ModelConfig
from distqa.models import build_hf_model

class Stand_in:  # what check_same_build asks of a task
    identity = Task.identity

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
info = DistInfo(rank=rank, local_rank=0, world_size=2, device=torch.device("cpu"))
for case in sys.argv[2:]:
    odd = rank == 1 and case != "same"
    torch.manual_seed(2 if odd and case == "weights" else 1)
    model = build_hf_model(AutoModelForSequenceClassification, ModelConfig(name="tiny"), num_labels=2)
    if odd and case == "config":
        model.config.layer_norm_eps = 0.5
    task = Stand_in()
    name = "tok-swapped" if odd and case == "tokenizer" else "tok"
    task.tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(sys.argv[1], name))
    if rank == 0:  # tokenizing sets the backend's truncation and padding: no difference in the ids
        task.tokenizer(["a b c"], truncation=True, max_length=4, padding="max_length")
    try:
        check_same_build(model, task, info)
        print(case, "agreed", flush=True)
    except DistqaError as err:
        print(case, "refused:", err, flush=True)
dist.destroy_process_group()
"""


def save_tokenizers(folder: Path) -> None:
    """A WordLevel tokenizer, and the same with two vocabulary entries swapped."""
    vocab = {"[PAD]": 0, "[UNK]": 1, "a": 2, "b": 3, "c": 4, "good": 5, "bad": 6}
    for name, table in (("tok", vocab), ("tok-swapped", {**vocab, "good": 6, "bad": 5})):
        backend = Tokenizer(models.WordLevel(table, unk_token="[UNK]"))
        backend.normalizer = normalizers.Lowercase()
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(
            folder / name
        )


def two_nodes(folder: Path, *, node1_src: Path | None = None) -> list[dict[str, str]]:
    from conftest import free_port, subprocess_env

    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = []
    for rank in (0, 1):
        extra = {"PYTHONPATH": str(node1_src)} if node1_src is not None and rank == 1 else {}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-W", "ignore", "-c", TWO_NODES, str(folder), *CASES],
                env={**subprocess_env(RANK=str(rank), **env), **extra},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        outputs.append(dict(line.split(" ", 1) for line in out.splitlines()))
    assert outputs[0] == outputs[1]  # the same line on every rank
    return outputs


@pytest.mark.safety
def test_nodes_that_build_another_model_or_tokenizer_stop_naming_it(tmp_path):
    save_tokenizers(tmp_path)
    lines = two_nodes(tmp_path)[0]
    assert lines["same"] == "agreed"
    cases = (("config", "model config (rank 0: "), ("weights", "model weights (rank(s) 1 built "))
    for case, what in (*cases, ("tokenizer", "tokenizer (rank 0: ")):
        assert lines[case].startswith(f"refused: {REFUSAL}: {what}"), lines[case]
        assert lines[case].count("(rank") == 1, lines[case]  # only what differs is named
        assert "find the same files for model.name and model.tokenizer" in lines[case]


@pytest.mark.safety
def test_a_node_with_other_distqa_code_stops_naming_it(tmp_path):
    import distqa

    save_tokenizers(tmp_path)
    src = tmp_path / "src"
    shutil.copytree(Path(distqa.__file__).parent, src / "distqa", ignore=shutil.ignore_patterns("__pycache__"))
    loss = src / "distqa" / "train_step.py"
    loss.write_text(loss.read_text() + "\n# a node whose code was edited\n")
    lines = two_nodes(tmp_path, node1_src=src)[0]
    assert lines["same"].startswith(
        "refused: the processes of this run did not build the same thing: distqa code (rank 0: "
    )
    assert lines["same"].count("(rank 0:") == 1


IDENTITY_OF = """
import json, sys
from distqa.build_identity import code_identity, own_modules
task = __import__(sys.argv[1], fromlist=["Task"]).Task()
print(json.dumps({"code": code_identity(task), "modules": own_modules(task)}))
"""


def identities_in(folder: Path, module: str, *, site: bool = False) -> dict[str, dict[str, str]]:
    """`code_identity` and `own_modules` of `module`'s Task, as a node whose PYTHONPATH is `folder`
    computes them (`site`: `folder` is a site-packages folder, where an image installs a fork)."""
    from conftest import subprocess_env

    script = IDENTITY_OF if not site else f"import site; site.addsitedir({str(folder)!r})\n{IDENTITY_OF}"
    env = subprocess_env(**({} if site else {"PYTHONPATH": str(folder)}))
    done = subprocess.run([sys.executable, "-c", script, module], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.safety  # each layout about 6 s: make test-safety, for make test's 5 minutes
@pytest.mark.parametrize("layout", ["flat", "package", "installed"])
def test_code_a_fork_s_task_imports_from_beside_it_is_part_of_its_identity(tmp_path, layout):
    """A review trained two nodes whose task module was the same and whose loss differed, in a
    module it imports: flatloss.py beside a flat task module, or a package one level above the
    task's own, or either installed into site-packages (the Dockerfile's `pip install ./`); exit 0
    and a loss of 78.8 where the same code gave 1.70. Only the task's own file (or its package's
    folder) was hashed."""
    task_code = "class Task:\n    pass\n"

    def node(name: str, scale: str) -> Path:
        root = tmp_path / name / ("lib/python3/site-packages" if layout == "installed" else "")
        if layout == "flat":
            root.mkdir(parents=True)
            (root / "flattask.py").write_text("import flatloss\n" + task_code)
            (root / "flatloss.py").write_text(f"SCALE = {scale}\n")
        else:
            (root / "ftop" / "tasks").mkdir(parents=True)
            (root / "ftop" / "__init__.py").write_text("")
            (root / "ftop" / "tasks" / "__init__.py").write_text("")
            (root / "ftop" / "tasks" / "t.py").write_text("import ftop.lossmod\n" + task_code)
            (root / "ftop" / "lossmod.py").write_text(f"SCALE = {scale}\n")
        return root

    module, loss = ("flattask", "flatloss") if layout == "flat" else ("ftop.tasks.t", "ftop.lossmod")
    site = layout == "installed"
    first, same, other = (identities_in(node(n, s), module, site=site) for n, s in (("a", "1"), ("b", "1"), ("c", "9")))
    assert first == same  # the same code in another folder: nodes keep it where they like
    assert first["code"]["task code"] == other["code"]["task code"]  # the task's own file is unchanged...
    assert first["modules"][loss] != other["modules"][loss]  # ...what it imports is not
    assert module_differences([first["modules"], other["modules"]]).startswith(f"{loss} (rank 0: ")
    assert "torch" not in first["modules"] and not any(name.startswith("distqa") for name in first["modules"])


def test_a_module_one_rank_loaded_alone_is_no_difference():
    """A fork's module imported by the process that builds a cache once per node, or by rank 0
    alone: only modules both ranks loaded are compared (the first version refused such runs)."""
    assert module_differences([{"fork.task": "aa", "fork.convert": "bb"}, {"fork.task": "aa"}]) == ""
    assert (
        module_differences([{"fork.task": "aa"}, {"fork.task": "cc"}, {}]) == "fork.task (rank 0: 'aa', rank 1: 'cc')"
    )


def test_the_identities_see_what_changes_the_computation_and_nothing_else(tmp_path):
    import torch

    from distqa.config import ModelConfig

    save_tokenizers(tmp_path)
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok")
    before = tokenizer_hash(tok)
    tok(["a b"], truncation=True, max_length=2, padding="max_length")
    assert tokenizer_hash(tok) == before
    assert tokenizer_hash(PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok-swapped")) != before
    assert tokenizer_hash(object()) is None  # a fork's own kind of tokenizer: its identity() says
    # How a call pads, truncates and what it returns (tokenizer_config.json): a left-padding copy
    # moved every padded text's positions, exit 0 (a review). The class's own values hash as before.
    assert tokenizer_hash(PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok", padding_side="right")) == before
    for name, value in (("padding_side", "left"), ("truncation_side", "left"), ("model_input_names", ["input_ids"])):
        edited = PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok", **{name: value})
        assert tokenizer_hash(edited) != before, name

    def built(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return build_hf_model(AutoModelForSequenceClassification, ModelConfig(name="tiny"), num_labels=2)

    model, reference = built(0), weight_summary(built(0))
    assert weights_differ(weight_summary(model), reference) == []
    with torch.no_grad():  # the last bits of every weight, as another CPU's random numbers differ
        for param in model.parameters():
            param.mul_(1 + 2e-7)
    assert weights_differ(weight_summary(model), reference) == []
    with torch.no_grad():
        model.classifier.weight[0, 0] += 0.5
    assert weights_differ(weight_summary(model), reference) == ["classifier.weight"]
    assert weights_differ(weight_summary(built(1)), reference)  # other random weights: most tensors

    # A config value JSON cannot hold (its repr names an address, other in every build) counts by its type.
    first, second = built(0), built(0)
    first.config.custom, second.config.custom = object(), object()
    assert config_identity(first) == config_identity(second)
    second.config.layer_norm_eps = 0.5
    assert config_identity(first) != config_identity(second)
    # The attention kernel, which the config's dict leaves out: named as it is.
    third = built(0)
    assert config_identity(third)["attention kernel"] == third.config._attn_implementation
    third.config._attn_implementation = "eager" if third.config._attn_implementation != "eager" else "sdpa"
    assert config_identity(third)["model config"] == config_identity(built(0))["model config"]
    assert config_identity(third)["attention kernel"] != config_identity(built(0))["attention kernel"]


def test_a_resume_whose_tokenizer_files_changed_is_refused_naming_it(tmp_path, minilm_dir):
    """The same model.tokenizer setting, other files (a hub id's newer snapshot, a folder replaced):
    textcls tokenizes as it collates, so nothing else would see that the ids changed."""
    from distqa.errors import ConfigError
    from distqa.registry import load_config
    from distqa.trainer import train
    from test_textcls import LABELS, write_keyword_csv

    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        if (minilm_dir / name).is_file():
            shutil.copy(minilm_dir / name, tok / name)
    out = tmp_path / "run"
    args = ["task.name=textcls", f"task.labels={LABELS}", "model.name=tiny", f"model.tokenizer={tok}"]
    args += [f"data.train={write_keyword_csv(tmp_path / 't.csv', 32, 0)}", "data.num_workers=0"]
    args += ["train.batch_size=8", f"output_dir={out}"]
    train(load_config(None, [*args, "train.max_steps=2"]))
    vocab = (tok / "vocab.txt").read_text().splitlines()
    first, second = vocab.index("good"), vocab.index("bad")
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tok / "vocab.txt").write_text("\n".join(vocab) + "\n")
    with pytest.raises(ConfigError) as refused:
        train(load_config(None, [*args, "train.max_steps=4"]))
    assert str(refused.value).startswith(
        f"checkpoint {out / 'checkpoints' / 'step-2'} was trained with another tokenizer than this run builds ("
    ), refused.value
    assert "give model.name and model.tokenizer the files it was trained with" in str(refused.value)


def test_a_fork_s_identity_keeps_the_tokenizer_s_hash(tmp_path):
    """A fork's `identity()` that returned only its own part (a lexicon's hash) dropped the
    tokenizer's: a resume onto a tokenizer with two ids swapped went on, exit 0."""
    from distqa.build_identity import full_identity

    save_tokenizers(tmp_path)

    class Fork:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok")

        def identity(self):
            return {"lexicon": "abc"}

    swapped = Fork()
    swapped.tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok-swapped")
    assert full_identity(Fork()) == {"tokenizer": tokenizer_hash(Fork.tokenizer), "lexicon": "abc"}
    assert full_identity(swapped)["tokenizer"] != full_identity(Fork())["tokenizer"]
