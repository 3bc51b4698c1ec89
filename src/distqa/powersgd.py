"""PowerSGD for `train.ddp_comm_hook=powersgd`: its state kept per parameter, and its reduction on gloo.

PowerSGD (Vogels et al., 2019) sends a rank-r approximation P Q^T of each gradient matrix, with error
feedback (what the approximation left out is added to the next step's gradient) and warm start (last
step's Q). PyTorch's `powerSGD_hook` and `PowerSGDState` run it; distqa adds two things:

- The state is keyed by DDP's bucket index. DDP builds its buckets in parameter order, then rebuilds
  them after the first step in the order gradients became ready, so a resumed run's first step sees
  other buckets than the uninterrupted run did at that step. The state is therefore kept, saved and
  restored per parameter (`_Pieces`), and laid out again for whatever bucket asks for it: the
  arithmetic of each gradient matrix does not depend on which bucket it rides in. Its first Q,
  too, is drawn per parameter (`PowerSGD._begin`), not per bucket as torch's hook draws it.
- On gloo, `reduce_on_gloo` instead of torch's hook (why: `PowerSGD.__init__`). It keeps torch's
  state and its layout, so checkpoints are the same on either backend, and computes M^T P as
  (P^T M)^T: the same product (equal to rounding), but a CPU's product with a transposed tall
  matrix first is several times slower (9.4 against 1.1 ms for the tiny model's 30522 x 128
  embedding gradient at rank 4, one thread). It also sends the uncompressed gradients and P in one
  all-reduce instead of two. Error feedback and warm start are always on (as `PowerSGD` sets them).

Bitwise resumes need every product to give the same bits wherever a gradient lies in its bucket
(`tests/test_powersgd.py`). At two processes that makes a resume exact; at three or more, gloo's own
sums depend on an element's place in the tensor (for every hook), so the first step after a resume,
whose buckets DDP has not yet rebuilt, agrees with the uninterrupted run only to rounding.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

if TYPE_CHECKING:
    from distqa.config import TrainConfig

FIRST_Q_SEED = 0x5053_4744  # "PSGD": parameter i's first Q is drawn from this seed plus i


def _matrices(state: powerSGD_hook.PowerSGDState, bucket: Any, source: torch.Tensor) -> tuple[list, list]:
    """The bucket's gradients as (where the result goes: a view of the bucket's buffer, what is
    reduced: the same place in `source`). Those PowerSGD compresses as n x m matrices, grouped by
    shape in order of first appearance (as torch's hook lays out P and Q), and those it sends
    whole; counts the savings as torch's hook does."""
    buffer = bucket.buffer()
    compress, whole = defaultdict(list), []
    for tensor in bucket.gradients():
        # DDP's gradients are views of the bucket's flat buffer, one after another.
        at = tensor.storage_offset() - buffer.storage_offset()
        pair = (tensor, source[at : at + tensor.numel()].view(tensor.shape))
        n = tensor.shape[0]
        m = tensor.numel() // n
        worth, before, after = powerSGD_hook._should_compress(
            n, m, min(n, m, state.matrix_approximation_rank), state.min_compression_rate
        )
        state.total_numel_before_compression += before
        state.total_numel_after_compression += after if worth else before
        if worth:
            compress[(n, m)].append(tuple(t.view(n, m) for t in pair))
        else:
            whole.append(pair)
    return [pair for group in compress.values() for pair in group], whole


def reduce_on_gloo(state: powerSGD_hook.PowerSGDState, bucket: Any) -> torch.Tensor:
    """One bucket's PowerSGD all-reduce, done before returning (see the module's docstring): the
    arithmetic of torch's `powerSGD_hook` with error feedback and warm start, one matrix at a time."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world_size = group.size()
    buffer, index = bucket.buffer(), bucket.index()
    if state.iter < state.start_powerSGD_iter:  # plain all-reduce first, as torch's hook does
        state.maybe_increase_iter(bucket)
        # Divided before the sum, as torch's hook and DDP's own all-reduce do: their bits at any
        # world size, and a sum in 16 bits that cannot overflow.
        dist.all_reduce(buffer.div_(world_size), group=group)
        return buffer
    if index not in state.error_dict:
        state.error_dict[index] = torch.zeros_like(buffer)
    # The gradient plus last step's error is reduced from the error's own memory (one pass fewer
    # than torch's copy of the buffer); once the result is subtracted, that memory is the new error.
    error = state.error_dict[index].add_(buffer)
    matrices, whole = _matrices(state, bucket, error)
    powerSGD_hook._report_compression_stats(bucket, state)
    ranks = [min(*m.shape, state.matrix_approximation_rank) for _, m in matrices]
    fresh = index not in state.p_memory_dict
    if fresh:
        state.p_memory_dict[index] = buffer.new_empty(sum(m.shape[0] * r for (_, m), r in zip(matrices, ranks)))
        state.q_memory_dict[index] = buffer.new_empty(sum(m.shape[1] * r for (_, m), r in zip(matrices, ranks)))
    ps, qs, p_at, q_at = [], [], 0, 0
    for (_, m), r in zip(matrices, ranks):
        (n, k) = m.shape
        ps.append(state.p_memory_dict[index][p_at : p_at + n * r].view(n, r))
        qs.append(state.q_memory_dict[index][q_at : q_at + k * r].view(k, r))
        p_at, q_at = p_at + n * r, q_at + k * r
    if fresh:  # random Qs, the same on every rank: torch's seed and draws, on a generator of their own
        generator = torch.Generator().manual_seed(state.rng.randint(1_000_000_000))
        for q in qs:
            q.copy_(torch.randn(1, *q.shape, generator=generator, dtype=buffer.dtype, device="cpu")[0])
    for q in qs:
        powerSGD_hook._orthogonalize(q.unsqueeze(0), state.orthogonalization_epsilon)
    for (_, m), q, p in zip(matrices, qs, ps):
        # M Q as (Q^T M^T)^T: twice as fast on a CPU for a tall M (2.1 against 4.2 ms for the tiny
        # model's embedding). Not `linear` (1.4 ms): its result changes with the gradient's memory
        # alignment, which moves with the bucket layout, and a resume must be bitwise. At rank 1 the
        # product is a matrix-vector one, whose result does too: M is copied to aligned memory first.
        if q.shape[1] == 1 and m.data_ptr() % 64:
            m = m.clone()
        p.copy_(torch.mm(q.t().contiguous(), m.t()).t())
    # The whole gradients and the Ps in one all-reduce (a sum: the Ps are orthogonalised next).
    sent = torch.cat([t.reshape(-1) for _, t in whole] + [state.p_memory_dict[index]])
    dist.all_reduce(sent, group=group)
    at = 0
    for result, tensor in whole:
        result.copy_(sent[at : at + tensor.numel()].view_as(tensor)).div_(world_size)
        at += tensor.numel()
    state.p_memory_dict[index].copy_(sent[at:])
    for (_, m), p, q in zip(matrices, ps, qs):
        powerSGD_hook._orthogonalize(p.unsqueeze(0), state.orthogonalization_epsilon)
        q.copy_(torch.mm(p.t(), m).t())  # M^T P as (P^T M)^T: see the module's docstring
    dist.all_reduce(state.q_memory_dict[index], group=group)
    state.q_memory_dict[index].div_(world_size)
    for (result, _), p, q in zip(matrices, ps, qs):
        torch.mm(p, q.t(), out=result)
    error.sub_(buffer)
    state.maybe_increase_iter(bucket)
    return buffer


class _Pieces:
    """Where each gradient's PowerSGD state lies in a bucket's flat tensors (bucket by bucket, as
    PowerSGD lays them out): error feedback in gradient order, P and Q of the compressed matrices
    grouped by shape in order of first appearance (powerSGD_hook's `shape_to_tensors`)."""

    def __init__(self, shapes: list[torch.Size], rank: int, min_rate: float) -> None:
        self.error: list[tuple[int, int]] = []  # (offset, length) per gradient
        self.p: dict[int, tuple[int, int]] = {}  # gradient position -> (offset, length) in P
        self.q: dict[int, tuple[int, int]] = {}
        offset, groups = 0, {}
        for pos, shape in enumerate(shapes):
            numel = shape.numel()
            self.error.append((offset, numel))
            offset += numel
            n = shape[0]
            m = numel // n
            r = min(n, m, rank)
            if powerSGD_hook._should_compress(n, m, r, min_rate)[0]:
                groups.setdefault((n, m, r), []).append(pos)
        p_off = q_off = 0
        for (n, m, r), positions in groups.items():
            for pos in positions:
                self.p[pos], self.q[pos] = (p_off, n * r), (q_off, m * r)
                p_off, q_off = p_off + n * r, q_off + m * r
        self.total = offset


class PowerSGD:
    """PyTorch's PowerSGD hook and state, kept per parameter across bucket rebuilds and resumes."""

    def __init__(self, model: nn.Module, train: TrainConfig, group: Any = None) -> None:
        self.state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=train.powersgd_rank,
            start_powerSGD_iter=train.powersgd_start_step,
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,  # the same on every rank: the random Qs must agree
        )
        self.params = list(model.parameters())
        self._index = {p.data_ptr(): i for i, p in enumerate(self.params)}
        self.layouts: dict[int, tuple[int, ...]] = {}  # bucket index -> parameter indices
        # Per-parameter state not yet laid out in a bucket: param index -> {"error", "p", "q"}.
        self.pieces: dict[int, dict[str, torch.Tensor]] = {}
        self.seen: set[int] = set()  # buckets reduced in the current step
        # torch's hook is shaped for NCCL, where a future's callbacks run as soon as they are set. On
        # gloo they run on one of its few worker threads, and torch's callbacks wait there for the
        # next all-reduce: with several buckets in flight those threads all wait and the step hangs
        # (seen at 2 processes with a 0.1 MB bucket_cap_mb). On gloo distqa reduces each bucket
        # itself, in the hook (`reduce_on_gloo`: the same arithmetic, no callbacks).
        self.on_gloo = dist.get_backend(group) == "gloo"

    def reduce(self, bucket: Any) -> Any:
        layout = tuple(self._index[p.data_ptr()] for p in bucket.parameters())
        index = bucket.index()
        if self.layouts.get(index) != layout:
            # New buckets (DDP's rebuild, a resume): the state of every bucket not yet reduced in
            # this step goes back to its parameters, and this bucket's is laid out from theirs.
            # (Buckets already reduced in this step keep theirs: their futures may still use it.)
            self._split_unseen()
            self._assemble(index, layout, bucket.buffer())
            self.layouts[index] = layout
        if self.state.iter >= self.state.start_powerSGD_iter and index not in self.state.p_memory_dict:
            self._begin(index, layout, bucket.buffer())
        self.seen.add(index)
        if self.on_gloo:
            future = torch.futures.Future()
            future.set_result(reduce_on_gloo(self.state, bucket))
        else:
            future = powerSGD_hook.powerSGD_hook(self.state, bucket)
        if bucket.is_last():  # DDP reduces bucket 0 last: the step's communication is all launched
            self.seen.clear()
        return future

    def _split_unseen(self) -> None:
        s = self.state
        for index in [i for i in self.layouts if i not in self.seen]:
            self.pieces.update(self._split_bucket(index, self.layouts.pop(index)))
            for memory in (s.error_dict, s.p_memory_dict, s.q_memory_dict):
                memory.pop(index, None)

    def _layout(self, layout: tuple[int, ...]) -> _Pieces:
        shapes = [self.params[i].shape for i in layout]
        return _Pieces(shapes, self.state.matrix_approximation_rank, self.state.min_compression_rate)

    def _split_bucket(self, index: int, layout: tuple[int, ...]) -> dict[int, dict[str, torch.Tensor]]:
        """One bucket's state per parameter (views of its tensors); empty before PowerSGD began."""
        s, pieces = self.state, {}
        if index not in s.error_dict:
            return pieces
        places = self._layout(layout)
        for pos, param in enumerate(layout):
            offset, length = places.error[pos]
            piece = {"error": s.error_dict[index][offset : offset + length]}
            if pos in places.p and index in s.p_memory_dict:
                (po, pl), (qo, ql) = places.p[pos], places.q[pos]
                piece["p"] = s.p_memory_dict[index][po : po + pl]
                piece["q"] = s.q_memory_dict[index][qo : qo + ql]
            pieces[param] = piece
        return pieces

    def _split(self) -> dict[int, dict[str, torch.Tensor]]:
        """The whole state per parameter, without changing the buckets' own tensors."""
        pieces = dict(self.pieces)
        for index, layout in self.layouts.items():
            pieces.update(self._split_bucket(index, layout))
        return pieces

    def _clear(self) -> None:
        self.layouts.clear()
        self.seen.clear()
        for memory in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
            memory.clear()

    def _begin(self, index: int, layout: tuple[int, ...], buffer: torch.Tensor) -> None:
        """PowerSGD's first step for this bucket: each parameter's state starts as its own, a zero
        error and a random Q drawn from the parameter's index (the same on every rank), then laid
        out as a warm start. torch's hook (and `reduce_on_gloo` alike) drew every Q of a bucket from
        one seed per bucket, in bucket order: a run resumed from the checkpoint at
        train.powersgd_start_step, whose first step sees DDP's first buckets, not the rebuilt ones,
        drew other Qs, and ended 6.6e-3 from the uninterrupted run, exit 0."""
        places = self._layout(layout)
        for pos, param in enumerate(layout):
            if param in self.pieces:
                continue
            piece = {"error": torch.zeros(places.error[pos][1])}
            if pos in places.p:
                generator = torch.Generator().manual_seed(FIRST_Q_SEED + param)
                piece["p"] = torch.zeros(places.p[pos][1])
                piece["q"] = torch.randn(places.q[pos][1], generator=generator)
            self.pieces[param] = piece
        self._assemble(index, layout, buffer)

    def _assemble(self, index: int, layout: tuple[int, ...], buffer: torch.Tensor) -> None:
        if not all(param in self.pieces for param in layout):
            return  # (a parameter without state: this bucket starts afresh, as PowerSGD would)
        places, pieces = self._layout(layout), [self.pieces.pop(param) for param in layout]
        device, dtype = buffer.device, buffer.dtype
        self.state.error_dict[index] = torch.cat([p["error"] for p in pieces]).to(device, dtype)
        for key, memory, where in (
            ("p", self.state.p_memory_dict, places.p),
            ("q", self.state.q_memory_dict, places.q),
        ):
            ordered = sorted(where, key=lambda pos: where[pos][0])
            parts = [pieces[pos][key] for pos in ordered if key in pieces[pos]]
            if len(parts) == len(ordered):
                memory[index] = (torch.cat(parts) if parts else torch.empty(0)).to(device, dtype)

    def state_dict(self) -> dict[str, Any]:
        s = self.state
        name, keys, pos, has_gauss, cached = s.rng.get_state()
        return {
            "rank": s.matrix_approximation_rank,
            "iter": s.iter,
            # NumPy's key array as a plain list: weights_only loading refuses ndarrays.
            "rng": (name, keys.tolist(), pos, has_gauss, cached),
            "numel": (s.total_numel_before_compression, s.total_numel_after_compression, s.next_stats_report),
            "pieces": {i: {k: t.detach().cpu().clone() for k, t in p.items()} for i, p in self._split().items()},
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        s = self.state
        s.iter = int(saved["iter"])
        name, keys, pos, has_gauss, cached = saved["rng"]
        s.rng.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        s.total_numel_before_compression, s.total_numel_after_compression, s.next_stats_report = saved["numel"]
        self._clear()
        self.pieces = {int(i): dict(p) for i, p in saved["pieces"].items()}
