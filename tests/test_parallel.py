"""`distqa.parallel` and the sharded checkpoint in one process (the two-process proofs are in
test_fsdp.py): which blocks are sharded and checkpointed, activation checkpointing changing no
weight, FSDP in a world of one equal to the plain model, the state figures, and what a sharded
checkpoint refuses."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import ROOT, SMALL, checkpoint_weights, load_weights, max_abs_diff
from distqa.checkpoint import verify_checkpoint
from distqa.errors import ConfigError, DistqaError
from distqa.parallel import state_bytes, transformer_blocks
from distqa.registry import load_config
from distqa.trainer import train

# AdamW with dropout and DataLoader workers: activation checkpointing must replay dropout's masks.
ADAMW = [
    *SMALL,
    "train.check_replicas=false",
    "model.dropout=0.1",
    "data.num_workers=2",
    "train.batch_size=2",
    "train.grad_accum=2",
    "train.lr=1e-3",
    "train.max_steps=3",
]


def run(tmp_path: Path, name: str, *extra: str) -> Path:
    out = tmp_path / name
    train(load_config(None, [*ADAMW, f"output_dir={out}", *extra]))
    return out


def test_the_blocks_are_the_encoder_layers_and_nothing_inside_them():
    from distqa.config import ModelConfig
    from distqa.nq.model import BertJointQA

    model = BertJointQA.build(ModelConfig(name="tiny"))
    blocks = transformer_blocks(model)
    assert blocks == list(model.qa.bert.encoder.layer)

    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stack = nn.ModuleList(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]) for _ in range(3))
            self.empty = nn.ModuleList([nn.ReLU()])

    nested = Nested()
    assert transformer_blocks(nested) == list(nested.stack)  # not the Linears inside, not the ReLU
    assert transformer_blocks(nn.Sequential(nn.Linear(2, 2))) == []


@pytest.mark.fsdp  # about 10 s: make perf-fsdp, for make test's 5 minutes
def test_activation_checkpointing_and_one_process_fsdp_give_the_same_weights(tmp_path):
    plain_run = run(tmp_path, "plain", "train.checkpoint_every=2")  # saving reads the RNGs, draws nothing
    plain = load_weights(plain_run)
    recomputed = load_weights(run(tmp_path, "ac", "train.activation_checkpointing=true"))
    assert max_abs_diff(plain, recomputed) < 1e-6
    sharded = run(tmp_path, "fsdp-ac", "train.parallel=fsdp", "train.activation_checkpointing=true")
    assert max_abs_diff(plain, load_weights(sharded)) < 1e-5
    # The export of a checkpointed and sharded model keeps the model's own key names.
    assert not any("_checkpoint_wrapped_module" in k for k in load_weights(sharded))
    # The tolerances above tell a step: step 2 is that far from step 3 (the final checkpoint).
    assert max_abs_diff(checkpoint_weights(plain_run, 2), checkpoint_weights(plain_run, 3)) > 1e-5


def test_state_bytes_counts_weights_gradients_and_adams_two_moments():
    model = nn.Linear(10, 10)  # 110 parameters
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 10)).sum().backward()
    optimizer.step()
    state = state_bytes(model, optimizer)
    assert state["parameters"] == state["gradients"] == 110 * 4
    assert state["optimizer"] == 2 * 110 * 4 + 2 * 4  # exp_avg, exp_avg_sq, and a step counter per tensor


def test_the_replica_check_is_refused_with_fsdp():
    with pytest.raises(ConfigError, match="train.check_replicas=true .* train.parallel=fsdp"):
        load_config(None, ["train.parallel=fsdp", "train.check_replicas=true"])
    with pytest.raises(ConfigError, match="train.parallel='zero' is not one of ddp, fsdp"):
        load_config(None, ["train.parallel=zero"])


@pytest.mark.fsdp  # about 5 s: make perf-fsdp, for make test's 5 minutes
def test_a_sharded_checkpoint_is_verified_and_refused_by_a_ddp_run(tmp_path):
    stale = tmp_path / "sharded" / ".distqa-shared-check-0123"  # as a run killed during its start leaves
    stale.parent.mkdir()
    stale.write_text("0123")
    out = run(tmp_path, "sharded", "train.parallel=fsdp", "train.max_steps=2")
    assert not list(out.glob(".distqa-shared-check-*"))  # the shared-storage check leaves nothing
    checkpoint = out / "checkpoints" / "step-2"
    assert verify_checkpoint(checkpoint) is None
    refused = r"changed train.parallel \('fsdp' -> 'ddp'\): its model and optimizer are stored as shards"
    with pytest.raises(ConfigError, match=refused):
        run(tmp_path, "sharded", "train.max_steps=3")
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert {"__0_0.distcp", ".metadata"} <= set(manifest) and "model.safetensors" not in manifest
    (checkpoint / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != ".metadata"}))
    assert verify_checkpoint(checkpoint) == "manifest.json lists no model (model.safetensors or .metadata)"
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    shard = checkpoint / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert verify_checkpoint(checkpoint) == "__0_0.distcp does not match its hash in the manifest"


def test_loading_a_checkpoint_of_the_other_kind_names_train_parallel(tmp_path):
    from distqa.checkpoint import load_checkpoint
    from distqa.dist import DistInfo

    out = run(tmp_path, "whole", "train.max_steps=1")
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters())
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    with pytest.raises(DistqaError, match=r"holds the model whole \(train.parallel=ddp\).*train.parallel=fsdp"):
        load_checkpoint(
            out / "checkpoints" / "step-1",
            model=model,
            optimizer=optimizer,
            scheduler=None,
            scaler=None,  # type: ignore[arg-type]
            info=info,
            sharded=True,
        )


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))


def _dotted_payload(marker: Path) -> bytes:
    """A protocol-4 pickle calling `torch.distributed.checkpoint.filesystem` / `os.system`: a name
    looked up through an allowed module into what that module imported."""

    def text(value: str) -> bytes:
        raw = value.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    call = text("torch.distributed.checkpoint.filesystem") + text("os.system") + b"\x93"  # STACK_GLOBAL
    return b"\x80\x04" + call + text(f"touch {marker}") + b"\x85R."  # TUPLE1, REDUCE, STOP


def _class_build_payload() -> bytes:
    """A protocol-4 pickle: `pathlib.PosixPath`, then BUILD with state (None, {"exists": OrderedDict})."""

    def text(value: str) -> bytes:
        raw = value.encode()
        return b"\x8c" + bytes([len(raw)]) + raw

    target = text("pathlib") + text("PosixPath") + b"\x93"
    attrs = b"N}" + text("exists") + text("collections") + text("OrderedDict") + b"\x93s"  # None, {k: v}
    return b"\x80\x04" + target + attrs + b"\x86b."  # TUPLE2, BUILD, STOP


@pytest.mark.safety  # about 5 s: make test-safety, for make test's 5 minutes
def test_a_checkpoint_index_naming_other_code_is_not_unpickled(tmp_path):
    from distqa.sharded import read_shards

    out = run(tmp_path, "sharded", "train.parallel=fsdp", "train.max_steps=1")
    checkpoint = out / "checkpoints" / "step-1"
    _Evil.marker = tmp_path / "ran"
    payloads = {
        "names posix.system, which": pickle.dumps(_Evil()),
        "names torch.distributed.checkpoint.filesystem.os.system, which": _dotted_payload(_Evil.marker),
        # An allowed class given new attributes (BUILD on the class): Path.exists would return an
        # OrderedDict for the rest of the process.
        "sets attributes of PosixPath itself": _class_build_payload(),
        # Damage, not attack: each named as the index's (torch 2.11's DCP alone says "metadata is None").
        "holds a value of type int, not DCP's index": pickle.dumps(5),
        "is damaged: KeyError 255": b"\xff\xfe" + bytes(range(64)),
        "is damaged: (UnpicklingError|EOFError)": (checkpoint / ".metadata").read_bytes()[:200],
    }
    model = nn.Linear(2, 2)
    for said, payload in payloads.items():
        (checkpoint / ".metadata").write_bytes(payload)
        with pytest.raises(ValueError, match=rf"^\.metadata ?{said}"):
            read_shards(checkpoint, model, torch.optim.SGD(model.parameters()))
        assert not _Evil.marker.exists() and Path("/").exists() is True
    # The dotted payload is a real one: plain pickle runs it.
    pickle.loads(payloads["names torch.distributed.checkpoint.filesystem.os.system, which"])
    assert _Evil.marker.exists()


def test_the_memory_formula_matches_the_measured_state_and_orders_the_setups():
    from distqa.bench.memory import ENCODERS, OVERHEAD_GIB, largest_batch, per_gpu_bytes, state_bytes_per_rank
    from distqa.config import ModelConfig
    from distqa.nq.model import BertJointQA

    model = BertJointQA.build(ModelConfig(name="tiny"))
    optimizer = torch.optim.AdamW(model.parameters())
    outputs = model(torch.ones(1, 8, dtype=torch.long))
    sum(v.sum() for v in outputs.values()).backward()
    optimizer.step()
    measured = sum(state_bytes(model, optimizer).values())
    parameters = sum(p.numel() for p in model.parameters())
    counters = 4 * len(list(model.parameters()))  # AdamW's step count, one float per tensor
    assert measured == state_bytes_per_rank(parameters, 1, sharded=False) + counters
    assert state_bytes_per_rank(parameters, 2, sharded=True) == state_bytes_per_rank(parameters, 1, sharded=False) / 2
    for encoder in ENCODERS:
        gib = {
            (sharded, ac): per_gpu_bytes(encoder, gpus=8, seq=512, batch=8, sharded=sharded, checkpointed=ac)
            for sharded in (False, True)
            for ac in (False, True)
        }
        assert gib[True, True] < gib[True, False] < gib[False, False] and gib[False, True] < gib[False, False]
        accumulating = per_gpu_bytes(
            encoder, gpus=8, seq=512, batch=8, sharded=True, checkpointed=False, accumulating=True
        )
        assert accumulating - gib[True, False] == 4 * encoder.parameters  # whole fp32 gradients
        fits = {
            (sharded, ac): largest_batch(encoder, gpus=8, seq=512, gib=24, sharded=sharded, checkpointed=ac)
            for sharded in (False, True)
            for ac in (False, True)
        }
        assert fits[False, False] < fits[True, False] < fits[True, True] and fits[False, False] < fits[False, True]
        # The batch it names fits, one more does not.
        for (sharded, ac), batch in fits.items():
            need = [
                per_gpu_bytes(encoder, gpus=8, seq=512, batch=b, sharded=sharded, checkpointed=ac)
                for b in (batch, batch + 1)
            ]
            assert need[0] <= (24 - OVERHEAD_GIB) * 2**30 < need[1]


def _table_after(text: str, marker: str) -> str:
    """The markdown table that follows `marker` in `text` (its lines starting with "|")."""
    lines = text[text.index(marker) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


def test_the_memory_tables_of_the_docs_are_what_the_formula_prints_now():
    """docs/benchmarks.md's three tables are pasted from `python -m distqa.bench.memory`: a change of
    the formula (its activation term was recalibrated once) must come with the tables it changes."""
    from distqa.bench.memory import fit_table, table

    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert _table_after(docs, "`python -m distqa.bench.memory --gpus 8 --seq 512 --batch 8`") == table(8, 512, 8)
    assert _table_after(docs, "\n24 GiB:\n") == fit_table(8, 512, 24)
    assert _table_after(docs, "\n80 GiB:\n") == fit_table(8, 512, 80)


@pytest.mark.parametrize(
    "parallel, expected",
    [
        # FSDP: weights cast by its policy, no autocast, and logits back in fp32 (the root's output_dtype).
        ("fsdp", [["logits", "torch.float32"], ["torch.bfloat16", False]]),
        ("ddp", [["logits", "torch.bfloat16"], ["torch.float32", True]]),
    ],
)
def test_bf16_is_fsdps_own_cast_not_autocast_over_shards(tmp_path, parallel, expected):
    """With fsdp, the block computes with weights FSDP cast to bf16 and autocast is off; with ddp,
    fp32 weights under autocast. Either way the weights kept and exported stay fp32."""
    out = tmp_path / parallel
    args = ["task=toy_task:PrecisionProbeTask", "train.precision=bf16", "train.max_steps=2", "data.num_workers=0"]
    train(load_config(None, [*args, f"train.parallel={parallel}", f"output_dir={out}"]))
    assert json.loads((out / "model" / "precision.json").read_text()) == expected
    assert {t.dtype for t in load_weights(out).values()} == {torch.float32}


def test_a_shard_byte_entry_holding_code_is_refused_even_where_torch_would_unpickle_it(tmp_path, monkeypatch):
    """M3: the optimizer's settings in a sharded checkpoint are DCP byte entries, each a torch.save'd
    object that DCP's own planner loads with weights_only=False. Ours passes weights_only=True
    explicitly; with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD set (as torch's own advice for old files
    suggests), a torch.load without it would run the entry's code."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from distqa.checkpoint import load_checkpoint
    from distqa.dist import DistInfo
    from distqa.sharded import read_shards

    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    _Evil.marker = tmp_path / "ran"
    optimizer_state["param_groups"][0]["lr"] = _Evil()  # torch.save'd into the byte entry as a pickle
    checkpoint = tmp_path / "step-1"
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(checkpoint), no_dist=True)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(ValueError, match="it names posix.system, which a checkpoint never holds; refused unread"):
        read_shards(checkpoint, model, optimizer)
    assert not _Evil.marker.exists()

    (checkpoint / "training_state.pt").write_bytes(b"")  # never reached: the shards fail first
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    with pytest.raises(DistqaError) as refused:
        load_checkpoint(
            checkpoint, model=model, optimizer=optimizer, scheduler=None, scaler=None, info=info, sharded=True
        )  # type: ignore[arg-type]
    message = str(refused.value)
    assert f"cannot load checkpoint file {checkpoint}/.metadata and __*.distcp: it names posix.system" in message
    assert "weights_only" not in message and "\n" not in message and not _Evil.marker.exists()


@pytest.mark.parametrize(
    ("args", "said"),
    [(["--gpus", "0"], "argument --gpus: 0 must be a number above 0"),
     (["--batch", "-8"], "argument --batch: -8 must be a number above 0"),
     (["--gib", "nan"], "argument --gib: nan must be a number above 0"),
     (["--seq", "x"], "argument --seq: 'x' is not a number")],
)  # fmt: skip
def test_the_memory_formula_refuses_sizes_that_are_no_sizes(args, said, capsys):
    """--batch -8 printed negative GiB per GPU, exit 0; --gpus 0 ended in a ZeroDivisionError."""
    from distqa.bench import memory

    with pytest.raises(SystemExit) as stopped:
        memory.main(args)
    assert stopped.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(f"error: {said}")
