"""`train.parallel=dp` (torch.nn.DataParallel in one process) without a GPU, and `distqa bench --dp`.

DataParallel needs CUDA: on the CPU the mode is refused in one line, and so it is in a launch of
several processes and with settings only DDP has. Its training path is proved here by letting the
internal choice of GPUs (`distqa.parallel.dp_device_ids`) return none: DataParallel then calls the
module itself, and everything around it (the wrapping, the optimizer, the checkpoints, the resume,
the export, the per-GPU loss vector) runs as on GPUs. The GPU runs: tests/test_gpu_dp.py.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from conftest import bench_result
from distqa import parallel
from distqa.bench.launch import dp_env, print_table
from distqa.bench.report import add_scaling, implausible, plot, summarize
from distqa.cli import main
from distqa.dist import DistInfo
from distqa.errors import ConfigError, DistqaError
from distqa.export import export_checkpoint
from distqa.registry import load_config, load_task
from distqa.task import Batch, batch_rows
from distqa.trainer import Trainer, train
from toy_task import ToyClassificationTask

TOY = [
    "task.name=toy_task:ToyClassificationTask",
    "task.size=64",
    "data.num_workers=0",
    "train.batch_size=8",
    "train.lr=1e-2",
    "train.log_every=1",
    "train.keep_checkpoints=0",
]
CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


class PerGpuLossTask(ToyClassificationTask):
    """A loss computed per GPU and gathered as DataParallel gathers a loss that a model returns from
    its forward (a Hugging Face model given labels): a vector of one mean per half of the batch."""

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        logits, labels, half = model(batch["features"]), batch["label"], len(batch["label"]) // 2
        return torch.stack(
            [F.cross_entropy(logits[:half], labels[:half]), F.cross_entropy(logits[half:], labels[half:])]
        )


@pytest.fixture
def no_gpus(monkeypatch) -> list[nn.Module]:
    """dp's wrapping on the CPU: no GPUs chosen, so DataParallel only calls the module. Returns the
    modules the trainer called, to show that it did call DataParallel."""
    if torch.cuda.is_available():
        pytest.skip("DataParallel without device ids is the CPU's pass-through; on GPUs see tests/test_gpu_dp.py")
    wrapped: list[nn.Module] = []
    original = parallel.one_process_data_parallel

    def spy(*args, **kwargs):
        wrapped.append(original(*args, **kwargs))
        return wrapped[-1]

    monkeypatch.setattr(parallel, "dp_device_ids", lambda info: [])
    monkeypatch.setattr(parallel, "one_process_data_parallel", spy)
    return wrapped


def run(out: Path, *extra: str) -> Path:
    train(load_config(None, [*TOY, f"output_dir={out}", *extra]))
    return out


def test_dp_trains_like_ddp_and_saves_resumes_and_exports_the_unwrapped_model(tmp_path, no_gpus):
    ddp = run(tmp_path / "ddp", "train.max_steps=4", "train.checkpoint_every=2")
    dp = run(tmp_path / "dp", "train.parallel=dp", "train.max_steps=2", "train.checkpoint_every=2")
    assert len(no_gpus) == 1 and isinstance(no_gpus[0], nn.DataParallel)
    # The checkpoint holds the module's own names, as DDP's does: never DataParallel's `module.`.
    step2 = load_file(str(dp / "checkpoints" / "step-2" / "model.safetensors"))
    reference = load_file(str(ddp / "checkpoints" / "step-2" / "model.safetensors"))
    assert step2.keys() == reference.keys() and not any(k.startswith("module.") for k in step2)
    assert all(torch.equal(step2[k], reference[k]) for k in step2)  # the same task, loss and optimizer
    run(dp, "train.parallel=dp", "train.max_steps=4", "train.checkpoint_every=2")  # resumes from step-2
    rows = [json.loads(line) for line in (dp / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    final, straight = (
        load_file(str(dp / "model" / "model.safetensors")),
        load_file(str(ddp / "model" / "model.safetensors")),
    )
    assert final.keys() == straight.keys() and all(torch.allclose(final[k], straight[k], atol=1e-6) for k in final)
    exported = export_checkpoint(str(dp / "checkpoints" / "step-2"))  # `distqa export` of a dp checkpoint
    assert load_file(str(exported / "model.safetensors")).keys() == reference.keys()


def test_a_per_gpu_loss_vector_is_averaged_under_dp_only(tmp_path, no_gpus):
    task = "task.name=test_dp:PerGpuLossTask"
    dp = run(tmp_path / "dp", task, "train.parallel=dp", "train.max_steps=2")
    ddp = run(tmp_path / "ddp", "train.max_steps=2")  # the scalar loss of the whole batch
    mine, theirs = (
        load_file(str(dp / "model" / "model.safetensors")),
        load_file(str(ddp / "model" / "model.safetensors")),
    )
    assert all(torch.allclose(mine[k], theirs[k], atol=1e-6) for k in mine)  # the mean of two even halves
    # Only dp's gather makes a vector a loss; elsewhere it is one line asking for the batch's mean.
    with pytest.raises(DistqaError, match=r"must be a floating-point scalar .* shape \[2\]: take the mean"):
        run(tmp_path / "vector-ddp", task, "train.max_steps=1")


class UnevenPerGpuLossTask(ToyClassificationTask):
    """One mean per GPU for three GPUs: DataParallel splits 8 rows as torch.chunk does, 3, 3, 2."""

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        logits, labels = model(batch["features"]), batch["label"]
        return torch.stack([F.cross_entropy(lg, lb) for lg, lb in zip(logits.chunk(3), labels.chunk(3))])


def test_per_gpu_losses_of_an_uneven_split_are_weighted_by_their_rows(tmp_path, no_gpus):
    """Their plain mean weighted the last GPU's 2 examples 1/6 each and the others' 1/9."""
    dp = run(tmp_path / "dp", "task.name=test_dp:UnevenPerGpuLossTask", "train.parallel=dp", "train.max_steps=2")
    ddp = run(tmp_path / "ddp", "train.max_steps=2")
    mine, theirs = (load_file(str(out / "model" / "model.safetensors")) for out in (dp, ddp))
    assert all(torch.allclose(mine[k], theirs[k], atol=1e-6) for k in mine)
    per_gpu = torch.tensor([1.0, 2.0, 3.0])  # 8 rows over 3 GPUs, and 4 rows over 3 GPUs (2, 2: two values)
    assert parallel.dp_batch_mean(per_gpu, 8, 3).item() == pytest.approx((3 * 1 + 3 * 2 + 2 * 3) / 8)
    assert parallel.dp_batch_mean(per_gpu[:2], 4, 3).item() == pytest.approx(1.5)
    with pytest.raises(DistqaError, match=r"returned 3 values for a batch of 4 that DataParallel splits into 2"):
        parallel.dp_batch_mean(per_gpu, 4, 3)


class CountFirstTask(UnevenPerGpuLossTask):
    """A batch whose first value is no tensor of rows: the count of its examples, as a 0-dim tensor."""

    def collate(self, items: list[Any]) -> Batch:
        ids = [f"row {i}" for i in range(len(items))]
        return {"count": torch.tensor(len(items)), "ids": ids, **super().collate(items)}


def test_the_rows_of_a_dp_batch_are_read_from_its_first_tensor_that_has_rows(tmp_path, no_gpus):
    """The rows (samples/s, and the weights of per-GPU losses) were the first value's len(): a 0-dim
    count first was a TypeError traceback."""
    dp = run(tmp_path / "dp", "task.name=test_dp:CountFirstTask", "train.parallel=dp", "train.max_steps=2")
    ddp = run(tmp_path / "ddp", "train.max_steps=2")
    mine, theirs = (load_file(str(out / "model" / "model.safetensors")) for out in (dp, ddp))
    assert all(torch.allclose(mine[k], theirs[k], atol=1e-6) for k in mine)
    assert batch_rows({"n": torch.tensor(3), "ids": ["a"] * 5, "x": torch.zeros(6, 2)}) == 6
    assert batch_rows({"n": torch.tensor(3), "ids": ["a"] * 5}) == 5
    assert batch_rows({"inputs": {"n": torch.tensor(3), "x": torch.zeros(4, 2)}, "ids": ["a"] * 5}) == 4  # nested
    with pytest.raises(DistqaError, match=r"no tensor or list of examples \(keys: n, name\)"):
        batch_rows({"n": torch.tensor(3), "name": "a"})


def _halves(value: Any) -> list[Any]:
    return list(value.chunk(2)) if torch.is_tensor(value) else [value, value]


def _joined(parts: list[Any]) -> Any:
    """What `gather` makes of the replicas' outputs: tensors concatenated (0-dim ones stacked into a
    vector), mappings (ModelOutput too) and sequences joined item by item."""
    first = parts[0]
    if torch.is_tensor(first):
        return torch.stack(parts) if first.dim() == 0 else torch.cat(parts)
    if isinstance(first, dict):
        return type(first)((key, _joined([part[key] for part in parts])) for key in first)
    if isinstance(first, tuple | list):
        return type(first)(_joined(list(items)) for items in zip(*parts))
    return first


class CpuReplicas(nn.Module):
    """DataParallel's forward on the CPU, for 2 "GPUs": torch's own `replicate` (its broadcast
    between devices made a clone), the inputs split in halves along dim 0 as `scatter` splits them,
    and the outputs joined as `gather` joins them. A model whose code breaks on a replica (whose
    parameters are plain tensors: its `parameters()` is empty) fails here as on GPUs."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        replicate = sys.modules["torch.nn.parallel.replicate"]
        with pytest.MonkeyPatch.context() as patch:
            clones = lambda tensors, devices, detach=False: [  # noqa: E731
                [t.detach().clone() if detach else t.clone() for t in tensors] for _ in devices
            ]
            patch.setattr(replicate, "_broadcast_coalesced_reshape", clones)
            replicas = replicate.replicate(self.module, [0, 0])
        split_args = list(zip(*map(_halves, args))) or [(), ()]
        split_kwargs = [{k: _halves(v)[i] for k, v in kwargs.items()} for i in range(2)]
        return _joined([r(*a, **k) for r, a, k in zip(replicas, split_args, split_kwargs)])


@pytest.mark.launch  # builds two Hugging Face models (seconds): beside the launches, out of `make test`'s budget
def test_every_built_in_task_computes_its_loss_through_replicas(tmp_path, minilm_dir):
    """nq (the tiny BERT) and textcls (MiniLM): the loss from two replicas' gathered outputs equals
    the whole batch's, and every parameter of the model gets its gradient through the copies."""
    rows = "".join(f"{'a fine' if i % 2 else 'a dull'} film number {i},{i % 2}\n" for i in range(8))
    (tmp_path / "train.csv").write_text("text,label\n" + rows)
    textcls = [
        "task.name=textcls",
        f"model.name={minilm_dir}",
        "task.labels=0,1",
        f"data.train={tmp_path / 'train.csv'}",
    ]
    for settings in (["model.name=tiny", "task.max_seq_len=64", "task.dummy_size=8"], textcls):
        task = load_task(load_config(None, [*settings, "model.dropout=0.0", "data.num_workers=0"]))
        model, data = task.build_model(), task.build_train_dataset()
        batch = task.collate([data[i] for i in range(8)])
        whole = task.loss(model, batch)
        split = task.loss(CpuReplicas(model), batch)
        split.backward()
        assert torch.allclose(split, whole, atol=1e-6), (settings[0], split, whole)
        assert all(p.grad is not None for p in model.parameters()), settings[0]


def test_autocast_reaches_a_replicas_thread_only_from_inside_its_forward(monkeypatch):
    """DataParallel runs each GPU's copy in a thread, and autocast's state is per thread: the
    trainer's bf16 reaches it only through `AutocastForward` (on CUDA, DataParallel carries
    "enabled" over but not the dtype, so bf16 would run as fp16). Shown with CPU autocast."""
    layer, features = nn.Linear(4, 4), torch.randn(2, 4)

    def in_thread(module: nn.Module) -> torch.Tensor:
        out: list[torch.Tensor] = []
        thread = threading.Thread(target=lambda: out.append(module(features)))
        thread.start()
        thread.join()
        return out[0]

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(features).dtype == torch.bfloat16
        assert in_thread(layer).dtype == torch.float32  # the thread has none of it
        assert in_thread(parallel.AutocastForward(layer, torch.bfloat16, "cpu")).dtype == torch.bfloat16
    # The trainer's wrapping puts it inside DataParallel for bf16 and fp16 on GPUs, and not for fp32.
    monkeypatch.setattr(parallel, "dp_device_ids", lambda info: [0])
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", None)):
        train = load_config(None, ["train.parallel=dp", f"train.precision={precision}"]).train
        inner = parallel.one_process_data_parallel(layer, CPU, train).module
        assert (inner.dtype, inner.module) == (dtype, layer) if dtype else inner is layer


def test_dp_is_refused_on_the_cpu_in_one_line_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TOY, "train.parallel=dp", "train.max_steps=1", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    if not torch.cuda.is_available():
        assert "train.parallel=dp splits each batch over CUDA GPUs, and none is visible" in err
        assert "use train.parallel=ddp" in err
    assert not out.exists()


def test_dp_is_refused_in_a_launch_of_several_processes(tmp_path):
    """Under torchrun with 2 processes every rank refuses at once, before any collective (so this
    needs no process group): one process per GPU is what ddp is for."""
    cfg = load_config(None, [*TOY, "train.parallel=dp", f"output_dir={tmp_path / 'run'}"])
    info = DistInfo(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))
    with pytest.raises(ConfigError) as refused:
        Trainer(cfg, load_task(cfg), info).fit()
    line = str(refused.value)
    assert "\n" not in line and "WORLD_SIZE=2" in line and "train.parallel=ddp" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "setting,says",
    [
        ("train.ddp_comm_hook=bf16", "train.ddp_comm_hook=bf16 hooks DDP's all-reduce"),
        ("train.ddp_comm_hook=powersgd", "train.ddp_comm_hook=powersgd hooks DDP's all-reduce"),
        ("train.compile=true", "train.compile=true is not supported with train.parallel=dp"),
    ],
)
def test_settings_dp_has_no_use_for_are_refused_in_one_line(setting, says):
    with pytest.raises(ConfigError, match=says) as refused:
        load_config(None, ["train.parallel=dp", setting])
    assert "\n" not in str(refused.value) and "train.parallel=ddp" in str(refused.value)
    cfg = load_config(None, ["train.parallel=dp", "train.check_replicas=true", "train.activation_checkpointing=true"])
    assert cfg.train.parallel == "dp"  # one process: the replica check passes as at world size 1


# ------------------------------------------------------------------------------ distqa bench --dp


def test_bench_dp_on_the_cpu_is_one_line_and_launches_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("distqa.bench.launch._launch", lambda *a: pytest.fail("launched on the CPU"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--nproc", "1,2", "--output", str(tmp_path / "b"), "--dp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "distqa: error: --dp needs GPUs: train.parallel=dp (torch.nn.DataParallel) splits each batch over "
        "CUDA devices, and none is visible here; leave --dp out"
    )
    assert main(["bench", "--nproc", "1", "--output", str(tmp_path / "b"), "train.parallel=dp"]) == 2
    assert "use --dp" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def _run(loop: str, seconds: float, nproc: int, parallel: str = "ddp") -> dict:
    """A worker's result file: 100 samples per process (dp: per GPU) in `seconds`."""
    return bench_result(
        seconds,
        loop=loop,
        parallel=parallel,
        samples=100 * nproc,
        tokens=1000 * nproc,
        host="h",
        torch="t",
        compile=False,
        seq_len=64,
        batch_size=8,
        grad_accum=1,
        state_bytes={"parameters": 2**20, "gradients": 2**20, "optimizer": 2**21},
    )


def test_bench_dp_rows_sit_beside_ddp_in_json_table_and_plot(tmp_path, monkeypatch, capsys):
    """Two GPUs, faked: each round launches DDP then dp per GPU count (odd rounds reversed); dp at 2
    GPUs is 1.5x slower per GPU than DDP (scatter, gather, one Python process)."""
    launched = []

    def fake_launch(nproc: int, loop: str, repeat: int, args, out: Path) -> dict:
        launched.append((nproc, loop, repeat))
        seconds = 1.5 if (loop, nproc) == ("dp", 2) else 1.0
        return _run(loop, seconds, nproc, parallel="dp" if loop == "dp" else "ddp")

    monkeypatch.setattr("distqa.bench.launch._launch", fake_launch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    out = tmp_path / "b"
    assert main(["bench", "--nproc", "1,2", "--output", str(out), "--dp", "--repeats", "2", "model.name=tiny"]) == 0
    assert launched == [(1, "trainer", 0), (1, "dp", 0), (2, "trainer", 0), (2, "dp", 0)] + [
        (2, "dp", 1), (2, "trainer", 1), (1, "dp", 1), (1, "trainer", 1)
    ]  # fmt: skip
    result = json.loads((out / "bench.json").read_text())
    assert [(r["parallel"], r["nproc"]) for r in result["runs"]] == [("ddp", 1), ("ddp", 2), ("dp", 1), ("dp", 2)]
    ddp2, dp1, dp2 = result["runs"][1:]
    assert ddp2["scaling_efficiency"] == 1.0 and dp1["scaling_efficiency"] == 1.0  # each against its own 1
    assert dp2["scaling_efficiency"] == pytest.approx(1 / 1.5) and dp2["dp_over_ddp"] == pytest.approx(1 / 1.5)
    assert dp2["step_breakdown_pct"]["forward_backward"] == pytest.approx(20.0)
    table = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3, tiny, ddp and dp, bf16" in table and "vs ddp" in table
    dp_line = next(line for line in table.splitlines() if line.split()[:2] == ["2", "dp"])
    assert "66.7%" in dp_line and dp_line.split()[-1] == "0.667"
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_of_synthetic_dp_rows_and_their_warnings(tmp_path, capsys):
    rows = [summarize(n, [_run("trainer", 1.0, n)], [], None) for n in (1, 2)]
    rows += [summarize(n, [_run("trainer", t, n, parallel="dp")], [], None) for n, t in ((1, 2.0), (2, 1.0))]
    add_scaling(rows)
    assert rows[3]["scaling_efficiency"] == 2.0 and rows[3]["dp_over_ddp"] == 1.0
    result = {"device": "cpu", "model": "tiny", "precision": "fp32", "seq_len": 64, "flops_note": None}
    result |= {"batch_size": 8, "runs": rows, "warnings": implausible(rows)}
    assert result["warnings"] == [
        "distqa bench: warning: dp 2: scaling efficiency 200.0 % is above 100 %: more than linear, which DDP "
        "with a fixed batch per process should not reach; the smallest process count's runs were probably "
        "slowed by other load"
    ]
    print_table(result)
    assert capsys.readouterr().out.count(" dp ") == 2
    plot(result, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_a_dp_launch_sees_exactly_its_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert dp_env(2, {"PATH": "/bin"}) == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert dp_env(2, {"CUDA_VISIBLE_DEVICES": "3, 5,6"})["CUDA_VISIBLE_DEVICES"] == "3,5"  # the user's own first
