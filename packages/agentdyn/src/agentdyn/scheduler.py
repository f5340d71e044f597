"""Scheduling policies the runtime can run under: the baselines and the CPU-aware one.

* ``NativePolicy``: no control (every tool call runs at once, as agent frameworks do).
* ``StaticLimitPolicy``: at most ``workers`` requests in flight, default ``max(1, int(0.75 x
  cores))`` -- the common harness rule (SWE-bench ``max_workers``, LangGraph ``max_concurrency``).
* ``FairPolicy``: the fair baselines the bench divides by. Every class's tools are told the same
  thread count the CPU-aware policy gives them, so the comparison is about scheduling, not thread
  caps: Linux CFS fair share with no admission (``fair``), the same plus a static semaphore on
  tool calls sized to the cores (``fair_semaphore``), or one cgroup per task class with equal CPU
  weight at full concurrency (``cgroup_split``).
* ``CpuAwarePolicy``: task-aware CPU allocation (``allocation``) + CPU-aware tool admission
  (``admission``), both learned from a ``ProfileStore``; each can be switched off for ablations.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator

from .admission import AdmissionPolicy, CpuAdmission, Ticket
from .allocation import DEFAULT_SHARES, TaskAwareAllocator, plan_allocation, tool_shares
from .cgroups import CpuGroup, ProcessWeight
from .monitor import SystemSampler, Usage
from .profiles import ProfileStore

__all__ = [
    "Policy",
    "NativePolicy",
    "StaticLimitPolicy",
    "FairPolicy",
    "FAIR_BASELINES",
    "CpuAwarePolicy",
    "make_policy",
    "POLICIES",
]


class Policy:
    name = "policy"

    @contextlib.asynccontextmanager
    async def request_slot(self, request_id: str, task_type: str) -> AsyncIterator[None]:
        yield None

    @contextlib.asynccontextmanager
    async def tool_slot(self, request_id: str, task_type: str, tool: str) -> AsyncIterator[CpuGroup | None]:
        yield None

    def observe(self, task_type: str, tool: str, usage: Usage) -> None:
        pass

    def describe(self) -> dict:
        return {"name": self.name}

    def close(self) -> None:
        pass


class NativePolicy(Policy):
    name = "native"


class StaticLimitPolicy(Policy):
    name = "static"

    def __init__(self, cores: int, workers: int | None = None):
        self.workers = workers if workers is not None else max(1, int(0.75 * cores))
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, not {self.workers}")
        self._sem = asyncio.Semaphore(self.workers)

    @contextlib.asynccontextmanager
    async def request_slot(self, request_id: str, task_type: str) -> AsyncIterator[None]:
        async with self._sem:
            yield None

    def describe(self) -> dict:
        return {"name": self.name, "workers": self.workers}


FAIR_BASELINES = ("fair", "fair_semaphore", "cgroup_split")
# the admission ticket of the tool run the current request task holds (read by ``observe``)
_TICKET: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("agentdyn_ticket", default=None)


class FairPolicy(Policy):
    """A fair baseline (``kind`` one of ``FAIR_BASELINES``): tools of class ``t`` are told
    ``threads[t]`` threads and run in an accounting group of their class; ``fair_semaphore`` also
    holds tool calls beyond ``workers`` (default: the cores) in arrival order; ``cgroup_split``
    gives each class's group the same CPU weight, so under contention the classes split the cores
    evenly whatever their number of processes."""

    def __init__(self, kind: str, threads: dict[str, int], cores: int, workers: int | None = None):
        if kind not in FAIR_BASELINES:
            raise ValueError(f"kind must be one of {', '.join(FAIR_BASELINES)}, not {kind!r}")
        if cores < 1:
            raise ValueError(f"cores must be >= 1, not {cores}")
        self.name = kind
        self.threads = dict(threads)
        self.workers = (workers or cores) if kind == "fair_semaphore" else None
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be >= 1, not {self.workers}")
        self._sem = asyncio.Semaphore(self.workers) if self.workers else None
        self.groups: dict[str, CpuGroup] = {}
        self.max_in_flight = 0  # most tool calls that held a slot at once
        self._in_flight = 0
        for t in self.threads:  # made now, so that no tool call pays for making its group
            self.group(t)

    def group(self, task_type: str) -> CpuGroup:
        """The class's group, made with the policy (a class it was not told of: at its first call)."""
        g = self.groups.get(task_type)
        if g is None:
            shares = 1024 if self.name == "cgroup_split" else None
            g = CpuGroup(f"{self.name}-{task_type}", shares=shares, threads=self.threads.get(task_type))
            self.groups[task_type] = g
        return g

    @contextlib.asynccontextmanager
    async def tool_slot(self, request_id: str, task_type: str, tool: str) -> AsyncIterator[CpuGroup | None]:
        async with self._sem if self._sem is not None else contextlib.nullcontext():
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
            try:
                yield self.group(task_type)
            finally:
                self._in_flight -= 1

    def describe(self) -> dict:
        return {
            "name": self.name,
            "threads": self.threads,
            "workers": self.workers,
            "groups": {k: g.describe() for k, g in self.groups.items()},
            "max_tool_calls_in_flight": self.max_in_flight,
        }

    def close(self) -> None:
        for g in self.groups.values():
            g.close()


class CpuAwarePolicy(Policy):
    """Task-aware CPU allocation plus CPU-aware admission, both learned from a ``ProfileStore``.

    With admission on two or more cores, every light tool run gets the CPU weight its measured
    profile earns (``allocation.tool_shares``: the shorter its runs, the higher its ``cpu.shares``
    over a plain process's, so CFS runs it first), each with its class's thread count, on any core,
    while admission keeps the heavy runs within the cores, and the heavy runs admitted carry the
    weight of all heavy runs in flight (``_reweigh``). Without admission (an ablation) or on one core, the plan's
    core sets, quotas and weights place each class instead."""

    name = "optimized"

    def __init__(
        self,
        profiles: ProfileStore,
        cores: list[int],
        sampler: SystemSampler | None = None,
        mix: dict[str, float] | None = None,
        admission: bool = True,
        allocation: bool = True,
        apply_cgroups: bool = True,
    ):
        self.profiles = profiles
        self.cores = list(cores)
        self.sampler = sampler
        self.use_admission, self.use_allocation = admission, allocation
        self.apply_cgroups = apply_cgroups
        plan = plan_allocation(profiles.classes(), self.cores, mix)
        # weighted runs on any core: one admission set of all the cores
        self.weighted = admission and allocation and len(self.cores) >= 2
        if not allocation or self.weighted:
            plan.capacity = {"all": float(len(self.cores))}
            for c in plan.classes.values():
                c.core_set = "all"
        self.allocator = TaskAwareAllocator(plan, apply=allocation and apply_cgroups and not self.weighted)
        self.admission_policy = AdmissionPolicy.learn(profiles, len(self.cores))
        self.admission = CpuAdmission(
            self.admission_policy, plan.capacity, pressure=(sampler.latest if sampler is not None else None)
        )
        self.shares = tool_shares(profiles, self.admission_policy.heavy_tools(profiles))
        # the runtime drives every request: it weighs as much as the most favoured tool, or the
        # weighted groups starve its event loop and the tools it is still starting
        self.runtime_weight = (
            ProcessWeight(max(self.shares.values(), default=DEFAULT_SHARES))
            if self.weighted and apply_cgroups
            else None
        )
        self._weighted_groups: dict[str, CpuGroup] = {}  # per task_type/tool: its weight, the class's threads
        self.runs: dict[str, int] = {}  # tool runs per group they were placed in
        self._in_flight: dict[str, int] = {}  # heavy runs per task_type/tool, admitted or waiting
        self.reweighed = False  # a heavy group's weight followed its runs in flight
        if self.weighted:  # made now, so that no tool call pays for making its group
            for key in self.shares:
                self._weighted_group(*key.split("/", 1), heavy=False)

    def intensity(self, task_type: str, tool: str) -> float:
        p = self.profiles.get(task_type, tool)
        return p.cpu_intensity if p is not None and p.n else 1.0  # unknown tools count as CPU-heavy

    @contextlib.asynccontextmanager
    async def request_slot(self, request_id: str, task_type: str) -> AsyncIterator[None]:
        # applied on first use, not when made: the policy this one replaces restores on its close
        if self.runtime_weight is not None:
            self.runtime_weight.apply()
        yield None

    @contextlib.asynccontextmanager
    async def tool_slot(self, request_id: str, task_type: str, tool: str) -> AsyncIterator[CpuGroup | None]:
        if not self.use_admission:
            yield self._count(self.allocator.group_for(task_type) if self.use_allocation else None)
            return
        cs = self.allocator.core_set(task_type)
        p = self.profiles.get(task_type, tool)
        cost = p.cpu_s if p is not None else 1.0
        inten = self.intensity(task_type, tool)
        key = ProfileStore.key(task_type, tool)
        heavy = self.weighted and self.admission.is_heavy(inten, cost)
        if heavy:
            self._reweigh(task_type, tool, +1)
        try:
            async with self.admission.admit(request_id, key, cs, inten, cost, inten) as ticket:
                prev = _TICKET.get()
                _TICKET.set(ticket)
                try:
                    if self.weighted:
                        yield self._count(self._weighted_group(task_type, tool, ticket.heavy))
                    else:
                        yield self._count(self.allocator.group_for(task_type) if self.use_allocation else None)
                finally:
                    _TICKET.set(prev)
        finally:
            if heavy:
                self._reweigh(task_type, tool, -1)

    def _reweigh(self, task_type: str, tool: str, delta: int) -> None:
        """Give a heavy tool's group the CPU weight its runs in flight (admitted or waiting) would
        have as plain processes under CFS, one ``DEFAULT_SHARES`` per thread: holding runs back
        then concentrates our weight on the runs admitted, and never cedes CPU to other tenants
        that the same runs would have taken from them under ``fair``."""
        key = ProfileStore.key(task_type, tool)
        n = self._in_flight.get(key, 0) + delta
        self._in_flight[key] = n
        g = self._weighted_group(task_type, tool, True)
        if g is not None and n > 0:
            self.reweighed |= g.set_shares(DEFAULT_SHARES * n * (g.threads or 1))

    def _count(self, g: CpuGroup | None) -> CpuGroup | None:
        key = g.name if g is not None else "none"
        self.runs[key] = self.runs.get(key, 0) + 1
        return g

    def _weighted_group(self, task_type: str, tool: str, heavy: bool) -> CpuGroup | None:
        """The group of ``task_type/tool``: its class's thread count and its cpu.shares, for a
        light tool learned from its profile, for a heavy one set by ``_reweigh``."""
        key = ProfileStore.key(task_type, tool)
        g = self._weighted_groups.get(key)
        if g is None:
            c = self.allocator.plan.classes.get(task_type)
            threads = c.threads if c is not None else None
            shares = self.shares.get(key, DEFAULT_SHARES) if self.apply_cgroups else None
            g = CpuGroup(f"w-{task_type}-{tool}", shares=shares, threads=threads)
            self._weighted_groups[key] = g
        return g

    def observe(self, task_type: str, tool: str, usage: Usage) -> None:
        self.profiles.observe(task_type, tool, usage, alone=False)
        t = _TICKET.get()
        if t is None or not t.heavy or t.crowded or usage.wall_s <= 0 or self.reweighed:
            # reweighed, the runs admitted already carry the weight of those held: admitting more
            # would take no more CPU from other tenants, only share the cores among our runs
            return
        # the share of its wall time a heavy run that never had to share the cores with more heavy
        # runs of ours sat runnable but not running, per thread: what other tenants (and our light
        # runs) took from it; admission passes the cores by as much
        c = self.allocator.plan.classes.get(task_type)
        threads = (c.threads if c is not None else None) or 1
        got = 1.0 - min(1.0, usage.run_wait_s / (usage.wall_s * threads))
        self.admission.scale += 0.3 * (got - self.admission.scale)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "admission": self.admission_policy.to_dict() if self.use_admission else None,
            "allocation": self.allocator.describe() if self.use_allocation else None,
            "admission_stats": self.admission.stats(),
            "tool_shares": self.shares if self.weighted else None,
            "weighted_groups": {k: g.describe() for k, g in self._weighted_groups.items()},
            "runs_by_group": dict(self.runs),
            "reweighed": self.reweighed,
            "runtime_weight": self.runtime_weight.describe() if self.runtime_weight is not None else None,
        }

    def close(self) -> None:
        if self.runtime_weight is not None:
            self.runtime_weight.restore()
        self.allocator.close()
        for g in self._weighted_groups.values():
            g.close()


POLICIES = ("native", "static", "optimized")


def make_policy(
    name: str, cores: list[int], profiles: ProfileStore | None = None, sampler=None, mix=None, workers=None
) -> Policy:
    """A policy by name (``native``, ``static``, ``optimized``)."""
    if name == "native":
        return NativePolicy()
    if name == "static":
        return StaticLimitPolicy(len(cores), workers)
    if name == "optimized":
        if profiles is None or not profiles.tools:
            raise ValueError(
                "policy 'optimized' needs learned profiles; run a calibration first (agentdyn characterize)"
            )
        return CpuAwarePolicy(profiles, cores, sampler, mix)
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {name!r}")
