"""xronos's ranks on ``hwtopo.launch``: each pinned to a CPU and slowed to its emulated speed.

``hwtopo.launch.spawn`` starts the ranks, joins them (gloo: the shards are CPU tensors), kills them
with the launcher and names the rank that failed first. What is xronos's own is the per-rank setup
(:class:`RankSetup`): pin rank r to ``cpus[r]`` and emulate ``speeds[r]``, ``emulate="dilate"``
(default) with ``hwtopo.dilate`` (the rank computes at full speed and sleeps ``(1/speed - 1)`` x its
thread CPU time at every synchronisation point: collectives, sends and receives, the ends of timed
regions call ``hwtopo.sync_point()``, so every compute segment is steadily ``1/speed`` as long) or
``emulate="cgroup"`` with the CPU quota of ``hwtopo.throttle``; and the workers' malloc settings
(:data:`WORKER_ENV`). Worker functions return plain data (dicts, lists, numbers, tensors).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hwtopo import launch as _launch
from hwtopo.launch import free_port

__all__ = [
    "WorkerError",
    "RankSetup",
    "spawn",
    "worker_env",
    "free_port",
    "init_from_env",
    "emulate_speed",
    "pin_ranks",
    "busy_cpus",
    "EMULATIONS",
    "emulation_label",
]

WorkerError = _launch.RankError  # a rank failed, died or timed out; its message names the rank
BACKEND = "gloo"  # shards and activations are CPU tensors; $MLSYSKIT_BACKEND still overrides

# cgroup quota period for emulated slow ranks. hwtopo uses 100 ms; a TP step synchronises every few
# milliseconds, so a long period turns a steady 0.5x into bursts of full speed and full stops. Shorter
# is not better either: the kernel hands out CPU time to a group in slices of a few ms, and a 0.5-core
# quota measured 0.27x at a 2 ms period and 0.4x at 5 ms, but 0.48-0.52x at 10 ms and 20 ms.
THROTTLE_PERIOD_US = 10_000
MIN_QUOTA_US = 1_000


def throttle_period_us(speed: float) -> int:
    """The cgroup period for ``speed``: THROTTLE_PERIOD_US, longer where the quota would be under 1 ms.

    ``XRONOS_THROTTLE_PERIOD_US`` overrides it (a fixed period for every throttled rank, for studying
    how the emulation's granularity shows up in the waits).
    """
    fixed = os.environ.get("XRONOS_THROTTLE_PERIOD_US")
    base = int(fixed) if fixed else THROTTLE_PERIOD_US
    return max(base, int(math.ceil(MIN_QUOTA_US / speed)))


# glibc malloc for the workers: keep freed memory in the heap instead of returning it to the kernel
# (mmap/munmap of every large activation, trimming the heap top). Otherwise each training step
# re-faults thousands of fresh pages (1.7k-28k minor faults a step measured on the bench's model), and
# in a VM that returns freed pages to the host each fault is slow and uneven: step-to-step jitter of
# the compute between two synchronisations. Applies to every rank and so to every variant alike;
# an explicit GLIBC_TUNABLES in the environment wins.
WORKER_ENV = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296"}


def worker_env() -> dict:
    """The environment entries :func:`spawn` adds to its workers (those not already set here)."""
    return {k: v for k, v in WORKER_ENV.items() if k not in os.environ}


def init_from_env(timeout_s: float = 60.0) -> tuple[int, int]:
    """One rank of ``torchrun`` (or of ``hwtopo.launch.spawn(init_group=False)``) joins gloo; (rank, world)."""
    return _launch.init_from_env(BACKEND, timeout_s)


EMULATIONS = ("auto", "dilate", "cgroup")


def check_emulation(emulate: str) -> str:
    """``emulate`` checked, with ``auto`` resolved (cgroup quota where writable, else dilation)."""
    if emulate not in EMULATIONS:
        raise ValueError(f"emulate must be one of {', '.join(EMULATIONS)}, not {emulate!r}")
    from .emulation import resolve_method

    return resolve_method(emulate)


def emulation_label(emulate: str) -> str:
    """What every table and JSON says: 'dilation' (hwtopo.dilate) or 'cgroup' (hwtopo.throttle's quota)."""
    return "dilation" if check_emulation(emulate) == "dilate" else "cgroup"


def emulate_speed(speed: float, emulate: str = "dilate", prioritise: bool = False):
    """Make this process run at ``speed`` of one CPU (emulated); an object with ``close()``, or None.

    ``dilate``: a process-wide ``hwtopo.Dilation`` measured on the calling thread (call this from the
    thread that computes) that charges CPU waits as compute (:func:`xronos.emulation.dilate_wall`);
    ``cgroup``: a CPU quota with a short period at top priority (:class:`xronos.emulation.RankQuota`);
    ``auto``: cgroup where writable. ``prioritise``: under cgroup, a full-speed rank also gets its own
    top-priority group (a quota of one core), so it is not the only rank that other programs slow.
    """
    emulate = check_emulation(emulate)
    if speed >= 1.0 and not (prioritise and emulate == "cgroup"):
        return None
    from .emulation import RankQuota, dilate_wall

    if emulate == "dilate":
        return dilate_wall(speed)
    # the shortest period whose quota is still >= the kernel's 1 ms minimum: finer-grained slices;
    # no silent duty-cycle fallback under a 'cgroup' label (hwtopo names what is missing)
    speed = min(speed, 1.0)
    return RankQuota(speed, throttle_period_us(speed) / 1e6)


def pin_ranks(shares: list[float], cpus: list[int] | None = None) -> list[int] | None:
    """A CPU for each rank such that no CPU carries more than one CPU's worth of quota, or None.

    First-fit decreasing over this process's allowed CPUs: an emulated rank pinned to its own core (or
    sharing one with ranks whose quotas fit beside it) is never pushed off by another rank's threads,
    so its speed is the quota, not the quota minus contention. None when the shares do not fit.
    """
    avail = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
    load = {c: 0.0 for c in avail}
    out: list[int | None] = [None] * len(shares)
    for r in sorted(range(len(shares)), key=lambda r: -shares[r]):
        cpu = next((c for c in avail if load[c] + shares[r] <= 1.0 + 1e-9), None)
        if cpu is None:
            return None
        load[cpu] += shares[r]
        out[r] = cpu
    return out  # type: ignore[return-value]


def busy_cpus(window_s: float = 1.0) -> float:
    """CPUs kept busy by all programs over the next ``window_s`` seconds (sampled with psutil).

    A sample over a short window, not the 1-minute load average: right after other programs stop
    the load average still reads high.
    """
    import psutil

    return psutil.cpu_percent(interval=window_s) / 100.0 * (psutil.cpu_count() or 1)


@dataclass(frozen=True)
class RankSetup:
    """What every xronos rank does before it joins: take its CPU, then slow itself to its speed.

    Called as ``setup(rank)`` in the rank's main thread (the one that computes, which the dilation
    measures); returns the emulation to ``close()`` at the end, or None at full speed.
    """

    speeds: tuple[float, ...]
    cpus: tuple[int, ...] | None = None
    emulate: str = "dilate"

    def __call__(self, rank: int):
        if self.cpus is not None:
            os.sched_setaffinity(0, {self.cpus[rank]})
        return emulate_speed(self.speeds[rank], self.emulate, prioritise=min(self.speeds) < 1.0)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    speeds: Sequence[float] | None = None,
    timeout_s: float = 600.0,
    pg_timeout_s: float = 60.0,
    cpus: Sequence[int] | None = None,
    emulate: str = "dilate",
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; each rank's return value.

    ``speeds[r]``: rank r's emulated speed (default 1.0 for all), ``emulate``: how a rank with
    ``speeds[r] < 1`` is slowed ("dilate" or "cgroup", see the module doc); ``cpus``: pin rank r to
    CPU ``cpus[r]`` (see :func:`pin_ranks`), None leaves placement to the OS. A failure raises
    :data:`WorkerError` naming the rank that failed first.
    """
    emulate = check_emulation(emulate)
    speeds = tuple(speeds) if speeds is not None else (1.0,) * world_size
    if len(speeds) != world_size:
        raise ValueError(f"speeds has {len(speeds)} entries but world_size is {world_size}")
    if cpus is not None and len(cpus) != world_size:
        raise ValueError(f"cpus has {len(cpus)} entries but world_size is {world_size}")
    setup = RankSetup(speeds, None if cpus is None else tuple(cpus), emulate)
    return _launch.spawn(
        fn,
        world_size,
        tuple(args),
        threads=1,
        backend=BACKEND,
        timeout_s=timeout_s,
        pg_timeout_s=pg_timeout_s,
        setup=setup,
        env=worker_env(),
    )
