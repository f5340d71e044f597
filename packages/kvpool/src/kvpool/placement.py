"""Placement, the paper's core: one logical pool over memory modules and SSDs.

Each request's chunks are striped over every device in proportion to its read bandwidth, so that
all devices finish their share of a retrieval at the same moment (water-filling: each chunk goes
to the device whose predicted finish time, ``latency*units + bytes/bandwidth`` summed over the
request's chunks already there, grows the least). Devices have capacities; when no device has room
the least-recently-used chunk of the whole pool is evicted (chunks of the request being placed are
protected). Chunks that keep being hit are promoted from SSD to memory, into free room or by
swapping with a colder memory chunk.

Pure bookkeeping, no I/O: the pool (``pool.py``) executes what this module decides. A chunk the
pool is still writing or moving is ``hold``-ed: absent to lookups, never evicted or moved, until
``commit`` makes it visible.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["DeviceInfo", "ChunkRecord", "Move", "PlacementPlan", "Placement"]

MEMORY = "memory"
SSD = "ssd"


@dataclass(frozen=True)
class DeviceInfo:
    """One device of the pool as placement sees it."""

    name: str
    kind: str  # "memory" or "ssd"
    read_bandwidth_bytes_per_s: float
    capacity_bytes: int
    latency_s: float = 0.0  # per unit read (request overhead)
    align_bytes: int = 1  # allocation granularity of the device's store
    unit_overhead_bytes: int = 0  # per-unit header the store adds

    def __post_init__(self) -> None:
        if self.kind not in (MEMORY, SSD):
            raise ValueError(f"DeviceInfo.kind must be 'memory' or 'ssd', not {self.kind!r}")
        if not self.read_bandwidth_bytes_per_s > 0:
            raise ValueError(f"DeviceInfo.read_bandwidth_bytes_per_s of {self.name!r} must be > 0")
        if self.capacity_bytes < 0:
            raise ValueError(f"DeviceInfo.capacity_bytes of {self.name!r} must be >= 0")

    def charge(self, nbytes: int, units: int) -> int:
        """Bytes a chunk of ``nbytes`` in ``units`` pieces occupies on this device."""
        per = -(-nbytes // units) + self.unit_overhead_bytes
        per = -(-per // self.align_bytes) * self.align_bytes
        return per * units

    def read_time_s(self, nbytes: int, units: int) -> float:
        return self.latency_s * units + nbytes / self.read_bandwidth_bytes_per_s


@dataclass
class ChunkRecord:
    key: str
    nbytes: int
    units: int
    device: str
    charged: int
    last_use: int = 0
    hits: int = 0
    ready: bool = True  # False while its bytes are being written or moved: invisible, never evicted


@dataclass(frozen=True)
class Move:
    """Move chunk ``key`` from device ``src`` to device ``dst`` (promotion or demotion)."""

    key: str
    src: str
    dst: str
    reason: str


@dataclass
class PlacementPlan:
    assign: dict[str, str] = field(default_factory=dict)  # chunk key -> device
    evicted: list[ChunkRecord] = field(default_factory=list)  # chunks the caller must delete
    unplaced: list[str] = field(default_factory=list)  # no room even after eviction (from here on)

    def per_device(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for k, d in self.assign.items():
            out.setdefault(d, []).append(k)
        return out


class Placement:
    """Bandwidth-proportional striping with capacities, pool-wide LRU and promotion. Thread-safe."""

    def __init__(self, devices: Sequence[DeviceInfo], promote_after: int = 2):
        if not devices:
            raise ValueError("Placement needs at least one device")
        names = [d.name for d in devices]
        if len(set(names)) != len(names):
            raise ValueError(f"device names must be unique, got {names}")
        if promote_after < 1:
            raise ValueError(f"promote_after must be >= 1, not {promote_after!r}")
        self.devices: dict[str, DeviceInfo] = {d.name: d for d in devices}
        self.disabled: set[str] = set()
        self.promote_after = promote_after
        self.records: dict[str, ChunkRecord] = {}
        self.used: dict[str, int] = {d.name: 0 for d in devices}
        self._clock = itertools.count(1)
        self._lock = threading.RLock()

    # --- queries -------------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        r = self.records.get(key)
        return r is not None and r.ready

    def free(self, device: str) -> int:
        return self.devices[device].capacity_bytes - self.used[device]

    def active(self) -> list[DeviceInfo]:
        return [d for d in self.devices.values() if d.name not in self.disabled]

    def location(self, key: str) -> str | None:
        """The device holding ``key``, or None when it is absent or still being written."""
        r = self.records.get(key)
        return r.device if r is not None and r.ready else None

    def state(self, key: str) -> str | None:
        """``"ready"``, ``"writing"`` (held: being written or moved) or None (absent)."""
        r = self.records.get(key)
        return None if r is None else ("ready" if r.ready else "writing")

    def predicted_times(self, keys: Iterable[str]) -> dict[str, float]:
        """Seconds each device needs to read its share of ``keys`` (the striping objective)."""
        out = {d.name: 0.0 for d in self.active()}
        for k in keys:
            r = self.records.get(k)
            if r is not None and r.device in out:
                out[r.device] += self.devices[r.device].read_time_s(r.nbytes, r.units)
        return out

    # --- placing -------------------------------------------------------------------------------
    def place(
        self, chunks: Sequence[tuple[str, int, int]], context: Iterable[str] = (), protect: Iterable[str] = ()
    ) -> PlacementPlan:
        """Choose a device for each new ``(key, nbytes, units)``; reserve the room; evict LRU if needed.

        ``context``: keys of the same request already in the pool (counted in the balance).
        ``protect``: keys that must not be evicted (besides the chunks being placed). Chunks already
        present are skipped. When a chunk fits nowhere even after evicting every unprotected chunk,
        it and the chunks after it are left out (``plan.unplaced``): a prefix with a gap is useless.
        """
        with self._lock:
            plan = PlacementPlan()
            load = self.predicted_times(context)
            guard = set(protect) | set(context) | {k for k, _, _ in chunks}
            for i, (key, nbytes, units) in enumerate(chunks):
                if key in self.records or key in plan.assign:
                    continue
                dev = self._best(load, nbytes, units)
                while dev is None:
                    victim = self._lru_victim(guard, self._could_fit(guard, nbytes, units))
                    if victim is None:
                        break
                    plan.evicted.append(self._drop(victim))
                    dev = self._best(load, nbytes, units)
                if dev is None:
                    plan.unplaced = [k for k, _, _ in chunks[i:] if k not in self.records]
                    break
                info = self.devices[dev]
                charged = info.charge(nbytes, units)
                self.used[dev] += charged
                self.records[key] = ChunkRecord(key, nbytes, units, dev, charged, next(self._clock))
                load[dev] = load.get(dev, 0.0) + info.read_time_s(nbytes, units)
                plan.assign[key] = dev
            # a new request's head is its most recent chunk, like after ``touch``
            for key in reversed(list(plan.assign)):
                self.records[key].last_use = next(self._clock)
            return plan

    def _best(self, load: dict[str, float], nbytes: int, units: int) -> str | None:
        best, best_t = None, None
        for d in self.active():
            if self.free(d.name) < d.charge(nbytes, units):
                continue
            t = load.get(d.name, 0.0) + d.read_time_s(nbytes, units)
            # ties: the faster device, then the one with more room
            rank = (t, -d.read_bandwidth_bytes_per_s, -self.free(d.name))
            if best_t is None or rank < best_t:
                best, best_t = d.name, rank
        return best

    def _could_fit(self, guard: set[str], nbytes: int, units: int) -> set[str]:
        """Devices where evicting every unprotected chunk would make room for this chunk."""
        reclaim = {d: 0 for d in self.devices}
        for r in self.records.values():
            if r.key not in guard and r.ready:
                reclaim[r.device] += r.charged
        return {d.name for d in self.active() if self.free(d.name) + reclaim[d.name] >= d.charge(nbytes, units)}

    def _lru_victim(self, guard: set[str], devices: set[str]) -> str | None:
        """The least recently used unprotected chunk on one of ``devices`` (evicting elsewhere would not help)."""
        cands = [r for r in self.records.values() if r.key not in guard and r.ready and r.device in devices]
        if not cands:
            return None
        return min(cands, key=lambda r: r.last_use).key

    def _drop(self, key: str) -> ChunkRecord:
        r = self.records.pop(key)
        self.used[r.device] -= r.charged
        return r

    def adopt(self, key: str, nbytes: int, units: int, device: str) -> bool:
        """Record a chunk found on a device (e.g. an SSD index after restart). False if it does not fit."""
        with self._lock:
            if key in self.records:
                return False
            info = self.devices[device]
            charged = info.charge(nbytes, units)
            if self.free(device) < charged:
                return False
            self.used[device] += charged
            self.records[key] = ChunkRecord(key, nbytes, units, device, charged, next(self._clock))
            return True

    def hold(self, keys: Iterable[str]) -> None:
        """Mark chunks as being written or moved: hidden from lookups and never chosen for eviction."""
        with self._lock:
            for k in keys:
                self.records[k].ready = False

    def commit(self, key: str, device: str) -> bool:
        """Make a held chunk visible once its bytes are stored on ``device``. False if it was dropped meanwhile."""
        with self._lock:
            r = self.records.get(key)
            if r is None or r.device != device:
                return False
            r.ready = True
            return True

    def remove(self, key: str, device: str | None = None, ready: bool | None = None) -> ChunkRecord | None:
        """Forget a chunk (failed write, corrupt read, explicit delete).

        ``device`` / ``ready``: only when the record is still on that device and in that state, so a
        reader dropping what it found unreadable never removes a newer copy being written.
        """
        with self._lock:
            r = self.records.get(key)
            if r is None or (device is not None and r.device != device) or (ready is not None and r.ready != ready):
                return None
            return self._drop(key)

    def disable(self, device: str) -> list[ChunkRecord]:
        """Take a failed device out of the pool; returns the chunks that were on it (now lost)."""
        with self._lock:
            self.disabled.add(device)
            lost = [k for k, r in self.records.items() if r.device == device]
            return [self._drop(k) for k in lost]

    # --- use, LRU and promotion ----------------------------------------------------------------
    def touch(self, keys: Sequence[str]) -> None:
        """Mark a hit on ``keys`` (a request's prefix, in order).

        Stamped last to first so a prefix's first chunk is the most recent: eviction takes a
        request's tail before its head, which keeps the remaining prefix usable.
        """
        with self._lock:
            for k in reversed(keys):
                r = self.records.get(k)
                if r is not None:
                    r.last_use = next(self._clock)
                    r.hits += 1

    def plan_promotions(self, keys: Sequence[str], max_moves: int = 8, busy: Iterable[str] = ()) -> list[Move]:
        """Moves that bring hot SSD chunks among ``keys`` into memory.

        Into free memory first; otherwise by swapping with the coldest memory chunk that has fewer
        hits (which goes to the SSD slot the hot chunk leaves). Reserves the room; the caller
        executes each move (or calls ``abort_move`` on failure). ``busy``: chunks not to move.
        """
        moves: list[Move] = []
        busy = set(busy)
        with self._lock:
            mems = [d for d in self.active() if d.kind == MEMORY]
            if not mems:
                return moves
            for k in keys:
                if len(moves) >= max_moves:
                    break
                r = self.records.get(k)
                if r is None or not r.ready or self.devices[r.device].kind != SSD or r.hits < self.promote_after:
                    continue
                fits = [m for m in mems if self.free(m.name) >= m.charge(r.nbytes, r.units)]
                if fits:
                    dst = max(fits, key=lambda m: (m.read_bandwidth_bytes_per_s, self.free(m.name)))
                    moves.append(self._reserve_move(r, dst.name, "promote"))
                    continue
                cold = [
                    c
                    for c in self.records.values()
                    if self.devices[c.device].kind == MEMORY
                    and c.ready
                    and c.device not in self.disabled
                    and c.hits < r.hits
                    and c.nbytes == r.nbytes
                    and c.units == r.units
                    and c.key not in keys
                    and c.key not in busy
                ]
                if not cold:
                    continue
                victim = min(cold, key=lambda c: (c.hits, c.last_use))
                src = r.device
                moves.append(Move(victim.key, victim.device, src, "demote"))
                moves.append(Move(r.key, src, victim.device, "promote"))
                # swap the records' devices (same size, so usage is unchanged)
                victim.device, r.device = src, victim.device
                victim.charged, r.charged = (
                    self.devices[src].charge(victim.nbytes, victim.units),
                    self.devices[r.device].charge(r.nbytes, r.units),
                )
                self._recount()
        return moves

    def _reserve_move(self, r: ChunkRecord, dst: str, reason: str) -> Move:
        mv = Move(r.key, r.device, dst, reason)
        self.used[r.device] -= r.charged
        r.device = dst
        r.charged = self.devices[dst].charge(r.nbytes, r.units)
        self.used[dst] += r.charged
        return mv

    def _recount(self) -> None:
        self.used = {d: 0 for d in self.devices}
        for r in self.records.values():
            self.used[r.device] += r.charged

    def abort_move(self, move: Move) -> None:
        """Undo a reserved move whose copy failed: the chunk stays where it was (``move.src``)."""
        with self._lock:
            r = self.records.get(move.key)
            if r is None or r.device != move.dst:
                return
            r.device = move.src
            r.charged = self.devices[move.src].charge(r.nbytes, r.units)
            self._recount()

    def snapshot(self) -> dict:
        """Usage and chunk counts per device, for stats."""
        with self._lock:
            counts = {d: 0 for d in self.devices}
            for r in self.records.values():
                counts[r.device] += 1
            return {
                d.name: {
                    "kind": d.kind,
                    "capacity_bytes": d.capacity_bytes,
                    "used_bytes": self.used[d.name],
                    "chunks": counts[d.name],
                    "read_bandwidth_bytes_per_s": d.read_bandwidth_bytes_per_s,
                    "disabled": d.name in self.disabled,
                }
                for d in self.devices.values()
            }
