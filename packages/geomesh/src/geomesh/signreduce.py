"""A sign-compressed all-reduce whose traffic per worker does not grow with the number of workers.

GeoMesh's default exchange all-gathers every worker's whole sign payload S: each worker sends
(n-1) x S per sync, which reaches an fp32 ring all-reduce's traffic at about 64 workers. Here the
coded vector is cut into n shards on chunk boundaries, one owned by each worker:

1. reduce-scatter: each worker sign-codes every shard of its update (with its own error feedback)
   and sends shard k to worker k (``all_to_all``): (n-1)/n x S bytes;
2. worker k decodes the n codings of its shard, takes their token-weighted mean, and codes that
   mean again with an error feedback of its own (what the re-coding dropped is added at its next
   sync, as the server side of 1-bit Adam does);
3. all-gather of the coded mean shards: another (n-1)/n x S bytes.

So about 2 x S per worker whatever n, in 2(n-1) ring hops (charged as a ring reduce-scatter plus a
ring all-gather by ``WanEmulator``). Every worker decodes the same bytes, so the outer step stays
bit-identical everywhere.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

import hwtopo

from .balance import token_weights
from .signcompress import SignCodec, SignCompressor, _stats
from .wan import WanEmulator, ring_wire_bytes

__all__ = ["SignReduceScatter", "shard_bounds"]


def shard_bounds(numel: int, chunk_size: int | None, world: int) -> list[tuple[int, int]]:
    """``world`` contiguous ranges of a flat vector of ``numel`` elements, cut on chunk boundaries
    (as even as whole chunks allow; a range may be empty when there are fewer chunks than workers)."""
    if world < 1:
        raise ValueError(f"world: {world!r} must be a positive integer")
    chunk = chunk_size or max(1, numel)
    per = math.ceil(math.ceil(numel / chunk) / world) * chunk if numel else 0
    edges = [min(numel, k * per) for k in range(world + 1)]
    return list(zip(edges, edges[1:]))


class SignReduceScatter:
    """The sharded exchange of one worker; ``reduce(tensors, tokens)`` is its part of one sync."""

    def __init__(
        self,
        compressor: SignCompressor,
        world: int,
        rank: int,
        group: dist.ProcessGroup | None = None,
        wan: WanEmulator | None = None,
    ):
        self.compressor = compressor
        codec = compressor.codec
        self.world, self.rank, self.group, self.wan = world, rank, group, wan
        self.bounds = shard_bounds(codec.numel, codec.chunk_size, world)
        # shards are coded in the compressor's coded basis (already rotated when it rotates)
        self.codecs = [SignCodec([(b - a,)], codec.chunk_size, codec.scale) for a, b in self.bounds]
        self.slot = max(c.nbytes for c in self.codecs)  # every message padded to one size for all_to_all
        a, b = self.bounds[rank]
        self.server_residual = torch.zeros(b - a)
        self.payload_bytes = sum(c.nbytes for c in self.codecs)
        self.collective_s = 0.0  # seconds of the last ``reduce`` spent in its two collectives (not coding)

    def wire_bytes(self) -> float:
        """What this worker sends per sync: n-1 shard codings, then n-1 copies of its coded mean shard."""
        return ring_wire_bytes("all_gather", self.slot, self.world) * 2

    def _pad(self, buf: torch.Tensor) -> torch.Tensor:
        return torch.cat([buf, buf.new_zeros(self.slot - buf.numel())])

    def _code_shards(self, tensors: Sequence[torch.Tensor], tokens: int) -> torch.Tensor:
        """This worker's update (plus its carried residual) coded shard by shard: world x slot bytes."""
        comp = self.compressor
        update = comp.codec.to_coded(tensors)
        target = update + comp.ef_decay * comp.residual.to(update.device) if comp.error_feedback else update
        bufs = [c.encode_coded(target[a:b], tokens) for c, (a, b) in zip(self.codecs, self.bounds)]
        decoded = torch.cat([c.decode_coded(buf)[0] for c, buf in zip(self.codecs, bufs)])
        if comp.error_feedback:
            comp.residual = target - decoded
        comp.last_stats = _stats(update, target, decoded)
        return torch.stack([self._pad(buf) for buf in bufs])

    def _mean_of_my_shard(self, got: torch.Tensor) -> torch.Tensor:
        """The token-weighted mean of every worker's coding of this worker's shard, coded again."""
        codec = self.codecs[self.rank]
        # (copies: a row of the received matrix starts at an offset the int64 header cannot be viewed at)
        parts = [codec.decode_coded(got[k, : codec.nbytes].clone()) for k in range(self.world)]
        weights = token_weights([t for _, t in parts])
        mean = torch.zeros(codec.numel)
        for (flat, _), w in zip(parts, weights):  # rank order: the same sum on every run
            mean.add_(flat, alpha=w)
        comp = self.compressor
        target = mean + comp.ef_decay * self.server_residual if comp.error_feedback else mean
        buf = codec.encode_coded(target, sum(t for _, t in parts))
        if comp.error_feedback:
            self.server_residual = target - codec.decode_coded(buf)[0]
        return self._pad(buf)

    def reduce(self, tensors: Sequence[torch.Tensor], tokens: int) -> list[torch.Tensor]:
        """The token-weighted mean of all workers' sign-coded ``tensors`` (float32, identical everywhere)."""
        send = self._code_shards(tensors, tokens)
        self.collective_s = 0.0
        if self.world > 1:
            got = torch.empty_like(send)
            hwtopo.sync_point()
            t0 = time.perf_counter()
            dist.all_to_all_single(got, send, group=self.group)
            hwtopo.resume_point()
            if self.wan is not None:
                self.wan.wait("reduce_scatter", self.world * self.slot, t0)
            self.collective_s += time.perf_counter() - t0
        else:
            got = send
        mine = self._mean_of_my_shard(got)
        if self.world > 1:
            shards = [torch.empty_like(mine) for _ in range(self.world)]
            hwtopo.sync_point()
            t0 = time.perf_counter()
            dist.all_gather(shards, mine, group=self.group)
            hwtopo.resume_point()
            if self.wan is not None:
                self.wan.wait("all_gather", self.slot, t0)
            self.collective_s += time.perf_counter() - t0
        else:
            shards = [mine]
        flat = torch.cat([c.decode_coded(s[: c.nbytes].clone())[0] for c, s in zip(self.codecs, shards)])
        return self.compressor.codec.from_coded(flat)
