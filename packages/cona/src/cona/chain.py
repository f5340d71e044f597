"""Surrogate and chaining, the paper's core: rank strategies by expected loss decrease per second.

A strategy's surrogate is its goodput: throughput (samples/s, probed or modelled) times the statistical efficiency
of its global batch under the current noise scale and the learning-rate rule (``gns.batch_efficiency``), i.e. the
reference-batch-equivalent samples it processes per second.

The initial choice (``Chainer.initial``) takes, for a noise scale only known to lie in a range, the strategy whose
goodput stays closest to the best anywhere in the range and under every efficiency model named (``robust_choice``).
A running decision (``Chainer.decide``) switches only to a rival that wins over the time left to the target T
(``remaining_time``), its switch cost c paid, wherever in the noise-scale range the truth lies (``switch_gain``):

    switch  iff  min over phi in range of  goodput_new(phi) (T - c) / (goodput_cur(phi) T)  > 1 + margin
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields

from .gns import GradientNoiseScale, batch_efficiency, efficiency_models
from .space import Strategy

__all__ = [
    "Estimate",
    "Decision",
    "Chainer",
    "GoodputScaler",
    "goodput",
    "robust_choice",
    "switch_gain",
    "noise_grid",
    "remaining_time",
]

log = logging.getLogger(__name__)


def goodput(
    throughput_samples_per_s: float, batch: int, noise_scale: float, reference_batch: int, lr_scaling: str = "sqrt"
) -> float:
    """Reference-batch-equivalent samples per second (Pollux goodput) under the learning-rate rule
    ``lr_scaling`` ("sqrt": Adam at lr0 sqrt(M/M0); "tuned": Pollux's per-batch tuned LR)."""
    return throughput_samples_per_s * batch_efficiency(batch, noise_scale, reference_batch, lr_scaling)


@dataclass(frozen=True)
class Estimate:
    strategy: Strategy
    throughput: float  # samples/s
    efficiency: float
    goodput: float
    source: str  # "probe" or "model"

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"strategy": self.strategy.name}


@dataclass(frozen=True)
class Decision:
    step: int
    elapsed_s: float
    current: Strategy | None
    chosen: Strategy
    switched: bool
    reason: str
    noise_scale: float
    switch_cost_s: float
    ranking: tuple[Estimate, ...]
    efficiency_model: str = "sqrt"  # the learning-rate rule(s) the choice assumes ("sqrt+tuned": robust over both)

    def to_dict(self) -> dict:
        named = {"current": self.current.name if self.current else None, "chosen": self.chosen.name}
        top = [e.to_dict() for e in self.ranking[:5]]
        return {f.name: getattr(self, f.name) for f in fields(self)} | named | {"ranking": top}


ThroughputFn = Callable[[Strategy], tuple[float, str]]


def _layout(s: Strategy) -> tuple[int, int, int]:
    return s.dp, s.tp, s.pp


def noise_grid(lo: float, hi: float, points: int = 25) -> list[float]:
    """Noise scales spread geometrically over [lo, hi] (0 included when lo is 0; inf capped at 1e9)."""
    lo = max(lo, 0.0)
    top = hi if math.isfinite(hi) else 1e9
    bottom = max(lo, 1e-3)
    grid = [bottom] if top <= bottom else [bottom * (top / bottom) ** (i / (points - 1)) for i in range(points)]
    return [0.0, *grid] if lo == 0.0 else grid


def switch_gain(
    new_tput: float,
    new_batch: int,
    cur_tput: float,
    cur_batch: int,
    noise_scales: Sequence[float],
    horizon_s: float,
    switch_cost_s: float,
    reference_batch: int,
    lr_scaling: str = "sqrt",
) -> float:
    """Worst case over ``noise_scales`` of the progress a switch makes over ``horizon_s`` (paying
    ``switch_cost_s`` first) relative to staying, minus 1 (-1 when the switch cost eats the horizon)."""
    keep = horizon_s - switch_cost_s
    if keep <= 0:
        return -1.0
    worst = math.inf
    for phi in noise_scales:
        new = new_tput * batch_efficiency(new_batch, phi, reference_batch, lr_scaling) * keep
        cur = cur_tput * batch_efficiency(cur_batch, phi, reference_batch, lr_scaling) * horizon_s
        worst = min(worst, new / cur if cur > 0 else math.inf)
    return worst - 1.0


def remaining_time(trace: Sequence[tuple[float, float]], target_loss: float, window_s: float, cap_s: float) -> float:
    """Training time left until the loss reaches ``target_loss``: the ``(clock, loss)`` points of the last
    ``window_s`` fitted as falling linearly in log(clock), from the mean of the last 3 points. 0 at the target,
    ``cap_s`` when the loss does not fall or there are fewer than 3 points."""
    t_last = trace[-1][0] if trace else 0.0
    pts = [(math.log(t), v) for t, v in trace if t >= t_last - window_s and t > 0 and math.isfinite(v)]
    if len(pts) < 3:
        return cap_s
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(v for _, v in pts) / n
    var = sum((x - mx) ** 2 for x, _ in pts)
    if var <= 0:
        return cap_s
    slope = sum((x - mx) * (v - my) for x, v in pts) / var  # loss per unit of log(clock)
    now = sum(v for _, v in pts[-3:]) / 3
    if now <= target_loss:
        return 0.0
    if slope >= 0:
        return cap_s
    ln_target = sum(x for x, _ in pts[-3:]) / 3 + (target_loss - now) / slope  # log of the clock at the target
    if ln_target > math.log(t_last + cap_s):
        return cap_s
    return max(math.exp(ln_target) - t_last, 0.0)


def robust_choice(
    tputs: Mapping[Strategy, float],
    lo: float,
    hi: float,
    reference_batch: int,
    points: int = 25,
    lr_scaling: str | Sequence[str] = "sqrt",
    tie: float = 0.0,
) -> tuple[Strategy, float]:
    """The strategy whose goodput stays closest to the best over every noise scale in [lo, hi] and every
    efficiency model in ``lr_scaling``, and that worst ratio of its goodput to the best. Strategies within ``tie``
    of the best worst ratio are level: of those the largest global batch, then the fastest, since the noise
    scale only grows from the initial weights on."""
    if not (isinstance(tie, (int, float)) and 0.0 <= tie < 1.0):
        raise ValueError(f"tie must be a fraction in [0, 1), got {tie}")
    worst = worst_ratios(tputs, lo, hi, reference_batch, points, lr_scaling)
    pick = take_level(worst, tputs, tie)
    return pick, worst[pick]


def worst_ratios(
    tputs: Mapping[Strategy, float],
    lo: float,
    hi: float,
    reference_batch: int,
    points: int = 25,
    lr_scaling: str | Sequence[str] = "sqrt",
) -> dict[Strategy, float]:
    """Each strategy's lowest goodput / best goodput over the noise scales in [lo, hi] and the models named."""
    models = efficiency_models(lr_scaling)
    grid = noise_grid(lo, hi, points)
    table = {
        (m, phi): {s: goodput(t, s.global_batch, phi, reference_batch, m) for s, t in tputs.items()}
        for m in models
        for phi in grid
    }
    peak = {k: max(row.values()) for k, row in table.items()}
    return {s: min(table[k][s] / peak[k] for k in table) for s in tputs}


def take_level(worst: Mapping[Strategy, float], tputs: Mapping[Strategy, float], tie: float) -> Strategy:
    """Of the strategies within ``tie`` of the best worst ratio, the largest global batch, then the fastest."""
    top = max(worst.values())
    level = [s for s in worst if worst[s] >= top * (1.0 - tie)]
    return max(level, key=lambda s: (s.global_batch, tputs[s], worst[s], s.name))


@dataclass
class Chainer:
    """Online strategy chaining over a fixed candidate set.

    ``throughput(strategy) -> (samples/s, source)`` (or a mapping of samples/s) from probes or a cost model.
    ``switch_cost_s`` / ``same_layout_cost_s``: priors for a switch that reshards / keeps the dp x tp x pp layout,
    replaced by the mean of the measured ones of that kind (``observe_switch``). ``horizon_s``: what a switch must
    pay off over when no time left is given. ``margin``: the hysteresis, and for the initial choice the tolerance
    within which strategies are level. ``initial_models``: the efficiency models the initial choice must hold
    under (None: the estimator's)."""

    candidates: Sequence[Strategy]
    throughput: ThroughputFn | Mapping[Strategy, float]
    gns: GradientNoiseScale
    horizon_s: float = 10.0
    margin: float = 0.05
    switch_cost_s: float = 0.5
    same_layout_cost_s: float = 0.0
    initial_models: tuple[str, ...] | None = None
    decisions: list[Decision] = field(default_factory=list)
    _switch_costs: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})  # by same layout

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("candidates must list at least one strategy")
        for name in ("horizon_s", "margin", "switch_cost_s", "same_layout_cost_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {v}")
        if self.initial_models is not None:
            self.initial_models = efficiency_models(self.initial_models, "initial_models")

    def _table(self, s: Strategy) -> tuple[float, str]:
        if isinstance(self.throughput, Mapping):
            return float(self.throughput[s]), "probe"
        return self.throughput(s)

    def expected_switch_cost_s(self, current: Strategy | None = None, new: Strategy | None = None) -> float:
        """Expected seconds of a switch from ``current`` to ``new``: the mean measured of its kind (same layout or
        not), else that kind's prior. Without both strategies: a resharding."""
        same = current is not None and new is not None and _layout(current) == _layout(new)
        seen = self._switch_costs[same]
        return sum(seen) / len(seen) if seen else (self.same_layout_cost_s if same else self.switch_cost_s)

    def observe_switch(self, seconds: float, same_layout: bool = False) -> None:
        """A measured switch; ``same_layout`` when it kept the dp x tp x pp layout."""
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be a measured switch time >= 0, got {seconds!r}")
        self._switch_costs[bool(same_layout)].append(float(seconds))

    def rank(self, noise_scale: float | None = None) -> list[Estimate]:
        """Candidates by goodput, best first (ties: higher throughput, then name)."""
        phi = self.gns.noise_scale if noise_scale is None else noise_scale
        out = []
        for s in self.candidates:
            tput, src = self._table(s)
            eff = self.gns.efficiency(s.global_batch, phi)
            out.append(Estimate(s, tput, eff, tput * eff, src))
        return sorted(out, key=lambda e: (-e.goodput, -e.throughput, e.strategy.name))

    def initial(
        self, noise_range: tuple[float, float] | None = None, step: int = 0, elapsed_s: float = 0.0
    ) -> Decision:
        """The strategy to start with: over ``noise_range`` (as after step 0) the ``robust_choice`` under every one
        of ``initial_models``, level within ``margin``; without a range the best goodput at the current estimate."""
        phi = self.gns.noise_scale
        ranking = tuple(self.rank(phi))
        if noise_range is None:
            best = ranking[0]
            reason = (
                f"initial choice: best goodput {best.goodput:.1f} (throughput {best.throughput:.1f}/s x "
                f"efficiency {best.efficiency:.3f}, noise scale {phi:.1f})"
            )
            return self._record(
                Decision(step, elapsed_s, None, best.strategy, True, reason, phi, 0.0, ranking, self.gns.lr_scaling)
            )
        lo, hi = noise_range
        tputs = {e.strategy: e.throughput for e in ranking}
        models = self.initial_models or (self.gns.lr_scaling,)
        ratios = worst_ratios(tputs, lo, hi, self.gns.reference_batch, lr_scaling=models)  # once, read twice
        pick, alone = take_level(ratios, tputs, self.margin), take_level(ratios, tputs, 0.0)
        under = f" under the {' and '.join(models)} efficiency models" if len(models) > 1 else ""
        level = (
            f" (level with {alone.name}'s {ratios[alone]:.3f} within the {self.margin:g} margin: the larger "
            f"global batch, as the noise scale grows from here)"
            if alone != pick
            else ""
        )
        reason = (
            f"initial choice under an uncertain noise scale in [{lo:.1f}, {hi:.1f}]: {pick.name} keeps "
            f">= {ratios[pick]:.3f} of the best goodput anywhere in that range{under}{level}"
        )
        return self._record(Decision(step, elapsed_s, None, pick, True, reason, phi, 0.0, ranking, "+".join(models)))

    def decide(
        self,
        current: Strategy | None,
        step: int = 0,
        elapsed_s: float = 0.0,
        noise_range: tuple[float, float] | None = None,
        remaining_s: float | None = None,
        noise_scale: float | None = None,
        models: Sequence[str] | str | None = None,
    ) -> Decision:
        """The running decision: switch from ``current`` only to a strategy whose progress over ``remaining_s``
        (else ``horizon_s``), its switch cost paid, beats staying by more than ``margin`` at every noise scale in
        ``noise_range`` and under every one of ``models`` (``switch_gain``). ``noise_scale``: the point estimate to
        rank by, in place of the estimator's. ``current`` None: the initial choice."""
        if current is None:
            return self.initial(noise_range, step, elapsed_s)
        models = (self.gns.lr_scaling,) if models is None else efficiency_models(models, "models")
        phi = self.gns.noise_scale if noise_scale is None else noise_scale
        ranking = tuple(self.rank(phi))
        cur = next((e for e in ranking if e.strategy == current), None)
        if cur is None:
            raise ValueError(f"current strategy {current.name} is not among the candidates")

        def decision(chosen: Strategy, reason: str, cost: float) -> Decision:
            switched, m = chosen != current, "+".join(models)
            return self._record(Decision(step, elapsed_s, current, chosen, switched, reason, phi, cost, ranking, m))

        if not self.gns.ready:
            cost = self.expected_switch_cost_s(current, ranking[0].strategy)
            return decision(current, f"stay: no gradient statistics yet for {current.name}", cost)
        lo, hi = noise_range if noise_range is not None else (phi, phi)
        grid = noise_grid(min(lo, phi), max(hi, phi), points=9)
        h = self.horizon_s if remaining_s is None else max(remaining_s, 0.0)

        def gain(e: Estimate) -> float:
            c, m0 = self.expected_switch_cost_s(current, e.strategy), self.gns.reference_batch
            args = (e.throughput, e.strategy.global_batch, cur.throughput, current.global_batch, grid, h, c, m0)
            return min(switch_gain(*args, m) for m in models)

        gains = sorted(
            ((gain(e), e) for e in ranking if e.strategy != current),
            key=lambda ge: (-ge[0], -ge[1].goodput, ge[1].strategy.name),
        )
        cost = self.expected_switch_cost_s(current, gains[0][1].strategy) if gains else 0.0
        left = f"{h:.2f}s to target estimated" if remaining_s is not None else f"a {h:.2f}s horizon"
        where = f"noise scale {phi:.1f} in [{min(lo, phi):.1f}, {max(hi, phi):.1f}], {left}, switch {cost:.2f}s"
        if models != (self.gns.lr_scaling,):
            where += f", under the {' and '.join(models)} efficiency models"
        if gains and gains[0][0] > self.margin:
            g, e = gains[0]
            reason = (
                f"switch: {e.strategy.name} (goodput {e.goodput:.1f} vs {cur.goodput:.1f}) gains >= {g:+.4f} "
                f"of {current.name}'s progress over the remaining time at every noise scale in the range "
                f"(margin {self.margin:g}; {where})"
            )
            return decision(e.strategy, reason, cost)
        best = ranking[0]
        if best.strategy == current:
            reason = f"stay: {current.name} is still best (goodput {cur.goodput:.1f}; {where})"
        else:
            g, e = gains[0]
            reason = (
                f"stay: best {best.strategy.name} goodput {best.goodput:.1f} vs {current.name} {cur.goodput:.1f}, "
                f"but the most robust rival {e.strategy.name} gains only {g:+.4f} of the remaining progress "
                f"at the worst noise scale in the range (margin {self.margin:g}; {where})"
            )
        return decision(current, reason, cost)

    def _record(self, d: Decision) -> Decision:
        self.decisions.append(d)
        log.info("step %d: %s", d.step, d.reason)
        return d


class GoodputScaler(Chainer):
    """AdaptDL/Pollux-style goodput-driven batch scaling without strategy switching: on the data-parallel layout
    alone (``data_parallel``), every decision takes the global batch (and micro-batch) of highest goodput at the
    current noise-scale estimate when it beats the current one's by more than ``margin`` (AdaptDL's 5% hysteresis,
    which ended its batch-size thrashing). No noise range, no time left, no evaluations read."""

    @staticmethod
    def data_parallel(candidates: Sequence[Strategy]) -> list[Strategy]:
        """The candidates AdaptDL scales over: dp = world, else the widest data-parallel layout there is (the
        one with the least tensor parallelism)."""
        widest = max(c.dp for c in candidates)
        tp = min(c.tp for c in candidates if c.dp == widest)
        return [c for c in candidates if (c.dp, c.tp) == (widest, tp)]

    def start(self, noise_scale: float | None, elapsed_s: float = 0.0) -> Decision:
        """The best goodput at step 0's point estimate of the noise scale (None, unresolved: the smallest batch)."""
        if noise_scale is None:
            pick = min(self.candidates, key=lambda c: (c.global_batch, -self._table(c)[0], c.name))
            ranking = tuple(self.rank(0.0))
            reason = f"start: noise scale unresolved at step 0, the smallest global batch {pick.name}"
            return self._record(Decision(0, elapsed_s, None, pick, True, reason, 0.0, 0.0, ranking))
        ranking = tuple(self.rank(noise_scale))
        best = ranking[0]
        reason = f"start: best goodput {best.goodput:.1f} at step 0's noise scale {noise_scale:.1f}"
        return self._record(Decision(0, elapsed_s, None, best.strategy, True, reason, noise_scale, 0.0, ranking))

    def decide(  # type: ignore[override]
        self, current: Strategy | None, step: int = 0, elapsed_s: float = 0.0, noise_scale: float | None = None, **_
    ) -> Decision:
        """Switch to the best goodput at ``noise_scale`` (else the estimator's) when it beats ``current``'s by
        ``margin``; other arguments of ``Chainer.decide`` are ignored."""
        if current is None:
            return self.start(self.gns.noise_scale if self.gns.ready else None, elapsed_s)
        phi = self.gns.noise_scale if noise_scale is None else noise_scale
        ranking = tuple(self.rank(phi))
        cur = next(e for e in ranking if e.strategy == current)
        best = ranking[0]
        if not self.gns.ready:
            reason = f"stay: no gradient statistics yet for {current.name}"
            return self._record(Decision(step, elapsed_s, current, current, False, reason, phi, 0.0, ranking))
        if best.strategy != current and best.goodput > cur.goodput * (1 + self.margin):
            reason = f"scale: {best.strategy.name} goodput {best.goodput:.1f} > {current.name} {cur.goodput:.1f}"
            return self._record(Decision(step, elapsed_s, current, best.strategy, True, reason, phi, 0.0, ranking))
        reason = f"stay: {current.name} goodput {cur.goodput:.1f} within {self.margin:g} of the best {best.goodput:.1f}"
        return self._record(Decision(step, elapsed_s, current, current, False, reason, phi, 0.0, ranking))
