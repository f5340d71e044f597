"""Baselines in the same harness: recompute, and LMCache-style serialized tiers.

``SerialTiers`` follows the design the paper measures against: a host-memory tier first, then
one local-disk tier holding one buffered file per chunk written with ``torch.save``; a lookup
walks the tiers in order and the first hit wins; chunks are loaded one after another by the
calling thread (which is blocked for all of it). Every filesystem call of the disk tier is
timed: ``os.stat`` (existence check), ``open``, the read/deserialize (``torch.load``) and
``close``, so the share of time in open/stat/close is measured rather than assumed.
"""

from __future__ import annotations

import os
import resource
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from .keys import KVLayout, chunk_keys
from .pagecache import drop, resident_bytes
from .retrieval import TORCH_DTYPES, KVBuffers
from .stores import Throttling

__all__ = ["SerialTiers", "SerialLoad"]


def _thread_stime() -> float:
    """System (kernel) CPU seconds of the calling thread."""
    try:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_stime
    except (AttributeError, OSError):
        return 0.0


class SerialLoad:
    """A finished serialized retrieval: per-layer (K, V) plus where the time went."""

    def __init__(self, layout: KVLayout, chunks: int, extra_tokens: int = 0, out: KVBuffers | None = None):
        n = chunks * layout.chunk_tokens
        dtype = TORCH_DTYPES[layout.dtype]
        shape = (1, layout.kv_heads, n + max(0, extra_tokens), layout.head_dim)
        self.tokens = n
        # same preallocated destination as kvpool's, so the compute path after retrieval is identical
        if out is not None and out.fits(layout, shape[2]):
            self.kbuf, self.vbuf = out.k, out.v
        else:
            self.kbuf = [torch.empty(shape, dtype=dtype) for _ in range(layout.num_layers)]
            self.vbuf = [torch.empty(shape, dtype=dtype) for _ in range(layout.num_layers)]
        self.k = [b[:, :, :n] for b in self.kbuf]
        self.v = [b[:, :, :n] for b in self.vbuf]
        self.timing = {"memory_s": 0.0, "disk_s": 0.0, "stat_s": 0.0, "open_s": 0.0, "read_s": 0.0, "close_s": 0.0}
        self.timing["disk_kernel_cpu_s"] = 0.0  # system CPU time of the reading thread in the disk tier
        self.bytes = {"memory": 0, "disk": 0}
        self.elapsed_s = 0.0

    def wait(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]  # already loaded: the caller waited for all of it

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kbuf[layer], self.vbuf[layer]

    @property
    def blocked_s(self) -> float:
        return self.elapsed_s  # the caller does every read itself

    @property
    def fs_time_frac(self) -> float | None:
        t = self.timing
        return (t["stat_s"] + t["open_s"] + t["close_s"]) / t["disk_s"] if t["disk_s"] > 0 else None

    @property
    def kernel_time_frac(self) -> float | None:
        """Share of the disk tier's wall time the reading thread spent in the kernel (getrusage)."""
        t = self.timing
        return t["disk_kernel_cpu_s"] / t["disk_s"] if t["disk_s"] > 0 else None

    def describe(self) -> dict:
        return {
            "kernel_time_frac": self.kernel_time_frac,
            "tokens": self.tokens,
            "elapsed_s": self.elapsed_s,
            "bytes": dict(self.bytes),
            "timing": dict(self.timing),
            "fs_time_frac": self.fs_time_frac,
        }


class SerialTiers:
    """Memory tier (LRU, ``memory_bytes``) then a disk tier of one ``torch.save`` file per chunk."""

    def __init__(
        self,
        layout: KVLayout,
        model_id: str,
        memory_bytes: int,
        disk_dir: str | os.PathLike,
        throttle: Throttling | None = None,
    ):
        self.layout = layout
        self.model_id = model_id
        self.memory_bytes = int(memory_bytes)
        self.dir = Path(disk_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.throttle = throttle
        self.memory: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.memory_used = 0

    def _file(self, hx: str) -> Path:
        return self.dir / f"{self.model_id}@{hx}.pt"

    def put(self, tokens, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Write-through: every chunk to disk; to memory while it has room.

        Room is made by evicting the least recently used chunks of other requests; a request's own
        chunks fill memory in order (its head stays in memory, the rest is only on disk).
        """
        n = self.layout.chunk_tokens
        stored = 0
        keys = chunk_keys(tokens, self.model_id, self.layout)
        mine = {k.hex for k in keys}
        for key in keys:
            s, e = key.index * n, (key.index + 1) * n
            chunk = torch.stack([torch.stack([k[0, :, s:e], v[0, :, s:e]]) for k, v in kv]).contiguous()
            path = self._file(key.hex)
            if not path.exists():
                tmp = path.with_suffix(".tmp")
                torch.save(chunk, tmp)
                os.replace(tmp, path)
                stored += 1
            size = chunk.numel() * chunk.element_size()
            if key.hex in self.memory:
                self.memory.move_to_end(key.hex)
                continue
            for old_key in [k for k in self.memory if k not in mine]:
                if self.memory_used + size <= self.memory_bytes:
                    break
                old = self.memory.pop(old_key)
                self.memory_used -= old.numel() * old.element_size()
            if self.memory_used + size <= self.memory_bytes:
                self.memory[key.hex] = chunk
                self.memory_used += size
        return stored

    def lookup(self, tokens) -> int:
        n = 0
        for key in chunk_keys(tokens, self.model_id, self.layout):
            if key.hex not in self.memory and not self._file(key.hex).exists():
                break
            n += 1
        return n * self.layout.chunk_tokens

    def retrieve(
        self, tokens, max_tokens: int | None = None, extra_tokens: int | None = 0, out: KVBuffers | None = None
    ) -> SerialLoad:
        """Load the longest cached prefix chunk by chunk, tier by tier, on the calling thread."""
        keys = chunk_keys(tokens, self.model_id, self.layout)
        if max_tokens is not None:
            keys = keys[: max_tokens // self.layout.chunk_tokens]
        t_start = time.perf_counter()
        found: list[tuple[int, torch.Tensor | None, Path | None]] = []
        lookup_stat_s = 0.0
        for key in keys:  # lookup: first hit wins, stop at the first miss
            if key.hex in self.memory:
                found.append((key.index, self.memory[key.hex], None))
                continue
            t0 = time.perf_counter()
            path = self._file(key.hex)
            ok = os.path.exists(path)
            lookup_stat_s += time.perf_counter() - t0
            if not ok:
                break
            found.append((key.index, None, path))
        if extra_tokens is None:
            extra_tokens = max(0, len(tokens) - len(found) * self.layout.chunk_tokens)
        load = SerialLoad(self.layout, len(found), extra_tokens, out)
        n = self.layout.chunk_tokens
        tm = load.timing
        tm["stat_s"] += lookup_stat_s
        tm["disk_s"] += lookup_stat_s
        for i, mem, file in found:
            t0 = time.perf_counter()
            if mem is not None:
                chunk = mem
            else:
                assert file is not None  # a chunk not in memory was found on disk
                k0 = _thread_stime()
                ts = time.perf_counter()
                size = os.stat(file).st_size
                to = time.perf_counter()
                f = open(file, "rb")  # noqa: SIM115 - open/close are timed separately
                tr = time.perf_counter()
                chunk = torch.load(f, weights_only=True)
                tc = time.perf_counter()
                f.close()
                te = time.perf_counter()
                tm["disk_kernel_cpu_s"] += _thread_stime() - k0
                if self.throttle:
                    self.throttle.after_read(size, ts)
                tm["stat_s"] += to - ts
                tm["open_s"] += tr - to
                tm["read_s"] += tc - tr
                tm["close_s"] += te - tc
                load.bytes["disk"] += size
            for layer in range(self.layout.num_layers):
                load.k[layer][0, :, i * n : (i + 1) * n].copy_(chunk[layer, 0])
                load.v[layer][0, :, i * n : (i + 1) * n].copy_(chunk[layer, 1])
            dt = time.perf_counter() - t0
            if mem is not None:
                tm["memory_s"] += dt
                load.bytes["memory"] += chunk.numel() * chunk.element_size()
            else:
                tm["disk_s"] += dt
        load.elapsed_s = time.perf_counter() - t_start
        return load

    def files(self) -> list[Path]:
        return sorted(self.dir.glob("*.pt"))

    def drop_page_cache(self) -> None:
        for p in self.files():
            drop(p)

    def page_cache_bytes(self) -> int:
        return sum(resident_bytes(p) for p in self.files())

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files())
