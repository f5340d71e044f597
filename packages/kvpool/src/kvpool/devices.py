"""Build a pool's device stores from paths, an hwtopo spec or a probe, and measure their bandwidth.

Memory modules: one ``MemoryStore`` arena per NUMA node, its pages bound to the node (or
``memory_modules`` arenas spread over the host's nodes; all on node 0 on a single-node host). SSDs: one ``PassthroughStore`` slab per path; a path that is missing, full or
locked is skipped with a warning. Optional per-device bandwidth caps (``Throttle``) emulate
several SSDs on one physical disk; they are labelled emulated in ``describe``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import hwtopo

from .numa import online_nodes
from .passthrough import DeviceUnavailable, PassthroughStore
from .stores import MemoryStore, Throttle

__all__ = ["DeviceSet", "build_devices", "from_machine", "measure_read_bandwidth"]

log = logging.getLogger(__name__)


@dataclass
class DeviceSet:
    stores: list = field(default_factory=list)
    bandwidths: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # device -> why
    emulated: dict = field(default_factory=dict)

    def close(self) -> None:
        for s in self.stores:
            s.close()


def measure_read_bandwidth(store, unit_bytes: int = 1 << 20, units: int = 16, reps: int = 3) -> float:
    """Read bandwidth of ``store`` through its own read path (O_DIRECT, caps included), bytes/s.

    Best of ``reps`` passes: on a shared machine interference only ever slows a pass down.
    """
    unit_bytes = max(512, min(unit_bytes, store.capacity_bytes // (2 * units) // 4096 * 4096 - 4096))
    payload = torch.randint(0, 255, (unit_bytes,), dtype=torch.uint8)
    names = [f"__probe__.{os.getpid()}.{i}" for i in range(units)]
    written = [n for n in names if store.put(n, payload)]
    if not written:
        raise DeviceUnavailable(0, f"device {store.name!r}: no room to measure bandwidth")
    staging = store.staging(unit_bytes)
    try:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for n in written:
                v = store.read(n, staging)
                if v is not None and store.kind == "memory":
                    payload.copy_(v)  # a memory read is a copy out of the arena
            times.append(time.perf_counter() - t0)
        return len(written) * unit_bytes / min(times)
    finally:
        for n in written:
            store.delete(n)
        for key in ("bytes_read", "reads", "hits", "read_s", "bytes_written", "writes", "write_s"):
            setattr(store.stats, key, type(getattr(store.stats, key))(0))


def build_devices(
    ssd_paths: Sequence[str | os.PathLike],
    memory_modules: int = 2,
    memory_bytes: int = 64 << 20,
    ssd_bytes: int = 256 << 20,
    ssd_read_cap: float | None = None,
    ssd_write_cap: float | None = None,
    memory_read_cap: float | None = None,
    measure: bool = True,
    bandwidths: dict[str, float] | None = None,
    numa_nodes: Sequence[int] | None = None,
    numa: bool = True,
    io_backend: str = "preadv",
    ssd_read_caps: Sequence[float] | None = None,
) -> DeviceSet:
    """Memory arenas plus one slab per SSD path; bandwidths measured unless given.

    Memory module ``i`` is bound to NUMA node ``numa_nodes[i % len(numa_nodes)]`` (default: this
    host's online nodes, so modules spread over the nodes); ``numa=False`` binds nothing. A node
    that cannot be bound leaves an unbound arena with a warning, never an error. ``io_backend``:
    how the SSD slabs are read ("preadv", "io_uring", or "auto": io_uring where the kernel allows).
    ``ssd_read_caps``: one emulated read cap per SSD path (SSDs of mixed speeds), in place of
    the one ``ssd_read_cap`` for all.
    """
    if memory_modules < 0:
        raise ValueError(f"memory_modules must be >= 0, not {memory_modules!r}")
    nodes = list(numa_nodes) if numa_nodes is not None else online_nodes()
    if numa and memory_modules and not nodes:
        raise ValueError("numa_nodes must name at least one node (or pass numa=False)")
    if ssd_read_caps is not None:
        read_caps: list[float | None] = [float(c) for c in ssd_read_caps]
        if len(read_caps) != len(ssd_paths) or any(not c or c <= 0 for c in read_caps):
            raise ValueError(
                f"ssd_read_caps must give one positive cap per SSD path ({len(ssd_paths)}), not {list(ssd_read_caps)}"
            )
    else:
        read_caps = [ssd_read_cap] * len(ssd_paths)
    out = DeviceSet()
    for i in range(memory_modules):
        thr = Throttle(memory_read_cap) if memory_read_cap else None
        node = nodes[i % len(nodes)] if numa else None
        out.stores.append(MemoryStore(f"mem{i}", memory_bytes, throttle=thr, numa_node=node))
    for i, p in enumerate(ssd_paths):
        name = f"ssd{i}"
        thr = Throttle(read_caps[i], ssd_write_cap) if (read_caps[i] or ssd_write_cap) else None
        try:
            out.stores.append(PassthroughStore(name, p, ssd_bytes, throttle=thr, io_backend=io_backend))
        except DeviceUnavailable as e:
            out.skipped[name] = str(e)
            log.warning("skipping %s: %s", name, e)
    if not out.stores:
        raise DeviceUnavailable(0, "no usable device: every SSD path was skipped and memory_modules is 0")
    for s in out.stores:
        if bandwidths and s.name in bandwidths:
            out.bandwidths[s.name] = float(bandwidths[s.name])
        elif measure:
            out.bandwidths[s.name] = measure_read_bandwidth(s)
        else:
            cap = read_caps[int(s.name[3:])] if s.kind == "ssd" else memory_read_cap
            out.bandwidths[s.name] = float(cap or (1e9 if s.kind == "ssd" else 1e10))
    caps = {s.name: s.throttle.describe() for s in out.stores if s.throttle is not None}
    out.emulated = (
        {"devices": caps, "note": "per-device bandwidth caps (token bucket) on one physical disk"} if caps else {}
    )
    return out


def from_machine(machine: hwtopo.Machine, memory_fraction: float = 0.01, ssd_bytes: int = 256 << 20) -> DeviceSet:
    """Devices of an hwtopo machine: an arena per NUMA node, a slab per disk with a path.

    Disk paths that do not exist here are skipped with a warning; bandwidths come from the spec
    where given, else are measured.
    """
    nodes = machine.numa_nodes or ()
    modules = max(1, len(nodes))
    per = int(max(16 << 20, machine.total_memory_bytes * memory_fraction / modules))
    paths = [d.path for d in machine.disks if d.path]
    given = {}
    for i, n in enumerate(nodes):
        if n.bandwidth_bytes_per_s:
            given[f"mem{i}"] = n.bandwidth_bytes_per_s
    for i, d in enumerate(x for x in machine.disks if x.path):
        if d.read_bandwidth_bytes_per_s:
            given[f"ssd{i}"] = d.read_bandwidth_bytes_per_s
    return build_devices(
        paths,
        memory_modules=modules,
        memory_bytes=per,
        ssd_bytes=ssd_bytes,
        bandwidths=given,
        numa_nodes=[n.id for n in nodes] or None,
    )
