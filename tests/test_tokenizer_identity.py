"""`distqa.models.tokenizer_difference`: whether a tokenizer given for a saved model would turn text
into other ids than the one saved with it (predict refuses it then: the model would read the wrong
words and write a plausible, wrong submission)."""

from __future__ import annotations

import json
import shutil

from transformers import AutoTokenizer

from distqa.models import tokenizer_difference


def _variant(minilm_dir, folder, edit_tokenizer=None, edit_config=None):
    """MiniLM's tokenizer files copied into `folder`, tokenizer.json or tokenizer_config.json edited."""
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, folder / name)
    for name, edit in (("tokenizer.json", edit_tokenizer), ("tokenizer_config.json", edit_config)):
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
    assert tokenizer_difference(swapped, saved) == "2 of 30522 vocabulary entries differ"
    cased = _variant(minilm_dir, tmp_path / "cased", edit_config=lambda c: c.update(do_lower_case=False))
    assert cased("River")["input_ids"] != saved("River")["input_ids"]
    assert tokenizer_difference(cased, saved) == (
        "same vocabulary, other normalization or splitting (lower-casing, accents, punctuation)"
    )


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
    assert "(2 of 30522 vocabulary entries differ): leave model.tokenizer out" in err and not output.exists()
    assert swapped.get_vocab() != AutoTokenizer.from_pretrained(str(model)).get_vocab()
    # The same tokenizer given from elsewhere (the folder it came from) predicts.
    assert main([*argv, f"model.tokenizer={minilm_dir}"]) == 0 and output.is_file()
