"""Cgroups for every package: create one with a CPU quota, a cpuset, a memory and a process limit, add
processes, read what they used, kill them all at once, remove it; cgroup v1 and v2.

A :class:`CGroup` is one named directory in each hierarchy that serves a controller it needs (v1
mounts one hierarchy per controller or per pair, v2 one for all). Its name is
``hwtopo-<creator pid>-<n>[-<label>]``, so any process can tell whose it is. A group never outlives
its creator: it is removed on ``close()``, at exit, by a guardian process that removes every group of
its creator the moment the creator dies (SIGKILL included: the guardian sees the end of a pipe only
the creator holds), and by :func:`cleanup_stale` at every creation, for groups whose creator and
guardian both died. Removing a group moves its processes to the hierarchy's root, so a process
outliving its creator runs unconstrained rather than in a group nobody will remove.

A group made with ``parent=`` nests inside that group's directories (a tool's group inside its task
class's group: the class's CPU limits still bind it, and on v2, where a process sits in exactly one
group, nesting is the only way to hold both). ``killable=True`` groups can be killed as a whole with
:meth:`CGroup.kill`: ``cgroup.kill`` on v2, the freezer on v1 (frozen, every member SIGKILLed,
thawed), so a process forking while it is killed cannot slip out.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CGroup",
    "CGroupUsage",
    "cgroup_available",
    "cgroup_controllers",
    "cleanup_stale",
    "cpu_group_of",
    "pid_alive",
    "remove_cgroup",
]

log = logging.getLogger(__name__)

PREFIX = "hwtopo-"
PERIOD_US = 100_000
MOUNTS = Path("/proc/self/mounts")
_KNOWN = frozenset({"cpu", "cpuacct", "cpuset", "memory", "pids", "freezer"})
# every v2 group has cpu.stat (usage), cgroup.freeze and (5.14+) cgroup.kill whatever is enabled
_V2_CORE = frozenset({"cpuacct", "freezer"})
_LABEL = re.compile(r"[A-Za-z0-9_.-]{0,64}")
_counter = 0
_live: dict[str, CGroup] = {}
_lock = threading.Lock()
_guardian: dict[str, object] = {}  # this process's guardian: the pid it guards, its Popen, the pipe's write end


@dataclass(frozen=True)
class _Hierarchy:
    root: Path
    version: int  # 1 or 2
    controllers: frozenset[str]


def _unescape(path: str) -> str:
    """/proc/mounts writes spaces, tabs and newlines in paths as octal escapes (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _hierarchies(mounts: Path = MOUNTS) -> list[_Hierarchy]:
    """Writable cgroup hierarchies serving any controller hwtopo uses, v1 before v2."""
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return []
    v1, v2 = [], []
    for line in lines:
        parts = line.split()
        if len(parts) < 4 or parts[2] not in ("cgroup", "cgroup2"):
            continue
        root = Path(_unescape(parts[1]))
        if not os.access(root, os.W_OK):
            continue
        if parts[2] == "cgroup":
            ctrl = _KNOWN & set(parts[3].split(","))
            if ctrl:
                v1.append(_Hierarchy(root, 1, frozenset(ctrl)))
        else:
            try:
                enabled = set((root / "cgroup.subtree_control").read_text().split())
            except OSError:
                continue
            v2.append(_Hierarchy(root, 2, frozenset((_KNOWN & enabled) | _V2_CORE)))
    return v1 + v2


def _serving(hierarchies: list[_Hierarchy]) -> dict[str, _Hierarchy]:
    """Each controller -> the first hierarchy that serves it."""
    out: dict[str, _Hierarchy] = {}
    for h in hierarchies:
        for c in sorted(h.controllers):
            out.setdefault(c, h)
    return out


def cgroup_controllers() -> frozenset[str]:
    """The controllers this process can create groups in: a subset of cpu, cpuacct, cpuset, memory,
    pids, freezer (on v2: ``cgroup.freeze``/``cgroup.kill``, there in every group)."""
    serving = _serving(_hierarchies())
    if set(serving) <= _V2_CORE and all(h.version == 2 for h in serving.values()):
        return frozenset()  # a v2 tree with nothing enabled: usage alone is no reason to make groups
    return frozenset(serving)


def cgroup_available() -> bool:
    """True when a cgroup CPU quota can be set here (root with a writable cpu controller)."""
    return "cpu" in cgroup_controllers()


def cpu_group_of(pid: int) -> tuple[frozenset[str], str] | None:
    """The v1 controllers co-mounted with ``cpu`` and the path (from the hierarchy's root) of the group
    holding ``pid``; None on cgroup v2, without a ``cpu`` hierarchy, or when ``pid`` cannot be read."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        names = frozenset(ctrls.split(","))
        if "cpu" in names:
            return names, path
    return None


def _proc_state(pid: int) -> str | None:
    """The one-letter state in /proc/<pid>/stat, or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` runs (also when it belongs to another user); a zombie has died."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return _proc_state(pid) not in ("Z", "X")


def _procs(group: Path) -> list[int]:
    try:
        return [int(x) for x in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def remove_cgroup(group: Path) -> bool:
    """Remove a cgroup and the groups nested in it, deepest first: each one's remaining processes
    move to the hierarchy's root, then it is rmdir'ed. True when removed."""
    try:
        nested = [p for p in group.iterdir() if p.is_dir()]
    except OSError:
        nested = []
    for child in nested:
        remove_cgroup(child)
    top = group.parent
    while top.name.startswith(PREFIX):
        top = top.parent  # v2 takes no process into a group that has groups inside
    parent = top / "cgroup.procs"
    for _ in range(50):
        for pid in _procs(group):
            try:
                parent.write_text(str(pid))
            except OSError:
                pass
        try:
            group.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.02)
    log.warning("could not remove cgroup %s", group)
    return False


def _owner(name: str) -> int | None:
    if not name.startswith(PREFIX):
        return None
    head = name[len(PREFIX) :].split("-")[0]
    return int(head) if head.isdigit() else None


def cleanup_stale() -> list[str]:
    """Remove hwtopo cgroups whose creating process has died (e.g. after a crash); returns their names."""
    removed: set[str] = set()
    me = os.getpid()
    for h in _hierarchies():
        for group in h.root.glob(f"{PREFIX}*"):
            owner = _owner(group.name)
            if owner is None:
                continue
            # a group named for this pid that this process does not hold was left by an earlier
            # process with the same pid
            stale = group.name not in _live if owner == me else not pid_alive(owner)
            if stale and remove_cgroup(group):
                removed.add(group.name)
    if removed:
        log.info("removed %d stale hwtopo cgroup(s): %s", len(removed), sorted(removed))
    return sorted(removed)


# Runs without importing hwtopo (fast, and nothing of the creator's state): waits for the end of a
# pipe only its creator holds (or, should a forked child keep the pipe open, for the creator to die),
# then removes the creator's groups from every hierarchy and exits.
_GUARDIAN = r"""
import os, select, sys, time
_, creator, fd, *roots = sys.argv
prefix = "hwtopo-" + creator + "-"
def dead():
    try:
        with open("/proc/" + creator + "/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True
while not select.select([int(fd)], [], [], 2.0)[0] and not dead():
    pass
groups = []
for root in roots:
    try:
        names = [n for n in os.listdir(root) if n.startswith(prefix)]
    except OSError:
        continue
    for name in names:  # nested groups first: a directory with groups inside cannot be removed
        groups += [d for d, _, _ in os.walk(os.path.join(root, name), topdown=False)]
for group in groups:
    root = os.path.dirname(group)
    while os.path.basename(root).startswith("hwtopo-"):
        root = os.path.dirname(root)  # v2 takes no process into a group that has groups inside
    for _ in range(50):
        try:
            with open(os.path.join(group, "cgroup.procs")) as fh:
                pids = fh.read().split()
        except OSError:
            pids = []
        for pid in pids:
            try:
                with open(os.path.join(root, "cgroup.procs"), "w") as fh:
                    fh.write(pid)
            except OSError:
                pass
        try:
            os.rmdir(group)
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.02)
"""


def _ensure_guardian(roots: list[Path]) -> None:
    """Start this process's guardian once (again after a fork: the parent's guards the parent)."""
    with _lock:
        if _guardian.get("creator") == os.getpid():
            return
        r, w = os.pipe()  # not inheritable: a child that execs does not keep the creator "alive"
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _GUARDIAN, str(os.getpid()), str(r), *map(str, roots)],
                pass_fds=(r,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # holding the creator's pipes would keep its reader waiting
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a signal to the creator's process group leaves it running
            )
        except OSError as e:  # groups are still removed at close, at exit and by cleanup_stale
            os.close(w)
            log.warning("could not start the cgroup guardian: %s", e)
            return
        finally:
            os.close(r)
        _guardian.update(creator=os.getpid(), proc=proc, fd=w)


@dataclass
class CGroupUsage:
    """What a group's processes used: CPU seconds, memory now and at its peak (None: not accounted)."""

    cpu_s: float | None
    memory_bytes: float | None
    memory_peak_bytes: float | None


class CGroup:
    """A cgroup holding processes under a CPU quota, a cpuset, a memory and a process limit. Use as a
    context manager.

    ``quota_cores`` (CPU time per ``period_s``, in cores) and ``shares`` (relative weight, v1 units
    2-262144) need the cpu controller, ``cpus``/``mems`` the cpuset one, ``memory_bytes`` the memory
    one (swap included where the kernel counts it), ``pids_max`` the pids one, ``killable`` the
    freezer (v1) or any v2 hierarchy; ``account=True`` also joins cpuacct and memory to read
    :meth:`usage`. ``parent``: a live group to nest in, in every hierarchy where it has a directory.
    A controller that is not writable here, or refuses a setting, is listed in ``missing`` (with
    ``strict=True`` it raises instead), so a caller can fall back (affinity, a duty-cycle throttle).
    ``paths`` maps each controller in use to its directory; ``version(controller)`` says v1 or v2.
    """

    closed: bool  # declared here: __init__ reads a parent's before it sets its own

    def __init__(
        self,
        label: str = "",
        *,
        cpus: list[int] | None = None,
        mems: list[int] | None = None,
        quota_cores: float | None = None,
        period_s: float | None = None,
        shares: int | None = None,
        memory_bytes: int | None = None,
        pids_max: int | None = None,
        killable: bool = False,
        account: bool = False,
        parent: CGroup | None = None,
        strict: bool = False,
    ) -> None:
        global _counter
        if not _LABEL.fullmatch(label):
            raise ValueError(f"label must be up to 64 letters, digits, '_', '.' or '-', not {label!r}")
        _check_limits(cpus, mems, quota_cores, period_s, shares, memory_bytes, pids_max)
        if parent is not None and (not isinstance(parent, CGroup) or parent.closed):
            raise ValueError(f"parent must be a live CGroup, not {parent!r}")
        self.settings: dict[str, Any] = {"cpus": cpus, "mems": mems, "quota_cores": quota_cores, "shares": shares}
        self.settings.update(
            memory_bytes=memory_bytes,
            pids_max=pids_max,
            period_us=PERIOD_US if period_s is None else int(period_s * 1e6),
        )
        want = _wanted(self.settings, killable)
        optional = {"cpuacct", "memory"} - want if account else set()
        self.creator = os.getpid()
        self.parent = parent
        self.paths: dict[str, Path] = {}
        self.closed = False
        hierarchies = _hierarchies()
        serving = _serving(hierarchies)
        self.missing: set[str] = want - set(serving)
        if strict and self.missing:
            raise RuntimeError(_unavailable(sorted(self.missing)))
        with _lock:
            _counter += 1
            self.name = f"{PREFIX}{self.creator}-{_counter}" + (f"-{label}" if label else "")
        self._versions = {c: serving[c].version for c in (want | optional) & set(serving)}
        if not self._versions:
            return  # nothing writable: an empty group whose add() does nothing
        cleanup_stale()
        _ensure_guardian([h.root for h in hierarchies])
        with _lock:
            _live[self.name] = self
        self._make(serving, want, optional, strict)

    def _base(self, root: Path) -> Path:
        """Where this group's directory goes in hierarchy ``root``: inside the parent's, if it has one."""
        if self.parent is not None:
            for path in self.parent.paths.values():
                if path.is_relative_to(root):
                    return path
        return root

    def _make(self, serving: dict[str, _Hierarchy], want: set[str], optional: set[str], strict: bool) -> None:
        """Create the directory in each hierarchy needed and write its settings."""
        by_root: dict[Path, list[str]] = {}
        for c in sorted(self._versions):
            by_root.setdefault(serving[c].root, []).append(c)
        for root, ctrls in by_root.items():
            base = self._base(root)
            path = base / self.name
            try:
                if base != root and serving[ctrls[0]].version == 2:
                    _delegate(base, ctrls)
                path.mkdir()
                for c in ctrls:
                    self.paths[c] = path
                    _SETUP[c](self, path, serving[c].version)
            except OSError as e:
                remove_cgroup(path)
                for c in ctrls:
                    self.paths.pop(c, None)
                failed = sorted(set(ctrls) & want)
                if strict and failed:
                    self.close()
                    raise
                self.missing.update(failed)
                log.warning("cgroup %s (%s) could not be set up: %s", path, ",".join(ctrls), e)

    def version(self, controller: str) -> int | None:
        """1 or 2 for a controller this group uses, else None."""
        return self._versions.get(controller) if controller in self.paths else None

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the group; its later children stay in it.
        With a parent, it also joins the parent's directories in hierarchies this group is not in."""
        mine = dict.fromkeys(self.paths.values())
        if self.parent is not None and not self.parent.closed:
            for path in dict.fromkeys(self.parent.paths.values()):
                if not any(p.is_relative_to(path) for p in mine):
                    (path / "cgroup.procs").write_text(str(pid))
        for path in mine:
            (path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        """The processes in the group (in any of its directories, groups nested in it included)."""
        dirs = {d for path in set(self.paths.values()) for d, _, _ in os.walk(path)}
        return sorted({p for d in dirs for p in _procs(Path(d))})

    def alive(self) -> list[int]:
        """The group's processes that have not exited (a zombie waiting for its parent has)."""
        return [p for p in self.pids() if pid_alive(p)]

    def kill(self, timeout_s: float = 5.0) -> bool:
        """SIGKILL every process in the group, and every one they fork meanwhile (``cgroup.kill`` on
        v2; frozen first on v1, so none can fork past the kill). True once none is left alive."""
        deadline = time.monotonic() + timeout_s
        v2 = [p for c, p in self.paths.items() if self._versions[c] == 2]
        while True:
            if v2 and (v2[0] / "cgroup.kill").exists():
                try:
                    (v2[0] / "cgroup.kill").write_text("1")
                except OSError as e:
                    log.debug("cgroup.kill of %s: %s", v2[0], e)
            else:
                self._frozen_kill()
            if not self.alive():
                return True
            if time.monotonic() > deadline:
                log.warning("cgroup %s still has processes %s after SIGKILL", self.name, self.alive())
                return False
            time.sleep(0.01)

    def _frozen_kill(self) -> None:
        """Freeze the group (where a freezer serves it), SIGKILL each member, thaw: killed processes die."""
        fz = self.paths.get("freezer")
        if fz is not None:
            v1 = self._versions["freezer"] == 1
            state, on, off = (fz / "freezer.state", "FROZEN", "THAWED") if v1 else (fz / "cgroup.freeze", "1", "0")
            try:
                state.write_text(on)
                _await_frozen(fz, v1)
            except OSError as e:
                log.debug("could not freeze %s: %s", fz, e)
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if fz is not None:
            try:
                state.write_text(off)
            except OSError as e:
                log.debug("could not thaw %s: %s", fz, e)

    def usage(self) -> CGroupUsage:
        """CPU seconds used by the group's processes since it was made, memory in use and at its peak."""
        cpu = mem = peak = None
        acct = self.paths.get("cpuacct")
        if acct is not None:
            if self._versions["cpuacct"] == 1:
                cpu = _read_number(acct / "cpuacct.usage", 1e-9)
            else:
                cpu = _read_stat(acct / "cpu.stat", "usage_usec", 1e-6)
        m = self.paths.get("memory")
        if m is not None:
            v1 = self._versions["memory"] == 1
            mem = _read_number(m / ("memory.usage_in_bytes" if v1 else "memory.current"))
            peak = _read_number(m / ("memory.max_usage_in_bytes" if v1 else "memory.peak"))
        return CGroupUsage(cpu, mem, peak)

    def close(self) -> None:
        """Remove the group (its processes move to the hierarchy's root and keep running)."""
        if self.closed:
            return
        self.closed = True
        for path in dict.fromkeys(self.paths.values()):
            remove_cgroup(path)
        with _lock:
            _live.pop(self.name, None)

    def __enter__(self) -> CGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unavailable(controllers: list[str]) -> str:
    return (
        f"no writable cgroup {', '.join(controllers)} controller here "
        "(needs root and cgroup v1 with it mounted, or v2 with it in cgroup.subtree_control)"
    )


def _wanted(settings: dict, killable: bool) -> set[str]:
    """The controllers a group's settings need."""
    want = set()
    if settings["quota_cores"] is not None or settings["shares"] is not None:
        want.add("cpu")
    if settings["cpus"] is not None or settings["mems"] is not None:
        want.add("cpuset")
    if settings["memory_bytes"] is not None:
        want.add("memory")
    if settings["pids_max"] is not None:
        want.add("pids")
    if killable:
        want.add("freezer")
    return want


def _delegate(base: Path, ctrls: list[str]) -> None:
    """Enable v2 controllers for the groups inside ``base`` (a parent group with no processes of its own)."""
    real = [c for c in ctrls if c not in _V2_CORE]
    if real:
        (base / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in real))


def _await_frozen(path: Path, v1: bool, timeout_s: float = 1.0) -> None:
    """Wait until every process of a group being frozen has stopped (a v1 group reads FREEZING until then)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if v1 and (path / "freezer.state").read_text().strip() == "FROZEN":
            return
        if not v1 and "frozen 1" in (path / "cgroup.events").read_text():
            return
        time.sleep(0.005)


def _check_limits(cpus, mems, quota_cores, period_s, shares, memory_bytes, pids_max=None) -> None:
    for field, ids in (("cpus", cpus), ("mems", mems)):
        if ids is not None and (not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)):
            raise ValueError(f"{field} must be a non-empty list of ids >= 0, not {ids!r}")
    if quota_cores is not None and not 0 < quota_cores < 1e6:
        raise ValueError(f"quota_cores must be a number of cores > 0, not {quota_cores!r}")
    if period_s is not None and not 0.001 <= period_s <= 1.0:
        raise ValueError(f"period_s must be between 0.001 and 1.0 seconds, not {period_s!r}")
    if shares is not None and not (isinstance(shares, int) and 2 <= shares <= 262144):
        raise ValueError(f"shares must be an integer between 2 and 262144, not {shares!r}")
    if memory_bytes is not None and not (isinstance(memory_bytes, int) and memory_bytes >= 1 << 20):
        raise ValueError(f"memory_bytes must be an integer >= 1 MiB, not {memory_bytes!r}")
    if pids_max is not None and not (isinstance(pids_max, int) and not isinstance(pids_max, bool) and pids_max >= 1):
        raise ValueError(f"pids_max must be an integer >= 1, not {pids_max!r}")


def _read_number(path: Path, scale: float = 1.0) -> float | None:
    try:
        return int(path.read_text().split()[0]) * scale
    except (OSError, ValueError, IndexError):
        return None


def _read_stat(path: Path, key: str, scale: float) -> float | None:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v) * scale
    except (OSError, ValueError):
        pass
    return None


def _cpu(g: CGroup, path: Path, version: int) -> None:
    s = g.settings
    quota, period = s["quota_cores"], s["period_us"]
    if quota is not None:
        quota_us = max(1000, int(quota * period))
        if version == 1:
            (path / "cpu.cfs_period_us").write_text(str(period))
            (path / "cpu.cfs_quota_us").write_text(str(quota_us))
        else:
            (path / "cpu.max").write_text(f"{quota_us} {period}")
    if s["shares"] is not None:
        if version == 1:
            (path / "cpu.shares").write_text(str(s["shares"]))
        else:  # v1 shares 2..262144 onto v2 weights 1..10000, 1024 -> 100
            (path / "cpu.weight").write_text(str(max(1, min(10000, round(s["shares"] * 100 / 1024)))))


def _cpuset(g: CGroup, path: Path, version: int) -> None:
    cpus, mems = g.settings["cpus"], g.settings["mems"]
    if cpus is not None:
        (path / "cpuset.cpus").write_text(",".join(map(str, cpus)))
    if mems is not None:
        (path / "cpuset.mems").write_text(",".join(map(str, mems)))
    elif version == 1:  # a v1 cpuset takes no process until its memory nodes are set
        (path / "cpuset.mems").write_text((path.parent / "cpuset.mems").read_text().strip() or "0")


def _memory(g: CGroup, path: Path, version: int) -> None:
    limit = g.settings["memory_bytes"]
    if limit is None:
        return
    (path / ("memory.limit_in_bytes" if version == 1 else "memory.max")).write_text(str(limit))
    # the limit holds for memory and swap together, where the kernel accounts swap
    swap = path / ("memory.memsw.limit_in_bytes" if version == 1 else "memory.swap.max")
    if swap.exists():
        swap.write_text(str(limit) if version == 1 else "0")


def _pids(g: CGroup, path: Path, version: int) -> None:
    if g.settings["pids_max"] is not None:
        (path / "pids.max").write_text(str(g.settings["pids_max"]))


def _nothing_to_set(g: CGroup, path: Path, version: int) -> None:
    """cpuacct only counts and the freezer is used by kill(); there is nothing to set."""


_SETUP = {
    "cpu": _cpu,
    "cpuset": _cpuset,
    "memory": _memory,
    "pids": _pids,
    "cpuacct": _nothing_to_set,
    "freezer": _nothing_to_set,
}


def close_owned_at_exit(registry: dict, lock: threading.Lock) -> None:
    """At exit, close every object of ``registry`` (guarded by ``lock``) that this process created:
    a forked child's exit leaves its parent's groups and throttles alone."""

    def close_all() -> None:
        with lock:
            live = [x for x in registry.values() if x.creator == os.getpid()]
        for x in live:
            x.close()

    atexit.register(close_all)


close_owned_at_exit(_live, _lock)
