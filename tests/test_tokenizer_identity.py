"""`distqa.models.tokenizer_difference`: whether a tokenizer given for a saved model would turn text
into other ids than the one saved with it (predict refuses it then: the model would read the wrong
words and write a plausible, wrong submission)."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from distqa.models import tokenizer_difference


def _variant(minilm_dir, folder, edit_tokenizer=None, edit_config=None, edit_roles=None):
    """MiniLM's tokenizer files copied into `folder`, tokenizer.json or tokenizer_config.json edited;
    `edit_roles` edits the special tokens in both files that name them."""
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, folder / name)
    edits = [("tokenizer.json", edit_tokenizer), ("tokenizer_config.json", edit_config)]
    edits += [("tokenizer_config.json", edit_roles), ("special_tokens_map.json", edit_roles)]
    for name, edit in edits:
        if edit:
            state = json.loads((folder / name).read_text())
            edit(state)
            (folder / name).write_text(json.dumps(state))
    return AutoTokenizer.from_pretrained(str(folder))


def _swap(state):
    vocab = state["model"]["vocab"]
    vocab["river"], vocab["city"] = vocab["city"], vocab["river"]


def test_the_same_tokenizer_and_settings_that_do_not_change_ids_are_no_difference(minilm_dir, tmp_path):
    saved = AutoTokenizer.from_pretrained(str(minilm_dir))
    again = _variant(minilm_dir, tmp_path / "again", edit_config=lambda c: c.update(model_max_length=64))
    assert again.model_max_length == 64
    assert tokenizer_difference(again, saved) is None


def test_two_swapped_words_and_another_casing_are_named(minilm_dir, tmp_path):
    saved = AutoTokenizer.from_pretrained(str(minilm_dir))
    swapped = _variant(minilm_dir, tmp_path / "swapped", edit_tokenizer=_swap)
    assert swapped("river")["input_ids"] != saved("river")["input_ids"]
    assert tokenizer_difference(swapped, saved) == "2 vocabulary entries differ (of 30522 and 30522)"
    cased = _variant(minilm_dir, tmp_path / "cased", edit_config=lambda c: c.update(do_lower_case=False))
    assert cased("River")["input_ids"] != saved("River")["input_ids"]
    assert tokenizer_difference(cased, saved) == (
        "same vocabulary, other normalization or splitting (lower-casing, accents, punctuation)"
    )


@pytest.mark.safety  # about 8 s: make test-safety, for make test's 5 minutes
def test_predict_refuses_a_given_tokenizer_that_is_not_the_saved_one(tmp_path, capsys, minilm_dir):
    from conftest import SMALL, TESTS
    from distqa.cli import main
    from distqa.nq.task import NQTask
    from distqa.registry import load_config

    model = tmp_path / "model"
    task = NQTask(load_config(None, SMALL))
    task.save_model(task.build_model(), model)
    task.save_settings(model)
    AutoTokenizer.from_pretrained(str(minilm_dir)).save_pretrained(str(model))  # saved with the model
    swapped = _variant(minilm_dir, tmp_path / "swapped", edit_tokenizer=_swap)
    source = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"
    output = tmp_path / "sub.csv"
    argv = ["predict", "--input", str(source), "--checkpoint", str(model), "--output", str(output)]
    argv.append(f"task.cache_dir={tmp_path / 'cache'}")
    capsys.readouterr()
    assert main([*argv, f"model.tokenizer={tmp_path / 'swapped'}"]) == 2
    err = capsys.readouterr().err
    assert f"model.tokenizer={tmp_path / 'swapped'} is not the tokenizer saved with the model in {model}" in err
    assert "(2 vocabulary entries differ (of 30522 and 30522)): leave model.tokenizer out" in err
    assert not output.exists()
    assert swapped.get_vocab() != AutoTokenizer.from_pretrained(str(model)).get_vocab()
    # The same tokenizer given from elsewhere (the folder it came from) predicts.
    assert main([*argv, f"model.tokenizer={minilm_dir}"]) == 0 and output.is_file()


def test_swapped_special_token_roles_and_a_smaller_vocabulary_are_named(minilm_dir, tmp_path):
    """[CLS] and [SEP] swapped in tokenizer_config.json kept the vocabulary: predict took it, exit 0,
    every window starting with [SEP] (a review). A vocabulary of 2 entries less counted 'of' the larger."""
    saved = AutoTokenizer.from_pretrained(str(minilm_dir))

    def swap_roles(config):
        config["cls_token"], config["sep_token"] = config["sep_token"], config["cls_token"]

    roles = _variant(minilm_dir, tmp_path / "roles", edit_roles=swap_roles)
    assert roles.cls_token_id == saved.sep_token_id
    assert tokenizer_difference(roles, saved) == "same vocabulary, another cls token: id 102 against 101"

    def drop_two(state):
        del state["model"]["vocab"]["river"], state["model"]["vocab"]["city"]

    fewer = _variant(minilm_dir, tmp_path / "fewer", edit_tokenizer=drop_two)
    assert tokenizer_difference(fewer, saved) == "2 vocabulary entries differ (of 30520 and 30522)"


def _first_entries(state, entries=2000):
    """MiniLM's vocabulary cut to its first `entries` ids (the special tokens among them): a BERT
    tokenizer of another size than the pretrained model's embeddings."""
    state["model"]["vocab"] = {token: i for token, i in state["model"]["vocab"].items() if i < entries}


def test_training_pretrained_weights_with_a_tokenizer_of_other_ids_is_refused(minilm_dir, tmp_path, capsys):
    """A 2000-entry tokenizer on MiniLM's 30522 embeddings trained, exit 0, every word read as
    another; a swapped [CLS]/[SEP] too. Both now stop before the model is built."""
    from conftest import TESTS
    from distqa.cli import main

    small = tmp_path / "small"
    assert len(_variant(minilm_dir, small, edit_tokenizer=_first_entries)) == 2000
    roles = tmp_path / "roles"
    _variant(minilm_dir, roles, edit_roles=lambda c: c.update(cls_token=c["sep_token"], sep_token=c["cls_token"]))
    source = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"
    common = [
        "train", f"model.name={minilm_dir}", f"data.train={source}", "task.max_seq_len=128", "train.max_steps=1",
        f"task.cache_dir={tmp_path / 'cache'}", "data.num_workers=0",
    ]  # fmt: skip
    capsys.readouterr()
    assert main([*common, f"model.tokenizer={small}", f"output_dir={tmp_path / 'a'}"]) == 2
    err = capsys.readouterr().err
    assert f"model.tokenizer={small} has 2000 entries but pretrained model '{minilm_dir}' has a vocabulary of" in err
    assert not (tmp_path / "a" / "model").exists()
    assert main([*common, f"model.tokenizer={roles}", f"output_dir={tmp_path / 'b'}"]) == 2
    assert "(same vocabulary, another cls token: id 102 against 101)" in capsys.readouterr().err


def test_a_tokenizer_without_cls_and_sep_is_refused_before_any_feature_is_written(minilm_dir, tmp_path, capsys):
    """prepare wrote None where [CLS] and [SEP] go, exit 0, and training ended in a TypeError in the
    collate; run by prepare's worker processes, the refusal read as a crash there."""
    from conftest import TESTS
    from distqa.cli import main

    bare = tmp_path / "bare"
    _variant(minilm_dir, bare, edit_roles=lambda c: c.update(cls_token=None, sep_token=None))
    source = TESTS / "fixtures" / "nq" / "simplified-nq-sample.jsonl"
    said = f"tokenizer '{bare}' has no cls_token and sep_token: its windows are [CLS] question [SEP] passage [SEP]"
    capsys.readouterr()
    argv = ["prepare", "--input", str(source), "--output", str(tmp_path / "f"), "--mode", "eval"]
    assert main([*argv, "model.name=tiny", f"model.tokenizer={bare}", "task.max_seq_len=128"]) == 2
    assert said in capsys.readouterr().err and not (tmp_path / "f").exists()
    train = ["train", "model.name=tiny", f"model.tokenizer={bare}", f"data.train={source}", "train.max_steps=1"]
    assert main([*train, f"task.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}"]) == 2
    assert said in capsys.readouterr().err and not (tmp_path / "cache").exists()
