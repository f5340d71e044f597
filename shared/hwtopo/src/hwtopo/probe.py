"""Describe this machine from sysfs/procfs (and torch.cuda when importable).

Never fails on a machine that lacks a file: it knows less and says so in ``Machine.notes``.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from .model import ISA_FLAGS, Accelerator, Cluster, Disk, Machine, NumaNode

__all__ = ["probe", "probe_cluster", "parse_cpulist", "usable_cpus"]

log = logging.getLogger(__name__)
SYS = Path("/sys")
PROC = Path("/proc")


def parse_cpulist(text: str) -> list[int]:
    """Linux cpulist ("0-3,8,10-11") -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            lo_i, hi_i = int(lo), int(hi)
            if hi_i < lo_i:
                raise ValueError(f"bad cpu range {part!r}")
            out.extend(range(lo_i, hi_i + 1))
        else:
            out.append(int(part))
    if any(c < 0 for c in out):
        raise ValueError("negative cpu id")
    return out


def usable_cpus() -> list[int]:
    """CPUs this process may run on (affinity), falling back to os.cpu_count()."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _meminfo_bytes(text: str, key: str) -> float | None:
    """Value of ``key`` in /proc/meminfo or a node's meminfo ("Node 0 MemTotal:  123 kB")."""
    for line in text.splitlines():
        head, sep, rest = line.partition(f"{key}:")
        if sep:
            parts = rest.split()
            if parts and parts[0].isdigit():
                unit = parts[1].lower() if len(parts) > 1 else ""
                return float(parts[0]) * (1024 if unit == "kb" else 1)
    return None


def _numa_nodes(usable: set[int], notes: list[str]) -> tuple[NumaNode, ...]:
    base = SYS / "devices/system/node"
    if not base.is_dir():
        notes.append("no /sys/devices/system/node: NUMA layout unknown")
        return ()
    nodes = []
    for d in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cpus = _read(d / "cpulist")
        mem = _read(d / "meminfo")
        try:
            # only the CPUs this process may use: the machine is what the caller can run on
            cpu_ids = tuple(c for c in parse_cpulist(cpus) if c in usable) if cpus else ()
        except ValueError:
            cpu_ids = ()
        mem_b = _meminfo_bytes(mem, "MemTotal") if mem else None
        bw = None
        # HMAT memory attributes, present on some servers (MB/s as seen from the local initiator)
        hmat = _read(d / "access0/initiators/read_bandwidth")
        if hmat and hmat.strip().isdigit():
            bw = float(hmat.strip()) * 1e6
        nodes.append(NumaNode(id=int(d.name[4:]), cpus=cpu_ids, memory_bytes=mem_b or 0.0, bandwidth_bytes_per_s=bw))
    if nodes and all(n.bandwidth_bytes_per_s is None for n in nodes):
        notes.append("no HMAT attributes: NUMA bandwidth unknown (measure with hwtopo measure)")
    return tuple(nodes)


def _mounts() -> dict[str, str]:
    """block device name -> first mount point."""
    out: dict[str, str] = {}
    text = _read(PROC / "mounts") or ""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].startswith("/dev/"):
            out.setdefault(os.path.basename(parts[0]), parts[1])
    return out


def _disks(notes: list[str]) -> tuple[Disk, ...]:
    base = SYS / "block"
    if not base.is_dir():
        notes.append("no /sys/block: disks unknown")
        return ()
    mounts = _mounts()
    disks = []
    for d in sorted(base.iterdir()):
        name = d.name
        if name.startswith(("loop", "ram", "zram", "dm-", "sr", "nbd")):
            continue
        size = _read(d / "size")
        rot = _read(d / "queue/rotational")
        mount = mounts.get(name) or next((m for dev, m in mounts.items() if dev.startswith(name)), None)
        disks.append(
            Disk(
                name=name,
                path=mount,
                rotational=(rot or "0").strip() == "1",
                capacity_bytes=float(size.strip()) * 512 if size and size.strip().isdigit() else None,
            )
        )
    return tuple(disks)


def _accelerators(notes: list[str]) -> tuple[Accelerator, ...]:
    try:
        import torch  # optional
    except ImportError:
        notes.append("torch not installed: GPUs not probed")
        return ()
    try:
        if not torch.cuda.is_available():
            return ()
        out = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append(Accelerator(kind="cuda", name=p.name, memory_bytes=float(p.total_memory)))
        return tuple(out)
    except Exception as e:  # a broken driver must not break probing
        notes.append(f"GPU probe failed: {e}")
        return ()


def _cgroup_cpu_limit() -> float | None:
    """CPUs allowed by a cgroup quota (v2 cpu.max or v1 cfs), if any."""
    v2 = _read(SYS / "fs/cgroup/cpu.max")
    if v2:
        q, _, p = v2.strip().partition(" ")
        if q != "max" and p:
            return int(q) / int(p)
    quota = _read(SYS / "fs/cgroup/cpu/cpu.cfs_quota_us") or _read(SYS / "fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us")
    period = _read(SYS / "fs/cgroup/cpu/cpu.cfs_period_us") or _read(SYS / "fs/cgroup/cpu,cpuacct/cpu.cfs_period_us")
    if quota and period and int(quota) > 0:
        return int(quota) / int(period)
    return None


def _isa(notes: list[str]) -> tuple[str, ...]:
    """The ``ISA_FLAGS`` this CPU's /proc/cpuinfo lists (in that order)."""
    text = _read(PROC / "cpuinfo")
    if text is None:
        notes.append("no /proc/cpuinfo: instruction-set extensions unknown")
        return ()
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return tuple(f for f in ISA_FLAGS if f in flags)


def probe(name: str | None = None, gpus: bool = True) -> Machine:
    """This machine as a Machine: usable cores, memory, NUMA nodes, disks, GPUs; unknowns in notes."""
    notes: list[str] = []
    cpus = usable_cpus()
    threads = len(cpus)
    cores = threads
    # physical cores: distinct (package, core_id) among usable cpus
    ids: set[tuple[str, str]] = set()
    for c in cpus:
        core = _read(SYS / f"devices/system/cpu/cpu{c}/topology/core_id")
        pkg = _read(SYS / f"devices/system/cpu/cpu{c}/topology/physical_package_id")
        if core is None or pkg is None:
            ids = set()
            notes.append("no CPU topology in sysfs: cores counted as hardware threads")
            break
        ids.add((pkg.strip(), core.strip()))
    if ids:
        cores = len(ids)
    limit = _cgroup_cpu_limit()
    if limit is not None and limit < threads:
        notes.append(f"cgroup CPU quota allows {limit:.2f} CPUs")
    meminfo = _read(PROC / "meminfo")
    memory = _meminfo_bytes(meminfo, "MemTotal") if meminfo else None
    if memory is None:
        notes.append("no /proc/meminfo: memory unknown")
    return Machine(
        name=name or socket.gethostname(),
        cores=cores,
        threads=threads,
        memory_bytes=memory or 0.0,
        cpus=() if cpus == list(range(threads)) else tuple(cpus),
        numa_nodes=_numa_nodes(set(cpus), notes),
        disks=_disks(notes),
        accelerators=_accelerators(notes) if gpus else (),
        isa=_isa(notes),
        notes=tuple(notes),
    )


def probe_cluster(name: str | None = None) -> Cluster:
    """A one-machine cluster of this host."""
    m = probe(name)
    return Cluster(name=m.name, machines=(m,))
