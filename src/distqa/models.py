"""Hugging Face models as every task gets them: `model.name`, `model.dropout` and
`model.attn_implementation` mean the same for any task, and so does the one-line error for a model
that cannot be loaded.

    model = build_hf_model(AutoModelForSequenceClassification, cfg.model, num_labels=3)
    tokenizer = load_tokenizer(cfg.model, required=True)
    check_model_fits(model, cfg.model, max_seq_len=cfg.task.max_seq_len, tokenizer=tokenizer)

`model.name` is a `RANDOM_MODELS` name (built from a config, random weights, no download), a
Hugging Face id, or a local folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import AutoConfig, AutoTokenizer, BertConfig, PretrainedConfig

from distqa.errors import DistqaError

if TYPE_CHECKING:  # for hints only
    from distqa.config import ModelConfig

# `model.name=tiny`: bert-base-uncased's vocabulary and positions, a fraction of its width and
# depth. Random weights, no download: for smoke runs, tests and the quick start.
TINY_BERT = dict(
    vocab_size=30522,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=512,
    max_position_embeddings=512,
)

# Encoders built from a config with random weights, no download. `bert-base-random` has
# bert-base-uncased's exact shape (BertConfig's defaults), `bert-large-random` bert-large-uncased's:
# for speed and memory benchmarks, where only the shape matters, on machines that cannot reach the
# Hugging Face hub.
BERT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
RANDOM_MODELS: dict[str, dict[str, int]] = {"tiny": TINY_BERT, "bert-base-random": {}, "bert-large-random": BERT_LARGE}


def set_dropout(config: PretrainedConfig, rate: float) -> None:
    """Set every dropout rate the encoder's config has (names differ between architectures)."""
    for key, value in config.to_dict().items():
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, rate)


class DamagedWeights(DistqaError):
    """A model's weights file that cannot be read (`build_hf_model`): a caller may say what fixes it."""


def load_error(what: str, name: str, err: Exception, key: str) -> DistqaError:
    """One line for a model or tokenizer that cannot be loaded: which, why, and what to do.
    (transformers' own error is a traceback of a hundred lines when the hub cannot be reached.)"""
    from huggingface_hub import constants

    reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if os.path.isdir(name):  # nothing was downloaded: the folder itself lacks a file, or holds a damaged one
        if broken := _damaged_config(Path(name) / "config.json"):
            # Read first by the tokenizer too (for its class): named as what it is, not as a tokenizer's fault.
            return DistqaError(
                f"cannot load {what} from the folder {name}: its config.json {broken}; set {key} to a folder "
                "that holds a whole model, or put back its config.json"
            )
        if not isinstance(err, OSError | ValueError | TypeError):  # there, and failing to load together (an edit)
            return DistqaError(
                f"cannot load {what} from the folder {name} ({reason}): its files do not load as a {what}; set "
                f"{key} to a whole, unedited copy"
            )
        return DistqaError(
            f"cannot load {what} from the folder {name} ({reason}): it does not hold a whole {what}; "
            f"set {key} to a folder that does"
        )
    if os.path.exists(name):  # a file: read as a path, never a hub id (it blamed the network: a review)
        return DistqaError(f"cannot load {what} from {name}: it is a file; set {key} to a {what}'s folder or a hub id")
    if os.path.isabs(name) or name.startswith(("./", "../", "~")):  # a path, never a hub id: no network advice
        return DistqaError(
            f"cannot load {what} from the folder {name}: there is no such folder (moved, or on a volume not "
            f"mounted here); set {key} to the folder that holds it now"
        )
    cached = _cached_file(name, "config.json")
    # The whole entry: its snapshot links to content-named blobs, which a download would reuse.
    entry = cached and next((up for up in cached.parents if up.name.startswith("models--")), cached.parent)
    if cached is not None and (broken := _damaged_config(cached)):  # not "download it": it is there, damaged
        return DistqaError(
            f"cannot load {what} {name!r}: its config.json in the Hugging Face cache ({cached}) {broken}; "
            f"delete {entry} and download it again, or set {key} to a local folder"
        )
    if cached is not None and not isinstance(err, OSError):  # downloaded, and its files fail to load (a review)
        return DistqaError(
            f"cannot load {what} {name!r} from the Hugging Face cache ({reason}): its files there do not load as a "
            f"{what}; delete {entry} and download it again, or set {key} to a local folder"
        )
    offline = os.environ.get("HF_HUB_OFFLINE", "")
    if offline.upper() in ("1", "ON", "YES", "TRUE"):
        where = (
            f"HF_HUB_OFFLINE={offline} is set, so nothing is downloaded: download it once where the hub is reachable"
        )
    else:
        where = f"Check the network: the Hugging Face hub ({constants.ENDPOINT}, HF_ENDPOINT) must be reachable"
    # A relative folder from another working directory reads as a hub id too: said, with where it was looked for.
    return DistqaError(
        f"cannot load {what} {name!r} ({reason}). It is no folder in {os.getcwd()}, so it was read as a "
        f"Hugging Face hub id. {where}; "
        f"or set HF_HOME to a cache that holds it (now {constants.HF_HOME}); or set {key} to a local folder"
    )


def _cached_file(repo_id: str, filename: str) -> Path | None:
    """Where the Hugging Face cache holds `filename` of a hub id, if it does (no network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, filename)
    except Exception:  # noqa: BLE001 - a name that is no hub id (the hub's validation errors vary)
        return None
    return Path(found) if isinstance(found, str) else None


def _damaged_config(path: Path) -> str | None:
    """What is wrong with a model folder's config.json that is there but cannot be a config (None:
    it is absent, or reads as a JSON object)."""
    try:
        text = path.read_bytes()
    except OSError:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # not UTF-8, not JSON
        return "is not JSON"
    if isinstance(value, dict):
        return None
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return f"holds {kinds.get(type(value), 'null')}, where a config is a JSON object"


def hf_config(cfg: ModelConfig, **overrides: Any) -> PretrainedConfig:
    """The configuration `model.name` names, with `model.dropout` applied and `overrides` set
    (e.g. num_labels)."""
    if cfg.name in RANDOM_MODELS:
        config: PretrainedConfig = BertConfig(**RANDOM_MODELS[cfg.name])
    else:
        try:
            config = AutoConfig.from_pretrained(cfg.name)
        except ImportError:  # a package the model's code needs: its own message names it
            raise
        # Any other: a config.json of the wrong shape or types fails in transformers' own code with
        # any kind of error (AttributeError, KeyError, its dataclass validation, RecursionError): each
        # is the folder's fault, said in one line (a review).
        except Exception as err:
            raise load_error("model", cfg.name, err, "model.name") from err
    # Every task reads a forward's outputs by name: a folder's config.json with "return_dict": false
    # gave tuples, and a traceback at the first step (a review).
    config.return_dict = True
    for key, value in overrides.items():
        setattr(config, key, value)
    if cfg.dropout is not None:
        set_dropout(config, cfg.dropout)
    return config


def build_hf_model(
    auto_class: Any,
    cfg: ModelConfig,
    config: PretrainedConfig | None = None,
    *,
    missing: list[str] | None = None,
    **overrides: Any,
) -> nn.Module:
    """`auto_class` (AutoModelForSequenceClassification, ...) for `model.name`: random weights for a
    RANDOM_MODELS name, else its pretrained weights (a new head where the checkpoint has none; the
    names of such new weights are added to `missing` when given, for a caller that needs them all)."""
    config = config or hf_config(cfg, **overrides)
    # fp32 weights whatever the checkpoint stores: transformers loads a model saved in bf16 (as many
    # on the hub are) as bf16 by default, and train.precision=fp32 then trained in pure bf16 (6 % of
    # the weights moved in 6 steps, the rest lost to rounding), recorded as fp32. The compute dtype
    # is train.precision's (autocast, or FSDP's policy), over fp32 weights.
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if cfg.attn_implementation is not None:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.name in RANDOM_MODELS:
        return auto_class.from_config(config, **kwargs)
    try:
        if missing is None:
            return auto_class.from_pretrained(cfg.name, config=config, **kwargs)
        model, info = auto_class.from_pretrained(cfg.name, config=config, output_loading_info=True, **kwargs)
        missing.extend(sorted(info["missing_keys"]))
        return model
    except OSError as err:
        raise load_error("model", cfg.name, err, "model.name") from err
    except SafetensorError as err:  # a truncated or overwritten model.safetensors
        raise DamagedWeights(
            f"the weights of model.name={cfg.name!r} are damaged ({str(err).splitlines()[0]}): set model.name to "
            "a whole copy of the model"
        ) from err
    except ValueError as err:  # e.g. an architecture without this kind of head
        raise DistqaError(f"model.name={cfg.name!r} cannot be used as {auto_class.__name__}: {err}") from err
    except (RuntimeError, KeyError, AttributeError, TypeError, IndexError) as err:
        # A config.json edited against its weights (another vocab_size: "ignore_mismatched_sizes"; an
        # activation transformers does not know: a KeyError) fails while the model is built.
        raise load_error("model", cfg.name, err, "model.name") from err


def load_tokenizer(cfg: ModelConfig, *, required: bool = False) -> Any | None:
    """The tokenizer `model.tokenizer` (default: `model.name`) names.

    A RANDOM_MODELS name has none of its own ('tiny' has bert-base-uncased's vocabulary size, but
    loading that tokenizer would need a download): None, which a task on synthetic ids accepts, or,
    for a task that reads text (`required`), an error saying to set model.tokenizer.
    """
    name = cfg.tokenizer or cfg.name
    if name in RANDOM_MODELS:
        if required:
            raise DistqaError(
                f"model.name={name!r} has no tokenizer: set model.tokenizer to one with a matching vocabulary "
                "(a Hugging Face id or a local folder)"
            )
        return None
    try:
        return AutoTokenizer.from_pretrained(name)
    except ImportError:  # a package the tokenizer needs (sentencepiece, say): its own message names it
        raise
    except Exception as err:  # as hf_config's: tokenizer files of the wrong shape fail with any kind
        raise load_error("tokenizer", name, err, "model.tokenizer" if cfg.tokenizer else "model.name") from err


def check_model_fits(
    model: nn.Module,
    cfg: ModelConfig,
    *,
    max_seq_len: int,
    tokenizer: Any | None,
    exported: bool = False,
    token_types: int = 1,
    length_said: str | None = None,
) -> None:
    """Refuse a model that cannot take the task's inputs when it is built, not with an index error
    in the middle of a run: `task.max_seq_len` past its position embeddings, `token_types` (the
    segment ids the task's inputs use: 2 for a question and a passage) past its token-type table
    (RoBERTa's and XLM-R's hold one; a model without one, DeBERTa-v3's 0, ignores them), or a
    tokenizer whose ids run past its embedding table. For an `exported` model (a command that runs
    it) the tokenizer must be the one it was trained with, so its vocabulary must also be about as
    large (models round theirs up a little for fast kernels); a much smaller one turns words into
    the wrong ids. `length_said` names the setting that makes the `max_seq_len` tokens, for a task
    whose length is another key (default: task.max_seq_len)."""
    config = getattr(model, "config", None)
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None and max_seq_len > max_positions:
        said = length_said or f"task.max_seq_len={max_seq_len}"
        raise DistqaError(f"{said} exceeds the {max_positions} positions model {cfg.name!r} was built for")
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers < 1:  # an edited config.json: an index error at the first forward
        raise DistqaError(
            f"model {cfg.name!r} has num_hidden_layers={layers} in its config.json: an encoder needs one or more"
        )
    types = getattr(config, "type_vocab_size", None)
    # (0: no token-type table at all, as DeBERTa-v3's: the model ignores segment ids.)
    if isinstance(types, int) and 0 < types < token_types:
        raise DistqaError(
            f"model {cfg.name!r} has {types} token type(s) (its type_vocab_size), and this task's inputs use "
            f"{token_types} (segment ids that tell the question from the passage): use a model with "
            f"{token_types} or more, as BERT, ALBERT and ELECTRA have"
        )
    vocab_size = getattr(config, "vocab_size", None)
    if tokenizer is None or vocab_size is None:
        return
    name, size = cfg.tokenizer or cfg.name, len(tokenizer)
    if exported and (size > vocab_size or size < 0.95 * vocab_size):
        raise DistqaError(
            f"tokenizer {name} has {size} entries but the model's vocabulary has {vocab_size}: "
            "set model.tokenizer to the tokenizer the model was trained with"
        )
    if size > vocab_size:
        raise DistqaError(
            f"tokenizer {name!r} has {size} tokens, more than model {cfg.name!r}'s vocabulary of {vocab_size}"
        )
    if not exported and cfg.name not in RANDOM_MODELS and cfg.tokenizer and cfg.tokenizer != cfg.name:
        _check_pretrained_tokenizer(cfg, tokenizer, vocab_size)
    elif not exported and cfg.name not in RANDOM_MODELS and size < 0.9 * vocab_size:
        # The folder's own tokenizer, cut short (a copy interrupted; vocab.txt alone, as older
        # folders ship it): every later word read as [UNK], the run trained on, exit 0 (a review).
        # 10 % of room: published models pad their embedding tables past their vocabulary, and this
        # folder is no export whose size distqa knows (a cut of less goes unseen).
        raise DistqaError(
            f"the tokenizer saved with model {cfg.name!r} has {size} entries but the model's vocabulary has "
            f"{vocab_size}: its tokenizer files (vocab.txt, tokenizer.json) are cut short or another model's; put "
            "back the model's own, or set model.tokenizer to the tokenizer it was pretrained with"
        )


def _check_pretrained_tokenizer(cfg: ModelConfig, tokenizer: Any, vocab_size: int) -> None:
    """Pretrained weights with a model.tokenizer of their own: its ids must mean the words the
    embeddings learnt. One of 2000 entries on MiniLM's 30522 trained, exit 0, every word read as
    another, and only `predict` refused the result, asking for the tokenizer it had been trained
    with (a review). Compared with the model folder's own tokenizer where it has one."""
    size = len(tokenizer)
    if size < 0.95 * vocab_size:
        raise DistqaError(
            f"model.tokenizer={cfg.tokenizer} has {size} entries but pretrained model {cfg.name!r} has a vocabulary "
            f"of {vocab_size}: its ids would pick other words' embeddings; leave model.tokenizer out to use the "
            "model's own, or name the tokenizer the model was pretrained with"
        )
    if difference := saved_tokenizer_difference(tokenizer, cfg):
        raise DistqaError(
            f"model.tokenizer={cfg.tokenizer} is not the tokenizer saved with model {cfg.name!r} ({difference}): "
            "leave model.tokenizer out to use the saved one"
        )


def holds_tokenizer(folder: Path) -> bool:
    """Whether `folder` holds a saved tokenizer (one of TOKENIZER_FILES)."""
    return folder.is_dir() and any((folder / f).is_file() for f in TOKENIZER_FILES)


def saved_tokenizer_difference(tokenizer: Any, cfg: ModelConfig) -> str | None:
    """How `tokenizer` would turn text into other ids than the one saved in the model folder
    `cfg.name` (`tokenizer_difference`); None when they agree, or when cfg.name holds none (a hub
    id: nothing to compare without a download)."""
    if not holds_tokenizer(Path(cfg.name)):
        return None
    return tokenizer_difference(tokenizer, load_tokenizer(dataclasses.replace(cfg, tokenizer=None)))


def tokenizer_difference(given: Any, saved: Any) -> str | None:
    """How tokenizer `given` would turn text into other ids than `saved`, or None when it would not:
    their vocabularies (special tokens included), then, for fast tokenizers, the normalization and
    pre-tokenization (lower-casing, accents, splitting). Settings that do not change ids (padding,
    truncation, model_max_length) are not compared."""
    vocab, saved_vocab = given.get_vocab(), saved.get_vocab()
    if vocab != saved_vocab:
        # (a token in one only, or at another id: counted once each, so it can pass either size)
        differ = sum(1 for token, index in vocab.items() if saved_vocab.get(token) != index)
        differ += len(saved_vocab.keys() - vocab.keys())
        return f"{differ} vocabulary entries differ (of {len(vocab)} and {len(saved_vocab)})"
    # The ids a task places itself ([CLS] question [SEP] ...): an edited tokenizer_config.json that
    # swapped two roles kept the vocabulary and gave every window another first token (a review).
    for role in SPECIAL_ROLES:
        mine, theirs = getattr(given, f"{role}_token_id", None), getattr(saved, f"{role}_token_id", None)
        if mine != theirs:
            return f"same vocabulary, another {role} token: id {mine} against {theirs}"
    if _text_pipeline(given) != _text_pipeline(saved):
        return "same vocabulary, other normalization or splitting (lower-casing, accents, punctuation)"
    return None


SPECIAL_ROLES = ("cls", "sep", "pad", "unk", "mask", "bos", "eos")
# Files a saved tokenizer consists of (any one will do): without them, AutoTokenizer would build a
# BERT tokenizer with only its 5 special tokens from config.json, and every word would become [UNK].
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "spiece.model", "vocab.json")


def _text_pipeline(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer: its class and casing are what it has
        return type(tokenizer).__name__, getattr(tokenizer, "do_lower_case", None)
    state = json.loads(backend.to_str())
    return state.get("normalizer"), state.get("pre_tokenizer")


def pad_collate(
    items: list[dict[str, Any]], pad_values: dict[str, int], *, max_len: int | None = None, multiple: int = 8
) -> dict[str, Any]:
    """A batch of tokenized examples: the sequence columns named in `pad_values` padded with their
    value to the longest in the batch, rounded up to `multiple` (shapes that suit GPU tensor cores)
    but never past `max_len`; numbers stacked into a tensor; strings (example ids) kept as a list.

    Padding to the batch's longest, not to `max_len`, is what makes short batches cheap.
    """
    longest = max(len(item[key]) for item in items for key in pad_values if key in item)
    length = max(longest, min(-(-longest // multiple) * multiple, max_len or longest))
    batch: dict[str, Any] = {}
    for key in items[0]:
        values = [item[key] for item in items]
        if key in pad_values:
            out = torch.full((len(items), length), pad_values[key], dtype=torch.long)
            for row, seq in enumerate(values):
                out[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            batch[key] = out
        elif all(isinstance(v, str) for v in values):
            batch[key] = values
        elif all(torch.is_tensor(v) for v in values):
            batch[key] = torch.stack(values)
        elif all(isinstance(v, (int, bool)) for v in values):
            batch[key] = torch.as_tensor([int(v) for v in values], dtype=torch.long)
        else:
            batch[key] = torch.as_tensor(values)
    return batch
