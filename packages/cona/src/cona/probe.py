"""Throughput: short real probes of a strategy (cached per strategy) and a cost model fitted from them.

The cost model is per (dp, tp, pp) layout: a step runs ``slots`` sequential micro-batch slots
(``accum`` for pp=1, ``accum + pp - 1`` for GPipe), so

    step_s = c0 + c1 * slots + c2 * slots * micro_batch        (c >= 0, least squares)

which predicts every micro-batch / global-batch combination of a layout from three probes of it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import hwtopo

from .space import Strategy

__all__ = [
    "cache_dir",
    "code_digest",
    "CostModel",
    "ProbeCache",
    "probe_key",
    "paired_rates",
    "probe_plan",
    "round_steps",
    "time_steps",
]

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlsyskit" / "cona"


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
    plan = []
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
    """Median seconds of ``steps`` timed calls of ``step_fn()`` after ``warmup`` untimed ones (the
    typical step under the machine's current load, which is what training will see).

    ``steps_after_first(seconds)``, when given, sets the number of timed steps from the first timed one
    (e.g. fewer for a slow strategy, whose long steps already average out the machine's jitter); in a
    distributed probe it must return the same count on every rank, since each step holds collectives.
    """
    for _ in range(warmup):
        step_fn()
    times = []
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
    """Throughputs of strategies timed in alternating blocks, one block each per cycle (``cycles``: per cycle,
    strategy -> samples/s of its block). Each strategy's figure is its median over cycles of its rate relative to
    the cycle's geometric mean, so a drift or a burst of the machine's speed that a cycle's blocks share cancels
    from the ratios. ``reference``: strategy -> samples/s measured otherwise (the probe rounds); the figures are put
    at its level, the median over the strategies of reference / figure (one reference read in a slow spell moves
    no figure: a geometric mean lowered all seven of a 2-rank table by ~7% for one at 0.62 of its speed, 2026-12-02).
    Default level: the geometric mean of the strategies' median block rates."""
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
    """Short hash of the source that sets a step's time (executor, model, process groups, strategy space,
    probe) and the transformers version the model runs through: a cache entry measured by other code is
    stale. (The 4-rank entries reused until 2026-11-30 21:51 UTC had been measured at 12:44 UTC, before the
    executor's 17:46 changes, under load 2.5: gb256 read 4178 samples/s against 3660-4060 measured in
    training, gb64 2545 against 2520-2970.) Where the sources cannot be read (a bytecode-only install) the
    package version stands in, marked so, and every process computes the same value."""
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
            version = metadata.version("cona")
        except metadata.PackageNotFoundError:
            version = "unknown"
        return f"no-source-{version}"
    return h.hexdigest()[:12]


def probe_key(**parts) -> str:
    """The cache key of a probe setting: this machine (host, cores), the software and the workload.

    Step times only transfer between runs that share all of these; anything else is probed afresh.
    """
    import platform

    import torch

    m = hwtopo.probe()
    base = {"host": platform.node(), "cores": m.cores, "threads": m.threads, "torch": torch.__version__}
    return json.dumps(base | parts, sort_keys=True, default=str)


@dataclass
class ProbeCache:
    """Measured step times by (machine, model, world, strategy), in a JSON file written atomically.

    Each entry keeps the median step time, what the probe cost (seconds of measuring) and when it was
    measured, so a run that reuses the cache can report the probing cost it did not pay again.
    """

    path: Path
    key: str
    data: dict = field(default_factory=dict)

    @classmethod
    def open(cls, key: str, path: Path | None = None) -> ProbeCache:
        path = Path(path) if path is not None else cache_dir() / "probes.json"
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        return cls(path, key, data)

    def entry(self, s: Strategy) -> dict | None:
        e = self.data.get(self.key, {}).get(s.name)
        if isinstance(e, (int, float)):  # older format: the step time alone
            return {"step_s": float(e), "cost_s": None, "measured_at": None}
        if isinstance(e, dict) and isinstance(e.get("step_s"), (int, float)) and e["step_s"] > 0:
            return e
        return None

    def get(self, s: Strategy) -> float | None:
        e = self.entry(s)
        return float(e["step_s"]) if e else None

    def put(self, s: Strategy, step_s: float, cost_s: float | None = None, rounds: list[float] | None = None,
            **extra) -> None:  # fmt: skip
        if not step_s > 0:
            raise ValueError(f"step time of {s.name} must be > 0, got {step_s}")
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        # the load it was measured under: a cache filled on a busy machine is visible (re-probe with
        # `cona bench --no-probe-cache`)
        self.data.setdefault(self.key, {})[s.name] = {"step_s": float(step_s), "cost_s": cost_s, "measured_at": stamp,
                                                      "loadavg_1m": os.getloadavg()[0], "rounds": rounds} | extra  # fmt: skip

    def clear(self) -> None:
        self.data.pop(self.key, None)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        hwtopo.atomic_write_text(self.path, json.dumps(self.data, indent=1, sort_keys=True))
