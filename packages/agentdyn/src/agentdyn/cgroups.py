"""Cgroup v1 cpuset / cpu-quota groups for tool classes, with fallbacks when they are not writable.

A ``CpuGroup`` holds the processes of one task class: a cpuset group (its own cores) and/or a cpu
group (a CFS quota in cores and a ``cpu.shares`` weight). Where cgroups are not writable, cores
fall back to ``sched_setaffinity`` and a quota to ``hwtopo.throttle`` per process (labelled).
Groups are named ``agentdyn-<creator pid>-<name>`` and removed on close, at exit, and by
``cleanup_stale()`` once their creator has died.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from pathlib import Path

import hwtopo

__all__ = ["CpuGroup", "cpuset_writable", "cpu_writable", "cleanup_stale"]

log = logging.getLogger(__name__)
CPUSET_ROOT = Path("/sys/fs/cgroup/cpuset")
CPU_ROOTS = (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct"))
PREFIX = "agentdyn-"
PERIOD_US = 100_000
_live: dict[str, CpuGroup] = {}
_counter = [0]
_swept = [False]
_lock = threading.Lock()


def cpuset_writable() -> bool:
    return (CPUSET_ROOT / "cpuset.cpus").exists() and os.access(CPUSET_ROOT, os.W_OK)


def _cpu_root() -> Path | None:
    for r in CPU_ROOTS:
        if (r / "cpu.cfs_quota_us").exists() and os.access(r, os.W_OK):
            return r
    return None


def cpu_writable() -> bool:
    return _cpu_root() is not None


def cleanup_stale() -> list[str]:
    """Remove agentdyn groups whose creating process has died."""
    removed = []
    roots = [CPUSET_ROOT] + [r for r in CPU_ROOTS if r.exists()]
    for root in roots:
        if not root.exists():
            continue
        for g in root.glob(f"{PREFIX}*"):
            try:
                owner = int(g.name[len(PREFIX) :].split("-")[0])
            except ValueError:
                continue
            if owner != os.getpid() and not hwtopo.pid_alive(owner) and hwtopo.remove_cgroup(g):
                removed.append(str(g))
    return removed


class CpuGroup:
    """Processes of one task class: own cores (``cpus``), a quota in cores, a cpu.shares weight."""

    def __init__(
        self,
        name: str,
        cpus: list[int] | None = None,
        quota_cores: float | None = None,
        shares: int | None = None,
        threads: int | None = None,
    ):
        if quota_cores is not None and quota_cores <= 0:
            raise ValueError(f"quota_cores must be > 0, not {quota_cores!r}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, not {threads!r}")
        self.name = name
        self.threads = threads  # the thread count its tools' numerical libraries are told
        self.cpus = sorted(cpus) if cpus else None
        self.quota_cores = quota_cores
        self.shares = shares
        self.methods: list[str] = []
        self._paths: list[Path] = []
        self._throttles: list = []
        self.closed = False
        if not _swept[0]:
            _swept[0] = True
            removed = cleanup_stale()
            if removed:
                log.info("removed %d stale agentdyn cgroup(s)", len(removed))
        with _lock:
            _counter[0] += 1
            tag = f"{PREFIX}{os.getpid()}-{_counter[0]}-{name}"
        if self.cpus is not None:
            if cpuset_writable():
                p = CPUSET_ROOT / tag
                try:
                    p.mkdir(exist_ok=True)
                    mems = (CPUSET_ROOT / "cpuset.mems").read_text().strip() or "0"
                    (p / "cpuset.cpus").write_text(",".join(map(str, self.cpus)))
                    (p / "cpuset.mems").write_text(mems)
                    self._paths.append(p)
                    self.methods.append("cgroup-v1-cpuset")
                except OSError:
                    log.warning("cpuset group %s failed; using sched_setaffinity", tag, exc_info=True)
                    hwtopo.remove_cgroup(p)
                    self.methods.append("affinity")
            else:
                self.methods.append("affinity")
        root = _cpu_root()
        if quota_cores is not None or shares is not None:
            if root is not None:
                p = root / tag
                try:
                    p.mkdir(exist_ok=True)
                    (p / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                    if quota_cores is not None:
                        (p / "cpu.cfs_quota_us").write_text(str(max(1000, int(quota_cores * PERIOD_US))))
                    if shares is not None:
                        (p / "cpu.shares").write_text(str(int(shares)))
                    self._paths.append(p)
                    self.methods.append("cgroup-v1-cpu")
                except OSError:
                    log.warning("cpu group %s failed; using hwtopo.throttle", tag, exc_info=True)
                    hwtopo.remove_cgroup(p)
                    self.methods.append("hwtopo-throttle" if quota_cores is not None else "none")
            elif quota_cores is not None:
                self.methods.append("hwtopo-throttle")
        with _lock:
            _live[tag] = self
        self._tag = tag

    def add(self, pid: int) -> None:
        """Place a (just started, not yet working) process into this group; its children follow."""
        for p in self._paths:
            try:
                (p / "cgroup.procs").write_text(str(pid))
            except OSError as e:
                log.debug("could not add %d to %s: %s", pid, p, e)
        if "affinity" in self.methods and self.cpus:
            try:
                os.sched_setaffinity(pid, self.cpus)
            except OSError:
                pass
        if "hwtopo-throttle" in self.methods and self.quota_cores:
            self._throttles.append(hwtopo.throttle(pid, speed=min(1.0, self.quota_cores), cpus=1))

    def describe(self) -> dict:
        return {
            "name": self.name,
            "cpus": self.cpus,
            "quota_cores": self.quota_cores,
            "shares": self.shares,
            "threads": self.threads,
            "methods": self.methods,
        }

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for t in self._throttles:
            t.close()
        for p in self._paths:
            hwtopo.remove_cgroup(p)
        with _lock:
            _live.pop(self._tag, None)


@atexit.register
def _close_all() -> None:
    with _lock:
        groups = list(_live.values())
    for g in groups:
        g.close()
