"""Baselines in the same harness as GeoMesh: DDP (all-reduce every step) and asynchronous stale updates.

(DiLoCo with uniform H and an fp32 or fp16 all-reduce is ``DiLoCo(..., compression="fp32"|"fp16")``.)
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

import hwtopo

from .balance import token_weights
from .diloco import SyncStats, dense_all_reduce, exchange_meta, reduce_kind
from .wan import WanEmulator, ring_wire_bytes

__all__ = ["GradientAllReduce", "AsyncServer"]


class GradientAllReduce:
    """DDP-style: after ``backward()``, ``sync(tokens)`` replaces every grad by the token-weighted mean."""

    def __init__(self, model: torch.nn.Module, group=None, wan: WanEmulator | None = None, all_reduce: str = "ring"):
        """``all_reduce``: one of ``ALL_REDUCE_ALGOS`` ("auto": the faster of ring and gather on ``wan``)."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.reduce_kind = reduce_kind(all_reduce, 4 * sum(p.numel() for p in self.params), wan)
        self.group = group
        self.wan = wan
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.history: list[SyncStats] = []
        self.step_index = 0
        self._phase_start = time.perf_counter()
        if self.world > 1:
            with torch.no_grad():
                for p in self.params:
                    dist.broadcast(p.data, src=0, group=group)

    def sync(self, tokens: int) -> SyncStats:
        hwtopo.sync_point()  # emulated slow compute: the backward's dilation is paid before it is timed
        compute_s = time.perf_counter() - self._phase_start
        all_tokens, rates, wait_s, *_ = exchange_meta(tokens, compute_s, self.world, self.group)
        t0 = time.perf_counter()
        w = token_weights(all_tokens)[self.rank]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])
        flat.mul_(w)
        nbytes = flat.numel() * 4
        flat = dense_all_reduce(flat, self.reduce_kind, self.world, self.group, self.wan)
        off = 0
        for p in self.params:
            n = p.numel()
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(flat[off : off + n].view_as(p))
            off += n
        stats = SyncStats(
            outer_step=self.step_index,
            tokens=tokens,
            all_tokens=all_tokens,
            weights=token_weights(all_tokens),
            compute_s=compute_s,
            wait_s=wait_s,
            comm_s=time.perf_counter() - t0,
            payload_bytes=nbytes,
            wire_bytes=ring_wire_bytes(self.reduce_kind, nbytes, self.world),
            collective=self.reduce_kind,
            rates=rates,
        )
        self.history.append(stats)
        self.step_index += 1
        hwtopo.sync_point()  # emulated slow compute: the averaging's CPU is paid within this sync
        self._phase_start = time.perf_counter()
        return stats


class AsyncServer:
    """A parameter store in shared memory: workers pull the global weights, train H steps, and push
    their (stale) pseudo-gradient, applied at once with Nesterov momentum; nobody waits for anyone.

    Build it in the parent before forking the workers (``geomesh.spawn(..., start_method="fork")``).
    """

    def __init__(self, model: torch.nn.Module, outer_lr: float = 0.7, outer_momentum: float = 0.9, lock=None):
        flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters() if p.requires_grad])
        self.weights = flat.clone().share_memory_()
        self.momentum = torch.zeros_like(flat).share_memory_()
        self.counters = torch.zeros(2, dtype=torch.int64).share_memory_()  # tokens applied, updates applied
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.lock = lock if lock is not None else threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.weights.numel() * 4

    def pull(self) -> tuple[torch.Tensor, int]:
        with self.lock:
            return self.weights.clone(), int(self.counters[0])

    def push(self, pseudo_gradient: torch.Tensor, tokens: int, share: float) -> tuple[int, int, float]:
        """Apply one worker's pseudo-gradient scaled by its token ``share``; returns (tokens, updates, wait_s)."""
        t0 = time.perf_counter()
        with self.lock:
            wait_s = time.perf_counter() - t0
            self.momentum.mul_(self.outer_momentum).add_(pseudo_gradient)
            step = pseudo_gradient + self.outer_momentum * self.momentum
            self.weights.sub_(step, alpha=self.outer_lr * share)
            self.counters[0] += int(tokens)
            self.counters[1] += 1
            return int(self.counters[0]), int(self.counters[1]), wait_s
