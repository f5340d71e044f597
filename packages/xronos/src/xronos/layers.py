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
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CommStats",
    "COMM",
    "copy_to_tp",
    "reduce_from_tp",
    "all_reduce",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "sync_partial_grads",
    "gather_uneven",
    "clip_grad_norm",
]


class CommStats:
    """Wall seconds spent inside collectives by this process (waiting for peers included)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.bytes = 0
        self.events: list[tuple[float, float]] | None = None  # (start, end) when recording a timeline

    def reset(self) -> None:
        self.seconds, self.calls, self.bytes = 0.0, 0, 0
        if self.events is not None:
            self.events = []


COMM = CommStats()


def _active(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce(t: torch.Tensor, group=None) -> torch.Tensor:
    """In-place sum over the group, timed into :data:`COMM`. A no-op outside a multi-rank group."""
    if not _active(group):
        return t
    t0 = time.perf_counter()
    dist.all_reduce(t, group=group)
    t1 = time.perf_counter()
    COMM.seconds += t1 - t0
    COMM.calls += 1
    COMM.bytes += t.numel() * t.element_size()
    if COMM.events is not None:
        COMM.events.append((t0, t1))
    return t


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""
    return _CopyToTP.apply(x, group) if _active(group) else x


def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's ``g``: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, group) if _active(group) else x


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


class _ParallelLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lora_A: nn.Parameter | None = None
        self.lora_B: nn.Parameter | None = None
        self.lora_scale = 0.0

    @property
    def shard_offset(self) -> int:
        return sum(self.sizes[: self.rank])

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
        self.weight.xronos_sharded = True
        if self.bias is not None:
            self.bias.xronos_sharded = True

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

    def _shard_lora(self, full_a, full_b):
        o, n = self.shard_offset, self.out_features
        return full_a, full_b[o : o + n].clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sync_input_grad:
            x = copy_to_tp(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        if self.lora_A is not None:
            y = y + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.lora_scale
        return y

    def enable_lora(self, r: int, alpha: float, generator=None) -> None:
        super().enable_lora(r, alpha, generator)
        self.lora_A.xronos_partial_grad = True  # replicated input side: per-rank partial gradient
        self.lora_B.xronos_sharded = True

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
        self.weight.xronos_sharded = True

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

    def _shard_lora(self, full_a, full_b):
        o, n = self.shard_offset, self.in_features
        return full_a[:, o : o + n].clone(), full_b

    def enable_lora(self, r: int, alpha: float, generator=None) -> None:
        super().enable_lora(r, alpha, generator)
        self.lora_B.xronos_partial_grad = True
        self.lora_A.xronos_sharded = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.lora_A is not None:
            y = y + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.lora_scale
        if self.reduce_output:
            y = reduce_from_tp(y, self.group)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return f"in_shard={self.in_features} of {self.full_in}, out={self.out_features}, rank={self.rank}"


def sync_partial_grads(module: nn.Module, group=None) -> None:
    """Sum the per-rank partial gradients of replicated LoRA halves (one all-reduce for all of them)."""
    grads = [p.grad for p in module.parameters() if getattr(p, "xronos_partial_grad", False) and p.grad is not None]
    if not grads or not _active(group):
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat, group)
    i = 0
    for g in grads:
        g.copy_(flat[i : i + g.numel()].view_as(g))
        i += g.numel()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, group=None) -> float:
    """Clip gradients by the global norm over all ranks (sharded parts summed, replicated ones once).

    Same formula as ``torch.nn.utils.clip_grad_norm_``; returns the total norm before clipping.
    """
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    grads = [p for p in params if p.grad is not None]
    for p in grads:
        sq = p.grad.detach().double().pow(2).sum()
        if getattr(p, "xronos_sharded", False):
            sharded += sq
        else:
            replicated += sq
    all_reduce(sharded, group)
    total = float((sharded + replicated).sqrt())
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for p in grads:
            p.grad.detach().mul_(coef)
    return total


def gather_uneven(shard: torch.Tensor, sizes: Sequence[int], dim: int, group=None) -> torch.Tensor:
    """Concatenate every rank's shard along ``dim`` (shards of different sizes: padded all_gather)."""
    if not _active(group):
        return shard.detach().clone()
    biggest = max(sizes)
    pad_shape = list(shard.shape)
    pad_shape[dim] = biggest
    padded = torch.zeros(pad_shape, dtype=shard.dtype)
    padded.narrow(dim, 0, shard.shape[dim]).copy_(shard.detach())
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes)], dim=dim)
