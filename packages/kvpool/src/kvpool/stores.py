"""What every device store shares: an extent allocator, I/O statistics, emulated bandwidth caps,
and the host-memory store (one preallocated arena per memory module).

A store holds named units (one (chunk, layer) of KV each) and offers ``put``, ``read`` (into a
staging buffer the caller owns, returning a uint8 tensor view), ``delete`` and ``names``. The
SSD store with its slab, journal and O_DIRECT I/O is ``passthrough.PassthroughStore``.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hwtopo import TokenBucket

from .numa import NumaArena

__all__ = ["ExtentAllocator", "StoreStats", "MemoryStore", "Throttle", "as_bytes_tensor", "StoreFull"]

log = logging.getLogger(__name__)


class StoreFull(RuntimeError):
    """The store has no free extent large enough."""


def as_bytes_tensor(data) -> torch.Tensor:
    """A flat contiguous uint8 view of ``data`` (tensor, bytes, bytearray or memoryview)."""
    if isinstance(data, torch.Tensor):
        t = data.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        return t.reshape(-1).view(torch.uint8)
    mv = memoryview(data).cast("B")
    if len(mv) == 0:
        return torch.empty(0, dtype=torch.uint8)
    if mv.readonly:
        return torch.frombuffer(bytearray(mv), dtype=torch.uint8)
    return torch.frombuffer(mv, dtype=torch.uint8)


class ExtentAllocator:
    """First-fit allocator of ``[offset, offset+size)`` extents over ``capacity`` bytes in ``align`` units.

    Free extents are kept sorted and coalesced on free. Not thread-safe (stores hold a lock).
    """

    def __init__(self, capacity: int, align: int = 4096):
        if align <= 0 or capacity < 0:
            raise ValueError("ExtentAllocator: capacity must be >= 0 and align > 0")
        self.align = align
        self.capacity = capacity // align * align
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []
        self.used = 0

    def round(self, nbytes: int) -> int:
        return max(self.align, -(-nbytes // self.align) * self.align)

    def alloc(self, nbytes: int) -> int | None:
        size = self.round(nbytes)
        for i, (off, ln) in enumerate(self._free):
            if ln >= size:
                if ln == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, ln - size)
                self.used += size
                return off
        return None

    def reserve(self, off: int, nbytes: int) -> bool:
        """Mark a known extent used (rebuilding from an index). False if it is not free."""
        size = self.round(nbytes)
        if off % self.align or off + size > self.capacity:
            return False
        i = bisect.bisect_right(self._free, (off, float("inf"))) - 1
        if i < 0:
            return False
        foff, fln = self._free[i]
        if not (foff <= off and off + size <= foff + fln):
            return False
        pieces = []
        if off > foff:
            pieces.append((foff, off - foff))
        if off + size < foff + fln:
            pieces.append((off + size, foff + fln - off - size))
        self._free[i : i + 1] = pieces
        self.used += size
        return True

    def free(self, off: int, nbytes: int) -> None:
        size = self.round(nbytes)
        i = bisect.bisect_left(self._free, (off, 0))
        self._free.insert(i, (off, size))
        # coalesce with neighbours
        if i + 1 < len(self._free) and off + size == self._free[i + 1][0]:
            self._free[i] = (off, size + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            poff, pln = self._free[i - 1]
            self._free[i - 1] = (poff, pln + self._free[i][1])
            del self._free[i]
        self.used -= size

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        return max((ln for _, ln in self._free), default=0)


@dataclass
class StoreStats:
    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    errors: int = 0
    read_s: float = 0.0  # wall seconds inside read() (incl. emulated waits)
    write_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class Throttling(Protocol):
    """What a store asks of its throttle: :class:`Throttle`, or a test's or fault sweep's own."""

    def after_read(self, nbytes: int, started: float) -> None: ...

    def after_write(self, nbytes: int, started: float) -> None: ...

    def describe(self) -> dict: ...


BURST_BYTES = 64 << 10


class Throttle:
    """An emulated bandwidth cap: an operation takes at least ``nbytes / rate`` (token bucket).

    It also measures what the emulated device achieved: bytes read over the wall time during
    which at least one read was under way (overlapping reads counted once), so a cap the real
    disk cannot keep up with shows as an achieved rate below it, and burst credit as one above.
    """

    def __init__(self, read_bytes_per_s: float | None, write_bytes_per_s: float | None = None):
        # a small burst: a real SSD banks no credit while idle, so a reader that pauses between
        # reads (serialized tiers visiting disks in turn) must not get its next MiB for free
        self.read = TokenBucket(read_bytes_per_s, burst_bytes=BURST_BYTES) if read_bytes_per_s else None
        self.write = TokenBucket(write_bytes_per_s, burst_bytes=BURST_BYTES) if write_bytes_per_s else None
        self.read_bytes_per_s = read_bytes_per_s
        self.write_bytes_per_s = write_bytes_per_s
        self._acct = threading.Lock()
        self._bytes, self._busy, self._last_end = 0, 0.0, 0.0

    @staticmethod
    def _wait(bucket: TokenBucket | None, nbytes: int, started: float) -> float:
        """Sleep until the bucket lets ``nbytes`` through; returns when the device finished them."""
        now = time.perf_counter()
        if bucket is None:
            return now
        due = bucket.reserve(nbytes) - (now - started)
        if due > 0:
            time.sleep(due)
        return now + max(0.0, due)

    def after_read(self, nbytes: int, started: float) -> None:
        done = self._wait(self.read, nbytes, started)
        with self._acct:
            # busy time: the union of the reads' [started, done) intervals. ``done`` is when the
            # emulated device delivered the bytes (real I/O time or the cap, whichever is longer),
            # not when the reader got the CPU back: scheduling delays are the reader's, not the disk's
            self._busy += max(0.0, done - max(started, self._last_end))
            self._last_end = max(self._last_end, done)
            self._bytes += nbytes

    def after_write(self, nbytes: int, started: float) -> None:
        self._wait(self.write, nbytes, started)

    def reset_achieved(self) -> None:
        """Start measuring the achieved read rate afresh (e.g. after a calibration pass)."""
        with self._acct:
            self._bytes, self._busy, self._last_end = 0, 0.0, 0.0

    def achieved(self) -> dict:
        with self._acct:
            rate = self._bytes / self._busy if self._busy > 0 else None
            return {"read_bytes": self._bytes, "read_busy_s": self._busy, "achieved_read_bytes_per_s": rate}

    def describe(self) -> dict:
        return {
            "emulated": True,
            "read_bandwidth_bytes_per_s": self.read_bytes_per_s,
            "write_bandwidth_bytes_per_s": self.write_bytes_per_s,
            **self.achieved(),
        }


class MemoryStore:
    """One host-memory module: a preallocated arena with its own allocator and index.

    ``numa_node``: the node whose memory the arena is bound to (``mbind``, see ``numa.py``) and
    whose CPUs the module's reader thread runs on; where binding is not possible (node not online,
    no support) the arena is an unbound one and ``describe()["numa"]`` says why. On a single-node
    host every module binds to node 0 and the modules are separate arenas of the same memory.
    """

    kind = "memory"
    unit_overhead_bytes = 0

    def __init__(
        self,
        name: str,
        capacity_bytes: int,
        align: int = 64,
        throttle: Throttling | None = None,
        numa_node: int | None = None,
    ):
        if capacity_bytes <= 0:
            raise ValueError(f"memory module {name!r}: capacity_bytes must be > 0, not {capacity_bytes!r}")
        self.name = name
        self.align_bytes = align
        self.alloc = ExtentAllocator(int(capacity_bytes), align)
        self.capacity_bytes = self.alloc.capacity
        # pre-touched (pages allocated now, not mid-request), on ``numa_node`` where it can be bound
        self._numa = NumaArena(self.capacity_bytes, numa_node)
        if numa_node is not None and not self._numa.bound:
            log.warning("memory module %s: not bound to a NUMA node (%s); using an unbound arena", name, self._numa.why)
        self.arena = self._numa.tensor
        self.numa_node = numa_node if self._numa.bound else None
        self.index: dict[str, tuple[int, int]] = {}
        self.throttle = throttle
        self.stats = StoreStats()
        self._lock = threading.Lock()

    def put(self, name: str, data) -> bool:
        """Store a unit; it becomes readable only once its bytes are all in the arena."""
        src = as_bytes_tensor(data)
        n = src.numel()
        t0 = time.perf_counter()
        with self._lock:
            if name in self.index:
                return True
            off = self.alloc.alloc(n)
            if off is None:
                return False
        self.arena[off : off + n].copy_(src)
        if self.throttle:
            self.throttle.after_write(n, t0)
        with self._lock:
            if name in self.index:  # a concurrent put of the same name was published first
                self.alloc.free(off, n)
                return True
            self.index[name] = (off, n)
        self.stats.add(bytes_written=n, writes=1, write_s=time.perf_counter() - t0)
        return True

    def read(self, name: str, staging: torch.Tensor | None = None) -> torch.Tensor | None:
        """A uint8 view of the unit (a zero-copy view of the arena; ``staging`` is not needed)."""
        t0 = time.perf_counter()
        with self._lock:
            ent = self.index.get(name)
        if ent is None:
            self.stats.add(misses=1)
            return None
        off, n = ent
        view = self.arena[off : off + n]
        if self.throttle:
            self.throttle.after_read(n, t0)
        self.stats.add(bytes_read=n, reads=1, hits=1, read_s=time.perf_counter() - t0)
        return view

    def read_many(
        self, names: list[str], stagings: list | None = None, max_run_bytes: int = 0, on_unit=None
    ) -> list[torch.Tensor | None]:
        """Zero-copy views of the units (``stagings`` and ``max_run_bytes`` concern SSDs only);
        ``on_unit(i, view)`` is called for each unit found."""
        out = [self.read(n) for n in names]
        if on_unit is not None:
            for i, v in enumerate(out):
                if v is not None:
                    on_unit(i, v)
        return out

    def delete(self, name: str) -> bool:
        with self._lock:
            ent = self.index.pop(name, None)
            if ent is None:
                return False
            self.alloc.free(*ent)
            return True

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def names(self) -> dict[str, int]:
        with self._lock:
            return {k: n for k, (_, n) in self.index.items()}

    def staging(self, nbytes: int) -> None:
        return None

    def page_cache_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.alloc.used,
            "emulated_cap": self.throttle.describe() if self.throttle else None,
            "numa": self._numa.describe(),
        }
