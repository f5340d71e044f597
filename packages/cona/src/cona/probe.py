"""Throughput: real probes of strategies, a per-layout cost model fitted from them, and a cache across runs.

``Prober`` times the probe plan, the model's fastest strategies and the fastest of every global batch in
interleaved rounds (median kept), then every global batch's contenders against each other in paired cycles
(``paired_rates``), so that a drift of the machine's speed lands on all of them alike. The cost model is per
(dp, tp, pp) layout, a step running ``slots`` sequential micro-batch slots (``accum + pp - 1``):

    step_s = c0 + c1 * slots + c2 * slots * micro_batch        (c >= 0, least squares)
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import hwtopo
from hwtopo import console

from . import dist as cdist
from .space import Strategy

__all__ = [
    "code_digest",
    "machine_digest",
    "CostModel",
    "ProbeCache",
    "Prober",
    "paired_rates",
    "pair_contenders",
    "merge_paired",
    "probe_plan",
    "round_steps",
    "time_steps",
    "fastest_per_batch",
    "rank0",
    "rank0_all",
    "every_rank",
]

log = logging.getLogger(__name__)
progress = logging.getLogger("cona.progress")  # the bench's progress lines (rank 0 only)


def _features(s: Strategy) -> list[float]:
    slots = s.accum + s.pp - 1
    return [1.0, float(slots), float(slots * s.micro_batch)]


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (tiny active-set loop; 3 unknowns)."""
    active = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


@dataclass
class CostModel:
    """Step time per layout, fitted from measured (strategy, seconds per step) pairs."""

    measured: dict[Strategy, float] = field(default_factory=dict)
    _coef: dict[tuple[int, int, int], np.ndarray] = field(default_factory=dict)

    def add(self, s: Strategy, step_s: float) -> None:
        if not step_s > 0:
            raise ValueError(f"step time of {s.name} must be > 0, got {step_s}")
        self.measured[s] = float(step_s)
        self._coef.pop((s.dp, s.tp, s.pp), None)

    def _fit(self, layout: tuple[int, int, int]) -> np.ndarray | None:
        if layout not in self._coef:
            pts = [(s, t) for s, t in self.measured.items() if (s.dp, s.tp, s.pp) == layout]
            if not pts:
                return None
            X = np.array([_features(s) for s, _ in pts])
            y = np.array([t for _, t in pts])
            self._coef[layout] = _nnls(X, y)
        return self._coef[layout]

    def step_time(self, s: Strategy) -> tuple[float, str]:
        """(seconds per step, "probe" or "model"); KeyError when the layout was never probed."""
        if s in self.measured:
            return self.measured[s], "probe"
        coef = self._fit((s.dp, s.tp, s.pp))
        if coef is None:
            raise KeyError(f"no probe of layout dp{s.dp}-tp{s.tp}-pp{s.pp}; probe one of its strategies first")
        return float(np.dot(coef, _features(s))), "model"

    def throughput(self, s: Strategy) -> tuple[float, str]:
        """(samples per second, source)."""
        t, src = self.step_time(s)
        return s.global_batch / max(t, 1e-9), src

    def relative_error(self) -> float:
        """Leave-one-out median relative error of the fitted model over the probes (nan if too few)."""
        errs = []
        for s, t in self.measured.items():
            others = CostModel({k: v for k, v in self.measured.items() if k != s})
            try:
                pred, _ = others.step_time(s)
            except KeyError:
                continue
            errs.append(abs(pred - t) / t)
        return statistics.median(errs) if errs else float("nan")


def probe_plan(candidates: Iterable[Strategy], per_layout: int = 3) -> list[Strategy]:
    """Which strategies to probe: per layout the extremes of slots x micro-batch (3 points fit the model)."""
    by_layout: dict[tuple[int, int, int], list[Strategy]] = {}
    for s in candidates:
        by_layout.setdefault((s.dp, s.tp, s.pp), []).append(s)
    plan: list[Strategy] = []
    for group in by_layout.values():
        picks = [
            min(group, key=lambda s: (s.global_batch, s.micro_batch)),
            max(group, key=lambda s: (s.micro_batch, -s.global_batch)),
            max(group, key=lambda s: (s.accum, s.global_batch)),
            max(group, key=lambda s: (s.global_batch, s.micro_batch)),
        ]
        for s in dict.fromkeys(picks):
            if len([p for p in plan if (p.dp, p.tp, p.pp) == (s.dp, s.tp, s.pp)]) < per_layout:
                plan.append(s)
    return plan


def time_steps(step_fn, steps: int = 3, warmup: int = 1, steps_after_first=None) -> float:
    """Median seconds of ``steps`` timed calls of ``step_fn()`` after ``warmup`` untimed ones.
    ``steps_after_first(seconds)`` resets ``steps`` from the first timed call (the same on every rank)."""
    for _ in range(warmup):
        step_fn()
    times: list[float] = []
    while len(times) < steps:
        t0 = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - t0)
        if len(times) == 1 and steps_after_first is not None:
            steps = int(steps_after_first(times[0]))
    return statistics.median(times)


def round_steps(first_step_s: float, max_steps: int, round_s: float | None, min_steps: int = 3) -> int:
    """Timed steps of one probe round: ``max_steps``, or fewer where they would take longer than ``round_s``
    (never fewer than ``min_steps``); None: no time limit."""
    if round_s is None or first_step_s <= 0:
        return max_steps
    return max(min(min_steps, max_steps), min(max_steps, math.ceil(round_s / first_step_s)))


def paired_rates(cycles: list[dict], reference: dict | None = None) -> dict:
    """Throughputs from ``cycles`` (per cycle, strategy -> samples/s of its block): each strategy's median over
    cycles of its rate relative to the cycle's geometric mean, so a speed change the cycle shares cancels. The
    level: the median over strategies of ``reference`` (samples/s from the rounds) / figure, so one slow reference
    moves nothing; without a reference the geometric mean of the median block rates."""
    if not cycles or any(set(c) != set(cycles[0]) for c in cycles):
        raise ValueError("paired_rates needs at least one cycle, each timing the same strategies")
    names = list(cycles[0])
    means = [statistics.geometric_mean(c.values()) for c in cycles]
    rel = {n: statistics.median(c[n] / m for c, m in zip(cycles, means)) for n in names}
    if reference is None:
        level = statistics.geometric_mean(statistics.median(c[n] for c in cycles) for n in names)
        scale = level / statistics.geometric_mean(rel.values())
    else:
        scale = statistics.median(reference[n] / rel[n] for n in names)
    return {n: scale * rel[n] for n in names}


DIGEST_SOURCES = ("executor.py", "model.py", "dist.py", "space.py", "probe.py")  # the code that sets a step's time


def code_digest() -> str:
    """Short hash of ``DIGEST_SOURCES`` and the transformers version: a step time measured by other code is
    stale. Without readable sources (a bytecode-only install) the package version stands in, marked so."""
    import hashlib
    from importlib import metadata, resources

    import transformers

    h = hashlib.sha256(f"transformers {transformers.__version__}".encode())
    try:
        pkg = resources.files("cona")
        for name in DIGEST_SOURCES:
            h.update((pkg / name).read_bytes())
    except OSError:
        try:
            version = metadata.version("mlsyskit-cona")
        except metadata.PackageNotFoundError:
            version = "unknown"
        return f"no-source-{version}"
    return h.hexdigest()[:12]


def machine_digest() -> str:
    """Short hash of this machine as hwtopo probes it (cores, threads, memory, NUMA nodes, disks): a step time
    measured on another machine, or on this one resized, is stale."""
    import hashlib

    text = json.dumps(hwtopo.to_dict(hwtopo.probe_cluster()), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass
class ProbeCache:
    """Measured step times by key (``bench_probe_key``: machine, software, code, settings) and strategy in a JSON
    file written atomically, each with what measuring it cost, when, and the 1-minute load average when the run
    that measured it opened the cache (``load_1m``: every run reads it at the same point, as its probing begins). An
    entry probed under a load more than a tolerance away from the load now is stale (``fresh``)."""

    path: Path
    key: str
    data: dict = field(default_factory=dict)
    load_1m: float = field(default_factory=lambda: os.getloadavg()[0])

    @classmethod
    def open(cls, key: str, path: Path | None = None) -> ProbeCache:
        path = Path(path) if path is not None else console.cache_dir("cona") / "probes.json"
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        return cls(path, key, data)

    def entry(self, s: Strategy) -> dict | None:
        e = self.data.get(self.key, {}).get(s.name)
        ok = isinstance(e, dict) and isinstance(e.get("step_s"), (int, float)) and e["step_s"] > 0
        return e if ok else None

    def fresh(self, strategies: Iterable[Strategy], load_tolerance: float) -> tuple[dict, dict]:
        """(name -> entry probed under a load within ``load_tolerance`` of ``load_1m``, name -> why each other
        entry of ``strategies`` is stale); an entry without its load is stale too."""
        load_now = self.load_1m
        fresh, stale = {}, {}
        for s in strategies:
            e = self.entry(s)
            if e is None:
                continue
            load = e.get("loadavg_1m")
            if not isinstance(load, (int, float)):
                stale[s.name] = "no load recorded"
            elif abs(load - load_now) > load_tolerance:
                stale[s.name] = f"probed at load {load:.2f}, now {load_now:.2f} (tolerance {load_tolerance:g})"
            else:
                fresh[s.name] = e
        return fresh, stale

    def other_tables(self) -> list[list[str]]:
        """For each table cached under another key, the key fields that differ from this one's (why it is not
        read: another machine, software, code or setting)."""

        def fields(key: str) -> dict:
            try:
                d = json.loads(key)
            except ValueError:
                return {"key": key}
            return d if isinstance(d, dict) else {"key": key}

        mine = fields(self.key)
        others = [fields(k) for k in self.data if k != self.key]
        return [sorted(f for f in set(mine) | set(o) if mine.get(f) != o.get(f)) for o in others]

    def put(
        self, s: Strategy, step_s: float, cost_s: float | None = None, rounds: list[float] | None = None, **extra
    ) -> None:
        if not step_s > 0:
            raise ValueError(f"step time of {s.name} must be > 0, got {step_s}")
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        entry = {"step_s": float(step_s), "cost_s": cost_s, "measured_at": stamp, "loadavg_1m": self.load_1m}
        self.data.setdefault(self.key, {})[s.name] = entry | {"rounds": rounds} | extra

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        hwtopo.atomic_write_text(self.path, json.dumps(self.data, indent=1, sort_keys=True))


def rank0_all(*xs: float) -> list[float]:
    """Rank 0's values on every rank, in one broadcast: measured times drive identical decisions on every rank."""
    t = torch.tensor(xs, dtype=torch.float64, device=cdist.current_device())
    dist.broadcast(t, 0)
    return t.tolist()


def every_rank(*xs: float) -> list[list[float]]:
    """Every rank's values, by rank, on every rank (one all_gather): which rank was slow, known everywhere."""
    t = torch.tensor(xs, dtype=torch.float64, device=cdist.current_device())
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def rank0(x: float) -> float:
    """Rank 0's value on every rank."""
    return rank0_all(x)[0]


Throughput = Callable[[Strategy], tuple[float, str]]


def fastest_per_batch(candidates: Iterable[Strategy], throughput: Throughput) -> list[Strategy]:
    """The fastest strategy (by ``throughput(s) -> (samples/s, source)``) of every global batch, smallest first
    (ties: the first listed)."""
    fastest: dict[int, Strategy] = {}
    for s in candidates:
        if s.global_batch not in fastest or throughput(s)[0] > throughput(fastest[s.global_batch])[0]:
            fastest[s.global_batch] = s
    return [fastest[g] for g in sorted(fastest)]


def fastest_first(candidates: Iterable[Strategy], throughput: Throughput) -> list[Strategy]:
    """Candidates, fastest first (name breaks ties)."""
    return sorted(candidates, key=lambda c: (-throughput(c)[0], c.name))


def pair_contenders(
    candidates: Sequence[Strategy],
    step_s: Mapping[Strategy, float],
    fastest_round_s: Mapping[Strategy, float],
    leaders: Sequence[Strategy],
    band: float,
) -> list[Strategy]:
    """The strategies the paired cycles time again, in ``candidates``' order: every global batch's leader and every
    measured strategy whose samples/s by its fastest round (or table figure, if faster) reach ``1 - band`` of the
    best such figure of its global batch. Fastest against fastest: interference only slows a round."""

    def rate(s: Strategy) -> float:
        return s.global_batch / min(fastest_round_s.get(s, math.inf), step_s[s])

    best: dict[int, float] = {}
    for s in candidates:
        if s in step_s:
            best[s.global_batch] = max(best.get(s.global_batch, 0.0), rate(s))
    lead = set(leaders)
    return [s for s in candidates if s in lead or (s in step_s and rate(s) >= (1 - band) * best[s.global_batch])]


def merge_paired(before: dict | None, later: dict) -> dict:
    """The report of the paired passes so far: ``later`` (one pass) folded into ``before`` (or None); a strategy
    timed again keeps its latest figures."""
    if before is None:
        return later
    return later | {
        "contenders": list(dict.fromkeys(before["contenders"] + later["contenders"])),
        "cost_s": before["cost_s"] + later["cost_s"],
        "passes": before["passes"] + later["passes"],
        "block_steps": before["block_steps"] | later["block_steps"],
        "rate_vs_rounds": before["rate_vs_rounds"] | later["rate_vs_rounds"],
    }


def bench_probe_key(cfg) -> str:
    """The cache key of a bench's probes (``BenchConfig``): this machine (``machine_digest``), the software
    (torch, transformers), the code (``code_digest``), the model, the world and the settings that decide what a
    probe measures."""
    import transformers

    c = cfg
    key: dict[str, object] = {"machine": machine_digest(), "torch": torch.__version__}
    key["transformers"] = transformers.__version__
    key |= {"world": c.world, "model": [c.layers, c.hidden, c.heads, c.kv_heads, c.intermediate], "seq_len": c.seq_len}
    key |= {"backend": cdist.backend(), "clip": c.clip_norm is not None, "code": code_digest()}
    key |= {"probe_steps": c.probe_steps, "probe_rounds": c.probe_rounds, "round_s": c.probe_round_s}
    key["paired"] = [c.probe_paired_cycles, c.probe_paired_block_s, c.probe_paired_band]
    return json.dumps(key, sort_keys=True, default=str)


class Prober:
    """Measures the throughput table of a bench ``Trainer`` ``tr`` into ``tr.cost``: from the ``ProbeCache`` where
    an earlier run measured it under the same key, else now (and cached)."""

    def __init__(self, tr) -> None:
        self.tr, self.cfg, self.cost = tr, tr.cfg, tr.cost
        self.round_step_s: dict[Strategy, float] = {}  # each probed strategy's figure from its rounds alone
        self.fastest_round_s: dict[Strategy, float] = {}  # and its fastest round (a contender by it)
        self.cache: ProbeCache | None = None
        self.measured_now: list[str] = []
        self.cost_s = 0.0  # seconds of measuring in this run
        self.spreads: list[float] = []  # (slowest - fastest round) / median, per strategy measured now

    def run(self) -> dict:
        """Measure (or reuse) the table; the report the bench's JSON carries."""
        cfg, tr = self.cfg, self.tr
        t0 = time.perf_counter()
        cached: dict = {}
        table: dict = {"key": None, "load_1m": os.getloadavg()[0], "load_tolerance": cfg.probe_load_tolerance}
        stale: dict = {}
        if cfg.probe_cache and dist.get_rank() == 0:
            self.cache = ProbeCache.open(bench_probe_key(cfg))
            table |= {"key": json.loads(self.cache.key), "load_1m": self.cache.load_1m}
            table["other_tables_differ_in"] = self.cache.other_tables()
            cached, stale = self.cache.fresh(tr.candidates, cfg.probe_load_tolerance)
        box = [cached if self.cache else {}]
        dist.broadcast_object_list(box, 0)  # every rank takes the same path: measure or reuse
        cached = box[0]
        if stale:
            progress.info("re-probing %d cached strategies: %s", len(stale), next(iter(stale.values())))
        reused = self._reuse(cached)
        plan = probe_plan(tr.candidates)
        fresh = [s for s in plan if s.name not in cached]
        if fresh:
            limit = f", fewer past {cfg.probe_round_s:g} s" if cfg.probe_round_s else ""
            where = "cached for later runs" if cfg.probe_cache else "not cached"
            msg = "probing %d strategies: %d interleaved rounds of %d steps each%s (%s)"
            progress.info(msg, len(fresh), cfg.probe_rounds, cfg.probe_steps, limit, where)
        self._measure(plan)
        self._verify()
        paired = self._paired_passes({n for n, e in cached.items() if e.get("paired")})
        if self.cache is not None and (self.measured_now or (paired and paired["measured"])):
            self.cache.save()
        old_cost = sum((cached[n].get("cost_s") or 0.0) for n in reused)
        loads = [cached[n]["loadavg_1m"] for n in reused]
        # fresh by construction: every figure is this run's or was probed with the same key under a load close to now
        table |= {"fresh": True, "reused": bool(reused), "stale_entries_reprobed": stale}
        return {
            "table": table,
            "measured_now": self.measured_now,
            "from_cache": reused,
            "probe_s": rank0(time.perf_counter() - t0),
            "probe_measure_s": self.cost_s,
            "cached_probe_cost_s": old_cost,
            "total_probe_cost_s": self.cost_s + old_cost,
            "cache": str(self.cache.path) if self.cache is not None else None,
            "cached_measured_at": sorted({cached[n].get("measured_at") or "?" for n in reused}),
            "cached_max_loadavg_1m": max(loads) if loads else None,
            "cost_model_loo_rel_error": self.cost.relative_error(),
            "probe_rounds": cfg.probe_rounds,
            "round_spread_median": statistics.median(self.spreads) if self.spreads else None,
            "paired": paired,
        }

    def _reuse(self, cached: dict) -> list[str]:
        """Every strategy an earlier run measured goes into the table."""
        reused = []
        for s in self.tr.candidates:
            if s.name in cached:
                e = cached[s.name]
                self.cost.add(s, e["step_s"])
                self.round_step_s[s] = (e.get("paired") or {}).get("rounds_step_s", e["step_s"])
                self.fastest_round_s[s] = min(e.get("rounds") or [self.round_step_s[s]])
                reused.append(s.name)
        return reused

    def _measure(self, todo: list[Strategy]) -> None:
        """Time the strategies not measured yet in ``probe_rounds`` interleaved rounds (each builds and times every
        strategy once) and keep each one's lower median round."""
        cfg, tr = self.cfg, self.tr
        fresh = [s for s in dict.fromkeys(todo) if s not in self.cost.measured]
        times: dict[Strategy, list[float]] = {s: [] for s in fresh}
        costs = dict.fromkeys(fresh, 0.0)

        def steps(first_s: float) -> int:
            return round_steps(rank0(first_s), cfg.probe_steps, cfg.probe_round_s)

        for _ in range(cfg.probe_rounds):
            for s in fresh:
                tp = time.perf_counter()
                ex = tr.executor(s, tr.state0)
                batch = tr.data.samples(0, s.global_batch)
                secs = time_steps(partial(ex.train_step, batch, gns=False), cfg.probe_steps, steps_after_first=steps)
                secs, cost = rank0_all(secs, time.perf_counter() - tp)
                times[s].append(secs)
                costs[s] += cost
                del ex
        for s in fresh:
            secs = statistics.median_low(times[s])
            self.cost.add(s, secs)
            self.round_step_s[s] = secs
            self.fastest_round_s[s] = min(times[s])
            self.measured_now.append(s.name)
            self.cost_s += costs[s]
            self.spreads.append((max(times[s]) - min(times[s])) / secs)
            if self.cache is not None:
                self.cache.put(s, secs, costs[s], rounds=times[s])

    def _verify(self) -> None:
        """Probe the modelled fastest strategies and the fastest of every global batch (an offline searcher
        measures its pick, and cona and the oracle choose among these)."""
        for _ in range(4):
            top = fastest_first(self.tr.candidates, self.cost.throughput)[: self.cfg.probe_verify_top]
            top += fastest_per_batch(self.tr.candidates, self.cost.throughput)
            todo = [c for c in dict.fromkeys(top) if c not in self.cost.measured]
            if not todo:
                return
            self._measure(todo)

    def _paired_passes(self, done: set[str]) -> dict | None:
        """Up to 3 passes of paired cycles (``_paired``), each followed by ``_verify``, since its figures can change
        the leaders; a table reused whole from the cache stands. Leaders left unpaired are named."""
        if not self.cfg.probe_paired_cycles:
            return None
        paired = None
        if not self.measured_now:
            leaders = fastest_per_batch(self.tr.candidates, self.cost.throughput)
            paired = {"contenders": [s.name for s in leaders], "measured": False}
        for _ in range(3 if self.measured_now else 0):
            p = self._paired(done)
            if not p["measured"]:
                paired = paired or p
                break
            self.cost_s += p["cost_s"]
            paired = merge_paired(paired, p)
            done |= set(p["contenders"])
            self._verify()
        leaders = fastest_per_batch(self.tr.candidates, self.cost.throughput)
        assert paired is not None  # set before the loop, or by its first pass (it runs when measured_now)
        paired["unpaired_leaders"] = left = [s.name for s in leaders if s.name not in done]
        if left:
            msg = "after 3 paired passes these global-batch leaders have no paired timing (their figures are their rounds'): %s"
            progress.warning(msg, ", ".join(left))
        return paired

    def _cycles(self, cons: list[Strategy], steps: dict[Strategy, int]) -> list[dict]:
        """``probe_paired_cycles`` cycles of one block per contender, in rotated order: strategy -> samples/s."""
        tr = self.tr
        exs = {s: tr.executor(s, tr.state0) for s in cons}
        batches = {s: tr.data.samples(0, s.global_batch) for s in cons}
        for s in cons:  # one warm-up step each
            exs[s].train_step(batches[s], gns=False)
        cycles = []
        for c in range(self.cfg.probe_paired_cycles):
            row = {}
            for s in cons[c % len(cons) :] + cons[: c % len(cons)]:
                tb = time.perf_counter()
                for _ in range(steps[s]):
                    exs[s].train_step(batches[s], gns=False)
                row[s] = steps[s] * s.global_batch / rank0(time.perf_counter() - tb)
            cycles.append(row)
        return cycles

    def _paired(self, done: set[str]) -> dict:
        """Time the contenders (``pair_contenders``) in cycles and replace their step times by ``paired_rates`` at
        the level of their rounds; nothing when every leader is in ``done`` (paired already)."""
        cfg, tr = self.cfg, self.tr
        leaders = fastest_per_batch(tr.candidates, self.cost.throughput)
        if all(s.name in done for s in leaders):
            return {"contenders": [s.name for s in leaders], "measured": False}
        band = cfg.probe_paired_band
        cons = pair_contenders(tr.candidates, self.cost.measured, self.fastest_round_s, leaders, band)
        t0 = time.perf_counter()
        steps = {s: max(2, math.ceil(cfg.probe_paired_block_s / self.cost.measured[s])) for s in cons}
        cycles = self._cycles(cons, steps)
        cost = rank0(time.perf_counter() - t0)
        before = {s: self.round_step_s.get(s, self.cost.measured[s]) for s in cons}
        rates = paired_rates(cycles, reference={s: s.global_batch / before[s] for s in cons})
        for s in cons:
            self.cost.add(s, s.global_batch / rates[s])
            if self.cache is not None:
                e = self.cache.entry(s) or {}
                paired = {"cycles": cfg.probe_paired_cycles, "block_steps": steps[s], "rounds_step_s": before[s]}
                spent = (e.get("cost_s") or 0.0) + cost / len(cons)
                self.cache.put(s, s.global_batch / rates[s], spent, e.get("rounds"), paired=paired)
        ratio = {s.name: before[s] * rates[s] / s.global_batch for s in cons}  # paired over the rounds' figure
        shown = ", ".join(f"{n} x{r:.2f}" for n, r in ratio.items())
        progress.info("paired timing of %d contenders, %d cycles (%.0f s): %s", len(cons), len(cycles), cost, shown)
        return {
            "contenders": [s.name for s in cons],
            "measured": True,
            "cycles": len(cycles),
            "cost_s": cost,
            "passes": 1,
            "block_steps": {s.name: steps[s] for s in cons},
            "rate_vs_rounds": ratio,
        }
