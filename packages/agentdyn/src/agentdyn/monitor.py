"""Resource monitor: what each request and each tool call costs, and how pressed the system is.

Per process (group): CPU time, wall time, disk read/write bytes and peak RSS, read with psutil
(plus ``/proc/<pid>/status`` VmHWM and per-thread ``schedstat`` run-queue wait, which psutil does
not expose) while it runs and from ``getrusage`` and the I/O counters of the sandbox wrapper when
it exits (reaped children are folded into both by the kernel).
System: CPU/IO/memory pressure from Linux PSI (``/proc/pressure/*``); where PSI is missing, CPU
pressure is estimated from the load average and the runnable count over the usable cores.

Sampling reads a handful of small procfs files per tick (tens of microseconds); the default tick is
0.1 s, so the sampler itself costs well under 0.1% of one core (``SystemSampler.overhead()``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

__all__ = [
    "Usage",
    "PressureSnapshot",
    "SystemSampler",
    "read_psi",
    "read_loadavg",
    "psi_available",
    "proc_usage",
    "group_pids",
    "RequestUsage",
    "GroupWatcher",
    "self_usage",
    "read_run_wait",
]

log = logging.getLogger(__name__)
PROC = Path("/proc")


@dataclass
class Usage:
    """Resources one tool call (or one request, summed) used."""

    cpu_s: float = 0.0
    wall_s: float = 0.0
    read_bytes: int = 0
    write_bytes: int = 0
    peak_rss_bytes: int = 0
    run_wait_s: float = 0.0  # time its threads sat runnable but not running (CPU contention)

    @property
    def cpu_intensity(self) -> float:
        """CPU seconds per uncontended wall second (wall minus run-queue wait; 1.0 = one busy core)."""
        wall = max(self.cpu_s, self.wall_s - self.run_wait_s) if self.cpu_s > 0 else self.wall_s
        return self.cpu_s / wall if wall > 0 else 0.0

    def add(self, other: Usage) -> None:
        """Accumulate another call's usage (peak RSS is a max, the rest sums)."""
        self.cpu_s += other.cpu_s
        self.wall_s += other.wall_s
        self.read_bytes += other.read_bytes
        self.write_bytes += other.write_bytes
        self.run_wait_s += other.run_wait_s
        self.peak_rss_bytes = max(self.peak_rss_bytes, other.peak_rss_bytes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cpu_intensity"] = round(self.cpu_intensity, 4)
        return d


@dataclass
class RequestUsage:
    """Per-request totals: tool usage plus time spent waiting on the LLM and in admission queues."""

    tools: Usage = field(default_factory=Usage)
    llm_wait_s: float = 0.0
    queue_wait_s: float = 0.0
    tool_calls: int = 0

    def to_dict(self) -> dict:
        return {
            "tools": self.tools.to_dict(),
            "llm_wait_s": self.llm_wait_s,
            "queue_wait_s": self.queue_wait_s,
            "tool_calls": self.tool_calls,
        }


# ---------------------------------------------------------------- system pressure


def psi_available() -> bool:
    """True when the kernel exposes PSI (``/proc/pressure/cpu`` is readable)."""
    try:
        (PROC / "pressure" / "cpu").read_text()
        return True
    except OSError:
        return False


def read_psi(resource: str) -> dict[str, dict[str, float]] | None:
    """Parse ``/proc/pressure/<resource>`` -> {"some": {"avg10":..., "total": us}, "full": {...}}."""
    try:
        text = (PROC / "pressure" / resource).read_text()
    except OSError:
        return None
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        vals = {}
        for kv in rest.split():
            k, _, v = kv.partition("=")
            vals[k] = float(v)
        out[kind] = vals
    return out


def read_loadavg() -> tuple[float, int, int]:
    """(1-minute load average, runnable tasks now, total tasks) from /proc/loadavg."""
    try:
        parts = (PROC / "loadavg").read_text().split()
        running, total = parts[3].split("/")
        return float(parts[0]), int(running), int(total)
    except (OSError, IndexError, ValueError):
        la = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        return la, 0, 0


@dataclass
class PressureSnapshot:
    """System pressure over the last sampling window, as fractions of wall time (0..1)."""

    t: float
    cpu_some: float
    io_some: float
    io_full: float
    mem_some: float
    mem_full: float
    runnable: int
    loadavg1: float
    source: str  # "psi" or "loadavg"

    def to_dict(self) -> dict:
        return asdict(self)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class SystemSampler:
    """Samples PSI (or load average) every ``interval_s`` in a daemon thread.

    Pressure is computed from the cumulative ``total=`` microsecond counters over the last tick, so
    it reacts in one tick instead of PSI's 10 s average. ``latest()`` is lock-free to read.
    """

    def __init__(self, interval_s: float = 0.1, history: int = 6000):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, not {interval_s!r}")
        self.interval_s = interval_s
        self.history_max = history
        self.history: list[PressureSnapshot] = []
        self.cores = _usable_cores()
        self.source = "psi" if psi_available() else "loadavg"
        self._prev: dict[str, float] | None = None
        self._prev_t = 0.0
        self._latest: PressureSnapshot | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sample_cpu_s = 0.0
        self._samples = 0
        self._started = 0.0

    def _totals(self) -> dict[str, float]:
        tot: dict[str, float] = {}
        for res in ("cpu", "io", "memory"):
            p = read_psi(res)
            if p is None:
                continue
            for kind in ("some", "full"):
                if kind in p:
                    tot[f"{res}_{kind}"] = p[kind].get("total", 0.0)
        return tot

    def sample(self) -> PressureSnapshot:
        """Take one sample now (also used by the thread)."""
        c0 = time.thread_time()
        now = time.monotonic()
        la1, runnable, _ = read_loadavg()
        if self.source == "psi":
            tot = self._totals()
            if self._prev is None or now - self._prev_t <= 0:
                p = read_psi("cpu") or {}
                pi = read_psi("io") or {}
                pm = read_psi("memory") or {}

                def avg(d, k):
                    return d.get(k, {}).get("avg10", 0.0) / 100.0

                snap = PressureSnapshot(
                    now,
                    avg(p, "some"),
                    avg(pi, "some"),
                    avg(pi, "full"),
                    avg(pm, "some"),
                    avg(pm, "full"),
                    runnable,
                    la1,
                    "psi",
                )
            else:
                dt_us = (now - self._prev_t) * 1e6

                def frac(k):
                    return min(1.0, max(0.0, (tot.get(k, 0.0) - self._prev.get(k, 0.0)) / dt_us))

                snap = PressureSnapshot(
                    now,
                    frac("cpu_some"),
                    frac("io_some"),
                    frac("io_full"),
                    frac("memory_some"),
                    frac("memory_full"),
                    runnable,
                    la1,
                    "psi",
                )
            self._prev, self._prev_t = tot, now
        else:
            # Without PSI: runnable tasks beyond the cores are waiting, as a share of the runnable ones.
            waiting = max(0, runnable - self.cores)
            cpu_some = min(1.0, waiting / max(1, runnable)) if runnable else min(1.0, max(0.0, la1 / self.cores - 1))
            snap = PressureSnapshot(now, cpu_some, 0.0, 0.0, 0.0, 0.0, runnable, la1, "loadavg")
        self._latest = snap
        self._sample_cpu_s += time.thread_time() - c0
        self._samples += 1
        return snap

    def latest(self) -> PressureSnapshot:
        """The most recent sample (taking one if the sampler has not run yet)."""
        snap = self._latest
        if snap is None or (self._thread is None and time.monotonic() - snap.t > self.interval_s):
            snap = self.sample()
        return snap

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                snap = self.sample()
            except Exception:  # noqa: BLE001 - a monitor must never take the runtime down
                log.debug("pressure sample failed", exc_info=True)
                continue
            self.history.append(snap)
            if len(self.history) > self.history_max:
                del self.history[: len(self.history) // 2]

    def start(self) -> SystemSampler:
        if self._thread is None:
            self.sample()
            self._started = time.monotonic()
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="agentdyn-psi", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    def overhead(self) -> dict:
        """CPU the sampler has spent, per sample and as a fraction of one core since start."""
        elapsed = time.monotonic() - self._started if self._started else 0.0
        return {
            "samples": self._samples,
            "cpu_s_per_sample": self._sample_cpu_s / self._samples if self._samples else 0.0,
            "core_fraction": self._sample_cpu_s / elapsed if elapsed > 0 else 0.0,
        }

    def summary(self, since: float = 0.0) -> dict:
        """Mean and max pressure over the history since monotonic time ``since``."""
        hs = [h for h in self.history if h.t >= since]
        if not hs:
            return {"samples": 0, "source": self.source}
        out: dict = {"samples": len(hs), "source": self.source}
        for k in ("cpu_some", "io_some", "mem_some", "runnable"):
            vals = [getattr(h, k) for h in hs]
            out[f"{k}_mean"] = sum(vals) / len(vals)
            out[f"{k}_max"] = max(vals)
        return out

    def __enter__(self) -> SystemSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------- per-process usage


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:  # gone, or not ours to ask about
        return None


def _cpu_rss(proc: psutil.Process) -> tuple[float, int] | None:
    """(user+system seconds incl. waited-for children, resident bytes) of one process, None if gone."""
    try:
        with proc.oneshot():
            t = proc.cpu_times()
            rss = proc.memory_info().rss
    except psutil.Error:
        return None
    return t.user + t.system + t.children_user + t.children_system, rss


def _read_io(proc: psutil.Process) -> tuple[int, int]:
    """(bytes read, bytes written) from storage; (0, 0) where not permitted or not accounted."""
    try:
        io = proc.io_counters()
    except (psutil.Error, AttributeError):  # AttributeError: no per-process I/O counters on this OS
        return 0, 0
    return io.read_bytes, io.write_bytes


def read_run_wait(pid: int) -> float:
    """Seconds the live threads of ``pid`` have waited on a run queue (/proc/<pid>/task/*/schedstat)."""
    total = 0
    try:
        tids = os.listdir(PROC / str(pid) / "task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            total += int((PROC / str(pid) / "task" / tid / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def _read_hwm(pid: int) -> int:
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def group_pids(pgid: int) -> list[int]:
    """Live pids in process group ``pgid`` (a scan of all pids; used for sampling and cleanup)."""
    return [pid for pid in psutil.pids() if _pgid(pid) == pgid]


def proc_usage(pids: list[int]) -> Usage:
    """Usage now of a set of live processes (CPU includes their reaped children)."""
    u = Usage()
    rss_total = 0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
        except psutil.Error:
            continue
        got = _cpu_rss(proc)
        if got is None:
            continue
        u.cpu_s += got[0]
        rss_total += got[1]
        r, w = _read_io(proc)
        u.read_bytes += r
        u.write_bytes += w
        u.run_wait_s += read_run_wait(pid)
        u.peak_rss_bytes = max(u.peak_rss_bytes, _read_hwm(pid))
    u.peak_rss_bytes = max(u.peak_rss_bytes, rss_total)
    return u


def self_usage(wall_s: float) -> Usage:
    """This process's own usage, children it has waited for included (for the sandbox wrapper)."""
    import resource

    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    r, w = _read_io(psutil.Process())
    if r == 0 and w == 0:  # no /proc/self/io: fall back to block counts (512-byte units)
        r, w = (s.ru_inblock + c.ru_inblock) * 512, (s.ru_oublock + c.ru_oublock) * 512
    return Usage(
        cpu_s=s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime,
        wall_s=wall_s,
        read_bytes=r,
        write_bytes=w,
        peak_rss_bytes=max(s.ru_maxrss, c.ru_maxrss) * 1024,
        run_wait_s=read_run_wait(os.getpid()),
    )


class GroupWatcher:
    """Samples every registered sandbox process group while it runs.

    Each tick reads only the known members of each group (a few small procfs files per process);
    every ``rescan_every`` ticks one scan of /proc finds new members (e.g. pytest under the tool).
    Keeps, per group, the peak RSS summed over its live members, the CPU and I/O totals and the
    run-queue wait seen, so a killed group (which never reports its own rusage) still has usage.
    """

    def __init__(self, interval_s: float = 0.2, rescan_every: int = 3):
        self.interval_s = interval_s
        self.rescan_every = max(1, rescan_every)
        self.groups: dict[int, Usage] = {}
        self._waits: dict[int, dict[int, float]] = {}
        self._members: dict[int, set[int]] = {}
        self._task: asyncio.Task | None = None
        self.scans = 0
        self.scan_cpu_s = 0.0

    def register(self, pgid: int) -> None:
        self.groups[pgid] = Usage()
        self._waits[pgid] = {}
        self._members[pgid] = {pgid}
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def unregister(self, pgid: int) -> Usage:
        self._waits.pop(pgid, None)
        self._members.pop(pgid, None)
        return self.groups.pop(pgid, Usage())

    def _discover(self) -> None:
        wanted = set(self.groups)
        for pid in psutil.pids():
            g = _pgid(pid)
            if g in wanted:
                self._members.setdefault(g, set()).add(pid)

    def scan(self, discover: bool = True) -> None:
        c0 = time.thread_time()
        if discover:
            self._discover()
        for g in list(self.groups):
            pids = [p for p in self._members.get(g, ()) if psutil.pid_exists(p)]
            self._members[g] = set(pids)
            if not pids:
                continue
            u = proc_usage(pids)
            prev = self.groups[g]
            u.peak_rss_bytes = max(prev.peak_rss_bytes, u.peak_rss_bytes)
            u.cpu_s = max(prev.cpu_s, u.cpu_s)
            u.read_bytes = max(prev.read_bytes, u.read_bytes)
            u.write_bytes = max(prev.write_bytes, u.write_bytes)
            waits = self._waits.setdefault(g, {})
            for pid in pids:
                waits[pid] = max(waits.get(pid, 0.0), read_run_wait(pid))
            u.run_wait_s = sum(waits.values())
            self.groups[g] = u
        self.scans += 1
        self.scan_cpu_s += time.thread_time() - c0

    def overhead(self) -> dict:
        return {"scans": self.scans, "cpu_s_per_scan": self.scan_cpu_s / self.scans if self.scans else 0.0}

    async def _loop(self) -> None:
        tick = 0
        while self.groups:
            try:
                self.scan(discover=tick % self.rescan_every == 1)
                tick += 1
            except Exception:  # noqa: BLE001 - never take the runtime down
                log.debug("group scan failed", exc_info=True)
            await asyncio.sleep(self.interval_s)
