"""The distributed life cycle and rank policy, in one place.

torchrun (or any launcher that sets the same variables) gives each process RANK, LOCAL_RANK and
WORLD_SIZE. Without them we are a single process and create no process group at all: every helper
below is then a no-op, so the trainer runs one code path for 1 or N processes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distqa.errors import DistqaError
from distqa.peer_watch import PeerWatch

if TYPE_CHECKING:  # for hints only
    from distqa.config import TrainConfig


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of `train.precision` (None: plain fp32)."""
    return AUTOCAST_DTYPES.get(precision)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise DistqaError(f"environment variable {name}={raw!r} is not an integer") from None


def init_distributed() -> DistInfo:
    """Read the launcher's variables, pick the device, and join the process group.

    The CUDA device is set *before* init_process_group so that NCCL binds each rank to its own GPU
    (otherwise every rank's communicator would land on cuda:0).
    """
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    if not 0 <= rank < world_size:
        raise DistqaError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world_size})")

    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise DistqaError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible: "
                "use --nproc-per-node <= the number of GPUs"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"

    error_file = os.environ.get("DISTQA_ERROR_FILE")
    if error_file and _env_int("TORCHELASTIC_RESTART_COUNT", 0) > 0 and local_rank == 0:
        # A restarted round (static or elastic, whatever its size): the launcher repeats the file's
        # first line when the run fails, so make it this round's failure, not the lost peer that
        # ended the last one. (Every worker of the last round is gone by now.)
        with contextlib.suppress(OSError):
            os.truncate(error_file, 0)

    if world_size > 1 and not dist.is_initialized():
        kwargs: dict = {"device_id": device} if backend == "nccl" else {}
        # One timeout for every collective, NCCL's included (its default is 10 minutes, gloo's 30):
        # ranks wait in a barrier while one process per node builds a cache (NQ's features when no
        # `prepare` job made them), longer than 10 minutes on few cores. A dead peer is still found
        # within DISTQA_PEER_TIMEOUT_S by PeerWatch.
        timeout_s = _env_int("DISTQA_PG_TIMEOUT_S", 1800)
        if timeout_s <= 0:
            raise DistqaError(f"DISTQA_PG_TIMEOUT_S={timeout_s} must be a positive number of seconds")
        peer_timeout_s = PeerWatch.timeout_from_env()  # a bad value stops the run here, before the rendezvous
        kwargs["timeout"] = timedelta(seconds=timeout_s)
        store = _restart_scoped_store()
        if store is not None:
            kwargs["store"] = store
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **kwargs)
        PeerWatch.start(rank, world_size, peer_timeout_s)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def _restart_scoped_store() -> dist.Store | None:
    """The agent's store, namespaced by the restart round that every node agrees on.

    After a worker dies, torchrun (`--max-restarts`) starts a new round in the same agent store,
    and the default process-group keys from the dead round are still there: gloo then tries to
    connect to the dead workers' addresses and fails or hangs (PITFALLS #1; pytorch/pytorch#167288
    and #135712). A prefix per round gives every round fresh keys; `distqa.rounds` numbers the
    rounds in the store, so that a node replacing a lost one joins the others' round at once.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from distqa import rounds

    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=_env_int("DISTQA_STORE_TIMEOUT_S", 900)),
    )
    rounds.client = client
    joined = rounds.joined = rounds.join_round(
        client,
        rank=_env_int("RANK", 0),
        world_size=_env_int("WORLD_SIZE", 1),
        node=_env_int("GROUP_RANK", 0),
        local_restarts=_env_int("TORCHELASTIC_RESTART_COUNT", 0),
        # worker.sh passes its RDZV_TIMEOUT on; torchrun's own default is 900 s
        timeout_s=_env_int("DISTQA_RDZV_TIMEOUT", 900),
    )
    if joined.number > 0 and _env_int("RANK", 0) == 0:
        print(f"distqa: {joined.describe()}", flush=True)
    return dist.PrefixStore(f"distqa/round-{joined.number}/", client)


def data_parallel(model: nn.Module, info: DistInfo, train: TrainConfig) -> DDP:
    """DDP as the trainer (and the bench's baseline loop) use it.

    gradient_as_bucket_view: gradients live in DDP's all-reduce buckets, saving a copy and the
    memory of a second gradient. static_graph: DDP skips searching for unused parameters and
    re-deciding the bucket order each step; it breaks under no_sync, i.e. gradient accumulation
    (huggingface/accelerate#3679; fix proposed in pytorch/pytorch#187732), and Dynamo splits a
    compiled graph at the buckets itself, so it is used only with neither.
    """
    static = train.static_graph and train.grad_accum == 1 and not train.compile
    device_ids = [info.local_rank] if info.device.type == "cuda" else None
    return DDP(
        model,
        device_ids=device_ids,
        gradient_as_bucket_view=True,
        # Gradients per all-reduce: larger buckets mean fewer, longer messages (a slow link's
        # latency paid less often), smaller ones an earlier start that overlaps the backward pass.
        bucket_cap_mb=train.bucket_cap_mb,
        static_graph=static,
        # A parameter no step uses (an unused head) makes DDP wait for its gradient forever or fail;
        # a static graph copes with that itself, otherwise DDP must look for them each step.
        find_unused_parameters=train.find_unused_parameters and not static,
    )


def cleanup(ended_well: bool = True) -> None:
    """Leave the process group. Safe to call twice and when none was created. `ended_well=False`
    (this rank failed): its neighbours are not told it stopped on purpose (`PeerWatch`)."""
    watch, PeerWatch.current = PeerWatch.current, None
    if watch is not None:
        watch.stop(done=ended_well)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (in place, returned for chaining). Every rank must call it."""
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def broadcast_object(obj: object, src: int = 0) -> object:
    """Send a picklable object from `src` to every rank (used for small decisions, not tensors)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_to_main(obj: object, info: DistInfo) -> list[object]:
    """Every rank's `obj`, in rank order, on rank 0 (an empty list elsewhere). Every rank must call it."""
    if not info.is_distributed:
        return [obj]
    out: list[object] | None = [None] * info.world_size if info.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out or []


def all_gather_objects(obj: object, info: DistInfo) -> list[object]:
    """Every rank's `obj`, in rank order, on every rank. Every rank must call it."""
    if not info.is_distributed:
        return [obj]
    out: list[object] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


@contextlib.contextmanager
def local_main_first(info: DistInfo) -> Iterator[None]:
    """Local rank 0 of each node runs the body first (e.g. downloads a model into the node's
    Hugging Face cache); the node's other ranks wait, then run it and find the files there.
    Without this, N processes would download the same files at once into the same cache."""
    if info.local_rank != 0:
        barrier()
    yield
    if info.local_rank == 0:
        barrier()


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, which honours taskset and container CPU sets
    (every CPU of the host where there is none: not on Linux)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpus_per_local_rank() -> int:
    """The CPUs this process may run on, shared among the processes torchrun started on this node."""
    return max(1, usable_cpus() // max(1, _env_int("LOCAL_WORLD_SIZE", 1)))


def default_num_workers() -> int:
    """DataLoader workers per rank when data.num_workers is unset: one core per rank runs the
    training loop itself, its share of the rest loads data; more than 8 only costs memory."""
    return max(0, min(8, cpus_per_local_rank() - 1))


def print0(*args: object, **kwargs: object) -> None:
    """print() on rank 0 only, so N processes do not repeat every line N times."""
    if _env_int("RANK", 0) == 0:
        print(*args, **kwargs, flush=True)  # type: ignore[call-overload]
