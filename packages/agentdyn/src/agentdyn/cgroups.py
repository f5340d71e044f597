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
from pathlib import Path

import hwtopo

__all__ = ["CpuGroup", "ProcessWeight", "cpuset_writable", "cpu_writable", "cleanup_stale"]

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


_cpu_membership = hwtopo.cgroups.cpu_group_of  # the v1 cpu group a pid is in (None on v2)


class ProcessWeight:
    """A CPU weight for a running process of ours (the agent runtime) while a policy is active.

    Weighted tool groups outweigh a plain process by up to 64 times, so without this the runtime
    that drives every request (its event loop, the tool spawns and relays, and servers it hosts)
    is what CFS starves. Applied only on a cgroup v1 ``cpu`` hierarchy not co-mounted with anything
    but ``cpuacct``, so moving the process changes no memory, pids or other membership (on v2 one
    move would take it out of its slice in every controller); :meth:`restore` moves it back."""

    def __init__(self, shares: int, pid: int | None = None):
        self.shares = max(2, min(262144, int(shares)))
        self.pid = os.getpid() if pid is None else pid
        self.group: hwtopo.CGroup | None = None
        self._home: Path | None = None
        self.reason: str | None = None  # why it was not applied
        self.tried = False

    def apply(self) -> bool:
        """Move the process into a group of weight ``shares``, once; False (and ``reason``) where it
        cannot, or when it was applied and restored before."""
        if self.tried:
            return self.group is not None
        self.tried = True
        member = _cpu_membership(self.pid)
        if member is None or not member[0] <= {"cpu", "cpuacct"}:
            self.reason = "no cgroup v1 cpu hierarchy of its own (v2 would move every controller)"
            return False
        g = hwtopo.CGroup(f"agentdyn-runtime-{self.pid}", shares=self.shares)
        path = g.paths.get("cpu")
        if path is None or g.version("cpu") != 1:
            g.close()
            self.reason = "no writable cgroup v1 cpu controller"
            return False
        try:
            g.add(self.pid)
        except OSError as e:
            g.close()
            self.reason = f"could not join {path}: {e.strerror or e}"
            return False
        self._home = path.parent / member[1].lstrip("/")
        self.group, self.reason = g, None
        return True

    def restore(self) -> None:
        """Back to the cgroup the process came from; the group is removed."""
        if self.group is None:
            return
        g, self.group = self.group, None
        try:
            if self._home is not None:
                (self._home / "cgroup.procs").write_text(str(self.pid))
        except OSError as e:
            log.warning("could not move %d back to %s: %s", self.pid, self._home, e)
        g.close()  # whatever is still inside moves to the hierarchy's root

    def describe(self) -> dict:
        return {"shares": self.shares, "applied": self.group is not None, "reason": self.reason}
