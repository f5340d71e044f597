"""Workload balancing: per-worker batch size b_i and inner-step count H_i so inner phases end together.

Given each worker's throughput (tokens/s) and memory, pick one inner-phase wall time T so that the
cluster processes about ``target_tokens`` per outer step (T = target / sum of throughputs), then for
every worker the (b_i, H_i) whose phase ``H_i * b_i * seq_len / throughput_i`` is closest to T, with
b_i within the memory limit. Fast workers do more tokens, slow ones fewer, nobody waits. The outer
step then averages pseudo-gradients weighted by tokens (``token_weights``), so a worker's say is its
share of the data. ``Rebalancer`` watches measured throughput and re-plans when it drifts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import hwtopo

__all__ = [
    "BalanceError",
    "WorkerProfile",
    "MemoryModel",
    "WorkerPlan",
    "Plan",
    "plan",
    "uniform_plan",
    "profiles_from_cluster",
    "token_weights",
    "fit_profile",
    "Rebalancer",
    "PhaseClock",
]


class BalanceError(ValueError):
    """A profile or plan request that cannot be satisfied; the message names the field or worker."""


@dataclass(frozen=True)
class WorkerProfile:
    """What the balancer knows about one worker: measured or spec'd throughput and usable memory."""

    name: str
    tokens_per_s: float
    memory_bytes: float = math.inf
    region: str | None = None
    step_overhead_s: float = 0.0  # fixed cost of one step (launches, optimizer) on top of tokens/rate
    sync_overhead_s: float = 0.0  # this worker's own CPU time per outer step outside the inner phase

    def step_time_s(self, batch: int, seq_len: int) -> float:
        return self.step_overhead_s + batch * seq_len / self.tokens_per_s

    def cycle_time_s(self, batch: int, steps: int, seq_len: int) -> float:
        """Inner phase plus this worker's own sync work (compress, decode, outer step): what must be equal."""
        return steps * self.step_time_s(batch, seq_len) + self.sync_overhead_s


UNCAPPED_BATCH = 1 << 30  # "no memory cap" as a batch size other bounds always undercut


@dataclass(frozen=True)
class MemoryModel:
    """Training memory = fixed (weights, grads, optimizer state) + per-sequence activations."""

    fixed_bytes: float = 0.0
    bytes_per_sample: float = 0.0

    def max_batch(self, memory_bytes: float) -> int:
        """Largest batch that fits ``memory_bytes``; unknown (infinite) memory caps nothing."""
        if memory_bytes < self.fixed_bytes:
            return 0
        if self.bytes_per_sample <= 0 or math.isinf(memory_bytes):
            return UNCAPPED_BATCH
        return min(UNCAPPED_BATCH, int((memory_bytes - self.fixed_bytes) // self.bytes_per_sample))


@dataclass(frozen=True)
class WorkerPlan:
    name: str
    batch: int
    inner_steps: int
    tokens: int
    phase_s: float
    weight: float = 0.0


@dataclass(frozen=True)
class Plan:
    """Per-worker (b_i, H_i), the target phase time and how well they meet it."""

    workers: tuple[WorkerPlan, ...]
    seq_len: int
    target_tokens: int
    phase_s: float
    profiles: tuple[WorkerProfile, ...] = field(default=(), compare=False, repr=False)

    @property
    def tokens(self) -> int:
        return sum(w.tokens for w in self.workers)

    @property
    def imbalance(self) -> float:
        """(slowest - fastest inner phase) / slowest: the idle fraction of the first finisher."""
        phases = [w.phase_s for w in self.workers]
        return (max(phases) - min(phases)) / max(phases) if max(phases) > 0 else 0.0

    def worker(self, name: str) -> WorkerPlan:
        for w in self.workers:
            if w.name == name:
                return w
        raise KeyError(f"no worker named {name!r} in the plan; workers are {[w.name for w in self.workers]}")

    def to_dict(self) -> dict:
        return {
            "seq_len": self.seq_len,
            "target_tokens": self.target_tokens,
            "tokens": self.tokens,
            "phase_s": self.phase_s,
            "imbalance": self.imbalance,
            "workers": [w.__dict__.copy() for w in self.workers],
        }


def _check_profiles(profiles: Sequence[WorkerProfile]) -> None:
    if not profiles:
        raise BalanceError("profiles: need at least one worker")
    names = [p.name for p in profiles]
    if len(set(names)) != len(names):
        raise BalanceError(f"profiles: worker names must be unique, got {names}")
    for i, p in enumerate(profiles):
        if not (isinstance(p.tokens_per_s, (int, float)) and p.tokens_per_s > 0 and math.isfinite(p.tokens_per_s)):
            raise BalanceError(f"profiles[{i}].tokens_per_s: {p.tokens_per_s!r} must be a positive finite number")
        if not p.memory_bytes > 0:
            raise BalanceError(f"profiles[{i}].memory_bytes: {p.memory_bytes!r} must be positive")
        if not p.step_overhead_s >= 0:
            raise BalanceError(f"profiles[{i}].step_overhead_s: {p.step_overhead_s!r} must be >= 0")
        if not p.sync_overhead_s >= 0:
            raise BalanceError(f"profiles[{i}].sync_overhead_s: {p.sync_overhead_s!r} must be >= 0")


def _batch_cap(p: WorkerProfile, memory: MemoryModel | None, max_batch: int | None) -> int:
    cap = max_batch if max_batch is not None else 1 << 30
    if memory is not None:
        fits = memory.max_batch(p.memory_bytes)
        if fits < 1:
            need = memory.fixed_bytes + memory.bytes_per_sample
            raise BalanceError(
                f"worker {p.name!r}: {hwtopo.format_bytes(p.memory_bytes)} of memory cannot hold even batch 1 "
                f"(needs {hwtopo.format_bytes(need)}); give it more memory or use a smaller model"
            )
        cap = min(cap, fits)
    return cap


def _check_plan_args(
    profiles: Sequence[WorkerProfile],
    seq_len: int,
    target_tokens: int,
    max_batch: int | None,
    min_steps: int,
    preferred_batch: int | None,
    preferred_steps: int | None,
) -> None:
    """Reject a :func:`plan` request that no plan can satisfy, naming the argument, before any search."""
    _check_profiles(profiles)
    if not isinstance(seq_len, int) or seq_len < 1:
        raise BalanceError(f"seq_len: {seq_len!r} must be a positive integer")
    if not isinstance(target_tokens, int) or target_tokens < seq_len * len(profiles):
        raise BalanceError(
            f"target_tokens: {target_tokens!r} must be an integer >= seq_len x workers = {seq_len * len(profiles)}"
        )
    if max_batch is not None and max_batch < 1:
        raise BalanceError(f"max_batch: {max_batch!r} must be >= 1")
    if min_steps < 1:
        raise BalanceError(f"min_steps: {min_steps!r} must be >= 1")
    if preferred_batch is not None and preferred_batch < 1:
        raise BalanceError(f"preferred_batch: {preferred_batch!r} must be >= 1 (or None: the largest that fits)")
    if preferred_steps is not None and preferred_steps < 1:
        raise BalanceError(f"preferred_steps: {preferred_steps!r} must be >= 1 (or None)")


def _choose_worker(
    p: WorkerProfile,
    cap: int,
    rate: float,
    phase: float,
    seq_len: int,
    min_steps: int,
    tolerance: float,
    preferred_batch: int | None,
    preferred_steps: int | None,
) -> WorkerPlan:
    """One worker's (b, H) whose cycle is nearest ``phase``, ties within ``tolerance`` broken by preference."""
    # beyond the batch that would finish the whole phase in one step nothing improves
    work = max(phase - p.sync_overhead_s, 1e-9)
    top = max(1, min(cap, math.ceil(2 * rate * work / (seq_len * min_steps))))
    cands = []
    for b in range(1, top + 1):
        h = max(min_steps, round(work / p.step_time_s(b, seq_len)))
        t = p.cycle_time_s(b, h, seq_len)
        cands.append((abs(t - phase) / phase, b, h, t))
    best = min(c[0] for c in cands)
    near = [c for c in cands if c[0] <= best + tolerance]
    if preferred_steps is not None:
        _, b, h, t = min(near, key=lambda c: (abs(c[2] - preferred_steps), c[0], -c[1]))
    else:
        pref = preferred_batch if preferred_batch is not None else top
        _, b, h, t = min(near, key=lambda c: (abs(c[1] - pref), c[0], -c[1]))
    return WorkerPlan(p.name, b, h, b * h * seq_len, t)


def _plan_score(ws: list[WorkerPlan], target_tokens: int) -> float:
    """Miss of the token target plus phase imbalance: lower is better, to keep the best rescaled plan."""
    phases = [w.phase_s for w in ws]
    tokens = sum(w.tokens for w in ws)
    return abs(tokens / target_tokens - 1) + (max(phases) - min(phases)) / max(phases)


def plan(
    profiles: Sequence[WorkerProfile],
    seq_len: int,
    target_tokens: int,
    memory: MemoryModel | None = None,
    max_batch: int | None = None,
    preferred_batch: int | None = None,
    min_steps: int = 1,
    tolerance: float = 0.01,
    preferred_steps: int | None = None,
) -> Plan:
    """Choose (b_i, H_i) per worker so inner phases take equal wall time and tokens ~ target_tokens.

    Among candidates within ``tolerance`` of the best phase match, the batch closest to
    ``preferred_batch`` (default: the largest that fits) wins, so optimizer dynamics stay similar;
    with ``preferred_steps`` the inner-step count closest to it wins instead (equal H everywhere
    when memory allows, the speed difference absorbed by the batch size).
    """
    _check_plan_args(profiles, seq_len, target_tokens, max_batch, min_steps, preferred_batch, preferred_steps)
    caps = [_batch_cap(p, memory, max_batch) for p in profiles]
    ref = [min(c, preferred_batch) if preferred_batch else min(c, 8) for c in caps]
    # the cycle T at which the workers, running near their reference batch, make the target together:
    # worker i computes for T - sync_overhead_i (its own sync work is part of its cycle)
    eff = [r * seq_len / p.step_time_s(r, seq_len) for p, r in zip(profiles, ref)]
    phase = (target_tokens + sum(e * p.sync_overhead_s for e, p in zip(eff, profiles))) / sum(eff)

    def choose(phase: float) -> list[WorkerPlan]:
        return [
            _choose_worker(p, cap, rate, phase, seq_len, min_steps, tolerance, preferred_batch, preferred_steps)
            for p, cap, rate in zip(profiles, caps, eff)
        ]

    # the chosen batches run at other efficiencies than the reference one: rescale the phase until
    # the tokens meet the target (a few fixed-point rounds), keeping the best plan seen
    workers, best_phase = choose(phase), phase
    for _ in range(8):
        tokens = sum(w.tokens for w in workers)
        if abs(tokens / target_tokens - 1) < 0.02:
            break
        phase *= target_tokens / tokens
        trial = choose(phase)
        if _plan_score(trial, target_tokens) < _plan_score(workers, target_tokens):
            workers, best_phase = trial, phase
    phase = best_phase
    total = sum(w.tokens for w in workers)
    workers = [replace(w, weight=w.tokens / total) for w in workers]
    return Plan(tuple(workers), seq_len, target_tokens, phase, tuple(profiles))


def uniform_plan(profiles: Sequence[WorkerProfile], seq_len: int, batch: int, inner_steps: int) -> Plan:
    """The DiLoCo baseline: the same (b, H) everywhere, so phases differ by the speed ratio."""
    _check_profiles(profiles)
    workers = [
        WorkerPlan(
            p.name, batch, inner_steps, batch * inner_steps * seq_len, batch * inner_steps * seq_len / p.tokens_per_s
        )
        for p in profiles
    ]
    total = sum(w.tokens for w in workers)
    workers = [replace(w, weight=w.tokens / total) for w in workers]
    return Plan(tuple(workers), seq_len, total, max(w.phase_s for w in workers), tuple(profiles))


def profiles_from_cluster(
    cluster: hwtopo.Cluster | str, tokens_per_s_at_speed_1: float, accelerator_memory: bool = True
) -> list[WorkerProfile]:
    """One profile per machine: throughput = relative speed x reference; memory = accelerator (or host)."""
    if isinstance(cluster, str):
        cluster = hwtopo.load(cluster)
    if not cluster.machines:
        raise BalanceError(f"cluster {cluster.name!r}: has no machines")
    if not tokens_per_s_at_speed_1 > 0:
        raise BalanceError(f"tokens_per_s_at_speed_1: {tokens_per_s_at_speed_1!r} must be positive")
    speeds = cluster.relative_speeds()
    out = []
    for m in cluster.machines:
        mem = m.accelerator_memory_bytes if (accelerator_memory and m.accelerators) else m.total_memory_bytes
        out.append(WorkerProfile(m.name, speeds[m.name] * tokens_per_s_at_speed_1, mem or math.inf, m.region))
    return out


def fit_profile(
    name: str,
    samples: Sequence[tuple[int, float]],
    seq_len: int,
    memory_bytes: float = math.inf,
    region: str | None = None,
) -> WorkerProfile:
    """A profile from measured (batch, seconds per step) pairs: step = overhead + batch*seq/rate.

    With one batch size (or a non-increasing fit) the overhead is taken as zero.
    """
    if not samples:
        raise BalanceError(f"worker {name!r}: no profiling samples")
    for b, t in samples:
        if b < 1 or not t > 0:
            raise BalanceError(f"worker {name!r}: profiling sample (batch={b}, seconds={t}) is not valid")
    xs = [b * seq_len for b, _ in samples]
    ys = [t for _, t in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var > 0:
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
        overhead = my - slope * mx
        if slope > 0 and overhead >= 0:
            return WorkerProfile(name, 1.0 / slope, memory_bytes, region, overhead)
    return WorkerProfile(name, sum(xs) / sum(ys), memory_bytes, region, 0.0)


def token_weights(tokens: Sequence[int]) -> list[float]:
    """Aggregation weights: each worker's share of the tokens of this outer step."""
    if any(t < 0 for t in tokens):
        raise BalanceError(f"tokens: counts must be >= 0, got {list(tokens)}")
    total = sum(tokens)
    if total == 0:
        return [1.0 / len(tokens)] * len(tokens)
    return [t / total for t in tokens]


class Rebalancer:
    """Tracks measured throughput (EMA) and re-plans when any worker drifts past ``threshold``."""

    def __init__(
        self,
        current: Plan,
        threshold: float = 0.15,
        ema: float = 0.5,
        imbalance_threshold: float = 0.03,
        **plan_kwargs,
    ):
        if not 0 < ema <= 1:
            raise BalanceError(f"ema: {ema!r} must be in (0, 1]")
        self.plan = current
        self.threshold = threshold
        self.imbalance_threshold = imbalance_threshold
        self.ema = ema
        self.plan_kwargs = plan_kwargs
        self.rates: dict[str, float] = {p.name: p.tokens_per_s for p in current.profiles}
        self.overheads: dict[str, float] = {p.name: p.sync_overhead_s for p in current.profiles}
        self.replans = 0

    def observe(self, name: str, tokens: int, seconds: float, sync_overhead_s: float | None = None) -> None:
        """A measured inner phase (``tokens`` in ``seconds``; the per-step overhead is taken out) and,
        when given, the worker's own CPU time of its last outer step."""
        if sync_overhead_s is not None and sync_overhead_s >= 0 and name in self.overheads:
            old = self.overheads[name]
            self.overheads[name] = (1 - self.ema) * old + self.ema * sync_overhead_s
        if seconds <= 0 or tokens <= 0:
            return
        prof = {p.name: p for p in self.plan.profiles}.get(name)
        work = seconds
        if prof is not None and prof.step_overhead_s > 0:
            try:
                w = self.plan.worker(name)
                steps = tokens / (w.batch * self.plan.seq_len)
            except KeyError:
                steps = 0
            work = max(seconds - steps * prof.step_overhead_s, 0.2 * seconds)
        rate = tokens / work
        old = self.rates.get(name, rate)
        self.rates[name] = (1 - self.ema) * old + self.ema * rate

    def observe_all(self, measured: Mapping[str, tuple]) -> None:
        """``{name: (tokens, seconds)}`` or ``{name: (tokens, seconds, sync_overhead_s)}``."""
        for name, m in measured.items():
            self.observe(name, *m)

    def drift(self) -> float:
        """Largest relative gap between a worker's measured and planned throughput."""
        return max(abs(self.rates[p.name] - p.tokens_per_s) / p.tokens_per_s for p in self.plan.profiles)

    def _measured_profiles(self) -> list[WorkerProfile]:
        return [
            replace(p, tokens_per_s=self.rates[p.name], sync_overhead_s=self.overheads[p.name])
            for p in self.plan.profiles
        ]

    def predicted_imbalance(self) -> float:
        """Imbalance of the current plan's (b_i, H_i) re-timed with the measured rates and sync overheads."""
        seq = self.plan.seq_len
        cycles = [
            p.cycle_time_s(w.batch, w.inner_steps, seq) for p, w in zip(self._measured_profiles(), self.plan.workers)
        ]
        return (max(cycles) - min(cycles)) / max(cycles) if max(cycles) > 0 else 0.0

    def maybe_replan(self) -> Plan | None:
        """A new plan from the measured rates and sync overheads when throughput drifts past
        ``threshold`` or the current plan would leave the first finisher idle for more than
        ``imbalance_threshold`` of a cycle; else None."""
        # a plan that cannot do better than its own granularity is not re-made every step
        allowed = max(self.imbalance_threshold, self.plan.imbalance + self.imbalance_threshold / 2)
        if self.drift() <= self.threshold and self.predicted_imbalance() <= allowed:
            return None
        profiles = self._measured_profiles()
        self.plan = plan(profiles, self.plan.seq_len, self.plan.target_tokens, **self.plan_kwargs)
        self.replans += 1
        return self.plan


class PhaseClock:
    """Time-boxed inner phases: H_i realised online, one step at a time, from measured step times.

    A fixed plan's (b_i, H_i) can only be as equal as its step-time model is right and its integer
    H_i allows: at a few steps per phase one step is 10-15% of it, and emulated or shared CPUs
    jitter by about as much from phase to phase. Here every worker gets the same deadline, ``cycle_s``
    after the common sync point (the instant the sync's meta all_gather releases every worker), and
    keeps taking steps of its planned batch b_i while one is expected to end before it; the last step
    takes the largest smaller batch that still fits. So the phases end together to within about one
    batch-1 step whatever the jitter, and a worker's own sync work (which runs at its own speed) is
    absorbed in its cycle. ``update`` re-times the cycle from the tokens, compute and post-sync times
    measured on every worker, so the cluster keeps doing about ``target_tokens`` per outer step; its
    inputs come from an all_gather, so every worker computes the same cycle.
    """

    def __init__(
        self,
        cycle_s: float,
        batch: int,
        profile: WorkerProfile,
        seq_len: int,
        target_tokens: int | None = None,
        ema: float = 0.5,
    ):
        if not (cycle_s > 0 and math.isfinite(cycle_s)):
            raise BalanceError(f"cycle_s: {cycle_s!r} must be a positive number of seconds")
        if not isinstance(batch, int) or batch < 1:
            raise BalanceError(f"batch: {batch!r} must be a positive integer")
        if not 0 < ema <= 1:
            raise BalanceError(f"ema: {ema!r} must be in (0, 1]")
        self.cycle_s = float(cycle_s)
        self.batch = batch
        self.profile = profile
        self.seq_len = seq_len
        self.target_tokens = target_tokens
        self.ema = ema
        self.deadline = math.inf
        self.step_s: float | None = None  # measured seconds of one step at ``batch`` (EMA)

    def set_batch(self, batch: int) -> None:
        if self.step_s is not None and batch != self.batch:
            self.step_s *= self.profile.step_time_s(batch, self.seq_len) / self.profile.step_time_s(
                self.batch, self.seq_len
            )
        self.batch = batch

    def begin(self, anchor: float) -> None:
        """Start a phase whose common deadline is ``cycle_s`` after ``anchor`` (perf_counter seconds)."""
        self.deadline = anchor + self.cycle_s

    def estimate(self, batch: int) -> float:
        """Expected seconds of one step at ``batch``: measured at b_i, scaled by the profile's shape."""
        model = self.profile.step_time_s(batch, self.seq_len)
        if self.step_s is None:
            return model
        return self.step_s * model / self.profile.step_time_s(self.batch, self.seq_len)

    def observe_step(self, tokens: int, seconds: float) -> None:
        if seconds <= 0 or tokens <= 0:
            return
        batch = max(1, round(tokens / self.seq_len))
        if batch == self.batch:
            t = seconds
        else:  # a partial last step: scale to b_i with the profile's shape
            t = (
                seconds
                * self.profile.step_time_s(self.batch, self.seq_len)
                / self.profile.step_time_s(batch, self.seq_len)
            )
        self.step_s = t if self.step_s is None else (1 - self.ema) * self.step_s + self.ema * t

    def next_batch(self, now: float) -> int:
        """The batch of the next step (b_i, or a smaller one that fits the time left), 0: sync now."""
        left = self.deadline - now
        if self.estimate(self.batch) <= left:
            return self.batch
        for b in range(self.batch - 1, 0, -1):
            if self.estimate(b) <= left:
                return b
        return 0

    def update(self, tokens: Sequence[int], compute_s: Sequence[float], post_s: Sequence[float]) -> float:
        """Re-time the cycle so the workers, at their measured rates, make ``target_tokens`` together.

        ``post_s[i]``: worker i's seconds from the sync point to the start of its next phase (the
        collective, its own codec and outer-step work); -1 where not measured yet. Identical inputs on
        every worker give the identical cycle.
        """
        if self.target_tokens is None:
            return self.cycle_s
        rates = [t / c for t, c in zip(tokens, compute_s) if c > 0 and t > 0]
        if len(rates) != len(tokens) or any(p < 0 for p in post_s):
            return self.cycle_s
        want = (self.target_tokens + sum(r * p for r, p in zip(rates, post_s))) / sum(rates)
        self.cycle_s = (1 - self.ema) * self.cycle_s + self.ema * want
        return self.cycle_s
