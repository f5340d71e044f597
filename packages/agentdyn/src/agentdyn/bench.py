"""Workloads, calibration and the side-by-side benchmark of the scheduling policies.

``calibrate`` runs one request per task type alone (native) and learns a ``ProfileStore`` from the
monitor. ``run_workload`` runs a mixed burst of requests under one policy and returns per-request
results plus the system pressure seen. ``bench`` runs native, the static worker limit and the
CPU-aware policy on the same workload, same seed, one after another in the same process, and
computes the headline ratios.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

from .emulator import EmulatorConfig
from .monitor import SystemSampler
from .profiles import ProfileStore
from .runtime import TASK_TYPES, AgentRequest, AgentResult, Harness
from .sandbox import zombie_children
from .scheduler import CpuAwarePolicy, NativePolicy, Policy, StaticLimitPolicy

__all__ = ["WorkloadConfig", "make_workload", "calibrate", "run_workload", "bench", "summarize"]

log = logging.getLogger(__name__)


@dataclass
class WorkloadConfig:
    per_type: int = 4
    types: tuple[str, ...] = ("rag_qa", "web_search", "coding")
    arrival_window_s: float = 1.0
    coding_work: int = 40_000
    rag_shards: int = 4
    web_pages: int = 12
    seed: int = 0
    emulator: EmulatorConfig = field(default_factory=lambda: EmulatorConfig(ttft_s=0.3, tokens_per_s=80.0))
    site_latency_s: float = 0.05
    tool_timeout_s: float = 120.0
    # numerical libraries in tools start their default thread count (one per core the tool may
    # run on), as in an unconstrained agent container; see ``sandbox.tool_env``
    tool_threads: int | str | None = "default"

    def __post_init__(self) -> None:
        if self.per_type < 1:
            raise ValueError(f"per_type must be >= 1, not {self.per_type}")
        bad = [t for t in self.types if t not in TASK_TYPES]
        if bad:
            raise ValueError(f"types: unknown task type {bad[0]!r}; one of {', '.join(TASK_TYPES)}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["emulator"] = self.emulator.describe()
        d["types"] = list(self.types)
        return d


def task_input(task_type: str, i: int, cfg: WorkloadConfig) -> dict:
    if task_type == "rag_qa":
        qs = [
            "how are email headers parsed and encoded",
            "json decoder error position",
            "thread pool executor shutdown",
            "tarfile extract members safely",
        ]
        return {"question": qs[i % len(qs)], "shard": i % cfg.rag_shards, "shards": cfg.rag_shards}
    if task_type == "web_search":
        qs = ["socket timeout connection", "unicode normalization", "http cookie parsing", "zip file compression"]
        return {"query": qs[i % len(qs)], "pages": cfg.web_pages}
    return {"work": cfg.coding_work}


def make_workload(cfg: WorkloadConfig) -> list[tuple[float, AgentRequest]]:
    """(arrival offset s, request) for ``per_type`` requests of each type, shuffled by the seed."""
    rng = random.Random(cfg.seed)
    reqs = [
        AgentRequest(t, task_input(t, i, cfg), request_id=f"{t}-{i}") for t in cfg.types for i in range(cfg.per_type)
    ]
    rng.shuffle(reqs)
    return sorted(((rng.uniform(0, cfg.arrival_window_s), r) for r in reqs), key=lambda x: x[0])


async def calibrate(
    h: Harness, cfg: WorkloadConfig, sampler: SystemSampler | None = None, rounds: int = 1
) -> ProfileStore:
    """Run each task type alone (native) and learn tool profiles from the monitor."""
    store = ProfileStore()
    prev = h.runtime.policy
    h.runtime.policy = NativePolicy()

    def on_tool(req, name, res):
        # the run-queue stall this run saw alone: the pressure one run of it adds or suffers
        u = res.usage
        store.observe(req.task_type, name, u, alone=True, pressure=u.run_wait_s / u.wall_s if u.wall_s > 0 else 0.0)

    try:
        for r in range(rounds):
            for t in cfg.types:
                req = AgentRequest(t, task_input(t, r, cfg), request_id=f"calib-{t}-{r}")
                res = await h.runtime.run(req, on_tool=on_tool)
                if not res.ok:
                    raise RuntimeError(f"calibration request {req.request_id} failed: {res.error}")
                store.observe_request(t)
    finally:
        h.runtime.policy = prev
    return store


async def run_workload(
    h: Harness, workload: list[tuple[float, AgentRequest]], sampler: SystemSampler | None = None
) -> dict:
    """Run the workload (arrivals at their offsets) under the harness's current policy."""
    t0 = time.monotonic()

    async def one(offset: float, req: AgentRequest) -> AgentResult:
        await asyncio.sleep(max(0.0, offset - (time.monotonic() - t0)))
        fresh = AgentRequest(req.task_type, dict(req.input), request_id=f"{h.runtime.policy.name}-{req.request_id}")
        return await h.runtime.run(fresh)

    results = await asyncio.gather(*(one(o, r) for o, r in workload))
    wall = time.monotonic() - t0
    return {
        "results": results,
        "makespan_s": wall,
        "pressure": sampler.summary(since=t0) if sampler is not None else {},
        "policy": h.runtime.policy.describe(),
    }


def summarize(run: dict, cpu_task: str) -> dict:
    res: list[AgentResult] = run["results"]
    lat = [r.latency_s for r in res]
    by: dict[str, dict] = {}
    for t in sorted({r.task_type for r in res}):
        rs = [r for r in res if r.task_type == t]
        ls = [r.latency_s for r in rs]
        n = len(rs)
        by[t] = {
            "n": n,
            "mean_latency_s": statistics.fmean(ls),
            "median_latency_s": statistics.median(ls),
            "llm_wait_s": sum(r.usage.llm_wait_s for r in rs) / n,
            "queue_wait_s": sum(r.usage.queue_wait_s for r in rs) / n,
            "tool_wall_s": sum(r.usage.tools.wall_s for r in rs) / n,
            "tool_cpu_s": sum(r.usage.tools.cpu_s for r in rs) / n,
            "tool_run_wait_s": sum(r.usage.tools.run_wait_s for r in rs) / n,
            "tool_read_bytes": sum(r.usage.tools.read_bytes for r in rs) / n,
            "tool_write_bytes": sum(r.usage.tools.write_bytes for r in rs) / n,
            "peak_rss_bytes": max(r.usage.tools.peak_rss_bytes for r in rs),
        }
    return {
        "requests": len(res),
        "failed": sum(not r.ok for r in res),
        "errors": sorted({r.error for r in res if r.error})[:5],
        "mean_latency_s": statistics.fmean(lat),
        "cpu_task_mean_latency_s": by.get(cpu_task, {}).get("mean_latency_s"),
        "makespan_s": run["makespan_s"],
        "per_type": by,
        "pressure": run["pressure"],
        "policy": run["policy"],
    }


def _cpu_task(store: ProfileStore) -> str:
    """The CPU-sensitive task class: the highest CPU demand per request among the characterized."""
    classes = store.classes()
    return max(classes, key=lambda t: classes[t]["cpu_s"])


def _schedule(variants: tuple[str, ...], repeats: int) -> list[str]:
    """Run order: native and optimized adjacent and alternating (ABBA over rounds) so that drifting
    load from other tenants hits both alike; the slow static baseline once, last."""
    pair = [v for v in ("native", "optimized") if v in variants]
    order: list[str] = []
    for r in range(repeats):
        order += pair if r % 2 == 0 else pair[::-1]
    return order + [v for v in variants if v not in pair]


async def _escape_attempts(out: dict, progress=None) -> int | None:
    """How many of ``agentdyn.escapes.ATTEMPTS`` got out of the strict sandbox (each listed in
    ``out["sandbox"]``); None where this host lacks a sandbox layer (named there instead)."""
    from .escapes import run_attempts
    from .sandbox import missing_layers

    missing = missing_layers()
    if missing:
        out["sandbox"] = {"escape_attempts": None, "missing": missing}
        return None
    if progress:
        progress("escape attempts against the tool sandbox")
    attempts = await run_attempts("strict")
    out["sandbox"] = {"escape_attempts": attempts}
    return sum(v is not None for v in attempts.values())


async def bench(
    cfg: WorkloadConfig, variants: tuple[str, ...] = ("native", "static", "optimized"), progress=None, repeats: int = 1
) -> dict:
    """The baselines and the CPU-aware policy on the same workload; returns results + headline."""
    from hwtopo import usable_cpus

    bad = [v for v in variants if v not in ("native", "static", "optimized")]
    if bad:
        raise ValueError(f"variant must be native, static or optimized, not {bad[0]!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, not {repeats}")
    cores = usable_cpus()
    sampler = SystemSampler(0.1).start()
    out: dict = {"results": {}, "order": []}
    runs: dict[str, list[dict]] = {}
    try:
        async with Harness(
            emulator=cfg.emulator,
            site_latency_s=cfg.site_latency_s,
            tool_timeout_s=cfg.tool_timeout_s,
            sampler=sampler,
            tool_threads=cfg.tool_threads,
        ) as h:
            if progress:
                progress("calibrating (each task type alone)")
            store = await calibrate(h, cfg, sampler)
            out["profiles"] = store.to_dict()
            cpu_task = _cpu_task(store)
            workload = make_workload(cfg)
            mix = {t: float(cfg.per_type) for t in cfg.types}
            for v in _schedule(tuple(variants), repeats):
                if progress:
                    progress(f"running {v}: {len(workload)} requests")
                pol: Policy
                if v == "native":
                    pol = NativePolicy()
                elif v == "static":
                    pol = StaticLimitPolicy(len(cores))
                else:
                    pol = CpuAwarePolicy(ProfileStore.from_dict(store.to_dict()), cores, sampler, mix)
                h.set_policy(pol)
                run = await run_workload(h, workload, sampler)
                runs.setdefault(v, []).append(run)
                out["order"].append(v)
                pol.close()
            h.set_policy(NativePolicy())
            out["watcher_overhead"] = h.runtime.watcher.overhead()
    finally:
        sampler.stop()
    for v, rs in runs.items():
        merged = {
            "results": [x for r in rs for x in r["results"]],
            "makespan_s": statistics.fmean(r["makespan_s"] for r in rs),
            "pressure": rs[-1]["pressure"],
            "policy": rs[-1]["policy"],
        }
        out["results"][v] = summarize(merged, cpu_task)
        out["results"][v]["rounds"] = len(rs)
    await asyncio.sleep(0.2)
    zombies = len(zombie_children())
    escapes = await _escape_attempts(out, progress)
    r = out["results"]
    head: dict = {"cpu_task": cpu_task}
    if "native" in r and "optimized" in r:
        head["cpu_task_latency_ratio"] = (
            r["native"]["cpu_task_mean_latency_s"] / r["optimized"]["cpu_task_mean_latency_s"]
        )
        head["mixed_avg_latency_reduction"] = 1 - r["optimized"]["mean_latency_s"] / r["native"]["mean_latency_s"]
    if "native" in r and "static" in r:
        head["static_limit_avg_latency_reduction"] = 1 - r["static"]["mean_latency_s"] / r["native"]["mean_latency_s"]
    head["requests_failed"] = sum(x["failed"] for x in r.values())
    head["zombie_processes"] = zombies
    head["sandbox_escapes"] = escapes
    out["headline"] = head
    out["sampler_overhead"] = sampler.overhead()
    return out
