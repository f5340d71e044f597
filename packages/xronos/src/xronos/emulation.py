"""Emulated device speeds that are checked, not assumed.

An emulated slow rank is slowed by a cgroup CPU quota where a writable cgroup cpu controller exists
(the quota binds whatever else runs on the machine), and otherwise by compute dilation that charges
*wall* time: a compute segment that took ``c`` CPU seconds plus ``q`` seconds waiting for a CPU owes
``(1/speed - 1) * (c + q)`` of sleep, so a busy machine slows the emulated device in proportion, as it
slows a real one. (hwtopo's default dilation credits ``q`` against the debt instead, which lets a
loaded slow rank sleep less than it owes and run at up to the fast rank's speed.)

Whatever the method, every run measures what it achieved: all ranks run the same calibrated compute
kernel at the same moment under their emulation (:func:`measure_kernel`), and :func:`check_speeds`
compares each rank's speed relative to the fastest requested rank with what was asked. A rank off by
more than :data:`TOLERANCE` makes the run invalid.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

import hwtopo
from hwtopo import resume_point, sync_point

__all__ = [
    "TOLERANCE",
    "resolve_method",
    "wall_clock",
    "dilate_wall",
    "measure_kernel",
    "check_speeds",
    "RankQuota",
    "cgroup_cpu",
]

TOLERANCE = 0.10  # a rank whose achieved relative speed is off its requested one by more is invalid
KERNEL_SIZE = 128  # square fp32 matrices: a GEMM like the model's, small enough to stay in cache
KERNEL_REPEATS = 1600  # ~55 ms at full speed on one core: 5+ cgroup periods, a quota's phase ~5 % at most


def resolve_method(emulate: str) -> str:
    """``auto`` -> ``cgroup`` where a writable cgroup cpu controller exists, else ``dilate``."""
    if emulate != "auto":
        return emulate
    return "cgroup" if hwtopo.cgroup_available() else "dilate"


def _schedstat_path() -> str:
    return f"/proc/self/task/{threading.get_native_id()}/schedstat"


def wall_clock(path: str | None = None) -> Callable[[], float]:
    """A clock for the calling thread: CPU seconds plus seconds spent runnable but waiting for a CPU.

    Read from the thread's ``schedstat`` (on-CPU and run-queue nanoseconds); where that file is missing
    or reads no CPU time (statistics switched off), the thread's CPU time alone.
    """
    path = path or _schedstat_path()
    try:
        with open(path, "rb") as f:
            on_cpu = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        on_cpu = 0
    if on_cpu == 0:
        return time.thread_time

    def clock() -> float:
        with open(path, "rb") as f:
            fields = f.read().split()
        return (int(fields[0]) + int(fields[1])) * 1e-9

    return clock


def dilate_wall(speed: float, clock: Callable[[], float] | None = None) -> hwtopo.Dilation:
    """Install a process-wide dilation at ``speed`` whose debt grows with compute *and* CPU waits.

    ``runqueue=None``: nothing is taken off the debt; the wait is in the clock instead, so it is owed
    ``(1/speed - 1)`` times over like the compute it delayed.
    """
    return hwtopo.dilate(speed, clock=clock or wall_clock(), runqueue=None)


def _kernel(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    """Seconds for ``repeats`` GEMMs, the rank's emulation paid inside the timed region."""
    sync_point()
    resume_point()
    t0 = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    sync_point()  # dilation owed for the kernel is paid before the clock stops
    return time.perf_counter() - t0


def measure_kernel(group=None, repeats: int = KERNEL_REPEATS) -> list[float]:
    """Every rank's time for the same calibrated kernel, run at the same moment; a collective call.

    The ranks meet at a barrier first, so each runs its kernel under the same machine load as the
    others. Returns the seconds of every rank (index = rank in ``group``).
    """
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(KERNEL_SIZE, KERNEL_SIZE, generator=gen)
    b = torch.randn(KERNEL_SIZE, KERNEL_SIZE, generator=gen)
    torch.mm(a, b)  # first call allocates; not part of the measurement
    if not (dist.is_available() and dist.is_initialized()):
        return [_kernel(a, b, repeats)]
    sync_point()
    dist.barrier(group=group)
    resume_point()
    mine = torch.tensor([_kernel(a, b, repeats)], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    resume_point()
    return [float(t) for t in every]


def check_speeds(requested: Sequence[float], seconds: Sequence[Sequence[float]], tolerance: float = TOLERANCE) -> dict:
    """Achieved vs requested relative speeds from kernel timings ``seconds[sample][rank]``.

    A rank's achieved speed is the fastest-requested rank's median kernel time over its own, per
    sample (the ranks ran that sample together), then the median over samples; requested is
    ``requested[r] / max(requested)``. Valid when every rank is within ``tolerance`` of its request.
    """
    if not requested or any(not v > 0 for v in requested):
        raise ValueError(f"requested must list speeds > 0, not {list(requested)}")
    if not seconds or any(len(s) != len(requested) or min(s) <= 0 for s in seconds):
        raise ValueError(f"seconds must hold one positive time per rank ({len(requested)}) in every sample")
    ref = max(range(len(requested)), key=lambda r: requested[r])
    want = [v / requested[ref] for v in requested]
    got = [statistics.median(s[ref] / s[r] for s in seconds) for r in range(len(requested))]
    off = [g / w - 1.0 for g, w in zip(got, want)]
    bad = [r for r, o in enumerate(off) if abs(o) > tolerance]
    return {
        "valid": not bad,
        "requested_relative_speeds": want,
        "achieved_relative_speeds": got,
        "off_by": off,
        "invalid_ranks": bad,
        "tolerance": tolerance,
        "samples": len(seconds),
    }


PRIORITY_SHARES = 262_144  # cgroup v1's largest cpu.shares (v2: weight 10000)


class RankQuota:
    """This process in its own cgroup: a CPU quota of ``speed`` cores per ``period_s``, at top priority.

    The quota caps the rank at its emulated speed (none at speed 1.0); the top ``cpu.shares`` makes the
    kernel give it that much before other programs on its CPU, so the cap is also what it gets on a
    busy machine (a quota alone only caps: under load a rank got less and the fast/slow ratio drifted).
    """

    method = "cgroup"

    def __init__(self, speed: float, period_s: float) -> None:
        if not 0 < speed <= 1:
            raise ValueError(f"speed must be in (0, 1], not {speed!r}")
        self.speed, self.period_s = speed, period_s
        self.cgroup = hwtopo.CGroup(
            "xronos",
            quota_cores=speed if speed < 1 else None,
            period_s=period_s,
            shares=PRIORITY_SHARES,
            strict=True,
        )
        try:
            self.cgroup.add(os.getpid())
        except OSError:
            self.cgroup.close()
            raise

    def describe(self) -> dict:
        return {"emulated": True, "method": self.method, "speed": self.speed, "period_s": self.period_s}

    def close(self) -> None:
        self.cgroup.close()


def cgroup_cpu(pid: int | None = None) -> dict | None:
    """Quota (cores) and shares of the cgroup v1 ``cpu`` group holding ``pid`` (default: this process).

    None where the process sits in no v1 cpu group below the root, or nothing can be read.
    """
    member = hwtopo.cgroups.cpu_group_of(os.getpid() if pid is None else pid)
    if member is None or member[1] == "/":
        return None
    base = f"/sys/fs/cgroup/{','.join(sorted(member[0]))}{member[1]}"
    try:
        quota = int(open(f"{base}/cpu.cfs_quota_us").read())
        period = int(open(f"{base}/cpu.cfs_period_us").read())
        shares = int(open(f"{base}/cpu.shares").read())
    except (OSError, ValueError):
        return None
    return {"quota_cores": quota / period if quota > 0 else None, "shares": shares}
