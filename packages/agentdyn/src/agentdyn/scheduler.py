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
from collections.abc import AsyncIterator

from .admission import AdmissionPolicy, CpuAdmission
from .allocation import TaskAwareAllocator, plan_allocation
from .cgroups import CpuGroup
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

    def group(self, task_type: str) -> CpuGroup:
        """The class's group, made at its first tool call."""
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
        plan = plan_allocation(profiles.classes(), self.cores, mix)
        if not allocation:
            plan.capacity = {"all": float(len(self.cores))}
            for c in plan.classes.values():
                c.core_set = "all"
        self.allocator = TaskAwareAllocator(plan, apply=allocation and apply_cgroups)
        self.admission_policy = AdmissionPolicy.learn(profiles, len(self.cores))
        self.admission = CpuAdmission(
            self.admission_policy, plan.capacity, pressure=(sampler.latest if sampler is not None else None)
        )
        self._unpinned: dict[str, CpuGroup] = {}  # per class: its thread count, no core set
        self.pinned_runs = self.unpinned_runs = self.stood_down = 0
        self._down_running = 0  # runs started while standing down, still running

    def intensity(self, task_type: str, tool: str) -> float:
        p = self.profiles.get(task_type, tool)
        return p.cpu_intensity if p is not None and p.n else 1.0  # unknown tools count as CPU-heavy

    @contextlib.asynccontextmanager
    async def tool_slot(self, request_id: str, task_type: str, tool: str) -> AsyncIterator[CpuGroup | None]:
        group = self.allocator.group_for(task_type) if self.use_allocation else None
        if not self.use_admission:
            yield group
            return
        if self._down_running == 0:
            self.admission.track_baseline()  # none of ours runs: the pressure is the neighbours'
        if self.neighbours_saturate():
            self.stood_down += 1
            self._down_running += 1
            try:
                yield self._free_group(task_type, group)
            finally:
                self._down_running -= 1
            return
        cs = self.allocator.core_set(task_type)
        p = self.profiles.get(task_type, tool)
        cost = p.cpu_s if p is not None else 1.0
        inten = self.intensity(task_type, tool)
        # the share of a core a run got alone (run-queue stall from other tenants discounted)
        avail = max(1 / 3, 1.0 - p.cpu_pressure) if p is not None and p.n_alone else 1.0
        async with self.admission.admit(request_id, f"{task_type}/{tool}", cs, inten, cost, inten * avail):
            yield self._placement(task_type, group)

    def _placement(self, task_type: str, pinned: CpuGroup | None) -> CpuGroup | None:
        """The class's pinned group only while the demand we admitted exceeds the cores. Below that a
        partition protects nothing and only keeps the kernel from moving a run to whichever core
        frees first (on a host other tenants load, that adds run-queue wait); the class's thread
        count applies either way. One core: the plan's quota and weights always apply."""
        if pinned is None or len(self.cores) < 2 or sum(self.admission.load.values()) > len(self.cores):
            self.pinned_runs += pinned is not None
            return pinned
        return self._free_group(task_type, pinned)

    def _free_group(self, task_type: str, pinned: CpuGroup | None) -> CpuGroup | None:
        """The class's group with its thread count and no core set, quota or weight."""
        if pinned is None:
            return None
        g = self._unpinned.get(task_type)
        if g is None:
            g = CpuGroup(f"free-{task_type}", threads=pinned.threads)
            self._unpinned[task_type] = g
        self.unpinned_runs += 1
        return g

    def neighbours_saturate(self) -> bool:
        """PSI ``cpu some`` seen while none of our runs ran (other tenants' share) is at least the
        policy's ``stand_down_pressure``. Then holding runs back or confining them to core sets
        only lowers the share of the CPU the kernel gives us against the neighbours' runnable tasks,
        so the policy stands down: every run starts at once, on any core, with its class's thread
        count (the fair share), until the neighbours' pressure falls again."""
        b = self.admission.baseline_pressure
        return b is not None and b >= self.admission_policy.stand_down_pressure

    def observe(self, task_type: str, tool: str, usage: Usage) -> None:
        self.profiles.observe(task_type, tool, usage, alone=False)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "admission": self.admission_policy.to_dict() if self.use_admission else None,
            "allocation": self.allocator.describe() if self.use_allocation else None,
            "admission_stats": self.admission.stats(),
            "pinned_runs": self.pinned_runs,
            "unpinned_runs": self.unpinned_runs,
            "stood_down_runs": self.stood_down,
        }

    def close(self) -> None:
        self.allocator.close()
        for g in self._unpinned.values():
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
