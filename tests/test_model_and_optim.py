"""The BERT-joint model: shapes, loss, no unused parameters, SDPA; the optimizer's decay groups."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from distqa.config import ModelConfig, TrainConfig
from distqa.nq.dummy import DummyDataset
from distqa.nq.model import BertJointQA, bert_joint_loss
from distqa.optim import build_optimizer, build_scheduler, parameter_groups


def tiny(dropout=0.0):
    torch.manual_seed(0)
    return BertJointQA.build(ModelConfig(name="tiny", dropout=dropout))


def batch(n=4, length=32):
    data = DummyDataset(n, length, vocab_size=30522, seed=0)
    return torch.utils.data.default_collate([data[i] for i in range(n)])


def test_shapes_and_initial_loss():
    model, b = tiny(), batch()
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], token_type_ids=b["token_type_ids"])
    assert out["start_logits"].shape == out["end_logits"].shape == (4, 32)
    assert out["answer_type_logits"].shape == (4, 5)
    loss = bert_joint_loss(out, b)
    # At initialisation the heads are near uniform: about (2 log 32 + log 5) / 3.
    assert abs(loss.item() - (2 * math.log(32) + math.log(5)) / 3) < 0.5


def test_every_parameter_gets_a_gradient():
    """DDP runs without find_unused_parameters, so an unused weight (BERT's pooler) would stop it."""
    model, b = tiny(), batch()
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], token_type_ids=b["token_type_ids"])
    bert_joint_loss(out, b).backward()
    unused = [name for name, p in model.named_parameters() if p.grad is None]
    assert unused == []
    # Only weights must have a non-zero gradient: a bias before a softmax over positions (qa_outputs)
    # gets sum(p - y) = 0 in exact arithmetic (a softmax ignores a shift), and rounding made it
    # non-zero on some CPUs only, exactly 0 on others.
    zero = [name for name, p in model.named_parameters() if name.endswith("weight") and not p.grad.abs().sum() > 0]
    assert zero == []
    assert not any("pooler" in name for name, _ in model.named_parameters())


def test_loss_falls_when_trained():
    model, b = tiny(), batch(n=8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], token_type_ids=b["token_type_ids"])
        loss = bert_joint_loss(out, b)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_dropout_and_attention_settings():
    model = tiny(dropout=0.0)
    assert model.config.hidden_dropout_prob == 0.0 and model.config.attention_probs_dropout_prob == 0.0
    assert model.config._attn_implementation == "sdpa"
    assert tiny(dropout=0.3).config.hidden_dropout_prob == 0.3
    assert model.config.vocab_size == 30522


def test_no_weight_decay_on_bias_and_layernorm():
    model = tiny()
    decay, no_decay = parameter_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    exempt = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert decayed | exempt == set(names.values()) and not decayed & exempt
    assert all(n.endswith(".bias") or "LayerNorm" in n for n in exempt)
    assert not any(n.endswith(".bias") or "LayerNorm" in n for n in decayed)
    assert "qa.bert.embeddings.LayerNorm.weight" in exempt
    assert "qa.qa_outputs.weight" in decayed and "answer_type_head.weight" in decayed


def test_every_kind_of_bias_is_exempt_from_weight_decay():
    """torch's attention keeps its biases as `in_proj_bias` (and `bias_k`, `bias_v`): decayed before,
    though the help says biases never are."""
    layer = nn.TransformerEncoderLayer(16, 2, 32)
    layer.self_attn = nn.MultiheadAttention(16, 2, add_bias_kv=True)
    decay, no_decay = parameter_groups(layer, 0.01)
    names = {id(p): n for n, p in layer.named_parameters()}
    exempt = {names[id(p)] for p in no_decay["params"]}
    assert {"self_attn.in_proj_bias", "self_attn.bias_k", "self_attn.bias_v", "linear1.bias"} <= exempt
    assert {names[id(p)] for p in decay["params"]} == {
        "self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight", "linear2.weight"
    }  # fmt: skip


def test_a_one_step_run_under_warm_up_says_its_rate_is_0(capsys):
    opt = build_optimizer(nn.Linear(2, 2), TrainConfig(lr=1.0), torch.device("cpu"))
    build_scheduler(opt, TrainConfig(lr=1.0, warmup_ratio=0.1), total_steps=1)
    assert opt.param_groups[0]["lr"] == 0.0
    assert "train.warmup_ratio=0.1 over a run of 1 step: its learning rate is 0" in capsys.readouterr().out
    build_scheduler(opt, TrainConfig(lr=1.0, warmup_ratio=0.0), total_steps=1)
    build_scheduler(opt, TrainConfig(lr=1.0, warmup_ratio=0.1), total_steps=2)
    assert capsys.readouterr().out == ""


def test_a_tied_parameter_is_stepped_once_per_step():
    """BART's shared embedding is also its encoder's and decoder's embed_tokens: listed once per
    module that holds it, AdamW updated it three times per step (step count 3, three times the
    update), with only torch's warning. One step must equal AdamW over each parameter once."""
    from transformers import AutoModelForSequenceClassification, BartConfig

    small = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2)
    config = BartConfig(**small, encoder_ffn_dim=16, decoder_ffn_dim=16, vocab_size=50, max_position_embeddings=32)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    shared = model.get_input_embeddings().weight
    assert model.model.encoder.embed_tokens.weight is shared is model.model.decoder.embed_tokens.weight
    groups = parameter_groups(model, 0.01)
    listed = [id(p) for group in groups for p in group["params"]]
    assert sorted(listed) == sorted(id(p) for p in model.parameters() if p.requires_grad)

    reference = copy.deepcopy(model)
    cfg = TrainConfig(lr=1e-2, weight_decay=0.01)
    optimizers = [build_optimizer(model, cfg, torch.device("cpu")), torch.optim.AdamW(
        [{"params": [p for n, p in reference.named_parameters() if ".bias" not in n and "norm" not in n]},
         {"params": [p for n, p in reference.named_parameters() if ".bias" in n or "norm" in n], "weight_decay": 0.0}],
        lr=1e-2, weight_decay=0.01)]  # fmt: skip
    ids = torch.tensor([[0, 5, 7, 9, 2], [0, 3, 4, 8, 2]])
    for net, optimizer in zip((model, reference), optimizers):
        net.eval()  # no dropout: both see the same forward
        net(input_ids=ids, labels=torch.tensor([0, 1])).loss.backward()
        optimizer.step()
    assert optimizers[0].state[shared]["step"].item() == 1
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, msg=name)


def test_optimizers_and_schedules():
    model = nn.Linear(2, 2)
    adamw = build_optimizer(model, TrainConfig(lr=0.1), torch.device("cpu"))
    assert isinstance(adamw, torch.optim.AdamW)
    sgd = build_optimizer(model, TrainConfig(optimizer="sgd", lr=0.1, momentum=0.9), torch.device("cpu"))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9

    def lrs(schedule):
        opt = build_optimizer(model, TrainConfig(optimizer="sgd", lr=1.0), torch.device("cpu"))
        sched = build_scheduler(opt, TrainConfig(lr=1.0, lr_schedule=schedule, warmup_ratio=0.2), total_steps=10)
        seen = []
        for _ in range(10):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return seen

    for schedule in ("linear", "constant", "cosine"):
        seen = lrs(schedule)
        assert seen[0] == 0.0 and seen[1] == 0.5 and seen[2] == 1.0  # 2 warm-up steps
    assert lrs("constant")[-1] == 1.0
    # After warm-up: linear falls to 0 at step 10, cosine follows half a cosine period.
    assert math.isclose(lrs("linear")[-1], 1 / 8)
    assert math.isclose(lrs("cosine")[-1], 0.5 * (1 + math.cos(math.pi * 7 / 8)))


def test_any_task_gets_hugging_face_models_the_same_way(minilm_dir, tmp_path):
    """model.name / model.dropout / model.attn_implementation and the load error are generic
    (distqa.models), not Natural Questions' own: here for a sequence classifier."""
    from transformers import AutoModelForSequenceClassification

    from distqa.config import ModelConfig
    from distqa.errors import DistqaError
    from distqa.models import build_hf_model

    tiny = build_hf_model(
        AutoModelForSequenceClassification,
        ModelConfig(name="tiny", dropout=0.0, attn_implementation="eager"),
        num_labels=3,
    )
    assert tiny.config.num_labels == 3 and tiny.config.hidden_size == 128
    assert tiny.config.hidden_dropout_prob == 0.0 and tiny.config.attention_probs_dropout_prob == 0.0
    assert tiny.config._attn_implementation == "eager"
    real = build_hf_model(AutoModelForSequenceClassification, ModelConfig(name=str(minilm_dir)), num_labels=2)
    assert real.config.hidden_size == 384 and real.config.num_labels == 2
    with pytest.raises(DistqaError, match=r"cannot load model 'no-such-org/no-such-model' .*set model.name to a local"):
        build_hf_model(AutoModelForSequenceClassification, ModelConfig(name="no-such-org/no-such-model"))
    # A local folder downloads nothing: its error is about the folder, not the network or the hub.
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DistqaError) as refused:
        build_hf_model(AutoModelForSequenceClassification, ModelConfig(name=str(tmp_path)))
    assert str(refused.value).startswith(f"cannot load model from the folder {tmp_path} (ValueError: ")
    assert str(refused.value).endswith("it does not hold a whole model; set model.name to a folder that does")
    assert "network" not in str(refused.value) and "HF_HOME" not in str(refused.value)


def test_the_generic_padding_collate():
    from distqa.models import pad_collate

    items = [
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "label": 2, "id": "a", "score": torch.tensor(0.5)},
        {"input_ids": [5], "attention_mask": [1], "label": 0, "id": "b", "score": torch.tensor(1.5)},
    ]
    batch = pad_collate(items, {"input_ids": 0, "attention_mask": 0}, max_len=512)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0, 0, 0]]  # to a multiple of 8
    assert batch["attention_mask"].sum().item() == 4
    assert batch["label"].tolist() == [2, 0] and batch["label"].dtype == torch.long
    assert batch["id"] == ["a", "b"] and batch["score"].tolist() == [0.5, 1.5]
    assert pad_collate(items, {"input_ids": 0, "attention_mask": 0}, max_len=4)["input_ids"].shape == (2, 4)


def test_a_model_folder_with_damaged_weights_is_one_line_for_every_task(minilm_dir, tmp_path):
    """Training textcls or NQ from a folder whose model.safetensors was cut short was a
    SafetensorError traceback."""
    import shutil

    from transformers import AutoModelForSequenceClassification

    from distqa.errors import DistqaError
    from distqa.models import build_hf_model

    folder = tmp_path / "model"
    shutil.copytree(minilm_dir, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    cfg = ModelConfig(name=str(folder))
    with pytest.raises(DistqaError, match=r"are damaged \(.*\): set model.name to a whole copy of the model"):
        build_hf_model(AutoModelForSequenceClassification, cfg, num_labels=2)
    with pytest.raises(DistqaError, match=rf"{weights} is damaged \(.*\): set model.name to a whole model"):
        BertJointQA.build(cfg)


def test_a_model_stored_in_bf16_is_trained_from_fp32_weights(minilm_dir, tmp_path):
    """transformers loads a checkpoint saved in bf16 (many on the hub are) as bf16: with
    train.precision=fp32 the run trained in pure bf16, 6 % of the weights moving in 6 steps (the
    rest lost to rounding), and recorded fp32; NQ's fp32 answer-type head beside it was a traceback."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForSequenceClassification

    from distqa.config import ModelConfig
    from distqa.models import build_hf_model
    from distqa.nq.model import BertJointQA

    stored = tmp_path / "minilm-bf16"
    shutil.copytree(minilm_dir, stored)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(str(stored / "model.safetensors")).items()}
    save_file(weights, str(stored / "model.safetensors"))
    config = json.loads((stored / "config.json").read_text())
    (stored / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16", "dtype": "bfloat16"}))
    cfg = ModelConfig(name=str(stored))
    classifier = build_hf_model(AutoModelForSequenceClassification, cfg, num_labels=2)
    qa = BertJointQA.build(cfg)
    for model in (classifier, qa):
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    # The stored values themselves, widened: nothing else changed on the way.
    name = next(k for k in weights if k.endswith("word_embeddings.weight"))
    loaded = dict(classifier.named_parameters())
    found = next(v for k, v in loaded.items() if k.endswith("word_embeddings.weight"))
    assert torch.equal(found, weights[name].float())


def test_damaged_or_edited_model_files_are_one_line_each(minilm_dir, tmp_path):
    """Files of the wrong shape failed in transformers' own code with any kind of error, each a
    traceback; a folder's own vocabulary cut short trained on, every later word [UNK], exit 0; a
    config.json edited against its weights failed while the model was built (a review)."""
    import json
    import shutil

    from transformers import AutoModelForSequenceClassification

    from distqa.config import ModelConfig
    from distqa.errors import DistqaError
    from distqa.models import build_hf_model, check_model_fits, load_tokenizer

    def copy(name: str, edit) -> ModelConfig:
        folder = tmp_path / name
        shutil.copytree(minilm_dir, folder)
        edit(folder)
        return ModelConfig(name=str(folder))

    def write(file: str, text: str):
        return lambda folder: (folder / file).write_text(text)

    def config(**changes):
        return lambda folder: (folder / "config.json").write_text(
            json.dumps({**json.loads((minilm_dir / "config.json").read_text()), **changes})
        )

    for cfg in (
        copy("list", write("tokenizer_config.json", "[1]")),
        copy("string", write("tokenizer.json", '"x"')),
        copy("specials", write("special_tokens_map.json", "5")),
        copy("deep", write("tokenizer_config.json", "[" * 100_000 + "]" * 100_000)),
    ):
        with pytest.raises(DistqaError, match=f"^cannot load tokenizer from the folder {cfg.name} "):
            load_tokenizer(cfg)
    for cfg in (
        copy("size", config(hidden_size="x")),
        copy("act", config(hidden_act="nope")),
        copy("vocab", config(vocab_size=100)),
    ):
        with pytest.raises(
            DistqaError, match=f"^cannot load model from the folder {cfg.name} .*do not load as a model"
        ):
            build_hf_model(AutoModelForSequenceClassification, cfg, num_labels=2)
    layers = copy("layers", config(num_hidden_layers=0))
    with pytest.raises(DistqaError, match="has num_hidden_layers=0 in its config.json"):
        check_model_fits(
            build_hf_model(AutoModelForSequenceClassification, layers, num_labels=2),
            layers,
            max_seq_len=32,
            tokenizer=None,
        )

    def cut_vocabulary(folder):
        (folder / "tokenizer.json").unlink()
        (folder / "vocab.txt").write_text("\n".join((minilm_dir / "vocab.txt").read_text().splitlines()[:13_000]))

    short = copy("short", cut_vocabulary)
    model = build_hf_model(AutoModelForSequenceClassification, ModelConfig(name=str(minilm_dir)), num_labels=2)
    with pytest.raises(
        DistqaError, match=r"the tokenizer saved with model '.*short' has 13000 entries but the model's"
    ):
        check_model_fits(model, short, max_seq_len=32, tokenizer=load_tokenizer(short))
    check_model_fits(
        model,
        ModelConfig(name=str(minilm_dir)),
        max_seq_len=32,
        tokenizer=load_tokenizer(ModelConfig(name=str(minilm_dir))),
    )
