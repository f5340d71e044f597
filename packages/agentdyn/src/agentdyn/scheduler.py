"""Scheduling policies the runtime can run under: the two baselines and the CPU-aware one.

* ``NativePolicy``: no control (every tool call runs at once, as agent frameworks do).
* ``StaticLimitPolicy``: at most ``workers`` requests in flight, default ``max(1, int(0.75 x
  cores))`` -- the common harness rule (SWE-bench ``max_workers``, LangGraph ``max_concurrency``).
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

__all__ = ["Policy", "NativePolicy", "StaticLimitPolicy", "CpuAwarePolicy", "make_policy", "POLICIES"]


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

    def intensity(self, task_type: str, tool: str) -> float:
        p = self.profiles.get(task_type, tool)
        return p.cpu_intensity if p is not None and p.n else 1.0  # unknown tools count as CPU-heavy

    @contextlib.asynccontextmanager
    async def tool_slot(self, request_id: str, task_type: str, tool: str) -> AsyncIterator[CpuGroup | None]:
        group = self.allocator.group_for(task_type) if self.use_allocation else None
        if not self.use_admission:
            yield group
            return
        cs = self.allocator.core_set(task_type)
        p = self.profiles.get(task_type, tool)
        cost = p.cpu_s if p is not None else 1.0
        inten = self.intensity(task_type, tool)
        # the share of a core a run got alone (run-queue stall from other tenants discounted)
        avail = max(1 / 3, 1.0 - p.cpu_pressure) if p is not None and p.n_alone else 1.0
        async with self.admission.admit(request_id, f"{task_type}/{tool}", cs, inten, cost, inten * avail):
            yield group

    def observe(self, task_type: str, tool: str, usage: Usage) -> None:
        self.profiles.observe(task_type, tool, usage, alone=False)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "admission": self.admission_policy.to_dict() if self.use_admission else None,
            "allocation": self.allocator.describe() if self.use_allocation else None,
            "admission_stats": self.admission.stats(),
        }

    def close(self) -> None:
        self.allocator.close()


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
