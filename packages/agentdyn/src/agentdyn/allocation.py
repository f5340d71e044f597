"""Task-aware CPU allocation (the paper's second mechanism).

From the monitor's characterization (``ProfileStore``), each task class gets a CPU intensity (tool
CPU seconds per uncontended tool wall second) and a CPU demand per request. CPU-sensitive classes
are those at or above the threshold learned at the largest gap of the intensities
(``split_threshold``). Taken by expected demand (workload mix x CPU s per request), a CPU-sensitive
class whose share of the demand fills at least one core gets that many cores of its own through a
cpuset group, always leaving one; the other classes (I/O-bound, or too small to fill a core) share
the remaining cores. With a single core, the split is by CFS
quota instead: I/O-bound classes are capped at their demand share and CPU-sensitive classes get a
higher ``cpu.shares`` weight. The plan names, per class, its core set; admission uses the core
sets' sizes as capacities.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from .cgroups import CpuGroup

__all__ = [
    "split_threshold",
    "ClassAllocation",
    "AllocationPlan",
    "plan_allocation",
    "tool_shares",
    "sensitive_classes",
    "DEFAULT_SHARES",
    "MAX_SHARE_RATIO",
    "TaskAwareAllocator",
]

log = logging.getLogger(__name__)

DEFAULT_SHARES = 1024  # cgroup v1 cpu.shares of a group nobody weighted (v2: weight 100)
MAX_SHARE_RATIO = 64  # the most a short tool's weight may exceed a heavy one's


def split_threshold(values: list[float], lo: float = 0.2, hi: float = 0.9) -> float:
    """Threshold between low and high values at their largest gap (in log space), clamped to [lo, hi]."""
    xs = sorted(max(1e-3, v) for v in values)
    if len(xs) < 2:
        return min(hi, max(lo, 0.5))
    gaps = [(math.log(xs[i + 1]) - math.log(xs[i]), i) for i in range(len(xs) - 1)]
    _, i = max(gaps)
    thr = math.sqrt(xs[i] * xs[i + 1])
    return min(hi, max(lo, thr))


@dataclass
class ClassAllocation:
    task_type: str
    kind: str  # "cpu" (CPU-sensitive) or "io" (I/O-bound, shares)
    core_set: str
    cpus: list[int]
    quota_cores: float | None = None
    shares: int | None = None
    intensity: float = 0.0
    cpu_s_per_request: float = 0.0
    threads: int | None = None  # threads its tools' numerical libraries are told to start
    own_cpus: list[int] | None = None  # cores no other class may use (``cpus`` may add spill cores)


@dataclass
class AllocationPlan:
    classes: dict[str, ClassAllocation]
    capacity: dict[str, float]
    threshold: float
    cores: list[int]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "threshold": round(self.threshold, 4),
            "cores": self.cores,
            "capacity": self.capacity,
            "classes": {k: v.__dict__ for k, v in self.classes.items()},
            "notes": self.notes,
        }


@dataclass
class _Demand:
    """What every plan shape reads per class: intensity, CPU s per request, expected demand, threshold."""

    types: list[str]
    inten: dict[str, float]
    cpu_s: dict[str, float]
    demand: dict[str, float]
    total: float
    thr: float

    def alloc(self, t: str, kind: str, core_set: str, cpus: list[int], **kw) -> ClassAllocation:
        """The allocation of class ``t``, carrying its measured intensity and CPU cost per request."""
        return ClassAllocation(
            t, kind, core_set, list(cpus), intensity=self.inten[t], cpu_s_per_request=self.cpu_s[t], **kw
        )


def plan_allocation(
    class_profiles: dict[str, dict],
    cores: list[int],
    mix: dict[str, float] | None = None,
    threshold: float | None = None,
) -> AllocationPlan:
    """Plan core sets per task class from class profiles ({type: {cpu_s, wall_s, cpu_intensity}}).

    Classes whose intensity reaches ``threshold`` (default: learned by ``split_threshold`` over the
    class intensities) are CPU-sensitive. Taken in order of expected CPU demand (mix x CPU s per
    request), each CPU-sensitive class whose demand share fills at least one core gets
    ``round(cores x share)`` own cores, always leaving one core for the classes that share.
    """
    if not cores:
        raise ValueError("cores must list at least one CPU")
    types = sorted(class_profiles)
    if not types:
        return AllocationPlan({}, {"all": float(len(cores))}, 0.5, list(cores), ["no profiles: all share"])
    mix = {t: (mix or {}).get(t, 1.0) for t in types}
    inten = {t: class_profiles[t].get("cpu_intensity", 1.0) for t in types}
    thr = threshold if threshold is not None else split_threshold(list(inten.values()))
    cpu_s = {t: class_profiles[t].get("cpu_s", 0.0) for t in types}
    demand = {t: mix[t] * cpu_s[t] for t in types}
    d = _Demand(types, inten, cpu_s, demand, sum(demand.values()) or 1.0, thr)
    return _plan_cores(d, cores) if len(cores) >= 2 else _plan_one_core(d, cores)


def _plan_cores(d: _Demand, cores: list[int]) -> AllocationPlan:
    """Two or more cores: own cores for CPU-sensitive classes, the rest shared, then spill onto idle ones."""
    n = len(cores)
    notes: list[str] = []
    classes: dict[str, ClassAllocation] = {}
    capacity: dict[str, float] = {}
    free = list(cores)
    for t in sorted(d.types, key=lambda t: -d.demand[t]):
        rest = [x for x in d.types if x not in classes and x != t]
        k = round(n * d.demand[t] / d.total)
        if d.inten[t] < d.thr or k < 1 or not rest or len(free) - k < 1:
            if d.inten[t] >= d.thr and k >= 1 and rest and len(free) > 1:
                k = len(free) - 1  # as many as can be spared
            else:
                continue
        own, free = free[len(free) - k :], free[: len(free) - k]
        classes[t] = d.alloc(t, "cpu", f"own-{t}", own, threads=k, own_cpus=list(own))
        capacity[f"own-{t}"] = float(k)
        notes.append(
            f"{t}: CPU-sensitive (intensity {d.inten[t]:.2f} >= {d.thr:.2f}), demand share {d.demand[t] / d.total:.2f} -> own cores {own}"
        )
    shared = [t for t in d.types if t not in classes]
    for t in shared:
        classes[t] = d.alloc(t, "cpu" if d.inten[t] >= d.thr else "io", "shared", free, threads=len(free))
    if shared:
        capacity["shared"] = float(len(free))
        notes.append(f"{shared} share cores {free}")
    _spill(d, n, classes, capacity, notes, free, shared)
    return AllocationPlan(classes, capacity, d.thr, list(cores), notes)


def _spill(d: _Demand, n: int, classes: dict, capacity: dict, notes: list, free: list[int], shared: list[str]) -> None:
    """Let classes with own cores whose demand exceeds them also run on the whole shared cores left idle."""
    # idle: whole shared cores the sharing classes' expected demand leaves unused
    shared_cores = n * sum(d.demand[t] for t in shared) / d.total if shared else 0.0
    spare = min(len(free), int(math.floor(len(free) - shared_cores + 0.5))) if free else 0
    for t in sorted((x for x in classes if classes[x].core_set.startswith("own-")), key=lambda x: -d.demand[x]):
        c = classes[t]
        k = len(c.cpus)
        want = n * d.demand[t] / d.total - k
        extra = min(spare, int(math.floor(want + 0.5)))
        if extra >= 1:
            c.cpus = sorted(c.cpus + free)
            capacity[c.core_set] = float(k + extra)
            spare -= extra
            notes.append(f"{t}: may also run on shared cores {free} ({extra} core(s) of admission capacity)")


def _plan_one_core(d: _Demand, cores: list[int]) -> AllocationPlan:
    """One core: no core sets to split, so I/O-bound classes get a CFS quota and CPU-sensitive ones weight."""
    heavy = [t for t in d.types if d.inten[t] >= d.thr]
    light = [t for t in d.types if t not in heavy]
    if not heavy or not light:
        classes = {t: d.alloc(t, "cpu" if t in heavy else "io", "all", cores) for t in d.types}
        return AllocationPlan(
            classes, {"all": float(len(cores))}, d.thr, list(cores), ["one core, no split: all share"]
        )
    heavy_share = sum(d.demand[t] for t in heavy) / d.total
    io_quota = min(0.8, max(0.2, 1 - heavy_share))
    notes = [f"one core: I/O-bound {light} capped at {io_quota:.2f} core, CPU-sensitive {heavy} weighted 4x"]
    classes = {t: d.alloc(t, "cpu", "cpu", cores, shares=4096) for t in heavy}
    classes.update({t: d.alloc(t, "io", "io", cores, quota_cores=io_quota, shares=1024) for t in light})
    return AllocationPlan(classes, {"cpu": 1.0, "io": io_quota}, d.thr, list(cores), notes)


def sensitive_classes(plan: AllocationPlan, heavy: set[str]) -> list[str]:
    """The CPU-sensitive classes, those the paper protects: CPU-bound in ``plan`` (``kind == "cpu"``)
    with no tool in ``heavy`` (the ``task_type/tool`` keys admission holds) -- short CPU-bound
    work on a request's critical path, which only contention with the heavy runs slows."""
    held = {k.split("/", 1)[0] for k in heavy}
    return sorted(t for t, c in plan.classes.items() if c.kind == "cpu" and t not in held)


def tool_shares(profiles, heavy: set[str]) -> dict[str, int]:
    """``cpu.shares`` per ``task_type/tool`` of a ``ProfileStore``: heavy tools (``heavy``, as
    admission classes them) ``DEFAULT_SHARES``, a plain process's weight; every other tool more, by
    how many times fewer CPU seconds a run of it takes than the lightest heavy tool's (at most
    ``MAX_SHARE_RATIO`` times). Under CFS a short run then takes a core at once instead of sharing
    it with long CPU-bound runs, which approximates shortest-job-first and leaves the long runs'
    finish almost unchanged."""
    costs = {k: p.cpu_s for k, p in profiles.tools.items() if p.n}
    ref = min((costs[k] for k in heavy if k in costs), default=max(costs.values(), default=0.0))
    out = {}
    for k, c in costs.items():
        ratio = 1.0 if k in heavy or ref <= 0 else min(MAX_SHARE_RATIO, max(1.0, ref / max(c, 1e-3)))
        out[k] = int(round(DEFAULT_SHARES * ratio))
    return out


class TaskAwareAllocator:
    """Holds one ``CpuGroup`` per core set of a plan; ``group_for(task_type)`` places tool processes."""

    def __init__(self, plan: AllocationPlan, apply: bool = True):
        self.plan = plan
        self.groups: dict[str, CpuGroup] = {}
        if apply:
            by_set: dict[str, ClassAllocation] = {}
            for c in plan.classes.values():
                by_set.setdefault(c.core_set, c)
            for cs, c in by_set.items():
                if cs == "all":
                    continue
                cpus = c.cpus if len(plan.cores) >= 2 else None
                self.groups[cs] = CpuGroup(
                    f"{cs}", cpus=cpus, quota_cores=c.quota_cores, shares=c.shares, threads=c.threads
                )

    def core_set(self, task_type: str) -> str:
        c = self.plan.classes.get(task_type)
        if c is not None:
            return c.core_set
        return next(iter(self.plan.capacity))

    def group_for(self, task_type: str) -> CpuGroup | None:
        return self.groups.get(self.core_set(task_type))

    def describe(self) -> dict:
        return {"plan": self.plan.to_dict(), "groups": {k: g.describe() for k, g in self.groups.items()}}

    def close(self) -> None:
        for g in self.groups.values():
            g.close()
