"""Workloads, calibration and the side-by-side benchmark of the scheduling policies.

``calibrate`` runs one request per task type alone (native) and learns a ``ProfileStore`` from the
monitor. ``run_workload`` runs a mixed burst of requests under one policy and returns per-request
results plus the system pressure seen. ``bench`` runs the fair baselines (``FAIR_BASELINES``: CFS
fair share, the same with a tool semaphore sized to the cores, a static cgroup split per class;
every one with the thread caps the CPU-aware policy gives its tools) and the CPU-aware policy on
the same workloads in one process, at two offered CPU loads (one that fits the cores, one
oversubscribed), over held-out seeds, and divides by the best fair baseline.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

from .allocation import plan_allocation, sensitive_classes
from .emulator import EmulatorConfig
from .monitor import SystemSampler
from .profiles import ProfileStore
from .runtime import TASK_TYPES, AgentRequest, AgentResult, Harness
from .sandbox import zombie_children
from .scheduler import FAIR_BASELINES, CpuAwarePolicy, FairPolicy, NativePolicy, Policy, StaticLimitPolicy

__all__ = [
    "WorkloadConfig",
    "make_workload",
    "calibrate",
    "run_workload",
    "bench",
    "summarize",
    "size_load",
    "vs_fair",
    "cpu_sensitive_tasks",
    "DEV_SEEDS",
    "HELDOUT_SEEDS",
    "LOADS",
    "VARIANTS",
]

log = logging.getLogger(__name__)

# Settings (the admission and allocation constants) are chosen on the development seeds' workloads;
# the bench reports only seeds outside them, and says so in its JSON.
DEV_SEEDS = (0, 1, 2)
HELDOUT_SEEDS = (101, 102, 103)
# a run made alone that waits in the run queue more than this share of its time measures other
# tenants, not the policies: the JSON marks such a host as not quiet (``host.quiet``)
QUIET_RUN_QUEUE_SHARE = 0.25
# offered CPU load (cores the in-flight requests would keep busy alone / usable cores)
LOADS = (("fit", 0.8), ("oversubscribed", 2.0))
VARIANTS = (*FAIR_BASELINES, "optimized")
SERVICE_TIMEOUT_S = 600.0  # per request of the service check, and its drain window
REFERENCES = ("native", "static")  # unfair references (default thread counts; one request at a time)


@dataclass
class WorkloadConfig:
    per_type: int | None = None  # requests per task type at every load; None: sized to each load
    types: tuple[str, ...] = ("rag_qa", "web_search", "coding")
    arrival_window_s: float = 1.0
    coding_work: int = 40_000
    rag_shards: int = 4
    web_pages: int = 12
    seed: int = 0  # the LLM emulator's; workloads are drawn from ``seeds``
    emulator: EmulatorConfig = field(default_factory=lambda: EmulatorConfig(ttft_s=0.3, tokens_per_s=80.0))
    site_latency_s: float = 0.05
    tool_timeout_s: float = 120.0
    # numerical libraries in tools start their default thread count (one per core the tool may
    # run on), as in an unconstrained agent container; see ``sandbox.tool_env``. Every compared
    # policy overrides it per class with the same caps (the CPU-aware plan's), so it only matters
    # for the unfair ``native`` reference and calibration
    tool_threads: int | str | None = "default"
    seeds: tuple[int, ...] = HELDOUT_SEEDS
    loads: tuple[tuple[str, float], ...] = LOADS
    max_per_type: int = 8  # a workload sized to a load never exceeds this many requests per type

    def __post_init__(self) -> None:
        if self.per_type is not None and self.per_type < 1:
            raise ValueError(f"per_type must be >= 1, not {self.per_type}")
        bad = [t for t in self.types if t not in TASK_TYPES]
        if bad:
            raise ValueError(f"types: unknown task type {bad[0]!r}; one of {', '.join(TASK_TYPES)}")
        if not self.seeds or any(not 0 <= s < 2**32 for s in self.seeds):
            raise ValueError(f"seeds must list at least one seed in [0, 2**32), not {self.seeds!r}")
        names = [n for n, _ in self.loads]
        if not self.loads or len(set(names)) != len(names) or any(not x > 0 for _, x in self.loads):
            raise ValueError(f"loads must name distinct loads with offered CPU load > 0, not {self.loads!r}")
        if self.max_per_type < 1:
            raise ValueError(f"max_per_type must be >= 1, not {self.max_per_type}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["emulator"] = self.emulator.describe()
        d["types"] = list(self.types)
        d["seeds"] = list(self.seeds)
        d["loads"] = dict(self.loads)
        d["dev_seeds"] = list(DEV_SEEDS)
        d["seeds_held_out"] = not set(self.seeds) & set(DEV_SEEDS)
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


def make_workload(
    cfg: WorkloadConfig, per_type: int | None = None, seed: int | None = None
) -> list[tuple[float, AgentRequest]]:
    """(arrival offset s, request) for ``per_type`` (default ``cfg.per_type``, else 1) requests of
    each type, shuffled and spread over the arrival window by ``seed`` (default ``cfg.seeds[0]``)."""
    n = per_type or cfg.per_type or 1
    rng = random.Random(cfg.seeds[0] if seed is None else seed)
    reqs = [AgentRequest(t, task_input(t, i, cfg), request_id=f"{t}-{i}") for t in cfg.types for i in range(n)]
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
                store.observe_request(t, res.latency_s)
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


def _mean_of(res: list[AgentResult], types) -> float | None:
    """Mean latency of the requests of the given task types, pooled per request (None: none ran)."""
    ls = [r.latency_s for r in res if r.task_type in types]
    return statistics.fmean(ls) if ls else None


def summarize(run: dict, cpu_tasks, heavy_tasks=()) -> dict:
    """One run's summary: latency over all requests, over the CPU-sensitive classes (``cpu_tasks``)
    and the CPU-heavy ones (``heavy_tasks``), and per task type where the time went."""
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
        "cpu_task_mean_latency_s": _mean_of(res, cpu_tasks),
        "cpu_heavy_task_mean_latency_s": _mean_of(res, heavy_tasks),
        "makespan_s": run["makespan_s"],
        "per_type": by,
        "pressure": run["pressure"],
        "policy": run["policy"],
    }


def cpu_sensitive_tasks(store: ProfileStore, ncores: int) -> tuple[list[str], list[str], str]:
    """(CPU-sensitive classes, CPU-heavy classes, the rule that chose them), from calibration alone.

    CPU-heavy: a class with a tool admission holds (``AdmissionPolicy.learn``'s intensity and cost
    thresholds). CPU-sensitive: a CPU-bound class (intensity at or above the allocation's learned
    split) with no heavy tool -- short CPU-bound runs on the request's critical path, which only
    contention with the heavy runs slows; the work the paper protects. Without such a class the
    class of the highest CPU demand per request stands in, and the rule says so."""
    from .admission import AdmissionPolicy

    classes = store.classes()
    held = AdmissionPolicy.learn(store, ncores).heavy_tools(store)
    heavy = sorted({k.split("/", 1)[0] for k in held})
    plan = plan_allocation(classes, list(range(max(1, ncores))))
    bound = sensitive_classes(plan, held)
    if bound:
        rule = f"CPU-bound (intensity >= {plan.threshold:.2f}), no tool held by admission"
        return bound, heavy, rule
    top = max(classes, key=lambda t: classes[t]["cpu_s"])
    return [top], heavy, "no CPU-bound class without heavy tools: the highest CPU demand per request"


def _schedule(variants: tuple[str, ...], k: int) -> list[str]:
    """Run order of the ``k``-th (seed, load) round: the variants rotated by ``k``, so that across
    rounds each takes each place and drifting load from other tenants hits all alike."""
    k %= len(variants)
    return list(variants[k:] + variants[:k])


def size_load(target: float, cores_per_request: dict[str, float], ncores: int, cap: int) -> tuple[int, float]:
    """Requests per task type giving an offered CPU load near ``target`` (at most ``target`` when
    it fits the cores, at least ``target`` when above them), clamped to [1, cap]; and that load."""
    per_set = sum(cores_per_request.values())
    if per_set <= 0:
        return 1, 0.0
    x = target * ncores / per_set
    n = min(cap, max(1, math.floor(x + 1e-9) if target <= 1 else math.ceil(x - 1e-9)))
    return n, n * per_set / ncores


def _policy(v: str, store: ProfileStore, cores: list[int], sampler, mix: dict[str, float]) -> Policy:
    if v == "native":
        return NativePolicy()
    if v == "static":
        return StaticLimitPolicy(len(cores))
    if v == "optimized":
        return CpuAwarePolicy(ProfileStore.from_dict(store.to_dict()), cores, sampler, mix)
    # a fair baseline's tools get the thread counts the CPU-aware plan gives each class
    plan = plan_allocation(store.classes(), cores, mix)
    return FairPolicy(v, {t: c.threads for t, c in plan.classes.items() if c.threads}, len(cores))


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


def host_check(store: ProfileStore, pressure: dict) -> dict:
    """How much other tenants took while calibration ran each request alone: the run-queue share of
    its tool runs (CPU-weighted) and PSI ``cpu some``; ``quiet`` when the share is at most
    ``QUIET_RUN_QUEUE_SHARE`` (otherwise latencies mostly measure the neighbours)."""
    ps = [p for p in store.tools.values() if p.n_alone]
    w = sum(p.cpu_s for p in ps)
    # a multi-threaded run's queue wait sums over its threads: a share past 1 still means "all of it"
    share = min(1.0, sum(p.cpu_pressure * p.cpu_s for p in ps) / w) if w > 0 else 0.0
    return {
        "alone_run_queue_share": share,
        "alone_cpu_some_mean": pressure.get("cpu_some_mean"),
        "loadavg_1min": os.getloadavg()[0],
        "quiet": share <= QUIET_RUN_QUEUE_SHARE,
        "quiet_threshold": QUIET_RUN_QUEUE_SHARE,
    }


_FIGURES = ("mean_latency_s", "cpu_task_mean_latency_s", "cpu_heavy_task_mean_latency_s")


def _merge(rs: list[tuple[int, dict]], cpu_tasks, heavy_tasks=()) -> dict:
    """One variant at one load over its seeds: the pooled summary plus each seed's means."""
    merged = {
        "results": [x for _, r in rs for x in r["results"]],
        "makespan_s": statistics.fmean(r["makespan_s"] for _, r in rs),
        "pressure": rs[-1][1]["pressure"],
        "policy": rs[-1][1]["policy"],
    }
    out = summarize(merged, cpu_tasks, heavy_tasks)
    out["rounds"] = len(rs)
    per: dict[str, dict] = {}
    for seed, r in rs:
        one = summarize(r, cpu_tasks, heavy_tasks)
        d = per.setdefault(str(seed), {k: [] for k in _FIGURES})
        for k in _FIGURES:
            if one[k] is not None:
                d[k].append(one[k])
    out["per_seed"] = {s: {k: statistics.fmean(v) if v else None for k, v in d.items()} for s, d in per.items()}
    return out


# headline figure -> (the latency it compares, ratio (baseline / ours) or reduction (1 - ours /
# baseline), the name its best fair baseline is listed under)
_COMPARED = {
    "cpu_task_latency_ratio": ("cpu_task_mean_latency_s", "ratio", "cpu_task"),
    "cpu_heavy_task_latency_ratio": ("cpu_heavy_task_mean_latency_s", "ratio", "cpu_heavy_task"),
    "mixed_avg_latency_reduction": ("mean_latency_s", "reduction", "mean"),
}


def _compare(ours: float, base: float, how: str) -> float:
    return base / ours if how == "ratio" else 1 - ours / base


def vs_fair(res: dict[str, dict]) -> dict | None:
    """The CPU-aware policy against the best fair baseline in ``res`` ({variant: summary}), per
    figure of ``_COMPARED`` (the baseline with the lowest latency it compares), pooled over seeds
    and per seed (each seed against its own best). None without both; a figure whose latency no
    run measured (no CPU-heavy class) is left out."""
    fair = [v for v in FAIR_BASELINES if v in res]
    if "optimized" not in res or not fair:
        return None
    opt = res["optimized"]
    out: dict = {"best_fair_baseline": {}, "per_seed": {s: {} for s in opt["per_seed"]}}
    for fig, (key, how, name) in _COMPARED.items():
        if opt.get(key) is None or any(res[v].get(key) is None for v in fair):
            continue
        best = min(fair, key=lambda v: res[v][key])
        out[fig] = _compare(opt[key], res[best][key], how)
        out["best_fair_baseline"][name] = best
        for s, o in opt["per_seed"].items():
            out["per_seed"][s][fig] = _compare(o[key], min(res[v]["per_seed"][s][key] for v in fair), how)
    return out


def _ratio_bound(results: dict) -> float | None:
    """What ``cpu_task_latency_ratio_vs_fair`` would read if the policy kept the CPU-sensitive
    requests as fast under oversubscription as the fastest variant ran them at the fitting load:
    their LLM waits and their own CPU time stay, whatever the scheduling, so a target above this
    asks for more than removing all contention gives. None without both loads."""
    over, fit = results.get("oversubscribed", {}), results.get("fit", {})
    fair = [v for v in FAIR_BASELINES if v in over]
    if not fair or not fit:
        return None
    best_fair = min(over[v]["cpu_task_mean_latency_s"] for v in fair)
    floor = min(r["cpu_task_mean_latency_s"] for r in fit.values())
    return best_fair / floor if floor else None


def _headline(out: dict, classes: dict) -> dict:
    """Headline keys: each figure at the oversubscribed load bare, at any other load suffixed by its
    name; their spread over the seeds; the best fair baseline each divides by; which classes the
    CPU-sensitive and CPU-heavy figures cover, and why (``classes``)."""
    head: dict = {
        "cpu_task": "+".join(classes["cpu_sensitive"]),
        "cpu_heavy_task": "+".join(classes["cpu_heavy"]) or None,
        "cpu_task_rule": classes["rule"],
        "heldout_seeds": out["seeds"],
        "offered_cpu_load": {},
        "seed_spread": {},
        "best_fair_baseline": {},
    }
    for load, res in out["results"].items():
        head["offered_cpu_load"][load] = out["loads"][load]["offered_cpu_load"]
        cmp = vs_fair(res)
        if cmp is None:
            continue
        sfx = "" if load == "oversubscribed" else f"_{load}"
        for k in _COMPARED:
            if k not in cmp:
                continue
            head[f"{k}_vs_fair{sfx}"] = cmp[k]
            vals = [d[k] for d in cmp["per_seed"].values()]
            head["seed_spread"][f"{k}_vs_fair{sfx}"] = [min(vals), max(vals)]
        head["best_fair_baseline"][load] = cmp["best_fair_baseline"]
    head["cpu_task_latency_ratio_bound"] = _ratio_bound(out["results"])
    head["requests_failed"] = sum(x["failed"] for res in out["results"].values() for x in res.values())
    return head


async def _run_loads(h: Harness, cfg: WorkloadConfig, store: ProfileStore, variants, repeats, progress, out) -> dict:
    """Every (seed, load, variant) run, variants rotated per round; {(load, variant): [(seed, run)]}."""
    from hwtopo import usable_cpus

    cores = usable_cpus()
    cpr = {t: v for t, v in store.cores_per_request().items() if t in cfg.types}
    out["loads"] = {}
    for name, target in cfg.loads:
        n, offered = size_load(target, cpr, len(cores), cfg.max_per_type)
        if cfg.per_type is not None:
            n, offered = cfg.per_type, cfg.per_type * sum(cpr.values()) / len(cores)
        out["loads"][name] = {
            "target": target,
            "per_type": n,
            "requests": n * len(cfg.types),
            "offered_cpu_load": offered,
        }
    runs: dict[tuple[str, str], list[tuple[int, dict]]] = {}
    k = 0
    for seed in cfg.seeds:
        for name, _ in cfg.loads:
            n = out["loads"][name]["per_type"]
            workload = make_workload(cfg, n, seed)
            mix = {t: float(n) for t in cfg.types}
            for _ in range(repeats):
                for v in _schedule(tuple(variants), k):
                    if progress:
                        progress(f"seed {seed}, load {name} ({len(workload)} requests): {v}")
                    pol = _policy(v, store, cores, h.sampler, mix)
                    h.set_policy(pol)
                    run = await run_workload(h, workload, h.sampler)
                    runs.setdefault((name, v), []).append((seed, run))
                    out["order"].append(f"{seed}/{name}/{v}")
                k += 1
    h.set_policy(NativePolicy())
    return runs


async def check_service(cfg: WorkloadConfig, store: ProfileStore, concurrency: int, progress=None) -> dict:
    """``servicecheck.lost_requests`` at twice ``concurrency`` with 20 % malformed requests, against
    ``agentdyn serve`` with the CPU-aware policy on ``store``'s profiles and the bench's emulated LLM;
    the valid requests are the bench's task types and inputs in turn."""
    from .servicecheck import lost_requests

    n = 2 * concurrency
    if progress:
        progress(f"service: {n} requests at once, 20% malformed, then SIGTERM")
    fd, path = tempfile.mkstemp(prefix="agentdyn-profiles-", suffix=".json")
    os.close(fd)
    try:
        store.save(path)
        e = cfg.emulator
        args = [
            *("--policy", "optimized", "--profiles", path, "--tool-timeout", str(cfg.tool_timeout_s)),
            # SIGTERM comes while all of them are in flight: the drain may take as long as they do
            *("--drain-timeout", str(SERVICE_TIMEOUT_S)),
            *("--ttft", str(e.ttft_s), "--tokens-per-s", str(e.tokens_per_s), "--seed", str(cfg.seed)),
        ]

        def valid(i: int) -> dict:
            t = cfg.types[i % len(cfg.types)]
            return {"task_type": t, "input": task_input(t, i // len(cfg.types), cfg)}

        return await lost_requests(
            n, valid, 0.2, seed=cfg.seeds[0], serve_args=tuple(args), timeout_s=SERVICE_TIMEOUT_S
        )
    finally:
        os.unlink(path)


async def bench(
    cfg: WorkloadConfig,
    variants: tuple[str, ...] = VARIANTS,
    progress=None,
    repeats: int = 1,
    service: bool = False,
) -> dict:
    """The fair baselines and the CPU-aware policy on the same workloads at each load and held-out
    seed; returns results per load and variant, and the headline. ``service``: also count the
    requests the real HTTP service loses (``check_service``) at twice the largest load's
    concurrency, as ``requests_lost``."""
    bad = [v for v in variants if v not in VARIANTS + REFERENCES]
    if bad:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS + REFERENCES)}, not {bad[0]!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, not {repeats}")
    sampler = SystemSampler(0.1).start()
    out: dict = {"results": {}, "order": [], "seeds": list(cfg.seeds)}
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
            t0 = time.monotonic()
            store = await calibrate(h, cfg, sampler)
            out["profiles"] = store.to_dict()
            out["host"] = host_check(store, sampler.summary(since=t0))
            from hwtopo import usable_cpus

            sensitive, heavy, rule = cpu_sensitive_tasks(store, len(usable_cpus()))
            out["classes"] = {"cpu_sensitive": sensitive, "cpu_heavy": heavy, "rule": rule}
            runs = await _run_loads(h, cfg, store, variants, repeats, progress, out)
            out["watcher_overhead"] = h.runtime.watcher.overhead()
    finally:
        sampler.stop()
    for (load, v), rs in runs.items():
        out["results"].setdefault(load, {})[v] = _merge(rs, sensitive, heavy)
    await asyncio.sleep(0.2)
    head = _headline(out, out["classes"])
    head["host_quiet"] = out["host"]["quiet"]
    head["zombie_processes"] = len(zombie_children())
    head["sandbox_escapes"] = await _escape_attempts(out, progress)
    out["headline"] = head
    if service:
        conc = max(x["requests"] for x in out["loads"].values())
        out["service"] = await check_service(cfg, store, conc, progress)
        head["requests_lost"] = out["service"]["lost"]
        head["service_leftovers"] = len(out["service"]["leftovers"])
    out["sampler_overhead"] = sampler.overhead()
    return out
