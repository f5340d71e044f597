"""The hardware vocabulary: frozen dataclasses with SI units in their field names.

A cluster is a flat list of machines (each with NUMA nodes, disks and accelerators) plus a flat
list of links (bandwidth, latency). A link's endpoints are machine names or region names, so one
shape covers a NUMA box, a LAN of edge devices and a WAN between regions.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace

__all__ = ["NumaNode", "Disk", "Accelerator", "Machine", "Link", "Cluster"]


@dataclass(frozen=True)
class NumaNode:
    """One memory node: the CPUs local to it and its memory."""

    id: int
    cpus: tuple[int, ...] = ()
    memory_bytes: float = 0.0
    bandwidth_bytes_per_s: float | None = None


@dataclass(frozen=True)
class Disk:
    """A block device or a directory standing for one (an SSD is addressed by a path)."""

    name: str
    path: str | None = None
    rotational: bool = False
    capacity_bytes: float | None = None
    read_bandwidth_bytes_per_s: float | None = None
    write_bandwidth_bytes_per_s: float | None = None


@dataclass(frozen=True)
class Accelerator:
    """A GPU or other accelerator; ``interconnect_bandwidth_bytes_per_s`` is its per-device
    bandwidth to its peers inside the machine (e.g. NVLink), per direction."""

    kind: str  # "cuda", "rocm", "npu", ...
    name: str
    memory_bytes: float = 0.0
    peak_flops: float | None = None
    interconnect_bandwidth_bytes_per_s: float | None = None


ISA_FLAGS = ("amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "avx2", "fma")
"""The /proc/cpuinfo flags ``probe()`` records in ``Machine.isa``: matrix (AMX) and vector extensions
whose presence decides how fast reduced-precision matmuls run on a CPU."""


@dataclass(frozen=True)
class Machine:
    """One host. ``speed`` is relative compute speed (1.0 = reference); ``flops`` is measured.

    ``cpus`` lists the machine's CPU ids (one per hardware thread) where they are not simply
    ``0..threads-1``, e.g. a container's share of a larger host; ``cpu_ids`` gives them either way.
    ``isa`` names the CPU's matmul-relevant instruction-set extensions (``ISA_FLAGS``): whether bf16 or
    fp16 is faster or slower than fp32 on a CPU depends on them.
    """

    name: str
    cores: int = 1
    threads: int | None = None
    memory_bytes: float = 0.0
    speed: float = 1.0
    flops: float | None = None
    region: str | None = None
    numa_nodes: tuple[NumaNode, ...] = ()
    disks: tuple[Disk, ...] = ()
    accelerators: tuple[Accelerator, ...] = ()
    notes: tuple[str, ...] = field(default=(), compare=False)
    cpus: tuple[int, ...] = ()
    isa: tuple[str, ...] = ()

    @property
    def hardware_threads(self) -> int:
        return self.threads if self.threads is not None else self.cores

    @property
    def cpu_ids(self) -> tuple[int, ...]:
        """The machine's CPU ids: ``cpus`` when given, else ``0..hardware_threads-1``."""
        return self.cpus or tuple(range(self.hardware_threads))

    @property
    def total_memory_bytes(self) -> float:
        """Host memory: ``memory_bytes`` when given, else the NUMA nodes' sum."""
        if self.memory_bytes > 0:
            return self.memory_bytes
        return sum(n.memory_bytes for n in self.numa_nodes)

    @property
    def accelerator_memory_bytes(self) -> float:
        return sum(a.memory_bytes for a in self.accelerators)

    @property
    def accelerator_interconnect_bytes_per_s(self) -> float | None:
        """Slowest declared peer bandwidth among this machine's accelerators (None if undeclared)."""
        bws = [a.interconnect_bandwidth_bytes_per_s for a in self.accelerators]
        declared = [b for b in bws if b is not None]
        return min(declared) if declared and len(declared) == len(bws) else None

    def with_(self, **changes) -> Machine:
        """A copy with fields replaced (e.g. measured flops attached)."""
        return replace(self, **changes)


@dataclass(frozen=True)
class Link:
    """A bidirectional link between two endpoints (machine or region names)."""

    a: str
    b: str
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    name: str | None = None

    def transfer_time_s(self, nbytes: float) -> float:
        """Latency plus serialization time for one message of ``nbytes``."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def connects(self, x: str, y: str) -> bool:
        return {self.a, self.b} == {x, y}


@dataclass(frozen=True)
class Cluster:
    name: str = "cluster"
    machines: tuple[Machine, ...] = ()
    links: tuple[Link, ...] = ()
    regions: tuple[str, ...] = ()

    # --- lookups -------------------------------------------------------------------------------
    def machine(self, name: str) -> Machine:
        for m in self.machines:
            if m.name == name:
                return m
        raise KeyError(f"no machine named {name!r}; machines are {[m.name for m in self.machines]}")

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.machines]

    @property
    def total_memory_bytes(self) -> float:
        return sum(m.total_memory_bytes for m in self.machines)

    @property
    def total_cores(self) -> int:
        return sum(m.cores for m in self.machines)

    def relative_speeds(self) -> dict[str, float]:
        """Each machine's speed divided by the fastest (measured flops preferred when all have it)."""
        measured = [float(m.flops) for m in self.machines if m.flops]
        if self.machines and len(measured) == len(self.machines):
            raw = dict(zip((m.name for m in self.machines), measured))
        else:
            raw = {m.name: float(m.speed) for m in self.machines}
        top = max(raw.values(), default=1.0) or 1.0
        return {k: v / top for k, v in raw.items()}

    def machines_in(self, region: str) -> list[Machine]:
        return [m for m in self.machines if m.region == region]

    # --- links and routes ----------------------------------------------------------------------
    def _endpoint(self, name: str) -> list[str]:
        """Names a machine can be reached under: itself, then its region."""
        m = self.machine(name)
        return [name] + ([m.region] if m.region else [])

    def link(self, a: str, b: str) -> Link | None:
        """The direct link between machines a and b: machine-to-machine first, then region-to-region."""
        if a == b:
            return None
        for x in self._endpoint(a):
            for y in self._endpoint(b):
                for link in self.links:
                    if link.connects(x, y):
                        return link
        return None

    def route(self, a: str, b: str) -> list[Link]:
        """Lowest-latency path of links from machine a to machine b (Dijkstra, ties by hop count).

        Machines in the same region without a link of their own are treated as co-located (an empty
        route). Raises LookupError when no path exists.
        """
        if a == b:
            return []
        direct = self.link(a, b)
        if direct is not None:
            return [direct]
        ma, mb = self.machine(a), self.machine(b)
        if ma.region and ma.region == mb.region:
            return []
        start, goal = set(self._endpoint(a)), set(self._endpoint(b))
        adj: dict[str, list[Link]] = {}
        for link in self.links:
            adj.setdefault(link.a, []).append(link)
            adj.setdefault(link.b, []).append(link)
        heap: list[tuple[float, int, str, tuple[Link, ...]]] = [(0.0, 0, s, ()) for s in start]
        seen: set[str] = set()
        while heap:
            lat, hops, node, path = heapq.heappop(heap)
            if node in goal:
                return list(path)
            if node in seen:
                continue
            seen.add(node)
            for link in adj.get(node, []):
                nxt = link.b if link.a == node else link.a
                if nxt not in seen:
                    heapq.heappush(heap, (lat + link.latency_s, hops + 1, nxt, path + (link,)))
        raise LookupError(f"no route between {a!r} and {b!r}")

    def bottleneck_bandwidth_bytes_per_s(self, a: str, b: str) -> float:
        """The narrowest link on the route (inf for co-located machines)."""
        route = self.route(a, b)
        return min((link.bandwidth_bytes_per_s for link in route), default=float("inf"))

    def route_latency_s(self, a: str, b: str) -> float:
        return sum(link.latency_s for link in self.route(a, b))

    def transfer_time_s(self, a: str, b: str, nbytes: float) -> float:
        """Time to move nbytes from a to b: summed latency plus bytes over the bottleneck."""
        route = self.route(a, b)
        if not route:
            return 0.0
        return sum(link.latency_s for link in route) + nbytes / min(link.bandwidth_bytes_per_s for link in route)
