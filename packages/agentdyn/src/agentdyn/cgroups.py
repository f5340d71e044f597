"""CPU groups for tool classes on hwtopo's cgroup layer, with fallbacks where cgroups are not writable.

A ``CpuGroup`` holds the processes of one task class in one ``hwtopo.CGroup``: a cpuset (its own
cores) and/or a CPU quota in cores and a ``cpu.shares`` weight, plus CPU and memory accounting. Where
a controller is not writable, cores fall back to ``sched_setaffinity`` and a quota to
``hwtopo.throttle`` per process; ``methods`` says which was used. Creating, removing and sweeping
groups left by dead runs is hwtopo's (its groups never outlive the process that made them).
"""

from __future__ import annotations

import logging
import os
import re

import hwtopo

__all__ = ["CpuGroup", "cpuset_writable", "cpu_writable", "cleanup_stale"]

log = logging.getLogger(__name__)


def cpuset_writable() -> bool:
    return "cpuset" in hwtopo.cgroup_controllers()


def cpu_writable() -> bool:
    return "cpu" in hwtopo.cgroup_controllers()


def cleanup_stale() -> list[str]:
    """Remove cgroups whose creating process has died (hwtopo's sweep, agentdyn's groups included)."""
    return hwtopo.cleanup_stale()


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
        self._throttles: list = []
        self.closed = False
        self.placed = 0  # processes put into the group
        self.add_errors = 0  # processes the cgroup refused (they ran outside it)
        label = "agentdyn-" + re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:48]
        self.cgroup = hwtopo.CGroup(label, cpus=self.cpus, quota_cores=quota_cores, shares=shares, account=True)
        self.methods: list[str] = []
        if self.cpus is not None:
            v = self.cgroup.version("cpuset")
            self.methods.append(f"cgroup-v{v}-cpuset" if v else "affinity")
        if quota_cores is not None or shares is not None:
            v = self.cgroup.version("cpu")
            self.methods.append(f"cgroup-v{v}-cpu" if v else "hwtopo-throttle" if quota_cores is not None else "none")
        if self.cgroup.missing:
            log.info("group %s: no cgroup %s here; using %s", name, sorted(self.cgroup.missing), self.methods)

    def add(self, pid: int) -> None:
        """Place a (just started, not yet working) process into this group; its children follow."""
        try:
            self.cgroup.add(pid)
            self.placed += 1
        except OSError as e:
            self.add_errors += 1
            log.debug("could not add %d to %s: %s", pid, self.cgroup.name, e)
        if "affinity" in self.methods and self.cpus:
            try:
                os.sched_setaffinity(pid, self.cpus)
            except OSError:
                pass
        if "hwtopo-throttle" in self.methods and self.quota_cores:
            self._throttles.append(hwtopo.throttle(pid, speed=min(1.0, self.quota_cores), cpus=1))

    def set_shares(self, shares: int) -> bool:
        """Change the group's CPU weight (v1 ``cpu.shares`` units, 2..262144) while its processes
        run; False where the group has no cpu controller (then nothing changes)."""
        shares = max(2, min(262144, int(shares)))
        path = self.cgroup.paths.get("cpu")
        if self.closed or path is None or shares == self.shares:
            return path is not None and not self.closed
        try:
            if self.cgroup.version("cpu") == 1:
                (path / "cpu.shares").write_text(str(shares))
            else:  # the v2 weight on the scale hwtopo maps shares onto (1024 -> 100)
                (path / "cpu.weight").write_text(str(max(1, min(10000, round(shares * 100 / 1024)))))
        except OSError as e:
            log.debug("could not weight %s: %s", self.cgroup.name, e)
            return False
        self.shares = shares
        return True

    def usage(self) -> hwtopo.CGroupUsage:
        """CPU seconds and memory of the processes placed in the group (None where not accounted)."""
        return self.cgroup.usage()

    def describe(self) -> dict:
        return {
            "name": self.name,
            "cpus": self.cpus,
            "quota_cores": self.quota_cores,
            "shares": self.shares,
            "threads": self.threads,
            "methods": self.methods,
            "placed": self.placed,
            "add_errors": self.add_errors,
        }

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for t in self._throttles:
            t.close()
        self.cgroup.close()
