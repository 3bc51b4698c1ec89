"""A resume or an export builds the model again from model.name's files: a config.json edited since
(another activation here) loaded the same tensors into another computation, and the run went on,
or the export packaged it, with exit 0. The checkpoint keeps the config it was trained with; keys
that do not decide what the model computes (dropout, the transformers version) may change."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import BertConfig, BertModel

from conftest import SMALL
from distqa.errors import ConfigError
from distqa.export import export_checkpoint
from distqa.models import RANDOM_MODELS
from distqa.registry import load_config
from distqa.trainer import train

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture()
def folder_run(tmp_path, minilm_dir):
    """A tiny BERT saved as a local model folder (with MiniLM's tokenizer), trained 2 steps on the
    DummyDataset: checkpoints/step-2."""
    folder = tmp_path / "mdl"
    BertModel(BertConfig(**RANDOM_MODELS["tiny"])).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_dir / name, folder / name)
    args = [*SMALL, f"model.name={folder}", "train.batch_size=2", f"output_dir={tmp_path / 'run'}"]
    train(load_config(None, [*args, "train.max_steps=2", "train.checkpoint_every=2"]))
    return folder, args


def edit(folder, **values) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(values)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.safety  # about 3 s: make test-safety, for make test's 5 minutes
def test_a_resume_refuses_a_model_config_edited_since_the_checkpoint(folder_run):
    folder, args = folder_run
    edit(folder, hidden_act="relu", layer_norm_eps=1e-5)
    with pytest.raises(ConfigError, match="trained with another model config than this run builds") as caught:
        train(load_config(None, [*args, "train.max_steps=4"]))
    assert "hidden_act: 'gelu' then, 'relu' now; layer_norm_eps: 1e-12 then, 1e-05 now" in str(caught.value)


@pytest.mark.safety  # about 3 s: make test-safety, for make test's 5 minutes
def test_an_export_refuses_a_model_config_edited_since_the_checkpoint(folder_run, tmp_path):
    folder, _ = folder_run
    step = tmp_path / "run" / "checkpoints" / "step-2"
    assert (export_checkpoint(str(step), str(tmp_path / "before")) / "config.json").is_file()
    edit(folder, hidden_act="relu")
    with pytest.raises(ConfigError, match=f"another model config than model.name='{folder}' holds now") as caught:
        export_checkpoint(str(step), str(tmp_path / "after"))
    assert "put back the files it was trained with" in str(caught.value)
    assert not (tmp_path / "after").exists()


@pytest.mark.safety  # about 3 s: make test-safety, for make test's 5 minutes
def test_dropout_and_the_transformers_version_may_change_on_resume(folder_run, tmp_path):
    folder, args = folder_run
    edit(folder, hidden_dropout_prob=0.2, transformers_version="4.0.0")
    train(load_config(None, [*args, "train.max_steps=4"]))
    assert (tmp_path / "run" / "checkpoints" / "step-4").is_dir()


@pytest.mark.safety  # about 3 s: make test-safety, for make test's 5 minutes
def test_edits_that_change_nothing_computed_are_no_refusal(folder_run, tmp_path):
    """Class names (unused by a question-answering head) and the feed-forward's chunking (the same
    numbers, computed in pieces) were refused as another model config (found by a review)."""
    folder, args = folder_run
    edit(folder, id2label={"0": "A", "1": "B"}, label2id={"A": 0, "B": 1}, chunk_size_feed_forward=16)
    train(load_config(None, [*args, "train.max_steps=4"]))
    assert (tmp_path / "run" / "checkpoints" / "step-4").is_dir()


def test_a_model_with_one_token_type_is_refused_when_built(tmp_path, minilm_dir):
    """NQ's windows mark the document with token type 1; RoBERTa's and XLM-R's configs hold one
    type. Every start-up check passed, the features were built (hours on the 17 GB file), and the
    first forward ended in 'IndexError: index out of range in self' (found by a review)."""
    from transformers import RobertaConfig, RobertaModel

    from distqa.errors import DistqaError

    folder = tmp_path / "roberta"
    RobertaModel(RobertaConfig(**{**RANDOM_MODELS["tiny"], "type_vocab_size": 1})).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_dir / name, folder / name)
    args = [*SMALL, f"model.name={folder}", "train.batch_size=2", "train.max_steps=1", f"output_dir={tmp_path / 'run'}"]
    refused = r"has 1 token type\(s\) \(its type_vocab_size\), and this task.s inputs use 2"
    with pytest.raises(DistqaError, match=refused):
        train(load_config(None, args))
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(("types", "refused"), [(0, False), (1, True), (2, False), (None, False)])
def test_the_token_type_check_refuses_only_a_table_too_small(types, refused):
    """0 is no token-type table (DeBERTa-v3: segment ids ignored, as ModernBERT's), which trained
    before the check and must still (found by a review); 1 (RoBERTa, XLM-R) cannot take type 1."""
    import types as pytypes

    from torch import nn

    from distqa.config import ModelConfig
    from distqa.errors import DistqaError
    from distqa.models import check_model_fits

    model = nn.Linear(1, 1)
    model.config = pytypes.SimpleNamespace(type_vocab_size=types, max_position_embeddings=512, vocab_size=100)
    check = lambda: check_model_fits(model, ModelConfig(name="m"), max_seq_len=64, tokenizer=None, token_types=2)  # noqa: E731
    if refused:
        with pytest.raises(DistqaError, match="has 1 token type"):
            check()
    else:
        check()
