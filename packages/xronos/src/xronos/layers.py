"""Tensor-parallel linear layers whose shard sizes are arbitrary per rank.

A Megatron pair: a column-parallel layer (each rank holds some output rows of the weight) feeds a
row-parallel layer (each rank holds the matching input columns). The only collectives are the pair's
``f``/``g`` operators: ``copy_to_tp`` (identity forward, all-reduce of the input gradient backward)
in front of the column layer and ``reduce_from_tp`` (all-reduce forward, identity backward) after
the row layer. Both all-reduce full-size tensors, so uneven middle shards need no uneven collective.

LoRA adapters are sharded the same way: a column layer's ``B`` is split by output rows and its
``A`` replicated; a row layer's ``A`` is split by input columns and its ``B`` replicated, its low-rank
product added to the partial sum before the all-reduce. The replicated halves receive per-rank
partial gradients, marked with ``param.xronos_partial_grad = True`` and summed by
:func:`sync_partial_grads`.

Every collective here first calls ``hwtopo.sync_point()``: under the compute-dilation emulation
(``hwtopo.dilate``) an emulated slow rank pays its compute dilation there, before the collective is
timed, so the time before the collective is the emulated compute; without one it does nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hwtopo import resume_point, sync_point

__all__ = [
    "CommStats",
    "COMM",
    "copy_to_tp",
    "reduce_from_tp",
    "all_reduce",
    "all_gather",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "sync_partial_grads",
    "gather_uneven",
    "gather_uneven_many",
    "merged_weight",
    "clip_grad_norm",
    "grad_square_sum",
    "scale_grads",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
]


class CommStats:
    """Wall seconds spent inside collectives by this process (waiting for peers included).

    ``syncs`` records every synchronisation of the current step as ``(kind, peer, enter, exit)``
    (``perf_counter`` seconds; kind "ar" for a collective of all ranks, all-reduce or all-gather,
    with peer -1; "send"/"recv" with the peer rank), so :mod:`xronos.waits` can split the time
    inside into waiting for the last peer to arrive and the transfer itself, and
    :mod:`xronos.rebalance` can time each compute segment between them.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.bytes = 0
        self.overlapped_s = 0.0  # weight-gradient compute that ran while an all-reduce was in flight
        self.syncs: list[tuple[str, int, float, float, str]] = []
        self.events: list[tuple[float, float]] | None = None  # (start, end) when recording a timeline

    def reset(self) -> None:
        self.seconds, self.calls, self.bytes = 0.0, 0, 0
        self.overlapped_s = 0.0
        self.syncs = []
        if self.events is not None:
            self.events = []

    def record(self, kind: str, peer: int, t0: float, t1: float, nbytes: int = 0, tag: str = "") -> None:
        self.seconds += t1 - t0
        self.calls += 1
        self.bytes += nbytes
        self.syncs.append((kind, peer, t0, t1, tag))
        if self.events is not None:
            self.events.append((t0, t1))


COMM = CommStats()


def _active(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce(t: torch.Tensor, group=None, op=None, tag: str = "") -> torch.Tensor:
    """In-place reduction (sum by default) over the group, timed into :data:`COMM`; a no-op outside a group."""
    if not _active(group):
        return t
    sync_point()  # emulated slow compute is paid before the synchronisation, not inside it
    t0 = time.perf_counter()
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group)
    COMM.record("ar", -1, t0, time.perf_counter(), t.numel() * t.element_size(), tag)
    resume_point()  # a wait for the core while waking up here is part of the wait, not of compute
    return t


def all_gather(t: torch.Tensor, group=None, tag: str = "") -> torch.Tensor:
    """Every rank's ``t`` stacked along a new first dimension (rank order), timed into :data:`COMM`
    like an all-reduce (a collective of all ranks); ``t[None]`` outside a group."""
    if not _active(group):
        return t.unsqueeze(0)
    out = torch.empty((dist.get_world_size(group), *t.shape), dtype=t.dtype)
    sync_point()
    t0 = time.perf_counter()
    dist.all_gather(list(out.unbind(0)), t.contiguous(), group=group)  # each rank's row written in place
    COMM.record("ar", -1, t0, time.perf_counter(), out.numel() * out.element_size(), tag)
    resume_point()
    return out


# Weight gradients of column-parallel layers whose computation waits for the next input-gradient
# all-reduce: (weight, grad_output, input). Autograd runs a block's column layers' backward before the
# block input's all-reduce (copy_to_tp), so their weight-gradient GEMMs can run while it is in flight,
# as Megatron overlaps them. CPU autograd runs on the thread that called backward(): one list suffices.
_DEFERRED_WGRAD: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []


def _flush_weight_grads() -> None:
    """Compute and accumulate every deferred weight gradient (``grad += g^T x``)."""
    while _DEFERRED_WGRAD:
        weight, g, x = _DEFERRED_WGRAD.pop()
        dw = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        if weight.grad is None:
            weight.grad = dw
        else:
            weight.grad.add_(dw)


class _DeferredWgradLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose weight gradient is queued for :func:`_flush_weight_grads`."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        grad_x = g @ weight if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            if not _DEFERRED_WGRAD:  # whatever no all-reduce picked up is computed when backward ends
                torch.autograd.Variable._execution_engine.queue_callback(_flush_weight_grads)
            _DEFERRED_WGRAD.append((weight, g, x))
        grad_b = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_b


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tag):
        ctx.group, ctx.tag = group, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        if not _DEFERRED_WGRAD:
            return all_reduce(g, ctx.group, tag=ctx.tag), None, None
        sync_point()  # emulated compute before the all-reduce is paid before it starts
        t_start = time.perf_counter()
        work = dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group, async_op=True)
        _flush_weight_grads()  # the weight-gradient GEMMs run while the all-reduce is in flight
        sync_point()  # and are paid before the wait, which alone is communication
        t0 = time.perf_counter()
        work.wait()
        t1 = time.perf_counter()
        COMM.record("ar", -1, t0, t1, g.numel() * g.element_size(), ctx.tag)
        COMM.overlapped_s += t0 - t_start
        resume_point()
        return g, None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tag):
        return all_reduce(x.contiguous().clone(), group, tag=tag)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def copy_to_tp(x: torch.Tensor, group=None, tag: str = "") -> torch.Tensor:
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""
    return _CopyToTP.apply(x, group, tag) if _active(group) else x


def reduce_from_tp(x: torch.Tensor, group=None, tag: str = "") -> torch.Tensor:
    """Megatron's ``g``: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, group, tag) if _active(group) else x


def _check_sizes(name: str, sizes: Sequence[int], rank: int, group=None) -> tuple[int, ...]:
    sizes = tuple(int(s) for s in sizes)
    if not sizes or any(s < 0 for s in sizes):
        raise ValueError(f"{name} must be a non-empty list of shard sizes >= 0, not {list(sizes)}")
    if not 0 <= rank < len(sizes):
        raise ValueError(f"rank {rank} is outside {name} ({len(sizes)} ranks)")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) != len(sizes):
        n = dist.get_world_size(group)
        raise ValueError(f"{name} has {len(sizes)} entries but the process group has {n} ranks")
    return sizes


_SHARDED = "xronos_sharded"  # split across ranks: clip_grad_norm sums its squares over them
_PARTIAL_GRAD = "xronos_partial_grad"  # replicated, but each rank's gradient is a partial sum


def _tag(attr: str, *params: nn.Parameter | None) -> None:
    """Mark parameters with one of the flags above (read back with ``getattr(p, attr, False)``)."""
    for p in params:
        if p is not None:
            setattr(p, attr, True)


class _ParallelLinear(nn.Module):
    # set by the subclasses' constructors
    sizes: tuple[int, ...]
    rank: int
    full_in: int
    full_out: int
    weight: nn.Parameter
    bias: nn.Parameter | None
    xronos_name = ""  # the name of the nn.Linear it replaced
    xronos_no_lora = False  # True: enable_lora leaves it out (the vocabulary-parallel head)

    def __init__(self) -> None:
        super().__init__()
        self.lora_A: nn.Parameter | None = None
        self.lora_B: nn.Parameter | None = None
        self.lora_scale = 0.0
        self.tag = ""  # the segment its collective closes ("attn", "mlp", "head"), for timing

    @property
    def shard_offset(self) -> int:
        return sum(self.sizes[: self.rank])

    def _shard_lora(self, full_a: torch.Tensor, full_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a full adapter (A: ``r x in``, B: ``out x r``); each layout cuts its own side."""
        raise NotImplementedError

    def enable_lora(self, r: int, alpha: float, generator: torch.Generator | None = None) -> None:
        """Add a LoRA adapter initialised from the *full* adapter (same seed on every rank), then sharded."""
        if r <= 0:
            raise ValueError(f"LoRA rank r must be > 0, not {r}")
        full_a = torch.empty(r, self.full_in)
        nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=generator)
        full_b = torch.zeros(self.full_out, r)
        a, b = self._shard_lora(full_a, full_b)
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(b)
        self.lora_scale = alpha / r
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)


class ColumnParallelLinear(_ParallelLinear):
    """``y[:, shard] = x W[shard]^T + b[shard]``; rank ``rank`` holds ``out_sizes[rank]`` output rows."""

    def __init__(
        self,
        in_features: int,
        out_sizes: Sequence[int],
        rank: int,
        bias: bool = True,
        group=None,
        sync_input_grad: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.sizes = _check_sizes("out_sizes", out_sizes, rank, group)
        self.rank, self.group, self.sync_input_grad = rank, group, sync_input_grad
        self.full_in, self.full_out = in_features, sum(self.sizes)
        self.in_features, self.out_features = in_features, self.sizes[rank]
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype)) if bias else None
        self.shard_dim = 0
        _tag(_SHARDED, self.weight, self.bias)

    @classmethod
    def from_linear(cls, lin: nn.Linear, out_sizes, rank, group=None, sync_input_grad=True) -> ColumnParallelLinear:
        if sum(out_sizes) != lin.out_features:
            raise ValueError(f"out_sizes sum to {sum(out_sizes)} but the layer has {lin.out_features} outputs")
        m = cls(lin.in_features, out_sizes, rank, lin.bias is not None, group, sync_input_grad, lin.weight.dtype)
        m.load_full(lin.weight.detach(), None if lin.bias is None else lin.bias.detach())
        return m

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        o, n = self.shard_offset, self.out_features
        with torch.no_grad():
            self.weight.copy_(weight[o : o + n])
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias[o : o + n])

    def _shard_lora(self, full_a: torch.Tensor, full_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o, n = self.shard_offset, self.out_features
        return full_a, full_b[o : o + n].clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sync_input_grad:
            x = copy_to_tp(x, self.group, self.tag)
        if self.weight.requires_grad and _active(self.group) and torch.is_grad_enabled():
            # the weight gradient waits for the input-gradient all-reduce, to overlap it
            y = _DeferredWgradLinear.apply(x, self.weight, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        if self.lora_A is not None and self.lora_B is not None:
            y = y + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.lora_scale
        return y

    def enable_lora(self, r: int, alpha: float, generator=None) -> None:
        super().enable_lora(r, alpha, generator)
        _tag(_PARTIAL_GRAD, self.lora_A)  # replicated input side: per-rank partial gradient
        _tag(_SHARDED, self.lora_B)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out_shard={self.out_features} of {self.full_out}, rank={self.rank}"


class RowParallelLinear(_ParallelLinear):
    """``y = allreduce(x[:, shard] W[:, shard]^T) + b``; rank ``rank`` holds ``in_sizes[rank]`` input columns."""

    def __init__(
        self,
        in_sizes: Sequence[int],
        out_features: int,
        rank: int,
        bias: bool = True,
        group=None,
        reduce_output: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.sizes = _check_sizes("in_sizes", in_sizes, rank, group)
        self.rank, self.group, self.reduce_output = rank, group, reduce_output
        self.full_in, self.full_out = sum(self.sizes), out_features
        self.in_features, self.out_features = self.sizes[rank], out_features
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        self.shard_dim = 1
        _tag(_SHARDED, self.weight)

    @classmethod
    def from_linear(cls, lin: nn.Linear, in_sizes, rank, group=None) -> RowParallelLinear:
        if sum(in_sizes) != lin.in_features:
            raise ValueError(f"in_sizes sum to {sum(in_sizes)} but the layer has {lin.in_features} inputs")
        m = cls(in_sizes, lin.out_features, rank, lin.bias is not None, group, True, lin.weight.dtype)
        m.load_full(lin.weight.detach(), None if lin.bias is None else lin.bias.detach())
        return m

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        o, n = self.shard_offset, self.in_features
        with torch.no_grad():
            self.weight.copy_(weight[:, o : o + n])
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias)

    def _shard_lora(self, full_a: torch.Tensor, full_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o, n = self.shard_offset, self.in_features
        return full_a[:, o : o + n].clone(), full_b

    def enable_lora(self, r: int, alpha: float, generator=None) -> None:
        super().enable_lora(r, alpha, generator)
        _tag(_PARTIAL_GRAD, self.lora_B)
        _tag(_SHARDED, self.lora_A)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.lora_A is not None and self.lora_B is not None:
            y = y + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.lora_scale
        if self.reduce_output:
            y = reduce_from_tp(y, self.group, self.tag)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return f"in_shard={self.in_features} of {self.full_in}, out={self.out_features}, rank={self.rank}"


def sync_partial_grads(module: nn.Module, group=None) -> None:
    """Sum the per-rank partial gradients of replicated LoRA halves (one all-reduce for all of them)."""
    grads = [p.grad for p in module.parameters() if getattr(p, _PARTIAL_GRAD, False) and p.grad is not None]
    if not grads or not _active(group):
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat, group, tag="lora")
    i = 0
    for g in grads:
        g.copy_(flat[i : i + g.numel()].view_as(g))
        i += g.numel()


def grad_square_sum(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of ``grads`` as a float64 scalar, from per-tensor fp32 norms.

    ``torch.nn.utils.clip_grad_norm_``'s arithmetic: one multi-tensor norm kernel over all of them,
    instead of a float64 copy, a square and a sum per gradient.
    """
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norms = torch._foreach_norm([g.detach() for g in grads])
    return torch.stack(norms).double().pow(2).sum()


def scale_grads(grads: list[torch.Tensor], total: float, max_norm: float) -> None:
    """Scale ``grads`` in place so that a global norm ``total`` becomes ``max_norm`` (only when above it)."""
    coef = max_norm / (total + 1e-6)
    if coef < 1.0 and grads:
        torch._foreach_mul_([g.detach() for g in grads], coef)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, group=None) -> float:
    """Clip gradients by the global norm over all ranks (sharded parts summed, replicated ones once).

    Same formula as ``torch.nn.utils.clip_grad_norm_``; returns the total norm before clipping.
    """
    grads = [p for p in params if p.grad is not None]
    sharded = grad_square_sum([p.grad for p in grads if getattr(p, _SHARDED, False)])
    replicated = grad_square_sum([p.grad for p in grads if not getattr(p, _SHARDED, False)])
    all_reduce(sharded, group, tag="clip")
    total = float((sharded + replicated).sqrt())
    scale_grads([p.grad for p in grads], total, max_norm)
    return total


def merged_weight(mod: _ParallelLinear | VocabParallelEmbedding) -> torch.Tensor:
    """This rank's shard of ``mod``'s weight with its LoRA adapter folded in (``W + s B A``).

    The adapter's sharded half matches the weight's shard and its replicated half is whole, so the
    product is exactly this rank's rows (column layer) or columns (row layer) of the full ``s B A``.
    """
    w = mod.weight.detach()
    a, b = getattr(mod, "lora_A", None), getattr(mod, "lora_B", None)
    if a is None or b is None:
        return w
    return w + mod.lora_scale * (b.detach() @ a.detach())


def gather_uneven(shard: torch.Tensor, sizes: Sequence[int], dim: int, group=None) -> torch.Tensor:
    """Concatenate every rank's shard along ``dim`` (shards of different sizes: padded all_gather)."""
    return gather_uneven_many([(shard, dim, tuple(sizes))], group)[0]


def gather_uneven_many(
    shards: list[tuple[torch.Tensor, int, tuple[int, ...]]], group, dst: int | None = None
) -> list[torch.Tensor]:
    """Full tensors from every rank's shards ``(local shard, dim, sizes)``, in one padded all_gather.

    Every rank passes the same list (same tensors, order and sizes); rank r's shard of a tensor has
    ``sizes[r]`` rows along ``dim``. One collective for all of them instead of one per tensor: a reshard
    moves ~90 tensors (weights and both AdamW moments), and each gather is a synchronisation. With
    ``dst`` only that rank receives (a gather): it gets the full tensors, every other rank ``[]``.
    """
    if not shards:
        return []
    if not _active(group):
        return [t.detach().clone() for t, _, _ in shards]
    receives = dst is None or dist.get_rank() == dst
    world = len(shards[0][2])
    # numel of rank r's shard of each tensor: the rows it holds times the numel of one row
    lens = [
        [math.prod(n for i, n in enumerate(t.shape) if i != d) * sizes[r] for t, d, sizes in shards]
        for r in range(world)
    ]
    local = torch.cat([t.detach().reshape(-1) for t, _, _ in shards])
    biggest = max(sum(n) for n in lens)
    padded = torch.zeros(biggest, dtype=local.dtype)
    padded[: local.numel()].copy_(local)
    parts = [torch.empty_like(padded) for _ in range(world)] if receives else None
    sync_point()
    if dst is None:
        dist.all_gather(parts, padded, group=group)
    else:
        dist.gather(padded, parts, dst=dst, group=group)
    resume_point()
    if parts is None:
        return []
    pieces = []  # per rank: its shard of each tensor, back in shape
    for r in range(world):
        split = parts[r][: sum(lens[r])].split(lens[r])
        shapes = [[*t.shape[:d], sizes[r], *t.shape[d + 1 :]] for t, d, sizes in shards]
        pieces.append([x.view(shape) for x, shape in zip(split, shapes)])
    return [torch.cat([pieces[r][i] for r in range(world)], dim=d) for i, (_, d, _) in enumerate(shards)]


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split unevenly: rank r holds ``sizes[r]`` token rows.

    A rank looks up the tokens it holds, zeros the others, and the partial embeddings are summed by
    one all-reduce (Megatron's ``g``); each rank's weight gradient covers only its own rows.
    """

    def __init__(self, sizes: Sequence[int], dim: int, rank: int, group=None, dtype: torch.dtype | None = None):
        super().__init__()
        self.sizes = _check_sizes("vocab sizes", sizes, rank, group)
        self.rank, self.group, self.embedding_dim = rank, group, dim
        self.num_embeddings = sum(self.sizes)
        self.shard_dim = 0
        self.weight = nn.Parameter(torch.empty(self.sizes[rank], dim, dtype=dtype))
        _tag(_SHARDED, self.weight)
        self.lora_A = self.lora_B = self.bias = None

    @property
    def shard_offset(self) -> int:
        return sum(self.sizes[: self.rank])

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, sizes, rank, group=None) -> VocabParallelEmbedding:
        if sum(sizes) != emb.num_embeddings:
            raise ValueError(f"vocab sizes sum to {sum(sizes)} but the embedding has {emb.num_embeddings} rows")
        m = cls(sizes, emb.embedding_dim, rank, group, emb.weight.dtype)
        with torch.no_grad():
            m.weight.copy_(emb.weight[m.shard_offset : m.shard_offset + m.sizes[rank]])
        return m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.shard_offset
        mine = (local >= 0) & (local < self.sizes[self.rank])
        out = (
            F.embedding(local.clamp(0, max(self.sizes[self.rank] - 1, 0)), self.weight)
            if self.sizes[self.rank]
            else None
        )
        if out is None:
            out = torch.zeros(*ids.shape, self.embedding_dim, dtype=self.weight.dtype)
        else:
            out = out * mine.unsqueeze(-1).to(out.dtype)
        return reduce_from_tp(out, self.group, "embed")

    def extra_repr(self) -> str:
        return f"rows={self.sizes[self.rank]} of {self.num_embeddings}, dim={self.embedding_dim}, rank={self.rank}"


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary: one small all-gather, no gather of the logits.

    Each rank reduces its slice to a log-sum-exp and the target's logit (zero where the target is
    not in its slice); the ranks' pairs are gathered and combined (log-sum-exp of log-sum-exps), so
    one synchronisation replaces the global max and the global sum.
    """

    @staticmethod
    def forward(ctx, logits, target, start, group):
        logits = logits.float()
        n_local = logits.shape[-1]
        local_t = target - start
        mine = (local_t >= 0) & (local_t < n_local)
        idx = local_t.clamp(0, max(n_local - 1, 0))
        if n_local:
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * mine
        else:
            lse, picked = torch.full(target.shape, -torch.inf), torch.zeros(target.shape)
        parts = all_gather(torch.stack([lse, picked]), group, tag="head")
        total_lse = torch.logsumexp(parts[:, 0], dim=0)
        ctx.save_for_backward((logits - total_lse.unsqueeze(-1)).exp(), idx, mine)
        return total_lse - parts[:, 1].sum(0)

    @staticmethod
    def backward(ctx, g):
        softmax, idx, mine = ctx.saved_tensors
        grad = softmax.clone()
        if grad.shape[-1]:
            grad.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        return grad * g.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int, group=None) -> torch.Tensor:
    """Per-token cross-entropy when this rank holds logits for vocabulary ids ``[start, start + V_local)``.

    Equals ``F.cross_entropy(full_logits, target, reduction="none")`` (the full logits being the
    concatenation of every rank's slice) without gathering them.
    """
    if not _active(group):
        return F.cross_entropy(logits.float(), target, reduction="none")
    return _VocabParallelCE.apply(logits, target, start, group)
