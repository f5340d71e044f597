"""CPU-aware tool admission (the paper's first mechanism).

A tool run whose learned CPU intensity (CPU seconds per uncontended wall second, from the monitor's
characterization) is at least the learned ``heavy_threshold`` and whose learned CPU time is at
least the learned ``cost_threshold`` is *CPU-heavy* (short tools pass: holding them back costs
more latency than their few milliseconds of CPU take from others). Heavy runs are admitted into
their core set while the demand of the heavy runs already admitted there, plus the new run's
(its intensity times the threads it is told), fits the set's cores; past the cores, only while the
``scale`` the runtime sets (how much of a core our runs really get against other tenants, measured
online) leaves room *and* the system is not under CPU pressure that we add: PSI ``cpu some`` over
the last tick below the pressure seen while none of our heavy runs ran (other tenants' share,
tracked online) plus the learned ``pressure_margin``, and the runnable count no more than
``runnable_margin`` above the runnable count seen then. A set where nothing heavy of ours runs
always admits (other tenants can delay us but never stall us).

Under CFS, n CPU-bound runs on m < n cores all progress at m/n speed and all finish late; holding
the heavy runs beyond the cores turns that processor sharing into run-to-completion, which cuts
their mean latency without costing throughput. Waiters are served closest-to-done first: the
waiter whose request has already had the most heavy runs admitted (it has the least heavy work
left; shortest-remaining-work order minimises mean latency), then the oldest. Waiting is bounded,
so no request starves: a waiter older than ``max_wait_s`` is admitted regardless. Light runs are
admitted at once and tracked but do not count against the cores: the runtime gives them a higher
CPU weight, so they take a core for their few milliseconds instead of queueing behind heavy runs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .monitor import PressureSnapshot

__all__ = ["AdmissionPolicy", "CpuAdmission", "Ticket"]

log = logging.getLogger(__name__)


@dataclass
class AdmissionPolicy:
    """Thresholds of admission; ``learn`` derives them from characterized tool profiles."""

    heavy_threshold: float = 0.5
    cost_threshold: float = 0.0
    pressure_margin: float = 0.3
    runnable_margin: int = 4
    overcommit: float = 1.0
    max_wait_s: float = 30.0
    source: str = "default"

    @classmethod
    def learn(cls, profiles, cores: int) -> AdmissionPolicy:
        """Thresholds from a ``ProfileStore``: split of tool intensities, pressure seen alone, tool times."""
        from .allocation import split_threshold

        intens = [p.cpu_intensity for p in profiles.tools.values() if p.n]
        thr = split_threshold(intens) if len(intens) >= 2 else 0.5
        costs = [p.cpu_s for p in profiles.tools.values() if p.n]
        cost_thr = split_threshold(costs, lo=0.02, hi=2.0) if len(costs) >= 2 else 0.0
        heavy = [p.wall_s for p in profiles.tools.values() if p.n and p.cpu_intensity >= thr and p.cpu_s >= cost_thr]
        # waiting bound: long enough to queue behind several of the longest heavy runs per core
        # (shorter, and waiters are forced in while the cores are still full), never unbounded
        max_wait = min(300.0, max(5.0, 10 * max(heavy, default=2.0)))
        # pressure one run adds: the stall its own run-queue wait means, as a share of its wall time
        added = [p.cpu_pressure for p in profiles.tools.values() if p.n_alone]
        margin = min(0.6, max(0.15, 2 * (sum(added) / len(added)) if added else 0.3))
        return cls(
            heavy_threshold=thr,
            cost_threshold=cost_thr,
            pressure_margin=margin,
            runnable_margin=max(4, 4 * cores),
            overcommit=1.0,
            max_wait_s=max_wait,
            source="learned",
        )

    def heavy_tools(self, profiles) -> set[str]:
        """The ``task_type/tool`` keys of a ``ProfileStore`` that admission holds: CPU-bound and
        costly by these thresholds (what ``CpuAdmission.is_heavy`` says of a profiled tool)."""
        return {
            k
            for k, p in profiles.tools.items()
            if p.n and p.cpu_intensity >= self.heavy_threshold and p.cpu_s >= self.cost_threshold
        }

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(eq=False)
class Ticket:
    request_id: str
    key: str
    core_set: str
    intensity: float
    heavy: bool
    cost_s: float
    demand: float  # cores it is expected to take while it runs (counted in the load)
    seq: int
    t_arrive: float
    t_admit: float | None = None
    forced: bool = False
    crowded: bool = False  # heavy runs past the cores were admitted while it ran
    _fut: asyncio.Future | None = field(default=None, repr=False)

    @property
    def waited_s(self) -> float:
        return (self.t_admit or time.monotonic()) - self.t_arrive


class CpuAdmission:
    """Admission controller; one per runtime. ``async with adm.admit(...) as ticket: run tool``."""

    def __init__(
        self,
        policy: AdmissionPolicy,
        capacity: dict[str, float],
        pressure: Callable[[], PressureSnapshot | None] | None = None,
        poll_s: float = 0.05,
    ):
        if not capacity or any(c <= 0 for c in capacity.values()):
            raise ValueError(f"capacity must map core sets to > 0 cores, not {capacity!r}")
        self.policy = policy
        self.capacity = dict(capacity)
        self.pressure = pressure or (lambda: None)
        self.poll_s = poll_s
        self.load: dict[str, float] = {k: 0.0 for k in capacity}  # every admitted run's demand
        self.heavy_load: dict[str, float] = {k: 0.0 for k in capacity}  # heavy runs' only: the gate
        self.running: dict[str, int] = {k: 0 for k in capacity}
        self.waiting: list[Ticket] = []
        self.served: dict[str, int] = {}  # heavy runs admitted per request
        # share of a core a run of ours gets (1.0: all of it); below 1, other tenants of equal
        # priority take part of each core, and admission may pass the cores while PSI allows
        self.scale = 1.0
        self.active: set[Ticket] = set()  # heavy runs admitted and not yet released
        self.held = 0  # heavy runs that had to wait
        self.held_by_pressure = 0  # dispatch rounds in which only PSI kept a waiter out
        self.log: list[Ticket] = []
        self._seq = itertools.count()
        self._poller: asyncio.Task | None = None
        self.forced = 0
        self.baseline_pressure: float | None = None  # cpu some while none of our runs runs
        self.baseline_runnable: float | None = None  # runnable tasks then (other tenants)

    # ---------------------------------------------------------------- decisions
    def _system_busy(self) -> bool:
        snap = self.pressure()
        if snap is None:
            return False
        base = self.baseline_pressure if self.baseline_pressure is not None else 0.0
        # when other tenants already saturate PSI, the limit passes 1.0: pressure cannot show our
        # increment any more and only the load accounting and runnable count gate
        limit = base + self.policy.pressure_margin
        base_run = self.baseline_runnable if self.baseline_runnable is not None else 1.0
        return snap.cpu_some >= limit or snap.runnable > base_run + self.policy.runnable_margin

    def track_baseline(self) -> None:
        """Fold the latest pressure into the neighbours' baseline, while no heavy run of ours runs."""
        if any(v > 0 for v in self.heavy_load.values()):
            return
        snap = self.pressure()
        if snap is None:
            return
        b = self.baseline_pressure
        self.baseline_pressure = snap.cpu_some if b is None else b + 0.3 * (snap.cpu_some - b)
        r = self.baseline_runnable
        self.baseline_runnable = float(snap.runnable) if r is None else r + 0.3 * (snap.runnable - r)

    def _fits(self, t: Ticket) -> bool:
        if not t.heavy:
            return True
        load = self.heavy_load[t.core_set]
        if load <= 0:
            return True  # nothing heavy of ours runs there: always make progress
        cores = self.capacity[t.core_set] * self.policy.overcommit
        if load + t.demand <= cores + 1e-9:
            return True
        if load + t.demand > cores / max(1 / 3, min(1.0, self.scale)) + 1e-9:
            return False
        busy = self._system_busy()
        self.held_by_pressure += busy
        return not busy

    def _grant(self, t: Ticket, forced: bool = False) -> None:
        t.t_admit = time.monotonic()
        t.forced = forced
        self.forced += forced
        self.load[t.core_set] += t.demand
        self.running[t.core_set] += 1
        if t.heavy:
            self.heavy_load[t.core_set] += t.demand
            self.served[t.request_id] = self.served.get(t.request_id, 0) + 1
            self.active.add(t)
            if self.heavy_load[t.core_set] > self.capacity[t.core_set] + 1e-9:
                # they now wait for each other: their run-queue wait no longer measures the neighbours
                for x in self.active:
                    x.crowded |= x.core_set == t.core_set
        self.log.append(t)
        if len(self.log) > 100_000:
            del self.log[:50_000]
        if t._fut is not None and not t._fut.done():
            t._fut.set_result(True)

    def _dispatch(self) -> None:
        """Admit waiters in fair order while they fit; force any waiter past the waiting bound."""
        now = time.monotonic()
        while self.waiting:
            overdue = [t for t in self.waiting if now - t.t_arrive >= self.policy.max_wait_s]
            if overdue:
                t = min(overdue, key=lambda x: x.seq)
                self.waiting.remove(t)
                self._grant(t, forced=True)
                continue
            progressed = False
            for cs in {t.core_set for t in self.waiting}:
                cands = [t for t in self.waiting if t.core_set == cs]
                # closest to done first: most heavy runs already admitted, then the oldest
                t = min(cands, key=lambda x: (-self.served.get(x.request_id, 0), x.seq))
                if self._fits(t):
                    self.waiting.remove(t)
                    self._grant(t)
                    progressed = True
            if not progressed:
                break
        if self.waiting and (self._poller is None or self._poller.done()):
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while self.waiting:
            await asyncio.sleep(self.poll_s)
            self.track_baseline()
            self._dispatch()

    # ---------------------------------------------------------------- API
    def is_heavy(self, intensity: float, cost_s: float | None = None) -> bool:
        cost_ok = cost_s is None or cost_s >= self.policy.cost_threshold
        return intensity >= self.policy.heavy_threshold and cost_ok

    async def acquire(
        self,
        request_id: str,
        key: str,
        core_set: str,
        intensity: float,
        cost_s: float = 0.0,
        demand: float | None = None,
    ) -> Ticket:
        """Wait for admission. ``intensity``/``cost_s`` decide heaviness; ``demand`` (default: the
        intensity) is the cores the run is expected to keep busy here, counted in the load."""
        if core_set not in self.capacity:
            raise ValueError(f"core_set {core_set!r} unknown; one of {sorted(self.capacity)}")
        self.track_baseline()
        d = intensity if demand is None else demand
        heavy = self.is_heavy(intensity, cost_s)
        t = Ticket(request_id, key, core_set, intensity, heavy, cost_s, d, next(self._seq), time.monotonic())
        t._fut = asyncio.get_running_loop().create_future()
        if not t.heavy:  # light runs: admitted at once, tracked, never held
            self._grant(t)
            return t
        self.waiting.append(t)
        self._dispatch()
        self.held += t.t_admit is None
        try:
            await t._fut
        except asyncio.CancelledError:
            if t in self.waiting:
                self.waiting.remove(t)
            elif t.t_admit is not None:
                self.release(t)
            raise
        return t

    def release(self, t: Ticket) -> None:
        self.load[t.core_set] = max(0.0, self.load[t.core_set] - t.demand)
        if t.heavy:
            self.heavy_load[t.core_set] = max(0.0, self.heavy_load[t.core_set] - t.demand)
            self.active.discard(t)
        self.running[t.core_set] -= 1
        self._dispatch()

    def admit(
        self,
        request_id: str,
        key: str,
        core_set: str,
        intensity: float,
        cost_s: float = 0.0,
        demand: float | None = None,
    ) -> _Slot:
        return _Slot(self, request_id, key, core_set, intensity, cost_s, demand)

    def stats(self) -> dict:
        waits = [t.waited_s for t in self.log]
        return {
            "admitted": len(self.log),
            "heavy_admitted": sum(t.heavy for t in self.log),
            "held": self.held,
            "held_by_pressure": self.held_by_pressure,
            "forced": self.forced,
            "scale": self.scale,
            "waiting": len(self.waiting),
            "max_wait_s": max(waits, default=0.0),
            "mean_wait_s": sum(waits) / len(waits) if waits else 0.0,
            "baseline_pressure": self.baseline_pressure,
            "baseline_runnable": self.baseline_runnable,
        }


class _Slot:
    def __init__(
        self, adm: CpuAdmission, request_id: str, key: str, core_set: str, intensity: float, cost_s: float, demand
    ):
        self.adm, self.args = adm, (request_id, key, core_set, intensity, cost_s, demand)
        self.ticket: Ticket | None = None

    async def __aenter__(self) -> Ticket:
        self.ticket = await self.adm.acquire(*self.args)
        return self.ticket

    async def __aexit__(self, *exc) -> None:
        if self.ticket is not None:
            self.adm.release(self.ticket)
