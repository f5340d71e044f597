"""Make this one machine behave like a spec: slower CPUs and shaped links. Always labelled emulated.

CPU speed: a process runs at a relative ``speed`` of one CPU through a cgroup CPU quota when the
cgroup ``cpu`` controller is writable (v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``), otherwise a
duty-cycle throttle: a small watchdog process alternates SIGSTOP/SIGCONT. ``CpuThrottle.method``
says which was used. Neither outlives the process that made it: the quota's group is a
:class:`~hwtopo.cgroups.CGroup` (removed on close, at exit, and by a guardian when its creator dies);
the watchdog resumes the process and exits when its creator dies or closes the throttle, and a
guardian of its own resumes the process if the watchdog itself is killed, so a stopped process is
never left behind.

Compute dilation (``Dilation``, ``dilate``, ``sync_point``): a process emulating relative ``speed``
computes at full speed and, at each synchronisation point it marks, sleeps ``(1/speed - 1)`` x the CPU
time its thread used since the previous point. Every compute segment then takes ``compute / speed``
of wall time, steady at millisecond scale (a CPU quota enforced per period makes short segments of a
slow process jittery), and the core is free while it sleeps, like a slower device leaving cycles
unused. Time the thread spends blocked (waiting for a peer) uses no CPU and is not dilated. Time it
spends runnable but waiting for a CPU (another process on its core; from
``/proc/self/task/<tid>/schedstat``) already slowed it down and is taken off the sleep it owes, so
contention on the emulating machine does not make the rank slower than asked.

Links: ``LinkShaper`` delays a transfer by the link's latency plus a token-bucket wait at its
bandwidth, for in-process shaping of messages or collectives; ``ShapedWriter`` wraps a file-like.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from .cgroups import CGroup, cgroup_available, cleanup_stale, close_owned_at_exit, pid_alive, remove_cgroup
from .model import Link

__all__ = [
    "CpuThrottle",
    "throttle",
    "cgroup_available",
    "cleanup_stale",
    "pid_alive",
    "remove_cgroup",
    "TokenBucket",
    "LinkShaper",
    "ShapedWriter",
    "EMULATED",
    "Dilation",
    "dilate",
    "undilate",
    "current_dilation",
    "sync_point",
    "resume_point",
]

log = logging.getLogger(__name__)

EMULATED = "emulated"
PERIOD_US = 100_000
WATCHDOG_MARKER = "hwtopo-watchdog"
_throttles: dict[int, CpuThrottle] = {}
_lock = threading.Lock()


# The duty-cycle watchdog, run without importing hwtopo. It sleeps in select() on two pipes: the end of
# the creator's lifeline (the creator died, or closed the throttle) and a signal wake-up (SIGTERM,
# SIGINT, SIGHUP), so it resumes the target at once in either case, stop phase or not. Its guardian, a
# forked child in its own session, waits for the end of a pipe only the watchdog holds and resumes the
# target if the watchdog dies by any means, SIGKILL included.
_WATCHDOG = r"""
import os, select, signal, sys
_, _marker, pid, parent, on_s, off_s, lifeline = sys.argv
pid, parent, lifeline, on_s, off_s = int(pid), int(parent), int(lifeline), float(on_s), float(off_s)

def send(sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass

def gone(p):
    try:
        os.kill(p, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    try:
        with open("/proc/%d/stat" % p, "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return False

guard_r, guard_w = os.pipe()
guardian = os.fork()
if guardian == 0:
    try:
        os.setsid()
        os.close(guard_w)
        os.close(lifeline)
        os.read(guard_r, 1)  # returns at the watchdog's end, however it came
        send(signal.SIGCONT)
    finally:
        os._exit(0)
os.close(guard_r)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, lambda *_: None)

def stop_now(seconds):
    ready = select.select([lifeline, wake_r], [], [], seconds)[0]
    return bool(ready) or gone(pid) or gone(parent)

try:
    while not stop_now(on_s):
        send(signal.SIGSTOP)
        if stop_now(off_s):
            break
        send(signal.SIGCONT)
finally:
    send(signal.SIGCONT)
    os.close(guard_w)
    os.waitpid(guardian, 0)
"""


@dataclass
class CpuThrottle:
    """A running throttle of one process to ``speed`` x ``cpus`` CPUs. Use as a context manager.

    ``group`` is the cgroup directory holding the quota (cgroup methods), ``cgroup`` the
    :class:`~hwtopo.cgroups.CGroup` it belongs to.
    """

    pid: int
    speed: float
    cpus: float
    method: str  # "cgroup-v1", "cgroup-v2", "duty-cycle" or "none" (speed >= 1)
    group: Path | None = None
    cgroup: CGroup | None = None
    _watchdog: subprocess.Popen | None = None
    _lifeline: int | None = None  # the write end the watchdog waits on; closing it stops the watchdog
    closed: bool = False
    creator: int = field(default_factory=os.getpid)

    def describe(self) -> dict:
        return {"emulated": True, "pid": self.pid, "speed": self.speed, "cpus": self.cpus, "method": self.method}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._watchdog is not None:
            self._stop_watchdog(self._watchdog)
        if self.cgroup is not None:
            self.cgroup.close()
        with _lock:
            _throttles.pop(id(self), None)

    def _stop_watchdog(self, watchdog: subprocess.Popen) -> None:
        if self._lifeline is not None:
            os.close(self._lifeline)  # the watchdog resumes the process and exits
            self._lifeline = None
        try:
            watchdog.wait(timeout=5)
        except subprocess.TimeoutExpired:
            watchdog.kill()  # its guardian resumes the process
            watchdog.wait()
        if pid_alive(self.pid):
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def __enter__(self) -> CpuThrottle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def throttle(
    pid: int | None = None,
    speed: float = 1.0,
    cpus: float = 1.0,
    method: str = "auto",
    period_s: float | None = None,
) -> CpuThrottle:
    """Run process ``pid`` (default: this process) at ``speed`` of ``cpus`` CPUs.

    method: "auto" (cgroup when writable, else duty-cycle), "cgroup" or "duty-cycle". The
    duty-cycle watchdog cannot stop the process that started it, so for ``pid == os.getpid()`` it
    runs as a separate process either way. ``period_s`` is the enforcement period (cgroup default
    0.1 s, duty-cycle default 0.02 s); shorter periods make sub-second phases of a slow process less
    jittery at a little more overhead.
    """
    if not 0 < speed:
        raise ValueError(f"speed must be > 0, not {speed!r}")
    if cpus <= 0:
        raise ValueError(f"cpus must be > 0, not {cpus!r}")
    if period_s is not None and not 0.001 <= period_s <= 1.0:
        raise ValueError(f"period_s must be between 0.001 and 1.0 seconds, not {period_s!r}")
    if method not in ("auto", "cgroup", "duty-cycle"):
        raise ValueError(f"method must be 'auto', 'cgroup' or 'duty-cycle', not {method!r}")
    pid = os.getpid() if pid is None else pid
    if speed >= 1.0:
        return CpuThrottle(pid, speed, cpus, "none")
    t = None
    if method in ("auto", "cgroup"):
        t = _cgroup_throttle(pid, speed, cpus, period_s, strict=method == "cgroup")
    if t is None:
        t = _duty_cycle(pid, speed, cpus, period_s)
    with _lock:
        _throttles[id(t)] = t
    return t


def _cgroup_throttle(pid: int, speed: float, cpus: float, period_s: float | None, strict: bool) -> CpuThrottle | None:
    """A CPU quota of ``speed * cpus`` cores in a new cgroup; None (or raise, if ``strict``) where it fails."""
    if not cgroup_available():
        if strict:
            raise RuntimeError("no writable cgroup cpu controller here (need root and cgroup v1 cpu or v2 cpu.max)")
        return None
    try:
        cg = CGroup(quota_cores=speed * cpus, period_s=period_s, strict=True)
        try:
            cg.add(pid)
        except OSError:
            cg.close()
            raise
    except (OSError, RuntimeError):
        if strict:
            raise
        log.warning("cgroup set-up failed; falling back to a duty-cycle throttle", exc_info=True)
        return None
    return CpuThrottle(pid, speed, cpus, f"cgroup-v{cg.version('cpu')}", group=cg.paths["cpu"], cgroup=cg)


def _duty_cycle(pid: int, speed: float, cpus: float, period_s: float | None) -> CpuThrottle:
    """Run ``speed`` of each period, stopped for the rest. Only exact for a 1-CPU process."""
    period = 0.02 if period_s is None else period_s
    on_s, off_s = speed * period, (1 - speed) * period
    r, w = os.pipe()
    try:
        wd = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WATCHDOG,
                WATCHDOG_MARKER,
                str(pid),
                str(os.getpid()),
                repr(on_s),
                repr(off_s),
                str(r),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # outliving the creator by a moment, it must not hold its pipes
            stderr=subprocess.DEVNULL,
            pass_fds=(r,),
            start_new_session=True,
        )
    except BaseException:
        os.close(w)
        raise
    finally:
        os.close(r)
    return CpuThrottle(pid, speed, cpus, "duty-cycle", _watchdog=wd, _lifeline=w)


close_owned_at_exit(_throttles, _lock)


def _as_float(value) -> float:
    """``float(value)``, or NaN where it is not a number (so every range check rejects it)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _check_speed(speed) -> float:
    v = _as_float(speed)
    if not (0.0 < v <= 1.0):  # also rejects NaN
        raise ValueError(f"speed must be a relative speed in (0, 1] (1.0 = this CPU), not {speed!r}")
    return v


class Dilation:
    """Emulate a CPU ``speed`` times as fast by dilating compute at synchronisation points.

    Call :meth:`sync_point` (from the thread that created it) right before every point where the
    process meets another (a collective, a send/receive, the end of a timed region). It sleeps
    ``(1/speed - 1)`` x the thread CPU time (``clock``, default ``time.thread_time``) used since the
    previous call, so a compute segment of c CPU-seconds takes c / speed of wall time. Debts shorter
    than ``min_sleep_s`` are carried to the next point; a sleep that overshoots (timer slack) is
    credited against the next debt, at most ``max_credit_s``, so being descheduled by another program
    is not paid back with undilated compute. ``runqueue`` returns the thread's cumulative seconds spent
    runnable but waiting for a CPU (default: read from ``/proc/self/task/<tid>/schedstat`` where it
    exists, else not used); such a wait during a compute segment already slowed the segment down and is
    taken off its debt. Call :meth:`resume` when the blocking call after a sync point returns: a wait
    for a CPU while waking up inside the collective belongs to the collective (it is waiting, measured
    as such) and must not shorten the next compute segment. Only the process and thread that created
    it are dilated (a forked child is not). ``clock``, ``sleep``, ``wall`` and ``runqueue`` are
    injectable for tests.
    Labelled emulated: ``describe()["method"] == "dilation"``.
    """

    method = "dilation"

    def __init__(
        self,
        speed: float,
        min_sleep_s: float = 1e-4,
        max_credit_s: float = 1e-3,
        clock=time.thread_time,
        sleep=time.sleep,
        wall=time.perf_counter,
        runqueue="auto",
    ) -> None:
        self.speed = _check_speed(speed)
        self.min_sleep_s = _check_seconds("min_sleep_s", min_sleep_s)
        self.max_credit_s = _check_seconds("max_credit_s", max_credit_s)
        self.factor = 1.0 / self.speed - 1.0
        self._clock, self._sleep, self._wall = clock, sleep, wall
        self.thread_id = threading.get_ident()
        self.pid = os.getpid()
        self.debt_s = 0.0  # sleep owed (negative: credit from an overshooting sleep)
        self.cpu_s = 0.0  # thread CPU seconds seen at sync points
        self.slept_s = 0.0
        self.points = 0
        self.runqueue_s = 0.0  # waited for a CPU, taken off the debts
        self.closed = False
        self._runqueue = _schedstat_reader() if runqueue == "auto" else runqueue
        # the schedstat file is closed once: by close(), or when the dilation is garbage-collected
        closer = getattr(self._runqueue, "close", None)
        self._release = weakref.finalize(self, closer) if closer is not None else None
        self._mark = clock()
        self._rq_mark = self._runqueue() if self._runqueue is not None else 0.0

    def _mine(self) -> bool:
        """True on the creating thread of the creating process (not after a fork, not on other threads)."""
        return not self.closed and threading.get_ident() == self.thread_id and os.getpid() == self.pid

    def sync_point(self) -> float:
        """Pay the dilation owed for the CPU used since the last point; returns the seconds slept."""
        if not self._mine():
            return 0.0
        now = self._clock()
        used = max(0.0, now - self._mark)
        self.cpu_s += used
        self.points += 1
        self.debt_s += used * self.factor
        self._mark = now
        if self._runqueue is not None:
            rq = self._runqueue()
            waited = max(0.0, rq - self._rq_mark)
            self._rq_mark = rq
            self.runqueue_s += waited
            self.debt_s = max(self.debt_s - waited, -self.max_credit_s)
        if self.debt_s < self.min_sleep_s:
            return 0.0
        t0 = self._wall()
        self._sleep(self.debt_s)
        slept = max(0.0, self._wall() - t0)
        self.debt_s = max(self.debt_s - slept, -self.max_credit_s)
        self.slept_s += slept
        self._mark = self._clock()  # the sleep call's own CPU is not compute to dilate
        if self._runqueue is not None:  # waking up from the sleep is in the overshoot already
            self._rq_mark = self._runqueue()
        return slept

    def resume(self) -> None:
        """Mark the return from the blocking call that followed a sync point.

        Time spent waiting for a CPU until now (e.g. woken inside the collective while another process
        held the core) belongs to the wait, not to the next compute segment, so it is not credited.
        """
        if self._mine() and self._runqueue is not None:
            self._rq_mark = self._runqueue()

    def reset(self) -> None:
        """Forget the CPU used since the last point (e.g. after set-up that should not be dilated)."""
        self._mark = self._clock()
        if self._runqueue is not None:
            self._rq_mark = self._runqueue()
        self.debt_s = 0.0

    def describe(self) -> dict:
        return {
            "emulated": True,
            "method": self.method,
            "speed": self.speed,
            "cpu_s": self.cpu_s,
            "slept_s": self.slept_s,
            "runqueue_wait_s": self.runqueue_s if self._runqueue is not None else None,
            "sync_points": self.points,
        }

    def close(self) -> None:
        """Stop dilating; uninstalls it if it is the process-wide dilation."""
        global _dilation
        self.closed = True
        if self._release is not None:
            self._release()  # the schedstat file this dilation opened (a no-op the second time)
        with _lock:
            if _dilation is self:
                _dilation = None

    def __enter__(self) -> Dilation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_dilation: Dilation | None = None


def _check_seconds(field: str, value) -> float:
    v = _as_float(value)
    if not v >= 0:  # also rejects NaN
        raise ValueError(f"{field} must be a number of seconds >= 0, not {value!r}")
    return v


class _SchedstatReader:
    """Called, gives the runqueue wait read from an open schedstat descriptor; ``close()`` once."""

    def __init__(self, fd: int, last: float) -> None:
        self._fd, self._open, self._last = fd, True, last

    def __call__(self) -> float:
        if self._open:
            try:
                self._last = int(os.pread(self._fd, 128, 0).split()[1]) * 1e-9
            except (OSError, ValueError, IndexError):
                pass  # keep the last reading: the wait never goes backwards
        return self._last

    def close(self) -> None:
        if self._open:  # once: the descriptor number may be reused after it is closed
            self._open = False
            try:
                os.close(self._fd)
            except OSError:
                pass


def _schedstat_reader(path: str | None = None) -> _SchedstatReader | None:
    """A function giving the calling thread's cumulative runqueue wait in seconds, or None if unavailable.

    ``/proc/<pid>/task/<tid>/schedstat`` holds: time on a CPU, time runnable but waiting for one (both
    in ns), timeslices. Where scheduler statistics are compiled in but switched off it reads zeros;
    then the reader is unavailable (None), not a measured zero.
    """
    path = path or f"/proc/self/task/{threading.get_native_id()}/schedstat"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fields = os.pread(fd, 128, 0).split()
        on_cpu = int(fields[0])
        int(fields[1])
    except (OSError, ValueError, IndexError):
        os.close(fd)
        return None
    if on_cpu == 0:  # this thread has run Python code, so zero means statistics are off
        os.close(fd)
        return None
    return _SchedstatReader(fd, int(fields[1]) * 1e-9)


def dilate(speed: float, **kwargs) -> Dilation:
    """Install a process-wide :class:`Dilation` at ``speed`` (replacing any), measured on the calling thread.

    Use as a context manager or ``close()`` it. :func:`sync_point` anywhere in the process then pays
    its debts; with no dilation installed :func:`sync_point` does nothing.
    """
    global _dilation
    d = Dilation(speed, **kwargs)
    with _lock:
        old, _dilation = _dilation, d
    if old is not None:
        old.close()
    return d


def undilate() -> Dilation | None:
    """Remove the process-wide dilation; returns it (None if there was none)."""
    d = _dilation
    if d is not None:
        d.close()
    return d


def current_dilation() -> Dilation | None:
    """The installed process-wide dilation, or None."""
    return _dilation


def sync_point() -> float:
    """Mark a synchronisation point: the installed dilation sleeps what it owes (a no-op without one)."""
    d = _dilation
    return 0.0 if d is None else d.sync_point()


def resume_point() -> None:
    """Mark the return from the blocking call after a :func:`sync_point` (a no-op without a dilation)."""
    d = _dilation
    if d is not None:
        d.resume()


class TokenBucket:
    """Bytes leave at ``rate`` bytes/s with bursts up to ``burst`` bytes. Thread-safe."""

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float | None = None):
        if rate_bytes_per_s <= 0:
            raise ValueError("rate_bytes_per_s must be > 0")
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst_bytes if burst_bytes is not None else max(1500.0, self.rate * 0.01))
        self._tokens = self.burst
        self._t = time.monotonic()
        self._lock = threading.Lock()

    def reserve(self, nbytes: float) -> float:
        """Take ``nbytes`` of tokens (going into debt) and return how long the caller must wait."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
            self._t = now
            self._tokens -= nbytes
            return max(0.0, -self._tokens / self.rate)

    def consume(self, nbytes: float) -> float:
        wait = self.reserve(nbytes)
        if wait > 0:
            time.sleep(wait)
        return wait


class LinkShaper:
    """Delays transfers as a link would: latency + bytes through a token bucket at its bandwidth."""

    def __init__(
        self, link: Link | None = None, bandwidth_bytes_per_s: float | None = None, latency_s: float | None = None
    ):
        bw = (
            bandwidth_bytes_per_s
            if bandwidth_bytes_per_s is not None
            else (link.bandwidth_bytes_per_s if link else None)
        )
        if bw is None:
            raise ValueError("LinkShaper needs a link or bandwidth_bytes_per_s")
        self.latency_s = latency_s if latency_s is not None else (link.latency_s if link else 0.0)
        self.bandwidth_bytes_per_s = bw
        self.bucket = TokenBucket(bw)
        self.bytes_sent = 0

    def delay_s(self, nbytes: float) -> float:
        """Seconds this transfer must take (reserves bandwidth; does not sleep)."""
        self.bytes_sent += int(nbytes)
        return self.latency_s + self.bucket.reserve(nbytes)

    def transfer(self, nbytes: float) -> float:
        """Block for the time the transfer would take on the link; returns the seconds waited."""
        d = self.delay_s(nbytes)
        if d > 0:
            time.sleep(d)
            resume_point()  # under a dilation, waking up late belongs to the transfer, not the next compute
        return d

    def describe(self) -> dict:
        return {"emulated": True, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "latency_s": self.latency_s}


class ShapedWriter:
    """A file-like wrapper whose writes leave at a link's bandwidth (latency once per write)."""

    def __init__(self, raw, shaper: LinkShaper, chunk: int = 16 << 10):
        self.raw = raw
        self.shaper = shaper
        self.chunk = chunk

    def write(self, data: bytes) -> int:
        mv = memoryview(data)
        first = True
        for off in range(0, len(mv), self.chunk):
            piece = mv[off : off + self.chunk]
            wait = self.shaper.bucket.reserve(len(piece)) + (self.shaper.latency_s if first else 0.0)
            first = False
            if wait > 0:
                time.sleep(wait)
            self.raw.write(piece)
        self.shaper.bytes_sent += len(mv)
        return len(mv)

    def flush(self) -> None:
        if hasattr(self.raw, "flush"):
            self.raw.flush()

    def close(self) -> None:
        self.raw.close()
